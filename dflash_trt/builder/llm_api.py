# SPDX-License-Identifier: Apache-2.0
"""Validate an LLM-API config against TensorRT-LLM's own classes, or, when `tensorrt_llm` is not
importable (CPU machines: it cannot be installed there), against the field list of its
`tensorrt_llm/llmapi/llm_args.py` kept in this package with its upstream commit.

TensorRT-LLM's config classes forbid unknown keys (pydantic extra="forbid"), so a stray key in
`llm_api.yaml` would fail at serving time; we fail at build time instead.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

from dflash_trt.errors import ConfigError

# nested sections and the class that validates each
NESTED = {
    "kv_cache_config": "KvCacheConfig",
    "cuda_graph_config": "CudaGraphConfig",
    "moe_config": "MoeConfig",
    "attention_dp_config": "AttentionDpConfig",
}
SPEC_CLASSES = {"DFlash": "DFlashDecodingConfig"}
# what "<any torch dtype string>" admits (torch.<name> exists)
TORCH_DTYPE_NAMES = ("float16", "half", "bfloat16", "float32", "float", "float64", "double", "int8", "uint8",
                     "float8_e4m3fn", "float8_e5m2")  # fmt: skip


@lru_cache(maxsize=1)
def field_list() -> dict[str, Any]:
    text = resources.files("dflash_trt.builder").joinpath("data/trtllm_llmapi_fields.json").read_text()
    return json.loads(text)


def _fields(cls: str) -> dict[str, Any]:
    data = field_list()["classes"][cls]["fields"]
    out = dict(data)
    for _name, spec in data.items():
        for alias in spec.get("aliases") or []:
            out.setdefault(alias, spec)
    return out


def _check_section(section: dict[str, Any], cls: str, path: str) -> None:
    fields = _fields(cls)
    for key, value in section.items():
        if key not in fields:
            raise ConfigError(
                f"{path}.{key}",
                value,
                f"is not a field of TensorRT-LLM's {cls} (it forbids unknown keys)",
                hint=f"fields: {', '.join(sorted(fields)[:12])}...",
            )
        raw = [c for c in fields[key].get("choices") or [] if isinstance(c, (str, bool, int))]
        choices = [c for c in raw if not (isinstance(c, str) and c.startswith("<"))]
        if "<any torch dtype string>" in raw:
            choices += list(TORCH_DTYPE_NAMES)
        if choices and value not in choices:
            raise ConfigError(f"{path}.{key}", value, f"must be one of {choices}")


def validate_against_field_list(cfg: dict[str, Any]) -> None:
    top = set(field_list()["top_level_keys"])
    for key, value in cfg.items():
        if key not in top:
            raise ConfigError(
                f"llm_api.{key}",
                value,
                "is not a TensorRT-LLM LLM-API (TorchLlmArgs) field",
                hint="remove it",
            )
        if key in NESTED and isinstance(value, dict):
            _check_section(value, NESTED[key], f"llm_api.{key}")
    spec = cfg.get("speculative_config")
    if isinstance(spec, dict):
        decoding = spec.get("decoding_type")
        if decoding not in field_list()["decoding_types"]:
            raise ConfigError(
                "llm_api.speculative_config.decoding_type", decoding, "is not a TensorRT-LLM decoding type"
            )
        cls = SPEC_CLASSES.get(str(decoding))
        if cls:
            rest = {k: v for k, v in spec.items() if k != "decoding_type"}
            _check_section(rest, cls, "llm_api.speculative_config")
        k = spec.get("max_draft_len")
        if not isinstance(k, int) or k <= 0:
            raise ConfigError("llm_api.speculative_config.max_draft_len", k, "must be set and > 0 (DFlash)")
        _check_rejection_sampling(cfg, spec)


def _check_rejection_sampling(cfg: dict[str, Any], spec: dict[str, Any]) -> None:
    """TorchLlmArgs refuses an explicit use_rejection_sampling: true beside a guided_decoding_backend (the
    field list's other_validators)."""
    if spec.get("use_rejection_sampling") is True and cfg.get("guided_decoding_backend") is not None:
        raise ConfigError(
            "llm_api.speculative_config.use_rejection_sampling",
            True,
            f"TensorRT-LLM refuses it beside guided_decoding_backend={cfg['guided_decoding_backend']!r}",
            hint="drop use_rejection_sampling, or build with --no-guided-decoding",
        )


def validate_llm_api(cfg: dict[str, Any]) -> dict[str, Any]:
    """Returns how the config was validated (recorded in the manifest); raises ConfigError."""
    try:
        from tensorrt_llm.llmapi.llm_args import TorchLlmArgs, update_llm_args_with_extra_dict
    except Exception:  # not installable on CPU machines; any import failure means "not available"
        validate_against_field_list(cfg)
        data = field_list()
        return {
            "method": "pinned field list",
            "source": data["source"]["path"],
            "commit": data["commit"],
            "ok": True,
        }
    try:  # pragma: no cover - needs a TensorRT-LLM installation
        args = update_llm_args_with_extra_dict(
            {"model": cfg["model"]}, {k: v for k, v in cfg.items() if k != "model"}
        )
        TorchLlmArgs(**args)
    except Exception as exc:  # pragma: no cover
        raise ConfigError("llm_api", "...", f"rejected by tensorrt_llm's TorchLlmArgs: {exc}") from exc
    import tensorrt_llm  # pragma: no cover

    return {
        "method": "tensorrt_llm classes",
        "version": getattr(tensorrt_llm, "__version__", "?"),
        "ok": True,
    }
