# SPDX-License-Identifier: Apache-2.0
"""dflash-trt: DFlash speculative decoding from checkpoint to production.

Importing this package is cheap: torch, transformers, tritonclient and modelopt are imported
only when a name that needs them is first used (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_LAZY: dict[str, str] = {
    "DFlashConfig": "dflash_trt.models.checkpoint:DFlashConfig",
    "parse_dflash_config": "dflash_trt.models.checkpoint:parse_dflash_config",
    "load_drafter": "dflash_trt.models.checkpoint:load_drafter",
    "DFlashDrafter": "dflash_trt.models.drafter:DFlashDrafter",
    "HFTarget": "dflash_trt.reference.hf_target:HFTarget",
    "spec_generate": "dflash_trt.reference.generate:spec_generate",
    "GenerationResult": "dflash_trt.reference.generate:GenerationResult",
    "build_target_layer_ids": "dflash_trt.models.features:build_target_layer_ids",
    "ensure_tiny": "dflash_trt.tiny:ensure_tiny",
    "LLM": "dflash_trt.api.llm:LLM",
    "SamplingParams": "dflash_trt.api.params:SamplingParams",
    "GuidedDecodingParams": "dflash_trt.api.params:GuidedDecodingParams",
    "KvCacheConfig": "dflash_trt.api.params:KvCacheConfig",
    "CudaGraphConfig": "dflash_trt.api.params:CudaGraphConfig",
    "DFlashDecodingConfig": "dflash_trt.spec.decoding_config:DFlashDecodingConfig",
}

__all__ = [
    "LLM",
    "CudaGraphConfig",
    "DFlashConfig",
    "DFlashDecodingConfig",
    "DFlashDrafter",
    "GenerationResult",
    "GuidedDecodingParams",
    "HFTarget",
    "KvCacheConfig",
    "SamplingParams",
    "__version__",
    "build_target_layer_ids",
    "ensure_tiny",
    "load_drafter",
    "parse_dflash_config",
    "spec_generate",
]

if TYPE_CHECKING:  # pragma: no cover
    from dflash_trt.api.llm import LLM
    from dflash_trt.api.params import CudaGraphConfig, GuidedDecodingParams, KvCacheConfig, SamplingParams
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.dflash_config import DFlashConfig, parse_dflash_config
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.models.features import build_target_layer_ids
    from dflash_trt.reference.generate import GenerationResult, spec_generate
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig
    from dflash_trt.tiny import ensure_tiny


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'dflash_trt' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
