# SPDX-License-Identifier: Apache-2.0
"""A stand-in for the `tensorrt_llm` package, used ONLY by the contract test of our Triton model's
TensorRT-LLM branch (TensorRT-LLM cannot be installed on CPU machines).

It implements the mirrored LLM-API subset (`LLM`, `SamplingParams`, `llmapi.llm_args.
update_llm_args_with_extra_dict`) by checking every argument against TensorRT-LLM's published
field list (extra keys are errors, as in TensorRT-LLM) and running the embedded dflash-trt engine
underneath. It records the arguments it received so the test can compare them with model.yaml.
"""

from __future__ import annotations

import json
import os

from dflash_trt.api.llm import LLM as _EmbeddedLLM
from dflash_trt.api.llm import SamplingParams
from dflash_trt.builder.llm_api import validate_against_field_list

__version__ = "0.0.0-contract-stand-in"
__all__ = ["LLM", "SamplingParams"]

# TensorRT-LLM-only (GPU) settings the stand-in accepts and ignores.
_GPU_ONLY = ("backend", "tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size",
             "kv_cache_config", "cuda_graph_config", "moe_config", "enable_attention_dp", "trust_remote_code")  # fmt: skip


class LLM(_EmbeddedLLM):
    def __init__(self, model: str, **kwargs):
        validate_against_field_list({"model": model, **kwargs})
        record = os.environ.get("FAKE_TRTLLM_RECORD")
        if record:
            with open(record, "w") as f:
                json.dump({"model": model, **kwargs}, f, default=str)
        spec = dict(kwargs.pop("speculative_config", None) or {}) or None
        if spec:  # the embedded engine takes ids from the drafter's own config
            spec.pop("mask_token_id", None)
            spec.pop("target_layer_ids", None)
        for key in _GPU_ONLY:
            kwargs.pop(key, None)
        super().__init__(model, speculative_config=spec, **kwargs)
