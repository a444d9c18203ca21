# SPDX-License-Identifier: Apache-2.0
"""Small building blocks shared by the drafter and the native target models."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """Qwen3/Llama RMSNorm: the variance is computed in fp32, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
    length). Key k is visible to query q iff valid, and (causal) k <= q, and (window) q - k < w;
    a non-causal window is symmetric (|q - k| < w).
    """
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    vis = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if causal:
        vis = vis & (kp <= qp)
    if window is not None:
        vis = vis & (qp - kp < window)
        if not causal:
            vis = vis & (kp - qp < window)
    return vis[:, None]
