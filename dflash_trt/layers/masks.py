# SPDX-License-Identifier: Apache-2.0
"""The attention visibility rule, in one place: causal or block (non-causal), with sliding windows.

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
