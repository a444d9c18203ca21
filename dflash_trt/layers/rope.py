# SPDX-License-Identifier: Apache-2.0
"""Rotary position embeddings: default, linear, llama3 and yarn, numerically equal to transformers'.

The yarn `attention_factor` multiplies cos and sin, so q.k is scaled by its square; that is
how HF (and the gpt-oss drafters trained with it) define it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dflash_trt.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_rope(hf_config: dict[str, Any], *, prefix: str = "") -> RopeConfig:
    """Read rope settings from a HF config dict (transformers 4 `rope_theta`/`rope_scaling`
    or transformers 5 `rope_parameters`)."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{prefix}rope_scaling", params, "must be a mapping or null")
    if params and set(params) <= {"full_attention", "sliding_attention"}:
        # Per-layer-type rope parameters: DFlash drafters use one rope for all layers.
        kinds = list(params.values())
        if any(k != kinds[0] for k in kinds):
            raise ConfigError(
                f"{prefix}rope_parameters", params, "different rope per layer type is not supported"
            )
        params = kinds[0]
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{prefix}rope_scaling.rope_type",
            rope_type,
            f"unsupported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    prf = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ConfigError(f"{prefix}partial_rotary_factor", prf, "only 1.0 (full rotary) is supported")
    omp = hf_config.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if rope_type in ("llama3", "yarn") and omp is None:
        omp = hf_config.get("max_position_embeddings")
    factor = params.get("factor")
    if rope_type in ("linear", "llama3") and factor is None:
        raise ConfigError(f"{prefix}rope_scaling.factor", None, f"required for rope_type={rope_type}")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if params.get(key) is None:
                raise ConfigError(f"{prefix}rope_scaling.{key}", None, "required for rope_type=llama3")
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=None if factor is None else float(factor),
        original_max_position_embeddings=None if omp is None else int(omp),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
    )


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
