# SPDX-License-Identifier: Apache-2.0
"""The attention visibility rule, in one place: causal or block (non-causal), with sliding windows,
and a block of new tokens with its own visibility (DDTree verification).

Used by the drafter's block pass, the native targets, the plugin references and training.
"""

from __future__ import annotations

import torch


def apply_visibility(
    q_pos: torch.Tensor, k_pos: torch.Tensor, base: torch.Tensor, *, causal: bool, window: int | None
) -> torch.Tensor:
    """The rule: key k is visible to query q iff `base` allows it, and (causal) k <= q, and
    (window w) q - k < w; a non-causal window is symmetric (|q - k| < w).

    q_pos, k_pos and base are broadcast against each other (e.g. q_pos [..., Q, 1],
    k_pos [..., 1, K], base [..., Q, K])."""
    vis = base
    if causal:
        vis = vis & (k_pos <= q_pos)
    if window is not None:
        vis = vis & (q_pos - k_pos < window)
        if not causal:
            vis = vis & (k_pos - q_pos < window)
    return vis


def visibility_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Boolean attention mask [bs, 1, Q, K] from absolute positions.

    q_pos: [bs, Q]; k_pos: [bs, K]; k_valid: [bs, K] (False for padding / beyond a sequence's
    length). See `apply_visibility` for the rule.
    """
    base = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)  # [bs, Q, K]
    vis = apply_visibility(q_pos[:, :, None], k_pos[:, None, :], base, causal=causal, window=window)
    return vis[:, None]


def block_visibility_mask(
    q_pos: torch.Tensor,
    k_valid: torch.Tensor,
    block_start: torch.Tensor,
    block_mask: torch.Tensor,
    *,
    window: int | None,
) -> torch.Tensor:
    """Boolean mask [bs, 1, T, Lc] for T new tokens whose keys occupy cache columns
    [block_start, block_start + T) in row order, with their own visibility among themselves
    (DDTree: a node sees itself and its ancestors only).

    q_pos: [bs, T] positions of the new tokens (they need not be distinct or increasing);
    k_valid: [bs, Lc] (column j of a sequence is position j before block_start);
    block_start: [bs]; block_mask: [bs, T, T] bool, [i, j] = row i sees row j.
    Columns before block_start are the past context: visible as under causal attention (with the
    window rule on positions); block columns follow `block_mask`, and the window on the two rows'
    positions.
    """
    bs, t = q_pos.shape
    lc = k_valid.shape[1]
    col = torch.arange(lc, device=q_pos.device)
    rel = col[None, :] - block_start[:, None]  # [bs, Lc]
    in_block = (rel >= 0) & (rel < t)
    rel = rel.clamp(0, t - 1)
    k_pos = torch.where(in_block, q_pos.gather(1, rel), col[None, :])  # [bs, Lc]
    seen = block_mask.gather(2, rel[:, None, :].expand(bs, t, lc))  # [bs, T, Lc]
    base = k_valid[:, None, :] & torch.where(in_block[:, None, :], seen, True)
    vis = apply_visibility(q_pos[:, :, None], k_pos[:, None, :], base, causal=True, window=window)
    return vis[:, None]
