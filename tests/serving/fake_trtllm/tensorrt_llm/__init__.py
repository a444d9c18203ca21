# SPDX-License-Identifier: Apache-2.0
"""A stand-in for the `tensorrt_llm` package, used ONLY by the contract test of our Triton model's
TensorRT-LLM branch (TensorRT-LLM cannot be installed on CPU machines).

It implements the mirrored LLM-API subset (`LLM`, `SamplingParams`, `llmapi.llm_args.
update_llm_args_with_extra_dict`) by checking every argument against TensorRT-LLM's published
field list (extra keys are errors, as in TensorRT-LLM) and running the embedded dflash-trt engine
underneath. It records the arguments it received so the test can compare them with model.yaml.

It keeps TensorRT-LLM's event-loop rule: a request's result binds its async queue to the loop
running where `generate_async` is called, and one created on a thread with no running loop cannot
be iterated asynchronously (TensorRT-LLM asserts "The asyncio event loop was not present during
initialization"). The embedded engine's handles are laxer (they bind on first iteration), so the
stand-in enforces the rule that the Triton model's TensorRT-LLM adapter must follow.
"""

from __future__ import annotations

import asyncio
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

    def generate_async(self, inputs, sampling_params=None, streaming=False):
        try:
            asyncio.get_running_loop()
            bound = True
        except RuntimeError:
            bound = False
        return _Result(super().generate_async(inputs, sampling_params, streaming), bound=bound)


class _Result:
    """TensorRT-LLM's GenerationResult as far as its event-loop rule goes."""

    def __init__(self, handle, *, bound: bool) -> None:
        self._handle = handle
        self._bound = bound

    def abort(self) -> None:
        self._handle.abort()

    def result(self, timeout=None):
        return self._handle.result(timeout)

    def __iter__(self):
        return iter(self._handle)

    def __aiter__(self):
        if not self._bound:
            raise AssertionError(
                "The asyncio event loop was not present during initialization, so async operations are not available."
            )
        return self._handle.__aiter__()
