# SPDX-License-Identifier: Apache-2.0
"""`dflash::block_attention`: the B block queries of every sequence over [context cache ; block].

Contract (one draft layer, a batch of bs sequences, block width B, GQA group G = H / Hkv):
  q            [bs, B, H, d]    block queries, already q_norm'ed and rotated
  k_block      [bs, B, Hkv, d]  block keys (k_norm + RoPE), never cached
  v_block      [bs, B, Hkv, d]
  k_cache      [S, Hkv, d]      the layer's paged context pool (slot = page * P + offset)
  v_cache      [S, Hkv, d]
  ctx_index    [bs, Lc] int64   slot of context position p in column p (kv_cache.context_index)
  ctx_lens     [bs] int64       valid context keys, positions 0 .. ctx_lens-1 (<= Lc)
  block_lens   [bs] int64       valid block slots B_i <= B; block slot j sits at position ctx_lens + j
  causal, window (0 = none), scale
  -> out       [bs, B, H, d]    in q's dtype

Visibility of key position k to the query at position q (the drafter's `visibility_mask`): the key
is valid, and (causal) k <= q, and (window w) q - k < w, and (window, not causal) k - q < w. Full
DFlash layers are non-causal without a window: every query sees every valid key. Query slots >= B_i
are computed but meaningless; a query that sees no key at all returns zeros from the kernel (the
reference returns whatever SDPA gives, NaN on some backends): callers ignore those rows.

Kernel: flash-decoding over the paged pool. One program per (sequence, KV head, split) holds all
G * B query rows of its KV head in one tile (GQA costs no extra K/V reads), walks its share of the
context range through `ctx_index` (no gather copy), the last split also takes the B block keys,
with an online softmax in fp32. With more than one split, a second kernel merges the partial
(max, sum, acc) rows. The context walk starts at max(0, ctx_len - window + 1) on window layers
and stops at ctx_len, so work is proportional to the visible keys, not to Lc.
"""

from __future__ import annotations

import math

import torch

from dflash_trt.layers.attention import attend_paged
from dflash_trt.layers.masks import visibility_mask
from dflash_trt.plugins import _registry as reg
from dflash_trt.plugins._registry import jit, tl

OP = "block_attention"
DEFAULT_BLOCK_N = 64  # context keys per tile (untuned: see bench/plugin_kernels.py)
MAX_SPLITS = 64


# --- the PyTorch reference: exactly the drafter's per-layer math (attend_paged's gather path) -------
def block_attention_reference(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_index: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_lens: torch.Tensor,
    causal: bool,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Shapes as in the module docstring. Returns a fresh contiguous [bs, B, H, d]."""
    bs, blk = q.shape[:2]
    lc = ctx_index.shape[1]
    dev = q.device
    j = torch.arange(blk, device=dev)
    q_pos = ctx_lens[:, None] + j  # [bs, B]
    ctx_pos = torch.arange(lc, device=dev).expand(bs, lc)  # [bs, Lc]
    k_pos = torch.cat([ctx_pos, q_pos], dim=1)  # [bs, Lc + B]
    k_valid = torch.cat([ctx_pos < ctx_lens[:, None], j[None, :] < block_lens[:, None]], dim=1)
    if not causal and window == 0:
        mask = k_valid[:, None, None, :]  # [bs, 1, 1, Lc + B]
    else:
        mask = visibility_mask(q_pos, k_pos, k_valid, causal=causal, window=window or None)
    out = attend_paged(q, k_cache, v_cache, ctx_index, mask, scale=scale, k_new=k_block, v_new=v_block)
    return out.contiguous()


# --- Triton kernels ---------------------------------------------------------------------------
@jit
def _block_attn_kernel(
    q_ptr,
    kb_ptr,
    vb_ptr,
    kc_ptr,
    vc_ptr,
    idx_ptr,
    ctx_lens_ptr,
    blk_lens_ptr,
    out_ptr,
    part_ptr,  # [bs, Hkv, NUM_SPLITS, BLOCK_M, BLOCK_D + 2] fp32: acc | max | sum (split mode only)
    sq0,
    sq1,
    sq2,
    skb0,
    skb1,
    skb2,
    svb0,
    svb1,
    svb2,
    skc0,
    skc1,
    svc0,
    svc1,
    sidx0,
    so0,
    so1,
    so2,
    lc,
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    B: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(ctx_lens_ptr + i)
    blk_len = tl.load(blk_lens_ptr + i)

    # rows: m = jq * G + g  (block slot jq, query head kvh * G + g)
    offs_m = tl.arange(0, BLOCK_M)
    jq = offs_m // G
    row_ok = offs_m < B * G
    head = kvh * G + offs_m % G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ptrs = q_ptr + i * sq0 + jq[:, None] * sq1 + head[:, None] * sq2 + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = ctx_len + jq  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # context keys [lo, hi): everything before the block; a window cuts the front off
    hi = tl.minimum(ctx_len, lc)
    lo = hi * 0
    if WINDOW > 0:
        lo = tl.maximum(ctx_len - WINDOW + 1, 0)
    lo = tl.minimum(lo, hi)
    chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo_s = tl.minimum(lo + split * chunk, hi)
    hi_s = tl.minimum(lo_s + chunk, hi)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo_s, hi_s, BLOCK_N):
        p = start + offs_n  # [BLOCK_N] context positions
        p_ok = p < hi_s
        slot = tl.load(idx_ptr + i * sidx0 + p, mask=p_ok, other=0)
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + slot[:, None] * skc0 + kvh * skc1 + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + slot[:, None] * svc0 + kvh * svc1 + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [BLOCK_M, BLOCK_N]
        vis = p_ok[None, :] & row_ok[:, None]
        if WINDOW > 0:  # context keys precede every query: only the window's far edge can hide them
            vis = vis & (q_pos[:, None] - p[None, :] < WINDOW)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new

    if split == NUM_SPLITS - 1:  # the block's own keys, once per (sequence, KV head)
        jk = tl.arange(0, BLOCK_B)
        k_ok = jk < blk_len
        bmask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            kb_ptr + i * skb0 + jk[:, None] * skb1 + kvh * skb2 + offs_d[None, :], mask=bmask, other=0.0
        )
        v = tl.load(
            vb_ptr + i * svb0 + jk[:, None] * svb1 + kvh * svb2 + offs_d[None, :], mask=bmask, other=0.0
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [BLOCK_M, BLOCK_B]
        vis = k_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            vis = vis & (jk[None, :] <= jq[:, None])
        if WINDOW > 0:
            vis = vis & (jq[:, None] - jk[None, :] < WINDOW)
            if not CAUSAL:
                vis = vis & (jk[None, :] - jq[:, None] < WINDOW)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key -> 0
        o_ptrs = out_ptr + i * so0 + jq[:, None] * so1 + head[:, None] * so2 + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        W = BLOCK_D + 2
        base = part_ptr + ((i * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * BLOCK_M * W
        tl.store(base + offs_m[:, None] * W + offs_d[None, :], acc)
        tl.store(base + offs_m * W + BLOCK_D, m_i)
        tl.store(base + offs_m * W + BLOCK_D + 1, l_i)


@jit
def _merge_splits_kernel(
    part_ptr,
    out_ptr,
    so0,
    so1,
    so2,
    B: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    W = BLOCK_D + 2
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    base = part_ptr + (i * tl.num_programs(1) + kvh) * NUM_SPLITS * BLOCK_M * W
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(base + s * BLOCK_M * W + offs_m * W + BLOCK_D))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        blk = base + s * BLOCK_M * W
        w = tl.exp2(tl.load(blk + offs_m * W + BLOCK_D) - m_safe)  # an empty split has max -inf: weight 0
        l_sum += w * tl.load(blk + offs_m * W + BLOCK_D + 1)
        acc += w[:, None] * tl.load(blk + offs_m[:, None] * W + offs_d[None, :])
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    jq = offs_m // G
    head = kvh * G + offs_m % G
    o_ptrs = out_ptr + i * so0 + jq[:, None] * so1 + head[:, None] * so2 + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m < B * G)[:, None] & (offs_d < D)[None, :])


def choose_num_splits(*, bs: int, num_kv_heads: int, span: int, block_n: int, device: torch.device) -> int:
    """Split the context walk until there are about two programs per SM (a static function of the
    shapes, so a captured CUDA graph keeps its launch geometry)."""
    programs = bs * num_kv_heads
    want = math.ceil(2 * reg.sm_count(device) / max(1, programs))
    return max(1, min(want, math.ceil(max(1, span) / block_n), MAX_SPLITS))


def _check_launch(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_index: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_lens: torch.Tensor,
    window: int,
) -> None:
    """Shapes, dtypes, strides and devices the kernels assume (a violation is an error, not garbage)."""
    bs, blk, h, d = q.shape
    hkv = k_block.shape[2]
    chk = reg.check
    chk(q.dim() == 4 and k_block.dim() == 4 and v_block.dim() == 4, OP, "q/k_block/v_block must be 4-D")
    chk(k_block.shape == (bs, blk, hkv, d) and v_block.shape == k_block.shape, OP, "k/v_block shape")
    chk(hkv > 0 and h % hkv == 0, OP, f"H={h} must be a multiple of Hkv={hkv}")
    chk(k_cache.dim() == 3 and k_cache.shape[1:] == (hkv, d) and v_cache.shape == k_cache.shape, OP, "pools")
    chk(k_cache.stride(2) == 1 and v_cache.stride(2) == 1, OP, "pools need unit stride in head_dim")
    for t, name in ((q, "q"), (k_block, "k_block"), (v_block, "v_block")):
        chk(t.stride(3) == 1, OP, f"{name} needs unit stride in head_dim")
        chk(t.dtype == q.dtype, OP, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    chk(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, OP, "pools must have q's dtype")
    chk(reg.float_dtype_ok(q), OP, f"unsupported dtype {q.dtype}")
    chk(ctx_index.dim() == 2 and ctx_index.shape[0] == bs and ctx_index.dtype == torch.int64, OP, "ctx_index")
    chk(ctx_index.stride(1) == 1 or ctx_index.shape[1] <= 1, OP, "ctx_index needs unit stride in columns")
    chk(ctx_lens.shape == (bs,) and block_lens.shape == (bs,), OP, "ctx_lens/block_lens must be [bs]")
    chk(ctx_lens.dtype == torch.int64 and block_lens.dtype == torch.int64, OP, "lengths must be int64")
    chk(window >= 0, OP, f"window={window} must be >= 0 (0 = none)")
    reg.check_same_device(OP, q, k_block, v_block, k_cache, v_cache, ctx_index, ctx_lens, block_lens)


def launch_block_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_index: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_lens: torch.Tensor,
    causal: bool,
    window: int,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """The Triton path. num_splits None picks `choose_num_splits`; tests force 1, 2, 3..."""
    reg.require_triton(OP)
    _check_launch(q, k_block, v_block, k_cache, v_cache, ctx_index, ctx_lens, block_lens, window)
    bs, blk, h, d = q.shape
    hkv = k_block.shape[2]
    out = torch.empty(bs, blk, h, d, dtype=q.dtype, device=q.device)
    if bs == 0 or blk == 0:
        return out
    g = h // hkv
    lc = ctx_index.shape[1]
    block_m = reg.block(blk * g)
    block_d = reg.block(d)
    span = min(lc, window) if window > 0 else lc
    splits = num_splits or choose_num_splits(
        bs=bs, num_kv_heads=hkv, span=span, block_n=block_n, device=q.device
    )
    part = (
        torch.empty(bs, hkv, splits, block_m, block_d + 2, dtype=torch.float32, device=q.device)
        if splits > 1
        else out  # unused in single-split mode
    )
    common = dict(B=blk, G=g, D=d, BLOCK_M=block_m, BLOCK_D=block_d)
    _block_attn_kernel[(bs, hkv, splits)](
        q, k_block, v_block, k_cache, v_cache, ctx_index, ctx_lens, block_lens, out, part,
        q.stride(0), q.stride(1), q.stride(2),
        k_block.stride(0), k_block.stride(1), k_block.stride(2),
        v_block.stride(0), v_block.stride(1), v_block.stride(2),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ctx_index.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lc,
        scale * math.log2(math.e),
        CAUSAL=bool(causal), WINDOW=int(window), NUM_SPLITS=splits,
        BLOCK_N=block_n, BLOCK_B=reg.block(blk), IEEE=q.dtype == torch.float32,
        **common,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(bs, hkv)](
            part, out, out.stride(0), out.stride(1), out.stride(2), NUM_SPLITS=splits, **common
        )
    return out


# --- the custom op -----------------------------------------------------------------------------
@torch.library.custom_op("dflash::block_attention", mutates_args=())
def block_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_index: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_lens: torch.Tensor,
    causal: bool,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Default (CPU) implementation: the reference; the Triton kernel under the interpreter switch."""
    args = (q, k_block, v_block, k_cache, v_cache, ctx_index, ctx_lens, block_lens, causal, window, scale)
    if reg.triton_on_cpu():
        return launch_block_attention(*args)
    return block_attention_reference(*args)


@block_attention.register_kernel("cuda")
def _block_attention_cuda(
    q, k_block, v_block, k_cache, v_cache, ctx_index, ctx_lens, block_lens, causal, window, scale
):
    return launch_block_attention(
        q, k_block, v_block, k_cache, v_cache, ctx_index, ctx_lens, block_lens, causal, window, scale
    )


@block_attention.register_fake
def _block_attention_fake(
    q, k_block, v_block, k_cache, v_cache, ctx_index, ctx_lens, block_lens, causal, window, scale
):
    return q.new_empty(q.shape)
