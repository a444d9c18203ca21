# SPDX-License-Identifier: Apache-2.0
"""Rotary position embeddings: default, linear, llama3 and yarn, numerically equal to transformers'.

The yarn `attention_factor` multiplies cos and sin, so q.k is scaled by its square; that is
how HF (and the gpt-oss drafters trained with it) define it.
"""

from __future__ import annotations

import math

import torch

from dflash_trt.errors import ConfigError
from dflash_trt.layers.rope_config import RopeConfig


def compute_inv_freq(rope: RopeConfig, head_dim: int, *, max_position_embeddings: int | None = None):
    """Returns (inv_freq [head_dim // 2] float32, attention_scaling float)."""
    dim = head_dim
    base = rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        assert rope.factor is not None
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        assert rope.factor and rope.low_freq_factor and rope.high_freq_factor
        old_len = float(rope.original_max_position_embeddings or 8192)
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    # yarn (arXiv 2309.00071), as transformers computes it
    omp = rope.original_max_position_embeddings
    factor = rope.factor
    if factor is None:
        if not (max_position_embeddings and omp):
            raise ConfigError("rope_scaling.factor", None, "yarn needs factor or max/original lengths")
        factor = max_position_embeddings / omp
    assert omp is not None

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(omp / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for absolute positions (neox / rotate-half layout)."""

    inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, *, max_position_embeddings: int | None = None):
        super().__init__()
        inv_freq, scaling = compute_inv_freq(rope, head_dim, max_position_embeddings=max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2]
        self.attention_scaling = scaling

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [...] int -> cos, sin: [..., head_dim] in `dtype` (computed in fp32)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)  # [..., d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., d]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, d]; cos/sin: [..., d] (broadcast over heads)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin
