# SPDX-License-Identifier: Apache-2.0
"""DFlash drafter configuration: one pure parsing function, pair validation.

`parse_dflash_config` accepts both z-lab checkpoint shapes (`block_size` at the top level or in
`dflash_config`) and returns a frozen `DFlashConfig`; every error names the field and the fix.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_trt.errors import CheckpointError, ConfigError, IncompatiblePairError
from dflash_trt.models.dflash2_config import (
    DFLASH2_ARCHITECTURE,
    PUBLISHED,
    DFlash2Params,
    parse_dflash2_params,
)
from dflash_trt.models.features import build_target_layer_ids

if TYPE_CHECKING:
    from dflash_trt.layers.rope_config import RopeConfig

log = logging.getLogger(__name__)

V1_ARCHITECTURE = "DFlashDraftModel"
SUPPORTED_ARCHITECTURES = (V1_ARCHITECTURE, DFLASH2_ARCHITECTURE)
LAYER_TYPES = ("full_attention", "sliding_attention")


def max_draft_len_for(block_size: int) -> int:
    """Draft tokens per round of a block of `block_size` slots (one anchor + the drafts): TensorRT-LLM's
    `max_draft_len`. The only place `block_size - 1` is computed; `block_size_for` is its inverse."""
    return block_size - 1


def block_size_for(max_draft_len: int) -> int:
    """The block that `max_draft_len` drafts per round fill (the inverse of `max_draft_len_for`)."""
    return max_draft_len + 1


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """Resolved drafter configuration (z-lab v1 semantics; DFlash 2 adds `dflash2`)."""

    hidden_size: int  # D; equals the target's hidden size
    intermediate_size: int  # I (SwiGLU)
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv
    head_dim: int  # d; H * d need not equal D (gpt-oss drafters: 64 * 64 vs 2880)
    rms_norm_eps: float
    attention_bias: bool  # q/k/v/o biases, o_proj included (gpt-oss drafters)
    rope: RopeConfig
    block_size: int  # B: one anchor slot + B - 1 mask slots
    mask_token_id: int  # a row of the *target* embedding
    target_layer_ids: tuple[int, ...]  # tapped target layers, in concatenation order
    layer_types: tuple[str, ...]  # per draft layer: full_attention | sliding_attention
    sliding_window: int | None
    is_causal: bool | None = None  # top-level override of per-layer causality
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    dflash2: DFlash2Params | None = None  # the convs and the selector of a DFlash2DraftModel
    dtype: str | None = field(default=None, compare=False)  # storage dtype, not semantics
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # --- derived -------------------------------------------------------------------------
    @property
    def max_draft_len(self) -> int:
        """Draft tokens per round of this drafter's trained block (see `max_draft_len_for`)."""
        return max_draft_len_for(self.block_size)

    @property
    def architecture(self) -> str:
        """The checkpoint's `architectures[0]`: DFlashDraftModel or DFlash2DraftModel."""
        return V1_ARCHITECTURE if self.dflash2 is None else DFLASH2_ARCHITECTURE

    @property
    def is_dflash2(self) -> bool:
        """A DFlash2DraftModel (convs and a candidate selector): the one test of DFlash 2-ness, which the
        drafter (`DFlashDrafter.selector`), the engine, the reference loop and the builder read."""
        return self.dflash2 is not None

    @property
    def num_target_features(self) -> int:
        """K, the number of tapped target layers (not always L)."""
        return len(self.target_layer_ids)

    def layer_is_causal(self, layer: int) -> bool:
        """Full layers are non-causal; sliding layers are causal (z-lab 0.1.0, vLLM, SGLang),
        unless the checkpoint sets a top-level `is_causal`."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def to_log_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rope"] = self.rope.to_dict()
        out.pop("extra", None)
        if self.dflash2 is None:
            out.pop("dflash2")
        out["max_draft_len"] = self.max_draft_len
        return out

    def to_hf_config(self) -> dict[str, Any]:
        """The z-lab `config.json` for this drafter (what `save_drafter` writes): v1, or the
        published DFlash 2 format with its four `dflash_config` keys."""
        rope_params: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        rope_params.update({k: v for k, v in self.rope.to_dict().items() if k not in ("rope_type", "theta")})
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": f"dflash.{self.architecture}"},
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "rope_theta": self.rope.theta,
            "rope_scaling": None if self.rope.rope_type == "default" else rope_params,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "max_window_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "tie_word_embeddings": False,
        }
        for key in ("max_position_embeddings", "vocab_size", "dtype"):
            if getattr(self, key) is not None:
                cfg[key] = getattr(self, key)
        for key in ("input_embedding_scale", "output_multiplier"):
            if getattr(self, key) != 1.0:
                cfg["dflash_config"][key] = getattr(self, key)
        if self.final_logit_softcapping is not None:
            cfg["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        if self.dflash2 is not None:
            cfg["dflash_config"].update(self.dflash2.to_dict())
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        cfg.update(self.extra)
        return cfg


def _int(cfg: Mapping[str, Any], key: str, *, required: bool = True, minimum: int = 1) -> int | None:
    value = cfg.get(key)
    if value is None:
        if required:
            raise ConfigError(key, None, "missing from the drafter config.json", hint=f"add '{key}'")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"must be an integer >= {minimum}")
    return value


def _float(value: Any, key: str, default: float | None) -> float | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(key, value, "must be a finite number")
    return float(value)


def _draft_value(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """0.1.0 semantics: `dflash_config.<key>` first, then the top level."""
    nested = cfg.get("dflash_config") or {}
    if key in nested and nested[key] is not None:
        return nested[key]
    return cfg.get(key, default)


# Keys parse_dflash_config reads; every other key is kept verbatim in DFlashConfig.extra.
_KNOWN_KEYS = frozenset(
    {"architectures", "model_type", "auto_map", "block_size", "dflash_config", "hidden_size",
     "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
     "head_dim", "hidden_act", "rms_norm_eps", "attention_bias", "attention_dropout", "rope_theta",
     "rope_scaling", "rope_parameters", "layer_types", "sliding_window", "use_sliding_window",
     "max_window_layers", "num_target_layers", "max_position_embeddings", "tie_word_embeddings",
     "vocab_size", "dtype", "torch_dtype", "is_causal", "input_embedding_scale", "output_multiplier",
     "final_logit_softcapping"}
)  # fmt: skip


def parse_dflash_config(*, hf_config: Mapping[str, Any], mask_token_id: int | None = None) -> DFlashConfig:
    """Parse a z-lab drafter `config.json` (as a dict) into a DFlashConfig: a v1
    `DFlashDraftModel`, or a `DFlash2DraftModel` whose four extra keys land in `dflash2`.

    Accepts both checkpoint shapes (`block_size` top level or in `dflash_config`; they must agree
    when both are present), derives `target_layer_ids` from `num_target_layers` when absent, and
    names the field and value in every error. `mask_token_id` overrides the checkpoint's (older
    checkpoints lack it; resolve `<|MASK|>` through the target tokenizer and pass it here).
    The fields are read in a fixed order, so a config with several faults reports the same first one.
    """
    from dflash_trt.layers.rope_config import parse_rope

    cfg = dict(hf_config)
    nested = _check_format(cfg)
    block_size = _block_size(cfg, nested)
    shape = _shape_fields(cfg)
    mask = _mask_token_id(cfg, mask_token_id)
    target_layer_ids, num_target_layers = _target_layers(cfg, shape["num_hidden_layers"])
    layer_types = _layer_types(cfg, shape["num_hidden_layers"])
    sliding_window = _sliding_window(cfg, layer_types)
    is_causal = cfg.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise ConfigError("is_causal", is_causal, "must be true, false or absent")
    softcap = _softcap(cfg)
    eps = _float(cfg.get("rms_norm_eps"), "rms_norm_eps", 1e-6)
    assert eps is not None
    dflash2 = None
    if DFLASH2_ARCHITECTURE in (cfg.get("architectures") or ()):
        dflash2 = parse_dflash2_params(cfg, hidden_size=shape["hidden_size"])
    return DFlashConfig(
        **shape,
        rms_norm_eps=eps,
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope=parse_rope(cfg),
        block_size=block_size,
        mask_token_id=mask,
        target_layer_ids=target_layer_ids,
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=is_causal,
        num_target_layers=num_target_layers,
        input_embedding_scale=_scale(cfg, "input_embedding_scale"),
        output_multiplier=_scale(cfg, "output_multiplier"),
        final_logit_softcapping=softcap,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        vocab_size=cfg.get("vocab_size"),
        dflash2=dflash2,
        dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        extra={k: v for k, v in cfg.items() if k not in _KNOWN_KEYS and not (dflash2 and k in PUBLISHED)},
    )


def _check_format(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Refuse checkpoints that are not z-lab DFlash (v1 or 2); return the `dflash_config` mapping."""
    if cfg.get("speculators_model_type") or cfg.get("speculators_config"):
        raise ConfigError(
            "speculators_model_type",
            cfg.get("speculators_model_type"),
            "this is a RedHat speculators checkpoint, not the z-lab DFlash v1 format",
            hint="use a z-lab DFlash drafter (architectures: [DFlashDraftModel])",
        )
    archs = cfg.get("architectures") or [V1_ARCHITECTURE]
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if len(set(known)) != 1:
        raise ConfigError(
            "architectures",
            archs,
            "not a z-lab DFlash drafter" if not known else "names both DFlash versions",
            hint="use a DFlashDraftModel or DFlash2DraftModel checkpoint (other variants are not supported)",
        )
    nested = cfg.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise ConfigError("dflash_config", nested, "must be a mapping")
    return nested


def _block_size(cfg: Mapping[str, Any], nested: Mapping[str, Any]) -> int:
    """The block size from either location (they must agree); 16 with a warning when absent."""
    top_bs, nested_bs = cfg.get("block_size"), nested.get("block_size")
    if top_bs is not None and nested_bs is not None and top_bs != nested_bs:
        raise ConfigError(
            "block_size",
            {"block_size": top_bs, "dflash_config.block_size": nested_bs},
            "set in both places with different values",
            hint="keep one of them",
        )
    block_size = nested_bs if nested_bs is not None else top_bs
    if block_size is None:
        block_size = 16
        log.warning("drafter config has no block_size; using the reference default 16")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ConfigError(
            "block_size", block_size, "must be an integer >= 2 (1 anchor + at least 1 draft slot)"
        )
    return block_size


def _shape_fields(cfg: Mapping[str, Any]) -> dict[str, int]:
    """The layer dimensions, keyed by DFlashConfig field (GQA heads must divide; head_dim defaults
    to hidden // heads), after the activation check (SwiGLU only)."""
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    num_layers = _int(cfg, "num_hidden_layers")
    assert hidden is not None and heads is not None and num_layers is not None
    kv_heads = _int(cfg, "num_key_value_heads", required=False) or heads
    if heads % kv_heads:
        raise ConfigError(
            "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads} (GQA groups)"
        )
    head_dim = _int(cfg, "head_dim", required=False) or hidden // heads
    intermediate = _int(cfg, "intermediate_size")
    assert intermediate is not None
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError("hidden_act", act, "only silu (SwiGLU) drafters are supported")
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


def _mask_token_id(cfg: Mapping[str, Any], override: int | None) -> int:
    """The mask token id: the caller's override, else the checkpoint's (required)."""
    mask = override if override is not None else _draft_value(cfg, "mask_token_id")
    if mask is None:
        raise ConfigError(
            "dflash_config.mask_token_id",
            None,
            "missing (older checkpoint)",
            hint="pass the id of the target tokenizer's <|MASK|> token (mask_token_id=...)",
        )
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise ConfigError("dflash_config.mask_token_id", mask, "must be a non-negative integer")
    return mask


def _target_layers(cfg: Mapping[str, Any], num_layers: int) -> tuple[tuple[int, ...], int | None]:
    """(target_layer_ids, num_target_layers): the ids as given, else derived from
    num_target_layers; each id must lie below num_target_layers when that is set."""
    num_target_layers = cfg.get("num_target_layers")
    ids = _draft_value(cfg, "target_layer_ids")
    if ids is None:
        if not isinstance(num_target_layers, int) or num_target_layers < 1:
            raise ConfigError(
                "dflash_config.target_layer_ids",
                None,
                "missing, and num_target_layers is not set either",
                hint="add dflash_config.target_layer_ids or num_target_layers",
            )
        ids = build_target_layer_ids(num_target_layers, num_layers)
    if (
        not isinstance(ids, Sequence)
        or not ids
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
    ):
        raise ConfigError(
            "dflash_config.target_layer_ids", ids, "must be a non-empty list of non-negative ints"
        )
    if not isinstance(num_target_layers, int):
        return tuple(ids), None
    for i, layer_id in enumerate(ids):
        if layer_id >= num_target_layers:
            raise ConfigError(
                f"dflash_config.target_layer_ids[{i}]",
                layer_id,
                f"out of range for num_target_layers={num_target_layers}",
            )
    return tuple(ids), num_target_layers


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per-layer attention kind: `layer_types`, else derived from the Qwen-style
    use_sliding_window / max_window_layers pair."""
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        use_swa = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
        mwl = cfg.get("max_window_layers", num_layers)
        layer_types = [
            "sliding_attention"
            if use_swa and i >= (mwl if isinstance(mwl, int) else num_layers)
            else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ConfigError(
            "layer_types",
            layer_types,
            f"need {num_layers} entries, each one of {', '.join(LAYER_TYPES)}",
        )
    return tuple(layer_types)


def _sliding_window(cfg: Mapping[str, Any], layer_types: Sequence[str]) -> int | None:
    """The window of the sliding layers (required when there are any, else None)."""
    if "sliding_attention" not in layer_types:
        return None
    sliding_window = cfg.get("sliding_window")
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ConfigError(
            "sliding_window",
            sliding_window,
            "must be a positive integer when layer_types has sliding_attention",
        )
    return sliding_window


def _softcap(cfg: Mapping[str, Any]) -> float | None:
    """final_logit_softcapping; absent, zero or negative means none."""
    softcap = _float(_draft_value(cfg, "final_logit_softcapping"), "final_logit_softcapping", None)
    return None if softcap is None or softcap <= 0 else softcap


def _scale(cfg: Mapping[str, Any], key: str) -> float:
    """input_embedding_scale / output_multiplier; absent or zero means 1.0."""
    return _float(_draft_value(cfg, key), key, 1.0) or 1.0


@dataclass(frozen=True, slots=True)
class TargetInfo:
    """What the drafter needs to know about its target."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int  # rows of the input embedding (may exceed the tokenizer's size)
    architecture: str = "unknown"


def validate_pair(cfg: DFlashConfig, target: TargetInfo, *, block_size: int | None = None) -> None:
    """Raise IncompatiblePairError (field, value, fix) when drafter and target do not fit."""
    if cfg.hidden_size != target.hidden_size:
        raise IncompatiblePairError(
            "drafter.hidden_size",
            cfg.hidden_size,
            f"does not match the target's hidden_size={target.hidden_size}",
            hint="use the drafter trained for this target",
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise IncompatiblePairError(
            "drafter.dflash_config.mask_token_id",
            cfg.mask_token_id,
            f"is not a row of the target's embedding (vocab_size={target.vocab_size})",
            hint="use the drafter trained for this target, or pass the target's <|MASK|> id",
        )
    for i, layer_id in enumerate(cfg.target_layer_ids):
        if layer_id >= target.num_hidden_layers:
            raise IncompatiblePairError(
                f"drafter.dflash_config.target_layer_ids[{i}]",
                layer_id,
                f"out of range for the target's num_hidden_layers={target.num_hidden_layers}",
                hint="use the drafter trained for this target",
            )
    if cfg.dflash2 is not None and cfg.vocab_size != target.vocab_size:
        raise IncompatiblePairError(
            "drafter.vocab_size",
            cfg.vocab_size,
            f"the DFlash 2 selector's codebooks must have one row per target token (vocab_size={target.vocab_size})",
            hint="use the DFlash 2 drafter trained for this target",
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_hidden_layers:
        log.warning(
            "drafter num_target_layers=%s but the target has %s layers",
            cfg.num_target_layers,
            target.num_hidden_layers,
        )
    if block_size is not None:
        check_runtime_block_size(cfg, block_size)


def check_runtime_block_size(cfg: DFlashConfig, block_size: int) -> None:
    """A runtime block may be smaller than the trained one, never larger (TRT-LLM rejects it too).
    Block size 1 is plain autoregressive decoding."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", block_size, "must be an integer >= 1 (1 = no drafting)")
    if block_size > cfg.block_size:
        raise ConfigError(
            "block_size",
            block_size,
            f"exceeds the drafter's trained block_size={cfg.block_size}",
            hint=f"use --block-size <= {cfg.block_size}",
        )


def target_info_from_config(cfg: dict[str, Any]) -> TargetInfo:
    text = cfg.get("text_config") or cfg
    try:
        return TargetInfo(
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            vocab_size=int(text["vocab_size"]),
            architecture=(cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0],
        )
    except KeyError as exc:
        raise CheckpointError(
            f"target config.json lacks {exc.args[0]!r}", hint="pass a transformers causal-LM directory"
        ) from exc
