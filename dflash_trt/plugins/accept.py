# SPDX-License-Identifier: Apache-2.0
"""`dflash::greedy_accept` and `dflash::rejection_accept`: verification for a batch, on device, with
no host synchronisation.

Contract (N sequences, g drafts each; row j of the target output judges draft j + 1, row g is the
bonus distribution — `spec/accept.py`):
  draft_tokens   [N, g] int64
  target_logits  [N, g + 1, V]       (greedy) any float dtype
  draft_probs    [N, g, V] float32   (rejection) q, rows of greedy drafts one-hot
  target_probs   [N, g + 1, V] float32 (rejection) p, already temperature/top-k/top-p processed
  u_accept       [N, g] float32      the u of "accept iff u * q(d) < p(d)"
  u_emit         [N, g + 1] float32  column a: the uniform for emitting after a accepted drafts
  valid          [N, g] bool         False: the slot lies beyond the sequence's block, never accepted
  -> accepted    [N] int64  a = length of the accepted prefix
     emitted     [N] int64  the target's token after it (correction or bonus)
The caller commits drafts[:a] and the emitted token (the engine does so on the host).

Equality with `spec/accept.py`: accepted lengths and greedy tokens are identical (argmax takes the first
maximal index; logits are assumed free of NaN). The rejection path's inverse-CDF draw uses the same
uniform and the same "first index whose running sum reaches u * total" rule, with fp32 sums in a
different order (chunked scan vs torch.cumsum), so the two can differ only when u * total lies
within float rounding of a CDF step (probability ~1e-7 per draw).

Kernels. Greedy: an argmax over vocabulary splits for every one of the N * (g + 1) rows (a
bandwidth-bound pass over the logits, spread over many programs), then one program per sequence
merges the splits, walks the g drafts and writes a and the emitted token. Rejection: one program per
sequence computes a from g scalar loads of p(d) and q(d), then makes two passes over row a
(residual mass; then the running sum up to u * total).
"""

from __future__ import annotations

import math

import torch

from dflash_trt.plugins import _registry as reg
from dflash_trt.plugins._registry import jit, tl
from dflash_trt.spec import accept as verify
from dflash_trt.spec.sampling import sample_from_probs

DEFAULT_BLOCK_V = 1024  # vocabulary entries per tile
ARGMAX_SPLIT = 8192  # vocabulary entries per argmax program (untuned)


# --- references: spec/accept.py -------------------------------------------------------------------
def greedy_accept_reference(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return verify.greedy_accept(draft_tokens, target_logits, valid)


def rejection_accept_reference(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if draft_tokens.shape[1] == 0:
        # verify.rejection_accept indexes an empty q at g = 0; the rule reduces to a draw from p_0.
        accepted = torch.zeros(draft_tokens.shape[0], dtype=torch.int64, device=draft_tokens.device)
        return accepted, sample_from_probs(target_probs[:, 0], u_emit[:, 0])
    return verify.rejection_accept(draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid)


# --- Triton kernels ---------------------------------------------------------------------------
@jit
def _argmax_splits_kernel(
    x_ptr,
    val_ptr,  # [R, NUM_SPLITS] fp32: the split's maximum
    idx_ptr,  # [R, NUM_SPLITS] int64: its first index
    rows_per_seq,
    sx0,
    sx1,
    vocab,
    split_len,  # a multiple of BLOCK_V
    NUM_SPLITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    split = tl.program_id(1)
    n = (r // rows_per_seq).to(tl.int64)  # n * sx0 can pass 2**31 at large batch x vocabulary
    j = r % rows_per_seq
    row = x_ptr + n * sx0 + j * sx1
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab)
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK_V], 2**62, tl.int64)
    for start in range(lo, hi, BLOCK_V):
        idx = start + offs
        x = tl.load(row + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        take = x > best  # strict: an earlier tile keeps a tie
        best = tl.where(take, x, best)
        best_idx = tl.where(take, idx.to(tl.int64), best_idx)
    m = tl.max(best, 0)
    # first index among the lanes holding the maximum; a row of -inf keeps the split's first index
    first = tl.min(tl.where(best == m, best_idx, 2**62), 0)
    first = tl.where(first == 2**62, lo.to(tl.int64), first)
    tl.store(val_ptr + r * NUM_SPLITS + split, m)
    tl.store(idx_ptr + r * NUM_SPLITS + split, first)


@jit
def _greedy_walk_kernel(
    val_ptr,
    idx_ptr,
    draft_ptr,
    valid_ptr,
    acc_ptr,
    emit_ptr,
    sd0,
    sv0,
    g,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # row offsets n * stride can pass 2**31
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    a = tl.full([], 0, tl.int32)
    alive = tl.full([], 1, tl.int32)
    for j in range(0, g):
        r = n * (g + 1) + j
        vals = tl.load(val_ptr + r * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
        best = tl.argmax(vals, 0, tie_break_left=True)  # earlier split wins a tie
        post = tl.load(idx_ptr + r * NUM_SPLITS + best)
        d = tl.load(draft_ptr + n * sd0 + j)
        ok = (d == post) & (tl.load(valid_ptr + n * sv0 + j) != 0)
        alive = alive * ok.to(tl.int32)
        a += alive
    r = n * (g + 1) + a
    vals = tl.load(val_ptr + r * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    emitted = tl.load(idx_ptr + r * NUM_SPLITS + tl.argmax(vals, 0, tie_break_left=True))
    tl.store(acc_ptr + n, a.to(tl.int64))
    tl.store(emit_ptr + n, emitted)


@jit
def _rejection_kernel(
    draft_ptr,
    q_ptr,
    p_ptr,
    ua_ptr,
    ue_ptr,
    valid_ptr,
    acc_ptr,
    emit_ptr,
    sd0,
    sq0,
    sq1,
    sp0,
    sp1,
    sua0,
    sue0,
    sv0,
    g,
    vocab,
    BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # row offsets n * stride can pass 2**31
    # 1. accepted prefix: accept draft j iff u * q(d) < p(d) (and the slot is valid)
    a = tl.full([], 0, tl.int32)
    alive = tl.full([], 1, tl.int32)
    for j in range(0, g):
        d = tl.load(draft_ptr + n * sd0 + j)
        p_d = tl.load(p_ptr + n * sp0 + j * sp1 + d)
        q_d = tl.load(q_ptr + n * sq0 + j * sq1 + d)
        u = tl.load(ua_ptr + n * sua0 + j)
        ok = (u * q_d < p_d) & (tl.load(valid_ptr + n * sv0 + j) != 0)
        alive = alive * ok.to(tl.int32)
        a += alive
    # 2. residual max(p_a - q_a, 0) of row a (q after the last draft is zero: the bonus row is p)
    p_row = p_ptr + n * sp0 + a * sp1
    q_row = q_ptr + n * sq0 + a * sq1
    q_len = tl.where(a < g, vocab, 0)  # no q row after the last draft
    offs = tl.arange(0, BLOCK_V)
    res_sum = tl.zeros([BLOCK_V], tl.float32)
    p_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        ok = idx < vocab
        p = tl.load(p_row + idx, mask=ok, other=0.0)
        q = tl.load(q_row + idx, mask=idx < q_len, other=0.0)
        res_sum += tl.maximum(p - q, 0.0)
        p_sum += p
    res_total = tl.sum(res_sum, 0)
    use_p = res_total <= 0  # numerically empty residual: sample p itself
    total = tl.where(use_p, tl.sum(p_sum, 0), res_total)
    target = tl.load(ue_ptr + n * sue0 + a) * total
    # 3. inverse CDF: the first index whose running sum reaches u * total
    carry = tl.full([], 0.0, tl.float32)
    found = tl.full([], 0, tl.int32) + vocab
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        ok = idx < vocab
        p = tl.load(p_row + idx, mask=ok, other=0.0)
        q = tl.load(q_row + idx, mask=idx < q_len, other=0.0)
        w = tl.where(use_p, p, tl.maximum(p - q, 0.0))
        cdf = tl.cumsum(w, 0) + carry
        found = tl.minimum(found, tl.min(tl.where(ok & (cdf >= target), idx, vocab), 0))
        carry += tl.sum(w, 0)
    emitted = tl.minimum(found, vocab - 1).to(tl.int64)
    tl.store(acc_ptr + n, a.to(tl.int64))
    tl.store(emit_ptr + n, emitted)


def _check_common(op: str, draft_tokens, valid, rows: torch.Tensor) -> tuple[int, int, int]:
    chk = reg.check
    chk(
        draft_tokens.dim() == 2 and draft_tokens.dtype == torch.int64, op, "draft_tokens must be [N, g] int64"
    )
    n, g = draft_tokens.shape
    chk(
        rows.dim() == 3 and rows.shape[:2] == (n, g + 1),
        op,
        f"target rows must be [N, g + 1, V], got {tuple(rows.shape)}",
    )
    chk(rows.stride(2) == 1, op, "target rows need unit stride in the vocabulary")
    chk(draft_tokens.stride(1) == 1 or g <= 1, op, "draft_tokens needs unit column stride")
    chk(valid.shape == (n, g) and valid.dtype == torch.bool, op, "valid must be [N, g] bool")
    chk(valid.stride(1) == 1 or g <= 1, op, "valid needs unit column stride")
    return n, g, rows.shape[2]


def _outputs(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [N], emitted [N]) int64, uninitialised."""
    acc = torch.empty(n, dtype=torch.int64, device=device)
    return acc, torch.empty_like(acc)


def launch_greedy_accept(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    valid: torch.Tensor,
    *,
    split_len: int = ARGMAX_SPLIT,
    block_v: int = DEFAULT_BLOCK_V,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "greedy_accept"
    reg.require_triton(op)
    n, g, vocab = _check_common(op, draft_tokens, valid, target_logits)
    reg.check(reg.float_dtype_ok(target_logits), op, f"unsupported logits dtype {target_logits.dtype}")
    reg.check(vocab > 0, op, "empty vocabulary")
    reg.check_same_device(op, draft_tokens, target_logits, valid)
    outs = _outputs(n, draft_tokens.device)
    if n == 0:
        return outs
    split_len = max(block_v, math.ceil(min(split_len, vocab) / block_v) * block_v)
    splits = math.ceil(vocab / split_len)
    rows = n * (g + 1)
    vals = torch.empty(rows, splits, dtype=torch.float32, device=draft_tokens.device)
    idxs = torch.empty(rows, splits, dtype=torch.int64, device=draft_tokens.device)
    _argmax_splits_kernel[(rows, splits)](
        target_logits, vals, idxs, g + 1, target_logits.stride(0), target_logits.stride(1), vocab, split_len,
        NUM_SPLITS=splits, BLOCK_V=block_v,
    )  # fmt: skip
    acc, emit = outs
    _greedy_walk_kernel[(n,)](
        vals, idxs, draft_tokens, valid, acc, emit, draft_tokens.stride(0), valid.stride(0), g,
        NUM_SPLITS=splits, BLOCK_S=reg.next_pow2(splits),
    )  # fmt: skip
    return outs


def launch_rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    valid: torch.Tensor,
    *,
    block_v: int = DEFAULT_BLOCK_V,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "rejection_accept"
    reg.require_triton(op)
    n, g, vocab = _check_common(op, draft_tokens, valid, target_probs)
    chk = reg.check
    chk(
        draft_probs.shape == (n, g, vocab),
        op,
        f"draft_probs must be [N, g, V], got {tuple(draft_probs.shape)}",
    )
    chk(draft_probs.stride(2) == 1, op, "draft_probs needs unit stride in the vocabulary")
    chk(u_accept.shape == (n, g) and u_emit.shape == (n, g + 1), op, "u_accept [N, g], u_emit [N, g + 1]")
    chk(u_accept.stride(1) == 1 or g <= 1, op, "u_accept needs unit column stride")
    chk(u_emit.stride(1) == 1, op, "u_emit needs unit column stride")
    for t, name in (
        (draft_probs, "draft_probs"),
        (target_probs, "target_probs"),
        (u_accept, "u_accept"),
        (u_emit, "u_emit"),
    ):
        chk(t.dtype == torch.float32, op, f"{name} must be float32, got {t.dtype}")
    reg.check_same_device(op, draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid)
    outs = _outputs(n, draft_tokens.device)
    if n == 0:
        return outs
    acc, emit = outs
    _rejection_kernel[(n,)](
        draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid, acc, emit,
        draft_tokens.stride(0), draft_probs.stride(0), draft_probs.stride(1),
        target_probs.stride(0), target_probs.stride(1), u_accept.stride(0), u_emit.stride(0),
        valid.stride(0), g, vocab,
        BLOCK_V=block_v,
    )  # fmt: skip
    return outs


# --- the custom ops ----------------------------------------------------------------------------
@torch.library.custom_op("dflash::greedy_accept", mutates_args=())
def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (CPU) implementation: the reference; the Triton kernels under the interpreter switch."""
    if reg.triton_on_cpu():
        return launch_greedy_accept(draft_tokens, target_logits, valid)
    return greedy_accept_reference(draft_tokens, target_logits, valid)


@greedy_accept.register_kernel("cuda")
def _greedy_accept_cuda(draft_tokens, target_logits, valid):
    return launch_greedy_accept(draft_tokens, target_logits, valid)


@greedy_accept.register_fake
def _greedy_accept_fake(draft_tokens, target_logits, valid):
    return _outputs(draft_tokens.shape[0], draft_tokens.device)


@torch.library.custom_op("dflash::rejection_accept", mutates_args=())
def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (CPU) implementation: the reference; the Triton kernel under the interpreter switch."""
    args = (draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid)
    if reg.triton_on_cpu():
        return launch_rejection_accept(*args)
    return rejection_accept_reference(*args)


@rejection_accept.register_kernel("cuda")
def _rejection_accept_cuda(draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid):
    return launch_rejection_accept(draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid)


@rejection_accept.register_fake
def _rejection_accept_fake(draft_tokens, draft_probs, target_probs, u_accept, u_emit, valid):
    return _outputs(draft_tokens.shape[0], draft_tokens.device)
