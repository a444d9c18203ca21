# SPDX-License-Identifier: Apache-2.0
"""The gated MLP of Llama-family decoders and the DFlash drafter."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dflash_trt.layers.linear import FusedLinear, Linear


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); after `fuse()`, gate and up run as one GEMM."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: FusedLinear | None = None

    def fuse(self) -> None:
        self.gate_up = FusedLinear.of([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)
