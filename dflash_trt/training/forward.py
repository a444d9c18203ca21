# SPDX-License-Identifier: Apache-2.0
"""The DFlash training objective (dflash-algorithm.md §7) over whole sequences.

One sequence x_0..x_{S-1} has target features f_0..f_{S-1} (target layer outputs at
`target_layer_ids`, computed once under no_grad) and a loss mask. Per step:
  anchors   up to N positions a_n, drawn uniformly without replacement among p <= S - B with
            loss_mask[p] = 1, sorted; padded blocks (fewer eligible positions) are invalid.
  blocks    block n is [x_{a_n}, MASK x (B - 1)] at positions a_n .. a_n + B - 1 (one denoising
            step: every non-anchor slot is MASK).
  mask      queries are all N * B block slots; keys are [context 0..S-1 ; all N * B block slots].
            Block n sees context keys t < a_n (strictly: the anchor's own feature does not exist
            at inference) and the B keys of block n (bidirectionally), nothing else; an invalid
            block sees nothing.
  labels    slot j of block n predicts x_{a_n + j}; weight 0 for j = 0, for a_n + j past the
            sequence's end, or where loss_mask is 0; otherwise w_j = exp(-(j - 1) / gamma).
  loss      sum(w * CE) / sum(w).
The attention is computed block-sparsely (context part + own-block part with one joint softmax),
which equals dense attention under `block_mask` exactly but needs O(N B (S + B)) memory instead of
O(N B (S + N B)). For one anchor the result equals the inference pass (`DFlashDrafter.forward_block`
over a context cache filled up to the anchor): same modules, same positions, same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch.nn import functional as F

from dflash_trt.layers.masks import apply_visibility
from dflash_trt.layers.rope import apply_rope
from dflash_trt.models.dflash_config import max_draft_len_for
from dflash_trt.models.drafter import DFlashDrafter, DraftLayer

LOGIT_CHUNK_ROWS = 8192  # rows of LM-head logits materialised at once in the loss


@dataclass
class BlockBatch:
    """Anchors and targets of one batch. bs sequences, N blocks each, block size B."""

    anchors: torch.Tensor  # [bs, N] long: a_n (0 for invalid blocks)
    valid: torch.Tensor  # [bs, N] bool: the block exists
    labels: torch.Tensor  # [bs, N, B] long: x_{a_n + j} (0 where it does not exist)
    weights: torch.Tensor  # [bs, N, B] float: w_j, 0 where there is no loss

    @property
    def block_size(self) -> int:
        return self.labels.shape[-1]


def eligible_anchor_positions(loss_mask: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """loss_mask: [S] -> positions p <= length - B with loss_mask[p] = 1, as [E] long."""
    last = length - block_size
    if last < 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(loss_mask[: last + 1].bool(), as_tuple=False).flatten()


def sample_anchors(
    loss_mask: torch.Tensor, *, length: int, block_size: int, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Up to `num_anchors` distinct eligible positions, uniformly at random, sorted: [n <= N] long."""
    pos = eligible_anchor_positions(loss_mask.cpu(), length, block_size)
    if pos.numel() > num_anchors:
        pos = pos[torch.randperm(pos.numel(), generator=generator)[:num_anchors]]
    return pos.sort().values


def make_block_batch(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: list[torch.Tensor],
    *,
    block_size: int,
    gamma: float,
    num_blocks: int | None = None,
) -> BlockBatch:
    """input_ids, loss_mask: [bs, S]; lengths: [bs]; anchors: bs tensors [n_i] (sorted) -> BlockBatch
    with N = num_blocks or max n_i blocks per sequence (the rest padded as invalid)."""
    bs, _ = input_ids.shape
    device = input_ids.device
    n = num_blocks if num_blocks is not None else max((a.numel() for a in anchors), default=0)
    n = max(n, 1)
    anchor_t = torch.zeros(bs, n, dtype=torch.long, device=device)
    valid = torch.zeros(bs, n, dtype=torch.bool, device=device)
    for i, a in enumerate(anchors):
        anchor_t[i, : a.numel()] = a.to(device)
        valid[i, : a.numel()] = True
    j = torch.arange(block_size, device=device)  # [B]
    pos = anchor_t[:, :, None] + j  # [bs, N, B]
    in_seq = pos < lengths.to(device)[:, None, None]
    safe = pos.clamp(max=input_ids.shape[1] - 1).flatten(1)  # [bs, N * B]
    labels = torch.gather(input_ids, 1, safe).view(bs, n, block_size)
    masked = torch.gather(loss_mask.to(device).bool(), 1, safe).view(bs, n, block_size)
    decay = torch.exp(-(j.float() - 1) / gamma)  # [B]; slot 0 is zeroed below
    keep = in_seq & masked & valid[:, :, None] & (j > 0)
    weights = torch.where(keep, decay, torch.zeros_like(decay))
    labels = torch.where(in_seq & valid[:, :, None], labels, torch.zeros_like(labels))
    return BlockBatch(anchors=anchor_t, valid=valid, labels=labels, weights=weights)


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, *, seq_len: int, block_size: int) -> torch.Tensor:
    """The dense training mask, straight from its definition (tests and the dense reference).

    anchors, valid: [bs, N] -> [bs, N * B, S + N * B] bool: query (n, j) sees context key t iff the
    block is valid and t < a_n, and block key (m, i) iff the block is valid and m == n.
    """
    bs, n = anchors.shape
    device = anchors.device
    t = torch.arange(seq_len, device=device)
    ctx = (t[None, None, :] < anchors[:, :, None]) & valid[:, :, None]  # [bs, N, S]
    ctx = ctx[:, :, None, :].expand(bs, n, block_size, seq_len).reshape(bs, n * block_size, seq_len)
    blk_id = torch.arange(n, device=device).repeat_interleave(block_size)  # [N * B]
    own = blk_id[:, None] == blk_id[None, :]  # [N * B, N * B]
    row_valid = valid.repeat_interleave(block_size, dim=1)  # [bs, N * B]
    blk = own[None] & row_valid[:, :, None]
    return torch.cat([ctx, blk], dim=2)


def _attend(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    ctx_vis: torch.Tensor,
    blk_vis: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Block-sparse attention with one softmax over [visible context ; own block].

    q: [bs, N, B, H, d]; k_ctx, v_ctx: [bs, S, Hkv, d]; k_blk, v_blk: [bs, N, B, Hkv, d];
    ctx_vis: [bs, N, B, S]; blk_vis: [bs, N, B, B] (query slot j, key slot i). -> [bs, N, B, H, d]
    """
    bs, n, b, h, d = q.shape
    hkv = k_ctx.shape[2]
    g = h // hkv
    qg = q.reshape(bs, n, b, hkv, g, d)
    s_ctx = torch.einsum("bnjkgd,btkd->bkgnjt", qg, k_ctx) * scale  # [bs, Hkv, g, N, B, S]
    s_blk = torch.einsum("bnjkgd,bnikd->bkgnji", qg, k_blk) * scale  # [bs, Hkv, g, N, B, B]
    neg = torch.finfo(torch.float32).min
    s_ctx = s_ctx.float().masked_fill(~ctx_vis[:, None, None], neg)
    s_blk = s_blk.float().masked_fill(~blk_vis[:, None, None], neg)
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(q.dtype)
    s = k_ctx.shape[1]
    out = torch.einsum("bkgnjt,btkd->bnjkgd", p[..., :s], v_ctx) + torch.einsum(
        "bkgnji,bnikd->bnjkgd", p[..., s:], v_blk
    )
    return out.reshape(bs, n, b, h, d)


def training_forward(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """All N blocks of every sequence in one pass.

    features: [bs, S, K * D] target layer outputs; input_ids: [bs, S]; anchors, valid: [bs, N].
    Returns the final-normed hidden states [bs, N, B, D] (slot j predicts x_{a_n + j}).
    """
    bs, s = input_ids.shape
    n = anchors.shape[1]
    b = drafter.block_size
    device = input_ids.device
    c = drafter.fuse_context(features)  # [bs, S, D]
    ctx_pos = torch.arange(s, device=device)
    ctx_cos, ctx_sin = drafter.rotary(ctx_pos, c.dtype)  # [S, d]
    slot = torch.arange(b, device=device)
    blk_pos = anchors[:, :, None] + slot  # [bs, N, B]
    block_ids = torch.full((bs, n, b), drafter.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    x = drafter.embed_block(block_ids.view(bs, n * b)).view(bs, n, b, -1)  # [bs, N, B, D]
    cos, sin = drafter.rotary(blk_pos, x.dtype)  # [bs, N, B, d]
    # Base visibility: context strictly before the anchor; the own block. Invalid blocks see
    # their own block only, so no softmax row is empty (their outputs carry zero weight).
    ctx_base = (ctx_pos[None, None, None, :] < anchors[:, :, None, None]) & valid[:, :, None, None]
    ctx_base = ctx_base.expand(bs, n, b, s)  # [bs, N, B, S]
    blk_base = torch.ones(bs, n, b, b, dtype=torch.bool, device=device)
    vis: dict[tuple[bool, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
    for module in drafter.layers:
        layer = cast(DraftLayer, module)
        key = (layer.causal, layer.window)
        if key not in vis:
            q_pos = blk_pos[..., None]  # [bs, N, B, 1]
            vis[key] = (
                apply_visibility(q_pos, ctx_pos.view(1, 1, 1, s), ctx_base, causal=key[0], window=key[1]),
                apply_visibility(q_pos, blk_pos[:, :, None, :], blk_base, causal=key[0], window=key[1]),
            )
        attn = layer.self_attn
        convs = layer.convs  # DFlash 2: (attention_conv, mlp_conv); None for v1
        hs = layer.input_layernorm(x)
        if convs is not None:  # DFlash 2: the conv runs along each block's B slots (dim -2)
            hs, coeff = convs[0].prepare(hs)
        q = attn.q_norm(attn.q_proj(hs).unflatten(-1, (attn.num_heads, attn.head_dim)))
        q = apply_rope(q, cos, sin)  # [bs, N, B, H, d]
        k_blk, v_blk = attn.project_kv(hs, cos, sin)  # [bs, N, B, Hkv, d]
        k_ctx, v_ctx = attn.project_kv(c, ctx_cos, ctx_sin)  # [bs, S, Hkv, d]
        out = attn.o_proj(_attend(q, k_ctx, v_ctx, k_blk, v_blk, *vis[key], attn.head_dim**-0.5).flatten(-2))
        x = x + (out if convs is None else convs[0].finish(out, coeff))
        hs = layer.post_attention_layernorm(x)
        if convs is None:
            x = x + layer.mlp(hs)
        else:
            hs, coeff = convs[1].prepare(hs)
            x = x + convs[1].finish(layer.mlp(hs), coeff)
    return drafter.norm(x)


@dataclass(frozen=True)
class LossVocab:
    """The tokens a training run's softmax runs over (`--loss-vocab data`): every token its samples hold.

    A 16-slot block batch multiplies thousands of rows by the LM head, forward and backward; on a 49k
    vocabulary (SmolLM2) that is most of a CPU step, and a target's own answers use a fifth of it."""

    ids: torch.Tensor  # [V'] sorted token ids
    lookup: torch.Tensor  # [V] the position of each token in `ids`, -1 for the rest

    @classmethod
    def of(cls, tokens: torch.Tensor, vocab_size: int) -> LossVocab:
        ids = torch.unique(tokens.flatten())  # on the tokens' device, as the lookup
        lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
        lookup[ids] = torch.arange(ids.numel(), device=ids.device)
        return cls(ids, lookup)

    def index(self, labels: torch.Tensor) -> torch.Tensor:
        """Token ids -> their columns in the loss vocabulary (each must be in it)."""
        idx = self.lookup[labels]
        if bool((idx < 0).any()):
            raise ValueError("a label is outside the loss vocabulary")
        return idx


@dataclass
class LossStats:
    loss: float
    weight: float  # sum of weights
    acc: list[float]  # per slot j = 1..B-1: accuracy of argmax among supervised slots
    tau: float  # 1 + mean accepted prefix over fully supervised blocks (greedy estimate; DFlash 2: the selector's)
    selector_loss: float | None = None  # DFlash 2: the selector's K-way cross entropy
    selector_acc: list[float] | None = (
        None  # DFlash 2: per slot, the selector's pick (true predecessor) is right
    )
    overturn: float | None = None  # DFlash 2: share of supervised slots whose pick is not the argmax


def selector_terms(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    prev: torch.Tensor,
    vocab: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's training objective on M supervised slots (dflash2.md §3, teacher-forced).

    hidden: [M, D] final-normed states; logits: [M, V]; labels: [M] the true tokens; prev: [M] the true
    previous tokens (the anchor for slot 1). With `vocab` ([V'] token ids) the logits' columns and the labels
    index that loss vocabulary. Candidates are the top-K of the logits, the label replacing
    the weakest one when it is missing (so the K-way cross entropy always has its class).
    Returns (cross entropy [M], hit [M]: the pick is the label and the label was a real candidate,
    overturned [M]: the pick is not the logits' argmax).
    """
    from dflash_trt.spec.selector import pair_scores

    sel = drafter.selector
    assert sel is not None, "selector_terms needs a DFlash 2 drafter"
    unary, cand = torch.topk(logits, sel.top_k, dim=-1)  # [M, K], sorted: column K - 1 is the weakest
    present = cand == labels[:, None]  # [M, K]
    missing = ~present.any(dim=-1)  # [M]
    cand = torch.where(missing[:, None] & (torch.arange(sel.top_k, device=cand.device) == sel.top_k - 1),
                       labels[:, None], cand)  # fmt: skip
    unary = logits.gather(-1, cand)  # [M, K] (the injected label keeps its own logit)
    target = (cand == labels[:, None]).to(torch.int64).argmax(dim=-1)  # [M]
    pair = pair_scores(
        F.embedding(prev, sel.predecessor_codebook)[:, None].float(),  # [M, 1, R]: one predecessor per row
        sel.project(hidden).float(),  # [M, R]
        F.embedding(cand if vocab is None else vocab[cand], sel.successor_codebook).float(),  # [M, K, R]
    )  # [M, 1, K]
    scores = unary.float() + pair[:, 0]  # [M, K]
    ce = F.cross_entropy(scores, target, reduction="none")
    pick = scores.detach().argmax(dim=-1)
    return ce, (pick == target) & ~missing, pick != 0


def dflash_loss(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    batch: BlockBatch,
    *,
    selector_weight: float = 1.0,
    vocab: LossVocab | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """hidden: [bs, N, B, D] -> (scalar loss = sum(w * CE) / sum(w), statistics). A DFlash 2 drafter adds
    selector_weight * sum(w * CE_selector) / sum(w), its K-way cross entropy (`selector_terms`). With
    `vocab` the softmax runs over that loss vocabulary, which holds every label, not the whole head."""
    sel = batch.weights > 0  # [bs, N, B]
    h = hidden[sel]  # [M, D]
    labels = batch.labels[sel] if vocab is None else vocab.index(batch.labels[sel])  # [M]
    ids = None if vocab is None else vocab.ids
    # the true previous token of slot j is the label of slot j - 1 (slot 0's label is the anchor)
    prev = torch.cat([batch.labels[..., :1], batch.labels[..., :-1]], dim=-1)[sel]  # [M]
    w = batch.weights[sel].float()  # [M]
    total_w = w.sum()
    dflash2 = drafter if drafter.selector is not None else None
    if h.shape[0] == 0:
        zero = hidden.sum() * 0.0
        return zero, LossStats(0.0, 0.0, [0.0] * max_draft_len_for(batch.block_size), 1.0)
    losses, correct, sel_losses, sel_hits, overturned = [], [], [], [], []
    for start in range(0, h.shape[0], LOGIT_CHUNK_ROWS):
        rows = slice(start, start + LOGIT_CHUNK_ROWS)
        logits = drafter.compute_logits(h[rows], ids).float()  # [m, V]
        losses.append(F.cross_entropy(logits, labels[rows], reduction="none"))
        correct.append(logits.detach().argmax(-1) == labels[rows])
        if dflash2 is not None:
            ce, hit, over = selector_terms(dflash2, h[rows], logits, labels[rows], prev[rows], ids)
            sel_losses.append(ce)
            sel_hits.append(hit)
            overturned.append(over)
    loss = (torch.cat(losses) * w).sum() / total_w
    stats = _slot_stats(sel, torch.cat(correct))
    stats.loss, stats.weight = float(loss.detach()), float(total_w)
    if dflash2 is not None:
        sel_loss = (torch.cat(sel_losses) * w).sum() / total_w
        loss = loss + selector_weight * sel_loss
        sel_stats = _slot_stats(sel, torch.cat(sel_hits))
        stats.selector_loss, stats.selector_acc, stats.tau = (
            float(sel_loss.detach()),
            sel_stats.acc,
            sel_stats.tau,
        )
        stats.overturn = float(torch.cat(overturned).float().mean())
    return loss, stats


@torch.no_grad()
def _slot_stats(sel: torch.Tensor, hits: torch.Tensor) -> LossStats:
    """Per-slot accuracy and the greedy tau estimate from hits [M] on the supervised slots sel [bs, N, B]."""
    hit = torch.zeros(sel.shape, dtype=torch.bool, device=sel.device)
    hit[sel] = hits
    per_slot = sel[..., 1:].sum(dim=(0, 1)).clamp(min=1)
    acc = (hit[..., 1:].sum(dim=(0, 1)) / per_slot).tolist()
    full = sel[..., 1:].all(dim=-1)  # [bs, N]: every slot supervised
    prefix = hit[..., 1:].long().cumprod(dim=-1).sum(dim=-1)  # [bs, N]
    tau = 1.0 + float(prefix[full].float().mean()) if bool(full.any()) else math.nan
    return LossStats(0.0, 0.0, acc, tau)
