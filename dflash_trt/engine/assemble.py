# SPDX-License-Identifier: Apache-2.0
"""Building an engine: load and check the pair, prepare the weights, plan the KV pages, and hand the
finished parts (round parts, executor, planner, scheduler) to a thin `LLMEngine`.

In order (`build_engine`):
  1. the target, and the drafter checked against the speculative config and the target;
  2. weight preparation: one GEMM for q/k/v and one for gate/up in both models; bf16 weights prepacked
     for the CPU GEMMs (fp32 weights holding bf16 values where the dtype policy runs a model that
     streams its weights in fp32); decode attention reading the paged caches in place on CPU (not with
     the drafting plugin, whose kernels read the dense weights and have their own attention);
  3. memory: pages for max_batch_size requests of max_seq_len tokens plus a DDTree's scratch (on the
     CPU for at most CPU_FULL_SEQUENCES of them: more requests run at once as long as their pages fit,
     and the rest wait for pages), or the KV budget the user gave, or (CUDA) a fraction of free memory;
  4. the round planner (engine/planner.py), the scheduler, the drafting backend, the round parts, the
     executor (engine/executor.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dflash_trt.engine.config import PAGE_SIZE, EngineConfig
from dflash_trt.engine.draft_backend import make_draft_backend
from dflash_trt.engine.engine import LLMEngine
from dflash_trt.engine.executor import Executor
from dflash_trt.engine.planner import NullPlanner, RoundPlanner
from dflash_trt.engine.round import RoundParts
from dflash_trt.engine.scheduler import Scheduler
from dflash_trt.errors import ConfigError
from dflash_trt.layers import cpu_attention, cpu_gemm
from dflash_trt.layers.kv_cache import PagedKVCache, pages_for
from dflash_trt.layers.linear import pack_linears
from dflash_trt.models.checkpoint import load_drafter
from dflash_trt.models.dflash_config import TargetInfo, validate_pair
from dflash_trt.models.loader import load_native_target
from dflash_trt.spec import native_tree, native_uniform
from dflash_trt.spec.decoding_config import DFlashDecodingConfig, check_tree_drafter
from dflash_trt.utils.device import streams_weights

log = logging.getLogger(__name__)

# The CPU's default KV budget, in requests of max_seq_len tokens. A batch wider than this (a served
# bundle runs 64) fills with requests shorter than max_seq_len without the memory of 64 full ones:
# that would be 3.2 GB for smollm2-135m in bf16 at 2048 tokens, zeroed at every start.
CPU_FULL_SEQUENCES = 16


def build_engine(*, target_dir: str | Path, drafter_dir: str | Path | None, spec: DFlashDecodingConfig | None,
                 tokenizer: Any | None, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: tuple[int, ...] = ()) -> LLMEngine:  # fmt: skip
    """The engine for a target (and a drafter, with its speculative config), ready to step."""
    target = load_native_target(target_dir, device=device, dtype=dtype)
    drafter = None
    if drafter_dir is not None and spec is not None:
        drafter = _load_drafter(drafter_dir, spec, target, device=device, dtype=dtype)
    planner = _planner(spec if drafter is not None else None)
    prepared = _prepare_weights(target, drafter, config, device=device, dtype=dtype)
    num_pages = _plan_pages(config, target, drafter, planner.scratch_tokens, device=device, dtype=dtype)
    scheduler = Scheduler(max_batch_size=config.max_batch_size, max_num_tokens=config.max_num_tokens,
                          num_pages=num_pages, page_size=PAGE_SIZE, round_tokens=planner.round_tokens,
                          scratch_tokens=planner.scratch_tokens, prefix_caching=config.prefix_caching)  # fmt: skip
    parts = RoundParts(
        target, drafter, make_draft_backend(drafter, device, config.use_plugins),
        max_batch_size=config.max_batch_size, num_pages=num_pages, page_size=PAGE_SIZE,
        block_size=planner.max_draft_len + 1, profile=config.profile,
        # sampled rounds' uniforms from dflash_rng::uniform on CPU (spec/native_uniform.py): same values
        native_uniform=device.type == "cpu" and native_uniform.available(),
        # DDTree rounds' trees from dflash_tree::best_first on CPU (spec/native_tree.py): eager or compiled
        native_tree=planner.trees and device.type == "cpu" and native_tree.available(),
    )  # fmt: skip
    executor = Executor(parts, num_pages=num_pages, cuda_graphs=config.cuda_graphs, static_rounds=config.static_rounds,
                        compile=config.compile, compile_dir=config.compile_dir,
                        **({"graph_batch_sizes": config.graph_batch_sizes} if config.graph_batch_sizes else {}))  # fmt: skip
    log.info("engine: %s target, drafter=%s, %s, %d KV pages of %d tokens, device=%s %s", target.config.model_type,
             drafter_dir, planner.describe(), num_pages - 1, PAGE_SIZE, device, dtype)  # fmt: skip
    return LLMEngine(config=config, tokenizer=tokenizer, parts=parts, executor=executor, planner=planner,
                     scheduler=scheduler, spec=spec, eos_token_ids=tuple(eos_token_ids) or target.config.eos_token_ids,
                     num_kv_pages=num_pages - 1, **prepared)  # fmt: skip


def _planner(spec: DFlashDecodingConfig | None) -> NullPlanner:
    """The round planner of a DFlash engine (a NullPlanner without a drafter)."""
    if spec is None:
        return NullPlanner()
    assert spec.max_draft_len is not None
    schedule = spec.draft_len_for if spec.schedule() is not None else None
    return RoundPlanner(spec.max_draft_len, tree_budget=spec.tree_budget, schedule=schedule)


def _load_drafter(drafter_dir: str | Path, spec: DFlashDecodingConfig, target: Any, *, device: torch.device,
                  dtype: torch.dtype) -> Any:  # fmt: skip
    """The drafter, checked against the speculative config and the target."""
    drafter = load_drafter(drafter_dir, device=device, dtype=dtype, mask_token_id=spec.mask_token_id)
    if spec.target_layer_ids is not None and list(spec.target_layer_ids) != list(
        drafter.config.target_layer_ids
    ):
        raise ConfigError(
            "speculative_config.target_layer_ids",
            spec.target_layer_ids,
            f"differs from the drafter's {list(drafter.config.target_layer_ids)}",
            hint="omit it; the drafter's config is authoritative",
        )
    tcfg = target.config
    validate_pair(
        drafter.config, TargetInfo(tcfg.hidden_size, tcfg.num_hidden_layers, tcfg.vocab_size, tcfg.model_type)
    )
    spec.validate(block_size=drafter.config.block_size)
    # DDTree with a DFlash 2 drafter: refused by name, never a silent fallback
    check_tree_drafter(spec.tree_budget, dflash2=drafter.config.is_dflash2)
    return drafter


def _prepare_weights(target: Any, drafter: Any, config: EngineConfig, *, device: torch.device,
                     dtype: torch.dtype) -> dict[str, int]:  # fmt: skip
    """Fused projections, prepacked weights and in-place paged attention (module docstring, step 2).
    Returns how many weights were packed and attention modules switched."""
    models = [m for m in (target, drafter) if m is not None]
    for m in models:
        m.fuse_projections()
    if config.use_plugins:
        return {"packed_weights": 0, "paged_attention": 0}
    float32 = (
        device.type == "cpu"
        and dtype == torch.float32
        and streams_weights(target.config.num_step_parameters())
    )
    packed = sum(pack_linears(m, float32=float32) for m in models)
    if packed and target.model.embed_tokens.weight.dtype == torch.float32 and not float32:
        log.info("prepacked %d fp32 weights (dflash-trt's fp32 CPU GEMM)", packed)
    elif packed:
        compute = torch.float32 if float32 else torch.bfloat16
        kind = "dflash-trt's CPU GEMM" if cpu_gemm.available(compute) else "oneDNN"
        log.info("prepacked %d weights as bf16 (%s, %s compute)", packed, kind, str(compute)[6:])
    paged = sum(cpu_attention.enable(m, device=device, dtype=dtype) for m in models)
    if paged:
        log.info(
            "decode attention reads the paged KV caches in place (%d layers, dflash_cpu::paged_attention)",
            paged,
        )
    return {"packed_weights": packed, "paged_attention": paged}


def _plan_pages(config: EngineConfig, target: Any, drafter: Any, scratch: int, *, device: torch.device,
                dtype: torch.dtype) -> int:  # fmt: skip
    """KV pages of both caches (they share page tables), the padding page included."""
    # Enough for max_batch_size requests of max_seq_len tokens each, plus a DDTree's scratch columns
    # (reservations are per page); on the CPU for at most CPU_FULL_SEQUENCES of them.
    per_sequence = pages_for(config.max_seq_len + scratch, PAGE_SIZE) * PAGE_SIZE
    full = config.max_batch_size * per_sequence
    if config.kv_max_tokens is not None:
        tokens = config.kv_max_tokens
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        tokens = min(
            full, int(free * config.kv_free_memory_fraction) // _bytes_per_token(target, drafter, dtype)
        )
    else:
        tokens = min(config.max_batch_size, CPU_FULL_SEQUENCES) * per_sequence
    pages = tokens // PAGE_SIZE
    if pages < 1:
        raise ConfigError(
            "kv_cache_config.max_tokens", tokens, f"leaves no room for one {PAGE_SIZE}-token page"
        )
    return pages + 1  # + the padding page


def _bytes_per_token(target: Any, drafter: Any, dtype: torch.dtype) -> int:
    per = target.config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    if drafter is not None:
        c = drafter.config
        per += PagedKVCache.bytes_per_token(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                                            head_dim=c.head_dim, dtype=dtype)  # fmt: skip
    return per
