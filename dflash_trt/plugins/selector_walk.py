# SPDX-License-Identifier: Apache-2.0
"""`dflash::selector_walk`: DFlash 2's sequential candidate walk for a batch, one Triton program per
request, a slot's K scores in registers (as the SGLang and vLLM ports run it inside the draft graph).

Contract (N requests, g slots, K candidates, rank R, vocabulary V) — `spec.selector.selector_walk`:
  unary        [N, g, K]   the drafter's logits at its candidates (any float dtype)
  candidates   [N, g, K]   int64 token ids
  proj         [N, g, R]   hidden_projection of the drafter's final states (unit stride in R)
  anchors      [N]         int64: the token before slot 1
  pred_codebook, succ_codebook  [V, R] (unit stride in R)
  temperature  [N] float32; u [N, g] float32 in (0, 1); greedy [N] bool
  any_sampled  False: every row is greedy (the kernel's draw is then never taken; it costs K exps)
  -> picks [N, g] int64 (index into the K candidates), q [N, g, K] float32
Slot j: score[k] = unary[j, k] + sum_r P[prev, r] * H[j, r] * S[cand[j, k], r]; greedy rows take the first
maximal score (q one-hot), sampled rows q = softmax(score / T) and the first k whose running sum of q
reaches u * sum(q); prev becomes cand[j, pick].

Equality with the reference: float32 scores summed in another order (R in tiles vs einsum), so picks are
identical unless two scores tie within rounding (greedy) or u * sum(q) lies within rounding of a CDF step
(sampled). Nothing synchronises with the host; the program's work is g * K * R multiply-adds.
"""

from __future__ import annotations

import torch

from dflash_trt.plugins import _registry as reg
from dflash_trt.plugins._registry import jit, tl
from dflash_trt.spec.selector import selector_walk as selector_walk_reference

MAX_BLOCK_R = 128  # rank entries per tile: a [K, 128] float32 tile of successor rows in registers


@jit
def _walk_kernel(
    unary_ptr,
    cand_ptr,
    proj_ptr,
    anchor_ptr,
    pred_ptr,
    succ_ptr,
    temp_ptr,
    u_ptr,
    greedy_ptr,
    pick_ptr,
    q_ptr,
    g,
    ksize,
    rank,
    su0,
    su1,
    sc0,
    sc1,
    sh0,
    sh1,
    spc,
    ssc,
    suu0,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < ksize
    greedy = tl.load(greedy_ptr + n) != 0
    temp = tl.load(temp_ptr + n)
    inv_t = 1.0 / tl.where(greedy | (temp <= 0), 1.0, temp)
    prev = tl.load(anchor_ptr + n)
    for j in range(0, g):
        cand = tl.load(cand_ptr + n * sc0 + j * sc1 + kk, mask=k_ok, other=0)
        pair = tl.zeros([BLOCK_K], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            r_ok = rr < rank
            pv = tl.load(pred_ptr + prev * spc + rr, mask=r_ok, other=0.0).to(tl.float32)
            hv = tl.load(proj_ptr + n * sh0 + j * sh1 + rr, mask=r_ok, other=0.0).to(tl.float32)
            sv = tl.load(
                succ_ptr + cand[:, None] * ssc + rr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0
            ).to(tl.float32)  # [BLOCK_K, BLOCK_R]
            pair += tl.sum(sv * (pv * hv)[None, :], axis=1)
        unary = tl.load(unary_ptr + n * su0 + j * su1 + kk, mask=k_ok, other=0.0).to(tl.float32)
        score = tl.where(k_ok, unary + pair, float("-inf"))
        # sampled: q = softmax(score / T); the first k whose running sum reaches u * sum(q)
        s = score * inv_t
        e = tl.where(k_ok, tl.exp(s - tl.max(s, 0)), 0.0)
        q = e / tl.sum(e, 0)
        cdf = tl.cumsum(q, 0)
        target = tl.load(u_ptr + n * suu0 + j) * tl.max(cdf, 0)
        drawn = tl.minimum(tl.min(tl.where(k_ok & (cdf >= target), kk, BLOCK_K), 0), ksize - 1)
        best = tl.argmax(score, 0, tie_break_left=True)
        pick = tl.where(greedy, best, drawn)
        q = tl.where(greedy, tl.where(kk == pick, 1.0, 0.0), q)
        tl.store(q_ptr + (n * g + j) * ksize + kk, q, mask=k_ok)
        tl.store(pick_ptr + n * g + j, pick.to(tl.int64))
        prev = tl.sum(tl.where(kk == pick, cand, 0), 0)


def _check_walk_inputs(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    proj: torch.Tensor,
    anchors: torch.Tensor,
    pred_codebook: torch.Tensor,
    succ_codebook: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[int, int, int]:
    """The launcher's shape, dtype, stride and device checks; returns (N, g, K)."""
    op = "selector_walk"
    reg.require_triton(op)
    chk = reg.check
    chk(unary.dim() == 3, op, f"unary must be [N, g, K], got {tuple(unary.shape)}")
    n, g, k = unary.shape
    chk(
        candidates.shape == (n, g, k) and candidates.dtype == torch.int64,
        op,
        "candidates must be [N, g, K] int64",
    )
    chk(unary.stride(2) == 1 or k == 1, op, "unary needs unit stride over K")
    chk(candidates.stride(2) == 1 or k == 1, op, "candidates need unit stride over K")
    chk(
        proj.dim() == 3 and proj.shape[:2] == (n, g) and proj.stride(2) == 1,
        op,
        "proj must be [N, g, R], unit stride in R",
    )
    rank = proj.shape[2]
    for cb, name in ((pred_codebook, "pred_codebook"), (succ_codebook, "succ_codebook")):
        chk(
            cb.dim() == 2 and cb.shape[1] == rank and cb.stride(1) == 1,
            op,
            f"{name} must be [V, R={rank}], unit stride in R",
        )
    chk(anchors.shape == (n,) and anchors.dtype == torch.int64, op, "anchors must be [N] int64")
    chk(
        temperature.shape == (n,) and temperature.dtype == torch.float32,
        op,
        "temperature must be [N] float32",
    )
    chk(
        u.shape == (n, g) and u.dtype == torch.float32 and (u.stride(1) == 1 or g <= 1),
        op,
        "u must be [N, g] float32",
    )
    chk(greedy.shape == (n,) and greedy.dtype == torch.bool, op, "greedy must be [N] bool")
    reg.check_same_device(
        op, unary, candidates, proj, anchors, pred_codebook, succ_codebook, temperature, u, greedy
    )
    return n, g, k


def launch_selector_walk(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    proj: torch.Tensor,
    anchors: torch.Tensor,
    pred_codebook: torch.Tensor,
    succ_codebook: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    greedy: torch.Tensor,
    any_sampled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, g, k = _check_walk_inputs(unary, candidates, proj, anchors, pred_codebook, succ_codebook, temperature, u,
                                 greedy)  # fmt: skip
    rank = proj.shape[2]
    picks = torch.empty(n, g, dtype=torch.int64, device=unary.device)
    q = torch.empty(n, g, k, dtype=torch.float32, device=unary.device)
    if n == 0 or g == 0:
        return picks, q
    _walk_kernel[(n,)](
        unary, candidates, proj, anchors, pred_codebook, succ_codebook, temperature.contiguous(), u, greedy.contiguous(),
        picks, q, g, k, rank, unary.stride(0), unary.stride(1), candidates.stride(0), candidates.stride(1),
        proj.stride(0), proj.stride(1), pred_codebook.stride(0), succ_codebook.stride(0), u.stride(0),
        BLOCK_K=reg.next_pow2(k), BLOCK_R=min(MAX_BLOCK_R, reg.next_pow2(rank)),
    )  # fmt: skip
    return picks, q


@torch.library.custom_op("dflash::selector_walk", mutates_args=())
def selector_walk(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    proj: torch.Tensor,
    anchors: torch.Tensor,
    pred_codebook: torch.Tensor,
    succ_codebook: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    greedy: torch.Tensor,
    any_sampled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (CPU) implementation: the reference; the Triton kernel under the interpreter switch."""
    args = (
        unary,
        candidates,
        proj,
        anchors,
        pred_codebook,
        succ_codebook,
        temperature,
        u,
        greedy,
        any_sampled,
    )
    if reg.triton_on_cpu():
        return launch_selector_walk(*args)
    return selector_walk_reference(*args)


@selector_walk.register_kernel("cuda")
def _selector_walk_cuda(
    unary, candidates, proj, anchors, pred_codebook, succ_codebook, temperature, u, greedy, any_sampled=True
):
    return launch_selector_walk(
        unary, candidates, proj, anchors, pred_codebook, succ_codebook, temperature, u, greedy, any_sampled
    )


@selector_walk.register_fake
def _selector_walk_fake(
    unary, candidates, proj, anchors, pred_codebook, succ_codebook, temperature, u, greedy, any_sampled=True
):
    n, g, k = unary.shape
    return (
        torch.empty(n, g, dtype=torch.int64, device=unary.device),
        torch.empty(n, g, k, dtype=torch.float32, device=unary.device),
    )
