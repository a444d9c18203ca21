# SPDX-License-Identifier: Apache-2.0
"""The four DFlash 2 keys of a drafter's `dflash_config` (dflash2.md §1), parsed and checked.

A `DFlash2DraftModel` checkpoint adds, per drafter layer, two grouped dynamic causal convolutions
(`conv_kernel_size` taps, one dynamic coefficient per group of `conv_group_size` channels) and,
once, a candidate selector (codebooks of rank `selector_rank` scoring the drafter's
`selector_top_k` best tokens per slot). Each key is read from `dflash_config` first, then from the
top level (the reference's rule); every error names the key, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_trt.errors import ConfigError

DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# The values of the published DFlash 2 drafters (Qwen3.8-27B-DFlash2), quoted in error hints.
PUBLISHED = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


@dataclass(frozen=True, slots=True)
class DFlash2Params:
    """The DFlash 2 additions of a drafter (absent on v1 drafters)."""

    conv_kernel_size: int  # K taps along the block (2 in the published drafters)
    conv_group_size: int  # channels sharing one dynamic coefficient; G = hidden / this
    selector_rank: int  # R, the codebooks' width
    selector_top_k: int  # candidates per slot the selector chooses among

    def num_groups(self, hidden_size: int) -> int:
        """G, dynamic coefficients per tap."""
        return hidden_size // self.conv_group_size

    def to_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in PUBLISHED}


def _value(cfg: Mapping[str, Any], key: str) -> Any:
    nested = cfg.get("dflash_config") or {}
    if key in nested and nested[key] is not None:
        return nested[key]
    return cfg.get(key)


def _positive(cfg: Mapping[str, Any], key: str) -> int:
    value = _value(cfg, key)
    field = f"dflash_config.{key}"
    if value is None:
        raise ConfigError(
            field,
            None,
            "missing from a DFlash2DraftModel config.json",
            hint=f"add it ({PUBLISHED[key]} in the published drafters)",
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            field, value, "must be an integer >= 1", hint=f"the published drafters use {PUBLISHED[key]}"
        )
    return value


def parse_dflash2_params(cfg: Mapping[str, Any], *, hidden_size: int) -> DFlash2Params:
    """The four keys of a DFlash 2 config, in a fixed order (the first fault is always the same).

    conv_kernel_size >= 1; conv_group_size divides hidden_size; selector_rank >= 1;
    1 <= selector_top_k <= vocab_size (vocab_size is then required: it sizes the codebooks).
    """
    kernel = _positive(cfg, "conv_kernel_size")
    group = _positive(cfg, "conv_group_size")
    if hidden_size % group:
        raise ConfigError(
            "dflash_config.conv_group_size",
            group,
            f"must divide hidden_size={hidden_size}",
            hint=f"use a divisor of {hidden_size} (16 in the published drafters)",
        )
    rank = _positive(cfg, "selector_rank")
    top_k = _positive(cfg, "selector_top_k")
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(
            "vocab_size",
            vocab,
            "a DFlash2DraftModel needs it (the selector's codebooks have one row per token)",
            hint="set it to the target's vocab_size",
        )
    if top_k > vocab:
        raise ConfigError(
            "dflash_config.selector_top_k",
            top_k,
            f"must be <= vocab_size={vocab}",
            hint="lower selector_top_k",
        )
    return DFlash2Params(
        conv_kernel_size=kernel, conv_group_size=group, selector_rank=rank, selector_top_k=top_k
    )
