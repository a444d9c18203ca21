# SPDX-License-Identifier: Apache-2.0
"""RMSNorm: the one normalisation shared by the drafter, the native targets and training."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Qwen3/Llama RMSNorm: the variance is computed in fp32 and the weight applied in the input
    dtype; `weight_in_fp32=True` (gpt-oss) applies the weight before casting back."""

    def __init__(self, dim: int, eps: float = 1e-6, *, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight * h).to(dtype)
        return self.weight * h.to(dtype)
