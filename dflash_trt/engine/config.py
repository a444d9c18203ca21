# SPDX-License-Identifier: Apache-2.0
"""Engine-wide settings, validated once when the engine is configured."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.errors import ConfigError

PAGE_SIZE = 16  # tokens per KV page (target and draft caches share page tables)


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8
    max_num_tokens: int = 2048
    max_seq_len: int = 2048
    kv_max_tokens: int | None = None  # KV budget in tokens (target and draft caches share pages)
    kv_free_memory_fraction: float = 0.9  # CUDA: fraction of free memory after weights
    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] | None = None
    profile: bool = False
    static_rounds: bool = False  # padded static-buffer rounds without graphs (CPU tests)
    use_plugins: bool | None = None  # dflash:: Triton ops for the drafter/accept; None = on for CUDA
    compile: bool = False  # torch.compile (inductor) the round: fused kernels, far less dispatch
    compile_dir: str | None = None  # where compiled rounds are saved and reused (engine/compile.py)
    prefix_caching: bool = True  # reuse cached prompt pages (engine/prefix_cache.py; enable_block_reuse)
    guided_decoding_backend: str | None = None  # "xgrammar": guided requests served (engine/grammar.py)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "must be a positive integer")
        if self.guided_decoding_backend not in (None, "xgrammar"):
            raise ConfigError("guided_decoding_backend", self.guided_decoding_backend,
                              "the embedded engine guides with xgrammar", hint="pass 'xgrammar' or None")  # fmt: skip
        if self.kv_max_tokens is not None and self.kv_max_tokens < PAGE_SIZE:
            raise ConfigError("kv_cache_config.max_tokens", self.kv_max_tokens, f"must be >= {PAGE_SIZE}")
        if not 0 < self.kv_free_memory_fraction <= 1:
            raise ConfigError(
                "kv_cache_config.free_gpu_memory_fraction", self.kv_free_memory_fraction, "must be in (0, 1]"
            )
