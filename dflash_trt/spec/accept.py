# SPDX-License-Identifier: Apache-2.0
"""Acceptance rules: one round turns g drafts and g + 1 target distributions into
`a` accepted drafts (0 <= a <= g) plus one token emitted by the target.

Row j of the verify output (j = 0..g) is the target's distribution for the position after
block slot j: rows 0..g-1 judge drafts d_1..d_g, row g is the bonus distribution.

- Greedy: a = longest prefix with d_j == argmax p_j; emit argmax p_{a+1}.
- Lossless sampling (Leviathan et al.; Chen et al.): accept d_j with probability
  min(1, p_j(d_j) / q_j(d_j)), i.e. u * q < p, stopping at the first rejection; on a rejection
  emit a sample of max(0, p - q) renormalised (p itself if that is numerically empty); if all g
  are accepted emit a sample of the bonus distribution. A greedy draft is q = one-hot, which turns
  the rule into "accept with probability p(d), else sample p without d".
Positions after the first rejection are computed but never read, which is what keeps the
position-keyed uniforms of `sampling.py` single-use.
"""

from __future__ import annotations

import torch

from dflash_trt.spec.sampling import sample_from_probs


def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens: [N, g]; target_logits: [N, g + 1, V]; valid: [N, g] optional (False marks a slot
    beyond the sequence's block: never accepted) -> (accepted [N], emitted [N])."""
    posterior = target_logits.argmax(dim=-1)  # [N, g + 1]
    match = draft_tokens == posterior[:, :-1]  # [N, g]
    if valid is not None:
        match = match & valid
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [N]
    emitted = posterior.gather(1, accepted[:, None]).squeeze(1)  # [N]
    return accepted, emitted


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for a batch.

    draft_tokens: [N, g]; draft_probs q: [N, g, V]; target_probs p: [N, g + 1, V] (already
    temperature/top-k/top-p processed, rows of greedy requests one-hot); u_accept: [N, g];
    u_emit: [N, g + 1] (column j is the uniform for emitting after j accepted drafts);
    valid: [N, g] optional (False marks a slot beyond the sequence's block: never accepted).
    Returns (accepted [N], emitted [N]).
    """
    n, g = draft_tokens.shape
    p_d = target_probs[:, :g].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [N, g]
    q_d = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [N, g]
    ok = u_accept * q_d < p_d  # [N, g]
    if valid is not None:
        ok = ok & valid
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [N]
    rows = torch.arange(n, device=draft_tokens.device)
    p_a = target_probs[rows, accepted]  # [N, V]
    # q after the last draft is zero: the bonus distribution is p itself.
    q_pad = torch.cat(
        [draft_probs, draft_probs.new_zeros(n, 1, target_probs.shape[-1])], dim=1
    )  # [N, g + 1, V]
    residual = (p_a - q_pad[rows, accepted]).clamp_min(0)  # [N, V]
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    dist = torch.where(empty, p_a, residual)
    emitted = sample_from_probs(dist, u_emit.gather(1, accepted[:, None]).squeeze(1))
    return accepted, emitted


def rejection_accept_candidates(
    draft_tokens: torch.Tensor,
    candidates: torch.Tensor,
    cand_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_accept` with q given over each slot's candidates (DFlash 2's selector).

    draft_tokens: [N, g]; candidates: [N, g, K] distinct token ids per slot; cand_probs: [N, g, K]
    q(x) = cand_probs[k] where candidates[k] = x (0 off the candidates); the other arguments as in
    `rejection_accept`. On a rejection the residual max(0, p - q) has q scattered over the candidates
    (p itself if that is numerically empty); after g accepted drafts the bonus is drawn from p.
    Returns (accepted [N], emitted [N]), equal to `rejection_accept` with q densified.
    """
    n, g = draft_tokens.shape
    p_d = target_probs[:, :g].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [N, g]
    q_d = (cand_probs * (candidates == draft_tokens[..., None])).sum(-1)  # [N, g]
    ok = u_accept * q_d < p_d  # [N, g]
    if valid is not None:
        ok = ok & valid
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [N]
    rows = torch.arange(n, device=draft_tokens.device)
    p_a = target_probs[rows, accepted]  # [N, V]
    k = candidates.shape[-1]
    # after the last draft there is no q: a zero row (at candidate index 0) leaves p unchanged
    q_pad = torch.cat([cand_probs, cand_probs.new_zeros(n, 1, k)], dim=1)[rows, accepted]  # [N, K]
    c_pad = torch.cat([candidates, candidates.new_zeros(n, 1, k)], dim=1)[rows, accepted]  # [N, K]
    residual = p_a.scatter_add(-1, c_pad, -q_pad.to(p_a.dtype)).clamp_min(0)  # [N, V]
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    dist = torch.where(empty, p_a, residual)
    emitted = sample_from_probs(dist, u_emit.gather(1, accepted[:, None]).squeeze(1))
    return accepted, emitted
