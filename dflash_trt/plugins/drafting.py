# SPDX-License-Identifier: Apache-2.0
"""The engine side of the plugin: the drafter's hot path and the acceptance step through `dflash::`.

`DrafterPlugins` has the drafter's `inject_context` / `forward_block` signatures, so the model runner
swaps it in without other changes. What runs where in a round with plugins on:
  KV injection        dflash::inject_context (fc, hidden_norm, all layers' K/V, k_norm, RoPE, write)
  block pass, per layer: input_layernorm, q/k/v projections, q_norm/k_norm, RoPE, o_proj, MLP stay
                      PyTorch; the attention over [context ; block] is dflash::block_attention,
                      reading the paged pools directly (no per-layer gather of the context);
                      a DFlash 2 layer's four convs are dflash::dynamic_conv
  DFlash 2 selector   dflash::selector_walk (`selector_walk` here, for spec.selector.propose's `walk`)
  acceptance          dflash::greedy_accept / dflash::rejection_accept
On CUDA the ops run their Triton kernels; on CPU their PyTorch references (or, under
TRITON_INTERPRET=1 with `_registry.set_triton_on_cpu(True)`, the interpreted kernels).

The stacked K/V projection weights are a copy taken when the plugins are enabled: weights changed
afterwards are not seen (the engine never changes them; rebuild `DrafterPlugins` if you do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from dflash_trt.plugins import load_ops
from dflash_trt.spec import accept as verify
from dflash_trt.spec.selector import dense_candidate_probs

if TYPE_CHECKING:
    from dflash_trt.layers.kv_cache import PagedKVCache
    from dflash_trt.models.dflash2 import GroupedDynamicCausalConv
    from dflash_trt.models.drafter import DFlashDrafter, DraftLayer

log = logging.getLogger(__name__)

AcceptFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class DrafterPlugins:
    """A drafter's context injection and block pass on the dflash:: ops (same results as the drafter's
    own methods up to floating-point reassociation; exactly the same math on CPU references)."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        load_ops()
        from dflash_trt.plugins.context_kv import stack_kv_weights

        self.drafter = drafter
        layers = [cast("DraftLayer", m) for m in drafter.layers]
        attn = [layer.self_attn for layer in layers]
        eps = {drafter.hidden_norm.eps, *(a.k_norm.eps for a in attn)}
        if len(eps) != 1:  # pragma: no cover - one rms_norm_eps per checkpoint
            raise ValueError(f"dflash::inject_context takes one eps; the drafter has {sorted(eps)}")
        self.eps = eps.pop()
        with torch.no_grad():
            self.kv_weight, self.kv_bias = stack_kv_weights(
                [a.k_proj.weight.detach() for a in attn],
                [a.v_proj.weight.detach() for a in attn],
                [None if a.k_proj.bias is None else a.k_proj.bias.detach() for a in attn],
                [None if a.v_proj.bias is None else a.v_proj.bias.detach() for a in attn],
            )  # [L * 2 * Hkv * d, D], [L * 2 * Hkv * d] | None
            self.k_norm_weight = torch.stack([a.k_norm.weight.detach() for a in attn])  # [L, d]
            # [d/2] float32: `model.to(bf16)` also casts the rotary buffer; upcasting it is exact and
            # is what RotaryEmbedding computes with (fp32 positions * bf16 inv_freq -> fp32).
            self.inv_freq = drafter.rotary.inv_freq.detach().float()

    def inject_context(
        self, cache: PagedKVCache, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """features: [N, K * D]; positions: [N]; slots: [N] (DFlashDrafter.inject_context)."""
        if features.shape[0] == 0:
            return
        d = self.drafter
        torch.ops.dflash.inject_context(
            features,
            positions,
            slots,
            d.fc.weight,
            d.hidden_norm.weight,
            self.kv_weight,
            self.kv_bias,
            self.k_norm_weight,
            self.inv_freq,
            float(d.rotary.attention_scaling),
            self.eps,
            cache.k,
            cache.v,
        )

    def forward_block(
        self,
        cache: PagedKVCache,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_index: torch.Tensor,
        ctx_lens: torch.Tensor,
        block_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """DFlashDrafter.forward_block with the attention on dflash::block_attention (and, for a
        DFlash 2 drafter, every conv on dflash::dynamic_conv: each row's taps stay in its block).

        block_embeds: [bs, B, D]; block_positions: [bs, B], which must be ctx_lens + j (the engine's
        layout: the block starts right after the context); ctx_index: [bs, Lc]; ctx_lens: [bs];
        block_lens: [bs] or None (= B). Returns the final-normed hidden states [bs, B, D].
        """
        dr = self.drafter
        bs, blk, _ = block_embeds.shape
        if block_lens is None:
            block_lens = torch.full((bs,), blk, dtype=torch.int64, device=block_embeds.device)
        cos, sin = dr.rotary(block_positions, block_embeds.dtype)  # [bs, B, d]
        x = block_embeds
        for i, module in enumerate(dr.layers):
            layer = cast("DraftLayer", module)
            a = layer.self_attn
            convs = layer.convs  # DFlash 2: (attention_conv, mlp_conv), else None
            h = layer.input_layernorm(x)  # [bs, B, D]
            if convs is not None:
                h, coeff = conv_prepare(convs[0], h)
            q, k_blk, v_blk = a.project_block(h, cos, sin)  # [bs, B, H, d], [bs, B, Hkv, d] x 2
            o = torch.ops.dflash.block_attention(
                q,
                k_blk,
                v_blk,
                cache.k[i],
                cache.v[i],
                ctx_index,
                ctx_lens,
                block_lens,
                layer.causal,
                layer.window or 0,
                a.head_dim**-0.5,
            )  # [bs, B, H, d]
            o = a.o_proj(o.reshape(bs, blk, a.num_heads * a.head_dim))
            x = x + (o if convs is None else conv_finish(convs[0], o, coeff))
            h = layer.post_attention_layernorm(x)
            if convs is None:
                x = x + layer.mlp(h)
            else:
                h, coeff = conv_prepare(convs[1], h)
                x = x + conv_finish(convs[1], layer.mlp(h), coeff)
        return dr.norm(x)

    # the rest of the drafter is unchanged
    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.embed_block(block_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.drafter.compute_logits(hidden)


# --- DFlash 2: the convs and the selector walk on their ops ---------------------------------------------
def conv_prepare(conv: GroupedDynamicCausalConv, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupedDynamicCausalConv.prepare on dflash::dynamic_conv: h [bs, B, D] -> (out, coeff [bs, B, 2, K, G])."""
    coeff = conv.coefficients(h)
    return torch.ops.dflash.dynamic_conv(h, coeff, conv.base_kernel, 0, conv.group_size), coeff


def conv_finish(conv: GroupedDynamicCausalConv, h: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    """GroupedDynamicCausalConv.finish on dflash::dynamic_conv."""
    return torch.ops.dflash.dynamic_conv(h, coeff, conv.base_kernel, 1, conv.group_size)


def selector_walk(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """spec.selector.selector_walk on dflash::selector_walk (pass as `propose(..., walk=selector_walk)`)."""
    picks, q = torch.ops.dflash.selector_walk(*args)
    return picks, q


# --- acceptance with spec/accept.py's signatures --------------------------------------------------------
def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify.greedy_accept on dflash::greedy_accept: draft_tokens [N, g]; target_logits [N, g+1, V];
    valid [N, g] | None -> (accepted [N], emitted [N])."""
    n, g = draft_tokens.shape
    if valid is None:
        valid = torch.ones(n, g, dtype=torch.bool, device=draft_tokens.device)
    acc, emit = torch.ops.dflash.greedy_accept(draft_tokens, target_logits, valid)
    return acc, emit


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify.rejection_accept on dflash::rejection_accept (same shapes; float32 probabilities)."""
    n, g = draft_tokens.shape
    if valid is None:
        valid = torch.ones(n, g, dtype=torch.bool, device=draft_tokens.device)
    acc, emit = torch.ops.dflash.rejection_accept(
        draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid
    )
    return acc, emit


def rejection_accept_candidates(
    draft_tokens: torch.Tensor,
    candidates: torch.Tensor,
    cand_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify.rejection_accept_candidates on dflash::rejection_accept: q over the candidates [N, g, K]
    scattered into the vocabulary (zero elsewhere), which is the same rule (spec/selector.py
    `Proposal.dense_probs`)."""
    dense = dense_candidate_probs(candidates, cand_probs, target_probs.shape[-1])  # [N, g, V]
    return rejection_accept(draft_tokens, dense, target_probs, u_accept, u_emit, valid)


# --- enabling in the runner -----------------------------------------------------------------------
def enable_plugins(
    drafter: DFlashDrafter | None, device: torch.device, *, check: bool | None = None
) -> tuple[DrafterPlugins | None, AcceptFn, AcceptFn]:
    """(drafting, greedy_accept, rejection_accept) for the model runner.

    check (default: on CUDA) runs every op once on the device against its reference with the
    drafter's real sizes; a failure (a kernel that does not compile for this GPU, or disagrees) logs a
    warning and returns the PyTorch path instead of taking the engine down.
    """
    plugins = DrafterPlugins(drafter) if drafter is not None else None
    if check if check is not None else device.type == "cuda":
        problem = self_check(drafter, device)
        if problem is not None:
            log.warning("dflash plugin disabled, using the PyTorch path: %s", problem)
            return None, verify.greedy_accept, verify.rejection_accept
    log.info("dflash plugin on (%s): inject_context, block_attention, greedy/rejection accept%s", device,
             ", dynamic_conv, selector_walk" if drafter is not None and drafter.selector is not None else "")  # fmt: skip
    return plugins, greedy_accept, rejection_accept


def self_check(drafter: DFlashDrafter | None, device: torch.device) -> str | None:
    """Run each op on `device` (Triton on CUDA) against its reference on small random inputs of the
    drafter's sizes. Returns None when all agree, else a description of the first problem."""
    rand = _RandomInputs(device)
    try:
        problem = _check_accept(rand)
        if problem is None and drafter is not None:
            problem = (
                _check_block_attention(drafter, rand)
                or _check_inject_context(drafter, rand)
                or _check_dflash2(drafter, rand)
            )
    except Exception as exc:  # a kernel that fails to compile or launch on this device
        return f"{type(exc).__name__}: {exc}"
    return problem


class _RandomInputs:
    """Seeded random tensors on the device under check (drawn on the CPU: the same on every device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    def normal(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=dtype)

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen).to(self.device)


def _check_accept(rand: _RandomInputs) -> str | None:
    from dflash_trt.plugins import accept

    n, g, vocab = 3, 3, 1000
    logits = rand.normal(n, g + 1, vocab)
    drafts = logits[:, :g].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % vocab  # one rejection
    valid = torch.ones(n, g, dtype=torch.bool, device=rand.device)
    got = torch.ops.dflash.greedy_accept(drafts, logits, valid)
    want = accept.greedy_accept_reference(drafts, logits, valid)
    if not all(torch.equal(a, b) for a, b in zip(got, want)):
        return "dflash::greedy_accept disagrees with its reference"
    p = torch.softmax(rand.normal(n, g + 1, vocab), -1)
    q = torch.softmax(rand.normal(n, g, vocab), -1)
    ua, ue = rand.uniform(n, g), rand.uniform(n, g + 1)
    got = torch.ops.dflash.rejection_accept(drafts, q, p, ua, ue, valid)
    want = accept.rejection_accept_reference(drafts, q, p, ua, ue, valid)
    if not all(torch.equal(a, b) for a, b in zip(got[:1], want[:1])):
        return "dflash::rejection_accept disagrees with its reference"
    return None


_PAGE, _PAGES = 16, 5  # the check's paged context: 5 pages of 16 slots after the padding page


def _tolerance(drafter: DFlashDrafter) -> float:
    return 1e-3 if drafter.fc.weight.dtype == torch.float32 else 5e-2


def _check_block_attention(drafter: DFlashDrafter, rand: _RandomInputs) -> str | None:
    from dflash_trt.plugins import block_attention

    cfg, dtype, dev, tol = drafter.config, drafter.fc.weight.dtype, rand.device, _tolerance(drafter)
    h, hkv, d, bq = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    slots_total = (_PAGES + 1) * _PAGE
    kc, vc = rand.normal(slots_total, hkv, d, dtype=dtype), rand.normal(slots_total, hkv, d, dtype=dtype)
    tables = torch.arange(1, _PAGES + 1, device=dev).reshape(1, _PAGES).expand(2, _PAGES)
    ctx_index = (tables[:, :, None] * _PAGE + torch.arange(_PAGE, device=dev)).reshape(2, -1)
    ctx_lens = torch.tensor([_PAGES * _PAGE - 3, 7], device=dev)
    blens = torch.tensor([bq, max(1, bq // 2)], device=dev)
    qb = rand.normal(2, bq, h, d, dtype=dtype)
    kb, vb = rand.normal(2, bq, hkv, d, dtype=dtype), rand.normal(2, bq, hkv, d, dtype=dtype)
    rows = torch.arange(bq, device=dev)[None, :] < blens[:, None]
    for li in range(cfg.num_hidden_layers):
        causal, window = cfg.layer_is_causal(li), cfg.layer_window(li) or 0
        args = (qb, kb, vb, kc, vc, ctx_index, ctx_lens, blens, causal, window, d**-0.5)
        got_o = torch.ops.dflash.block_attention(*args).float()
        want_o = block_attention.block_attention_reference(*args).float()
        if not torch.allclose(got_o[rows], want_o[rows], atol=tol, rtol=tol):
            return f"dflash::block_attention (causal={causal}, window={window}) disagrees with its reference"
    return None


def _check_inject_context(drafter: DFlashDrafter, rand: _RandomInputs) -> str | None:
    from dflash_trt.plugins import context_kv

    cfg, dtype, dev, tol = drafter.config, drafter.fc.weight.dtype, rand.device, _tolerance(drafter)
    plug = DrafterPlugins(drafter)
    num = 5
    feats = rand.normal(num, cfg.num_target_features * cfg.hidden_size, dtype=dtype)
    pos = torch.arange(num, device=dev) * 7
    slot = torch.arange(num, device=dev) + _PAGE
    shape = ((_PAGES + 1) * _PAGE, cfg.num_key_value_heads, cfg.head_dim)
    k1, v1, k2, v2 = ([torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
                      for _ in range(4))  # fmt: skip
    common = (
        feats, pos, slot, drafter.fc.weight, drafter.hidden_norm.weight, plug.kv_weight, plug.kv_bias,
        plug.k_norm_weight, plug.inv_freq, float(drafter.rotary.attention_scaling), plug.eps,
    )  # fmt: skip
    torch.ops.dflash.inject_context(*common, k1, v1)
    context_kv.inject_context_reference(*common, k2, v2)
    for a, b in zip((*k1, *v1), (*k2, *v2)):
        if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
            return "dflash::inject_context disagrees with its reference"
    return None


def _check_dflash2(drafter: DFlashDrafter, rand: _RandomInputs) -> str | None:
    """The DFlash 2 ops at the drafter's sizes against their references (None for a v1 drafter)."""
    from dflash_trt.plugins import dynamic_conv, selector_walk

    convs = cast("DraftLayer", drafter.layers[0]).convs
    sel = drafter.selector
    if convs is None or sel is None:
        return None
    conv, tol = convs[0], _tolerance(drafter)
    dtype = conv.base_kernel.dtype
    x = rand.normal(3, drafter.config.block_size, drafter.config.hidden_size, dtype=dtype)
    coeff = conv.coefficients(x)
    for half in (0, 1):
        got = torch.ops.dflash.dynamic_conv(x, coeff, conv.base_kernel, half, conv.group_size).float()
        want = dynamic_conv.dynamic_conv_reference(x.float(), coeff.float(), conv.base_kernel.float(), half,
                                                   conv.group_size)  # fmt: skip
        if not torch.allclose(got, want, atol=tol, rtol=tol):
            return "dflash::dynamic_conv disagrees with its reference"
    n, g, vocab = 3, drafter.config.max_draft_len, sel.predecessor_codebook.shape[0]
    unary, cand = torch.topk(rand.normal(n, g, vocab), min(sel.top_k, vocab), dim=-1, sorted=False)
    args = (unary, cand, sel.project(rand.normal(n, g, drafter.config.hidden_size, dtype=dtype)),
            cand[:, 0, 0].contiguous(), sel.predecessor_codebook, sel.successor_codebook,
            torch.tensor([0.0, 1.0, 0.7], device=unary.device), rand.uniform(n, g) * 0.98 + 0.01,
            torch.tensor([True, False, False], device=unary.device))  # fmt: skip
    picks, q = torch.ops.dflash.selector_walk(*args)
    want_picks, want_q = selector_walk.selector_walk_reference(*args)
    if not torch.equal(picks[0], want_picks[0]) or not torch.allclose(q, want_q, atol=1e-3, rtol=1e-3):
        return "dflash::selector_walk disagrees with its reference"
    return None
