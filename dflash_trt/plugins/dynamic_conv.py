# SPDX-License-Identifier: Apache-2.0
"""`dflash::dynamic_conv`: DFlash 2's grouped dynamic causal convolution over a batch of blocks,
fused with its dynamic coefficients (one launch instead of 2K padded copies and 2K multiply-adds).

Contract (N blocks of B slots, D channels, K taps, G = D / group_size groups):
  x       [N, B, D]            the conv's input (unit channel stride); row n is one request's block
  coeff   [N, B, 2, K, G]      the kernel projection's output as `GroupedDynamicCausalConv.coefficients`
                               gives it ([2, K, G] contiguous; the leading strides are free)
  base    [2, K, D]            base_kernel
  half    0 (prepare) | 1 (finish)
  -> out  [N, B, D]: out[n, i, c] = sum_t (base[half, t, c] + coeff[n, i, half, t, c // group_size]) * x[n, i - t, c]
The taps stay inside row n: slot i - t < 0 reads zero padding (the anchor's left), never the previous
request's block, which is what makes a ragged batch safe. The reference is
`models.dflash2.grouped_dynamic_conv` (through `GroupedDynamicCausalConv`'s halves).

Kernel: one program per (slot, channel tile); the K taps are unrolled; it reads the coefficients from
the projection output in place (no slice copies, no materialised per-slot kernel), accumulates in
float32 in the reference's order (base term, then dynamic term, per tap) and rounds once.
"""

from __future__ import annotations

import torch

from dflash_trt.models.dflash2 import grouped_dynamic_conv
from dflash_trt.plugins import _registry as reg
from dflash_trt.plugins._registry import jit, tl

DEFAULT_BLOCK_D = 128


def dynamic_conv_reference(
    x: torch.Tensor, coeff: torch.Tensor, base: torch.Tensor, half: int, group_size: int
) -> torch.Tensor:
    return grouped_dynamic_conv(x, coeff[..., half, :, :], base[half], group_size=group_size).contiguous()


@jit
def _dynamic_conv_kernel(
    x_ptr,
    c_ptr,
    b_ptr,
    out_ptr,
    blk,
    dim,
    sx0,
    sx1,
    sc0,
    sc1,
    so0,
    so1,
    half,
    KSIZE: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    n = (row // blk).to(tl.int64)
    i = row % blk
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = ch < dim
    grp = ch // GROUP_SIZE
    acc = tl.zeros([BLOCK_D], tl.float32)
    for t in tl.static_range(KSIZE):
        src = ch * 0 + (i - t)  # [BLOCK_D]: taps before the anchor read zero padding, never another row
        xv = tl.load(x_ptr + n * sx0 + src * sx1 + ch, mask=ok & (src >= 0), other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + (half * KSIZE + t) * dim + ch, mask=ok, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + n * sc0 + i * sc1 + (half * KSIZE + t) * GROUPS + grp, mask=ok, other=0.0).to(
            tl.float32
        )
        acc += bv * xv
        acc += cv * xv
    tl.store(out_ptr + n * so0 + i * so1 + ch, acc.to(out_ptr.dtype.element_ty), mask=ok)


def launch_dynamic_conv(
    x: torch.Tensor,
    coeff: torch.Tensor,
    base: torch.Tensor,
    half: int,
    group_size: int,
    *,
    block_d: int = DEFAULT_BLOCK_D,
) -> torch.Tensor:
    op = "dynamic_conv"
    reg.require_triton(op)
    chk = reg.check
    chk(
        x.dim() == 3 and x.stride(2) == 1,
        op,
        f"x must be [N, B, D] with unit channel stride, got {tuple(x.shape)}",
    )
    n, blk, dim = x.shape
    chk(group_size >= 1 and dim % group_size == 0, op, f"group_size={group_size} must divide D={dim}")
    groups = dim // group_size
    chk(base.dim() == 3 and base.shape[0] == 2 and base.shape[2] == dim and base.is_contiguous(), op,
        f"base must be a contiguous [2, K, D], got {tuple(base.shape)}")  # fmt: skip
    ksize = base.shape[1]
    chk(coeff.shape == (n, blk, 2, ksize, groups), op,
        f"coeff must be [N, B, 2, K, G] = {(n, blk, 2, ksize, groups)}, got {tuple(coeff.shape)}")  # fmt: skip
    chk(coeff.stride(4) == 1 and coeff.stride(3) == groups and coeff.stride(2) == ksize * groups, op,
        "coeff's [2, K, G] must be contiguous (a view of the kernel projection's output)")  # fmt: skip
    chk(half in (0, 1), op, f"half must be 0 or 1, got {half}")
    chk(reg.float_dtype_ok(x) and coeff.dtype == x.dtype, op, "x and coeff need one float dtype")
    reg.check_same_device(op, x, coeff, base)
    out = torch.empty(n, blk, dim, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = min(block_d, reg.next_pow2(dim))
    grid = (n * blk, -(-dim // block_d))
    _dynamic_conv_kernel[grid](
        x, coeff, base, out, blk, dim, x.stride(0), x.stride(1), coeff.stride(0), coeff.stride(1),
        out.stride(0), out.stride(1), half,
        KSIZE=ksize, GROUPS=groups, GROUP_SIZE=group_size, BLOCK_D=block_d,
    )  # fmt: skip
    return out


@torch.library.custom_op("dflash::dynamic_conv", mutates_args=())
def dynamic_conv(
    x: torch.Tensor, coeff: torch.Tensor, base: torch.Tensor, half: int, group_size: int
) -> torch.Tensor:
    """Default (CPU) implementation: the reference; the Triton kernel under the interpreter switch."""
    if reg.triton_on_cpu():
        return launch_dynamic_conv(x, coeff, base, half, group_size)
    return dynamic_conv_reference(x, coeff, base, half, group_size)


@dynamic_conv.register_kernel("cuda")
def _dynamic_conv_cuda(x, coeff, base, half, group_size):
    return launch_dynamic_conv(x, coeff, base, half, group_size)


@dynamic_conv.register_fake
def _dynamic_conv_fake(x, coeff, base, half, group_size):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
