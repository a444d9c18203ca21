# SPDX-License-Identifier: Apache-2.0
"""LLM-API parameters with TensorRT-LLM's names: SamplingParams, KvCacheConfig, CudaGraphConfig."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.errors import RequestError


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request parameters, with TensorRT-LLM's names and defaults.

    temperature/top_k/top_p all None means greedy (TensorRT-LLM's rule); temperature 0 is greedy.
    `stop` strings are excluded from the text unless include_stop_str_in_output. `ignore_eos`
    ignores the end id but keeps explicit stop_token_ids. `min_tokens` defers stopping (it does not
    mask the end token's probability: output stays distributed as the target's).
    `greedy_draft` (dflash-trt extension): at T > 0 propose argmax drafts (one-hot rule).
    """

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    min_tokens: int | None = None
    n: int = 1
    best_of: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    greedy_draft: bool = False

    def check_supported(self) -> None:
        """Refuse what the embedded engine does not implement (several outputs, penalties).
        Every other field is validated by the engine when the request is added."""
        if self.n != 1 or (self.best_of not in (None, 1)):
            raise RequestError(
                f"n={self.n}, best_of={self.best_of}: only one output per request is supported"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise RequestError(f"{name}={getattr(self, name)} is not supported by the embedded engine")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise RequestError(
                f"repetition_penalty={self.repetition_penalty} is not supported by the embedded engine"
            )


@dataclass
class KvCacheConfig:
    """Mirror of the KV-cache fields the embedded engine honours."""

    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool | None = None  # accepted; prefix reuse is not implemented (ignored)
    dtype: str = "auto"


@dataclass
class CudaGraphConfig:
    batch_sizes: list[int] | None = None
    max_batch_size: int | None = None
    enable_padding: bool = True
