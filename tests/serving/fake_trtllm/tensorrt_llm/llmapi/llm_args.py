# SPDX-License-Identifier: Apache-2.0
"""Stand-in for tensorrt_llm.llmapi.llm_args (contract tests only): the merge helper that NVIDIA's
Triton model and trtllm-serve use to combine YAML options with LLM arguments."""

from __future__ import annotations

from typing import Any

_DEEP_MERGED = ("kv_cache_config",)


def update_llm_args_with_extra_dict(llm_args: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(llm_args)
    for key, value in extra.items():
        if key in _DEEP_MERGED and isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = {**out[key], **value}
        elif key == "hf_revision":
            out["revision"] = value
        else:
            out[key] = value
    return out
