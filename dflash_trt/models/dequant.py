# SPDX-License-Identifier: Apache-2.0
"""Dequantize packed checkpoint weights on load: ModelOpt unified-HF exports and gpt-oss MXFP4.

  FP8    weight: float8_e4m3fn [out, in], weight_scale: fp32 scalar (or per channel)
         W = weight * weight_scale
  NVFP4  weight: uint8 [out, in / 2] (two E2M1 codes per byte, low nibble first),
         weight_scale: float8_e4m3fn [out, in / 16] (per 16-element block),
         weight_scale_2: fp32 scalar (global)       W = e2m1 * weight_scale * weight_scale_2
Activation scales (input_scale) and KV-cache scales (k_scale, v_scale) are dropped: the embedded
engine computes in its own dtype, so a quantized bundle reproduces the quantized *weights* exactly
but not TensorRT-LLM's activation/KV quantization.
  MXFP4  (gpt-oss experts) `*_blocks` uint8 + `*_scales` uint8: E2M1 codes, two per byte with the
         low nibble first, times 2^(scale - 127) per 32-element block.
"""

from __future__ import annotations

import torch

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK = 16
_DROPPED = ("input_scale", "k_scale", "v_scale", "output_scale", "weight_scale_inv")


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> fp32 [..., 2n]: two E2M1 codes per byte, low nibble first."""
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    return torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1).flatten(-2)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    vals = unpack_e2m1(packed)  # [out, in]
    blocks = vals.view(*vals.shape[:-1], -1, NVFP4_BLOCK)
    scale = block_scale.float() * global_scale.float()
    return (blocks * scale[..., None]).view_as(vals)


def dequantize_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Return (plain state dict, detected format or None)."""
    fmt = None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(_DROPPED) or name.endswith("weight_scale") or name.endswith("weight_scale_2"):
            continue
        if name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            scale = state.get(name + "_scale")
            if scale is None:
                raise ValueError(f"{name} is FP8 but has no {name}_scale")
            w = tensor.float()
            out[name] = w * (
                scale.float() if scale.dim() == 0 else scale.float().view(-1, *([1] * (w.dim() - 1)))
            )
            fmt = fmt or "fp8"
        elif name.endswith(".weight") and tensor.dtype == torch.uint8 and name + "_scale_2" in state:
            out[name] = dequantize_nvfp4(tensor, state[name + "_scale"], state[name + "_scale_2"])
            fmt = "nvfp4"
        else:
            out[name] = tensor
    return out, fmt


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks: [..., rows, G, 16] uint8; scales: [..., rows, G] uint8 -> [..., G * 32, rows] (transposed
    to the [in, out] layout of the bf16 gpt-oss experts)."""
    vals = unpack_e2m1(blocks)  # [..., rows, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None])
    out = vals.flatten(-2)  # [..., rows, G * 32]
    return out.transpose(-1, -2).contiguous().to(dtype)
