# SPDX-License-Identifier: Apache-2.0
"""Fused projections: linears that read the same input, run as one GEMM.

`FusedLinear.of(linears)` stacks their weights (and biases) into one matrix and makes each original
linear's weight a view of its rows. Loading by name, `state_dict()` and in-place weight updates keep
working on the originals, and no second copy of the weights exists. One [N1 + N2 + ..., K] GEMM
instead of several: fewer calls (each costs a fixed dispatch and packing overhead on CPU) and a wider
GEMV on the bandwidth-bound path. Inference only: the fused tensors are non-persistent buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class FusedLinear(nn.Module):
    """y_1, ..., y_n = split(x @ [W_1; ...; W_n]^T + [b_1; ...; b_n])."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # [sum N_i, K]
        self.register_buffer("bias", bias, persistent=False)  # [sum N_i] or None
        self.sizes = tuple(sizes)

    @classmethod
    def of(cls, linears: Sequence[nn.Linear]) -> FusedLinear:
        """Fuse `linears` (same input width; all with biases or none) and rebind each one's weight and
        bias to a view of the fused tensors."""
        has_bias = [m.bias is not None for m in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("FusedLinear.of: either every linear has a bias or none has")
        with torch.no_grad():
            weight = torch.cat([m.weight for m in linears], dim=0)
            bias = torch.cat([m.bias for m in linears if m.bias is not None]) if all(has_bias) else None
        rows = 0
        for m in linears:
            n = m.out_features
            m.weight = nn.Parameter(weight[rows : rows + n], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[rows : rows + n], requires_grad=False)
            rows += n
        return cls(weight, bias, [m.out_features for m in linears])

    def tail(self, first: int) -> FusedLinear:
        """The projections after the first `first` ones, as views of this one's rows."""
        skip = sum(self.sizes[:first])
        bias = None if self.bias is None else self.bias[skip:]
        return FusedLinear(self.weight[skip:], bias, self.sizes[first:])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
