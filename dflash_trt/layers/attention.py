# SPDX-License-Identifier: Apache-2.0
"""Scaled dot-product attention over a paged KV cache or gathered K/V, with grouped query heads and
optional sinks.

`attend_paged` is the target's and the drafter's attention over their paged caches: on CPU, where
the model enabled it (layers/cpu_attention.py), dflash-trt's operator reads the pool in place;
elsewhere the context's K/V is gathered and goes to `attend`. One place for the choice of kernel.

`attend`: on CPU in bfloat16, torch's fused SDPA kernel is slow for the few query rows of a decode
step or a DFlash block (bs=8, one query over 64 keys: ~1 ms against ~0.25 ms for two batched GEMMs
and a softmax; 2 vCPU AMD EPYC, torch 2.13): there the scores are computed as GEMMs in float32 and
normalised in float32 (the accuracy of the fused kernel), then applied to V in bfloat16. Long query
blocks and every other dtype/device keep torch's SDPA. Prompt chunks (`chunk=True`) always do: their
length varies inside one compiled prefill graph, and a choice made on it would become a guard that
refuses every other length (the prefill compiled at warm-up on a 2-token prompt then refused every
real prompt longer than 32 tokens and ran eagerly from then on).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

# Query rows per request up to which the GEMM form is used on CPU in bfloat16 (a DFlash block of 16
# rows verifies, a decode step has 1). Beyond it (prefill chunks) the fused kernel is faster.
MAX_GEMM_QUERY_ROWS = 32


def attend_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    ctx_index: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    kernel: bool = False,
    chunk: bool = False,
) -> torch.Tensor:
    """q: [bs, T, H, d] (token-major, as projected); k_pool, v_pool: one layer's pool [slots, Hkv, d];
    ctx_index: [bs, Lc] the pool slots of each sequence's context columns; k_new, v_new: [bs, B, Hkv, d]
    keys after the context that are not in the pool (the drafter's block), or None; mask: bool
    [bs, 1, T or 1, Lc (+ B)], True = visible. Returns [bs, T, H, d].

    kernel: read the pool in place with `dflash_cpu::paged_attention` (CPU, float32 or bfloat16, no
    sinks; the caller's module was enabled by `cpu_attention.enable`, which loaded the operator).
    Otherwise the context is gathered into [bs, Hkv, Lc (+ B), d] and attended with `attend`.
    chunk: q is a prompt chunk, whose length varies within a compiled graph (`attend`)."""
    if kernel:
        return torch.ops.dflash_cpu.paged_attention(q, k_pool, v_pool, ctx_index, k_new, v_new, mask, scale)
    k, v = k_pool[ctx_index], v_pool[ctx_index]  # [bs, Lc, Hkv, d]
    if k_new is not None and v_new is not None:
        k, v = torch.cat([k, k_new], dim=1), torch.cat([v, v_new], dim=1)
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=scale, sinks=sinks,
                 chunk=chunk)  # fmt: skip
    return out.transpose(1, 2)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    chunk: bool = False,
) -> torch.Tensor:
    """q: [bs, H, T, d]; k, v: [bs, Hkv, L, d] (H a multiple of Hkv; query head h reads KV head
    h // (H / Hkv)); mask: bool [bs, 1, T or 1, L], True = visible; sinks: [H] or None, one extra key
    per head with a learned logit and zero value (gpt-oss); chunk: q is a prompt chunk (torch's SDPA
    whatever T is: module docstring). Returns [bs, H, T, d]."""
    t = q.shape[2]
    if not chunk and q.device.type == "cpu" and q.dtype == torch.bfloat16 and t <= MAX_GEMM_QUERY_ROWS:
        return _gemm_attention(q, k, v, mask, scale=scale, sinks=sinks)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # A sink is one extra key with zero value whose logit is a learned per-head constant: it takes
    # softmax mass without contributing to the output.
    bs, h = q.shape[:2]
    hkv, lk, d = k.shape[1:]
    zeros = k.new_zeros(bs, hkv, 1, d)
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
    bias = torch.zeros(bs, h, t, lk, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    sink = sinks.to(q.dtype)[None, :, None, None].expand(bs, -1, t, 1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.cat([bias, sink], dim=-1), scale=scale, enable_gqa=True
    )


def _gemm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The same attention as two batched GEMMs: float32 scores and softmax, bf16 probabilities @ V."""
    bs, h, t, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    qg = q.reshape(bs, hkv, g * t, d)  # the g query heads of each KV head, stacked as rows
    scores = torch.matmul(qg.float(), k.float().transpose(-1, -2)).view(bs, hkv, g, t, lk) * scale
    # A finite floor, not -inf: a row with no visible key (padding) then averages V instead of making
    # NaNs, which would reach the padding page's K/V and, through 0 * NaN, rows that never see it.
    hidden = ~mask.reshape(mask.shape[0], 1, 1, mask.shape[-2], lk)
    scores = scores.masked_fill(hidden, torch.finfo(torch.float32).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(bs, hkv, g, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :lk]
    out = torch.matmul(probs.to(v.dtype).view(bs, hkv, g * t, lk), v)  # [bs, Hkv, g*T, d]
    return out.view(bs, h, t, d)
