# SPDX-License-Identifier: Apache-2.0
"""make_plan: validate, resolve and decide everything before heavy work (configs only).

Checks that need no config (flags, GPU profile, backend, quantization support) run first, before
any config is read, so that they never wait for the network.
"""

from __future__ import annotations

from dflash_trt.builder.gpus import GpuProfile, detect_gpu, get_profile
from dflash_trt.builder.plan import BuildPlan, BuildRequest
from dflash_trt.builder.resolve import resolve_pair
from dflash_trt.builder.shapes import text_config
from dflash_trt.builder.source import ResolvedPair
from dflash_trt.builder.torch_backend import plan_torch
from dflash_trt.builder.trtllm_backend import check_requested_quant, plan_trtllm
from dflash_trt.errors import ConfigError, UsageError
from dflash_trt.models.dflash_config import (
    DFlashConfig,
    TargetInfo,
    check_runtime_block_size,
    parse_dflash_config,
    validate_pair,
)
from dflash_trt.spec.decoding_config import parse_tree_budget

QUANT_CHOICES = ("auto", "none", "fp8", "nvfp4")
KV_CHOICES = ("auto", "fp8")
BACKEND_CHOICES = ("trtllm", "torch")


def _positive(value: int | None, flag: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UsageError(f"{flag}={value!r} must be a positive integer")


def make_plan(req: BuildRequest) -> BuildPlan:
    """The plan of a build: the request's own checks (no config needed), then the configs of the
    pair (maybe from the network), then the backend's plan."""
    profile, detected_count, backend = _check_request(req)
    # everything above needs no config; from here on configs are read (maybe from the network)
    pair = resolve_pair(req.target, req.drafter, offline=req.offline)
    if pair.drafter is None:
        raise UsageError(
            f"--target={req.target!r} has no registered DFlash drafter", hint="pass --drafter DIR_OR_HF_ID"
        )
    dcfg, block = _check_pair(req, pair)
    if backend == "trtllm":
        plan = plan_trtllm(req, pair, profile, dcfg, block, detected_count)
    else:
        plan = plan_torch(req, pair, profile, dcfg, block)
    plan.config_sources = pair.config_sources()
    plan.notices = list(pair.notices)
    return plan


def _check_request(req: BuildRequest) -> tuple[GpuProfile, int | None, str]:
    """Flags that are wrong whatever the target: (GPU profile, GPUs nvidia-smi shows or None, backend)."""
    for value, flag in ((req.tp, "--tp"), (req.ep, "--ep"), (req.max_batch_size, "--max-batch-size"),
                        (req.max_seq_len, "--max-seq-len"), (req.max_num_tokens, "--max-num-tokens")):  # fmt: skip
        _positive(value, flag)
    if req.quant not in QUANT_CHOICES:
        raise UsageError(f"--quant={req.quant!r}", hint=f"use one of {', '.join(QUANT_CHOICES)}")
    if req.kv_cache_dtype not in KV_CHOICES:
        raise UsageError(
            f"--kv-cache-dtype={req.kv_cache_dtype!r}", hint=f"use one of {', '.join(KV_CHOICES)}"
        )
    if req.backend is not None and req.backend not in BACKEND_CHOICES:
        raise UsageError(f"--backend={req.backend!r}", hint=f"use one of {', '.join(BACKEND_CHOICES)}")
    if req.gpu:
        profile, detected_count = get_profile(req.gpu), None
    else:
        found = detect_gpu()
        profile, detected_count = found if found else (get_profile("cpu"), None)
    backend = req.backend or ("trtllm" if profile.is_gpu else "torch")
    if backend == "trtllm" and not profile.is_gpu:
        raise UsageError(
            "--backend trtllm needs a GPU profile (TensorRT-LLM does not run on CPU)",
            hint="pass --gpu h100|h200|b200|b300|gb200|gb300, or use --backend torch for the embedded engine",
        )
    if backend == "torch" and (req.tp != 1 or req.ep != 1):
        raise UsageError(
            f"--tp={req.tp}/--ep={req.ep}: the embedded (torch) engine runs on one device",
            hint="use --backend trtllm for tensor/expert parallelism",
        )
    if backend == "torch" and req.kv_cache_dtype == "fp8":
        raise UsageError(
            "--kv-cache-dtype fp8 with --backend torch: the embedded engine keeps its KV cache in the model dtype",
            hint="drop --kv-cache-dtype or use --backend trtllm",
        )
    tree = parse_tree_budget(req.tree_budget, field_name="--tree-budget")
    if tree != 0 and backend == "trtllm":
        raise UsageError(
            f"--tree-budget={req.tree_budget}: TensorRT-LLM has no DFlash tree verification (DDTree)",
            hint="build for the embedded engine with --backend torch, or drop --tree-budget (linear DFlash)",
        )
    if backend == "trtllm":
        check_requested_quant(req, profile)
    return profile, detected_count, backend


def _check_pair(req: BuildRequest, pair: ResolvedPair) -> tuple[DFlashConfig, int]:
    """The drafter's config and the block size to run, checked against the target."""
    assert pair.drafter is not None
    tcfg = text_config(pair.target.config)
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if not isinstance(tcfg.get(key), int):
            raise ConfigError(f"target.{key}", tcfg.get(key), "missing from the target config.json")
    dcfg = parse_dflash_config(hf_config=pair.drafter.config)
    info = TargetInfo(
        hidden_size=tcfg["hidden_size"],
        num_hidden_layers=tcfg["num_hidden_layers"],
        vocab_size=tcfg["vocab_size"],
        architecture=(pair.target.config.get("architectures") or ["?"])[0],
    )
    block = req.block_size or dcfg.block_size
    validate_pair(dcfg, info, block_size=block)
    if block < 2:
        raise UsageError("--block-size=1 would disable DFlash", hint="use a block size >= 2 (drafter trained with "
                         f"{dcfg.block_size})")  # fmt: skip
    check_runtime_block_size(dcfg, block)
    return dcfg, block
