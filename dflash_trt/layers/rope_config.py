# SPDX-License-Identifier: Apache-2.0
"""Rotary-embedding settings parsed from a transformers config (no torch: build plans read it too)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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
