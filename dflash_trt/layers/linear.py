# SPDX-License-Identifier: Apache-2.0
"""Linear layers of the engine: fused projections, and weights prepacked for the CPU's GEMM library.

Fused projections. `FusedLinear.of(linears)` stacks their weights (and biases) into one matrix and
makes each original linear's weight a view of its rows. Loading by name, `state_dict()` and in-place
weight updates keep working on the originals, and no second copy of the weights exists. One
[N1 + N2 + ..., K] GEMM instead of several: fewer calls (each costs a fixed dispatch and packing
overhead on CPU) and a wider GEMV on the bandwidth-bound path. Inference only: the fused tensors are
non-persistent buffers.

Prepacked weights (CPU, bfloat16). oneDNN's bf16 GEMM reorders a plain row-major weight into its
blocked layout on every call; for decoding (a handful of rows against the whole weight) that reorder
is most of the cost: a [1, 1024] x [1024, 6144] bf16 GEMV streams the weight at ~12 GB/s plain and
~22 GB/s prepacked on a 2-core AMD EPYC whose read bandwidth is ~30 GB/s. `pack_linears(model)`
packs every bf16 linear weight once, after loading, and from then on each `Linear`/`FusedLinear`
runs `dflash_cpu::packed_linear`: on a CPU with AVX512-BF16, dflash-trt's own GEMM on its own layout
(`cpu_gemm`: reads the weight once per call, faster than oneDNN at every batch measured), elsewhere
oneDNN's kernels on the layout oneDNN picks (the same numerics as unpacked, without the reorder).
On CPUs without native bf16 a wide bf16 checkpoint runs in fp32; `pack_linears(model, float32=True)`
keeps its weights bf16 in memory there (`cpu_gemm`'s AVX2 kernel widens them in registers).

Packed fp32 weights (CPU with AVX-512F). fp32 models keep fp32 and run every linear whose width is a
multiple of 16 through `dflash_f32::linear` (layers/gemm_f32_op.cpp, a C++ operator): on `tiny`, a
compiled DFlash round at batch 1 1.16-1.24x and a plain step 1.25-1.35x faster than MKL's sgemm
(bench/README.md, "dflash-trt's own fp32 GEMM"). Such a weight is packed as [N/16, K, 16] and the
layer holds that tensor itself (3-D, so `linear` knows it), not a placeholder. Likewise a bf16 weight in
`cpu_gemm`'s layout whose width is a whole number of blocks runs through `dflash_bf16::linear` (the
same kernel as a C++ operator, layers/gemm_bf16_op.cpp) and the layer holds the 4-D packed tensor.

A packed layer's weight is a *placeholder*: an empty [out_features, 0] tensor that stands for the
packed one (torch.compile cannot trace oneDNN's opaque tensors; a placeholder is an ordinary graph
input, so a compiled graph names no process-specific handle and can be saved and reused by another
process). The dense weight is released where nothing else reads it; any stray use of a placeholder
fails on its shape instead of computing on garbage. A weight shared with an embedding (tied LM heads)
keeps its dense copy for the lookup, and the layer gets the placeholder beside it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dflash_trt.layers import cpu_gemm

# The packed weight of every placeholder (oneDNN's opaque tensor, or `cpu_gemm`'s layout), keyed by
# the placeholder's TensorImpl address; an entry is dropped when its placeholder is freed.
_PACKED: dict[int, torch.Tensor | cpu_gemm.BlockedWeight] = {}


def is_packed(weight: torch.Tensor) -> bool:
    """A placeholder of a packed weight ([out_features, 0]; no real linear has zero inputs)."""
    return weight.dim() == 2 and weight.shape[1] == 0


def in_features(weight: torch.Tensor) -> int | None:
    """The input width of a weight as `linear` takes it: dense [N, K], fp32-packed [N/16, K, 16]; None
    for a placeholder (its packed copy is not a tensor here)."""
    if weight.dim() == 3:
        return weight.shape[1]
    if weight.dim() == 4:
        return 2 * weight.shape[1]
    return None if is_packed(weight) else weight.shape[-1]


def _placeholder(
    packed: torch.Tensor | cpu_gemm.BlockedWeight, out_features: int, like: torch.Tensor
) -> torch.Tensor:
    holder = torch.empty(out_features, 0, dtype=like.dtype, device=like.device)
    key = holder._cdata
    _PACKED[key] = packed
    weakref.finalize(holder, _PACKED.pop, key, None)
    return holder


@torch.library.custom_op("dflash_cpu::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., K] bf16 -> [..., N] through the packed weight that `weight` (a placeholder
    [N, 0], see `pack_linears`) stands for."""
    packed = _PACKED.get(weight._cdata)
    if packed is None:
        raise RuntimeError("dflash_cpu::packed_linear: this placeholder stands for no packed weight")
    if isinstance(packed, cpu_gemm.BlockedWeight):
        return cpu_gemm.gemm(x, packed, bias)
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [None], "")
    return y.view(*x.shape[:-1], weight.shape[0])


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias; through the packed copy when `weight` is a placeholder, and through
    `dflash_f32::linear` when it is an fp32 weight in that operator's layout (3-D), `dflash_bf16::linear`
    when it is a bf16 weight in `cpu_gemm`'s layout (4-D)."""
    if weight.dim() == 3:
        return torch.ops.dflash_f32.linear(x, weight, bias, weight.shape[0] * cpu_gemm.BLOCK)
    if weight.dim() == 4:
        return torch.ops.dflash_bf16.linear(x, weight, bias, weight.shape[0] * cpu_gemm.BLOCK)
    if is_packed(weight):
        return torch.ops.dflash_cpu.packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) that can run on a packed weight: its
    `packed` placeholder when set (a tied weight stays dense beside it), else `weight`."""

    packed: torch.Tensor | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("packed", None, persistent=False)  # a buffer: compiled graphs take it as input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight if self.packed is None else self.packed, self.bias)


class FusedLinear(nn.Module):
    """y_1, ..., y_n = split(x @ [W_1; ...; W_n]^T + [b_1; ...; b_n])."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        sizes: Sequence[int],
        sources: Sequence[nn.Linear] = (),
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # [sum N_i, K]
        self.register_buffer("bias", bias, persistent=False)  # [sum N_i] or None
        self.sizes = tuple(sizes)
        # The linears whose weights are views of this one's rows (not submodules: their parents own them).
        self._sources = tuple(sources)

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
        return cls(weight, bias, [m.out_features for m in linears], linears)

    def tail(self, first: int) -> FusedLinear:
        """The projections after the first `first` ones, as views of this one's rows."""
        skip = sum(self.sizes[:first])
        bias = None if self.bias is None else self.bias[skip:]
        return FusedLinear(self.weight[skip:], bias, self.sizes[first:], self._sources[first:])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def can_pack(weight: torch.Tensor, *, float32: bool = False) -> bool:
    """Whether `pack_linears` would pack this weight: bf16 on a CPU where our GEMM or oneDNN runs; with
    `float32`, also an fp32 weight whose values are all bf16 values where our AVX2 kernel runs."""
    return _packed_form(weight, float32=float32) is not None


def _packed_form(weight: torch.Tensor, *, float32: bool) -> str | None:
    """'ours' (`cpu_gemm`'s bf16 layout), 'onednn', 'f32' (`dflash_f32::linear`), or None (stays
    dense) for this weight."""
    if weight.device.type != "cpu" or weight.dim() != 2 or is_packed(weight):
        return None
    if weight.dtype == torch.bfloat16 or (float32 and weight.dtype == torch.float32):
        if cpu_gemm.supports(weight):
            return "ours"
        if weight.dtype == torch.bfloat16 and onednn_bf16_available():
            return "onednn"
    # fp32 kept fp32: output widths in whole blocks only, so that the packed shape names the width
    if weight.dtype == torch.float32 and weight.shape[0] % cpu_gemm.BLOCK == 0 and cpu_gemm.f32_available():
        return "f32"
    return None


def onednn_bf16_available() -> bool:
    """Whether oneDNN packs and multiplies bf16 weights on this CPU (it needs AVX512BW/VL/DQ or
    AVX-NE-CONVERT; an AVX2-only CPU has neither, and its bf16 weights stay dense for torch's matmul)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module, *, float32: bool = False) -> int:
    """Prepack every bf16 `Linear` and `FusedLinear` weight of `model` (CPU: in `cpu_gemm`'s layout
    where that kernel runs, else in oneDNN's) and release the dense copies that nothing else needs
    (every nn.Embedding weight of `model` stays dense, tied or not). With `float32`, also every fp32
    weight whose values are all bf16 values (a bf16 checkpoint loaded in fp32): stored as bf16 in
    `cpu_gemm`'s layout, half the bytes, computed in fp32 (where its AVX2 kernel runs; else it stays
    dense). Every other fp32 weight whose width is a multiple of 16 is packed for `dflash_f32::linear`
    where that operator runs (AVX-512F). Returns the number of weights packed. Inference only; call
    after loading, fusing and moving the model."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    fused = [m for m in model.modules() if isinstance(m, FusedLinear)]
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            if module.packed is not None or any(module in f._sources for f in fused):
                continue  # packed already, or runs through the FusedLinear its weight is a row block of
        elif not isinstance(module, FusedLinear):
            continue
        weight = module.weight
        form = _packed_form(weight, float32=float32)
        if form is None:
            continue
        with torch.no_grad():
            packed: torch.Tensor | cpu_gemm.BlockedWeight
            if form == "ours":
                packed = cpu_gemm.pack(weight)
            elif form == "f32":
                packed = cpu_gemm.pack_f32(weight)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        holder: torch.Tensor
        if isinstance(packed, torch.Tensor) and form == "f32":
            holder = packed  # the packed tensor itself goes into the graph: the operator is C++, no lookup
        elif isinstance(packed, cpu_gemm.BlockedWeight) and _bf16_op_takes(packed, weight):
            holder = packed.data  # 4-D: `dflash_bf16::linear`, also C++
        else:
            holder = _placeholder(packed, weight.shape[0], weight)
        count += 1
        if isinstance(module, FusedLinear):
            for src in module._sources:  # views of its storage: dropped with it
                src.weight = nn.Parameter(_empty_like(weight), requires_grad=False)
            module.weight = holder
        else:
            module.packed = holder
            if id(weight) not in embeddings:  # tied: the embedding keeps the dense weight
                module.weight = nn.Parameter(_empty_like(weight), requires_grad=False)
    return count


def _bf16_op_takes(packed: cpu_gemm.BlockedWeight, weight: torch.Tensor) -> bool:
    """A bf16 weight of whole blocks runs through `dflash_bf16::linear` where it is built (the packed
    shape then names the width); others keep the placeholder and the Python op."""
    return weight.dtype == torch.bfloat16 and packed.n % cpu_gemm.BLOCK == 0 and cpu_gemm.bf16_op_available()


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)
