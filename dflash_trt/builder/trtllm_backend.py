# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM (PyTorch backend) plan: quantization choice, parallelism and memory checks,
and the LLM-API config with TensorRT-LLM's exact field names.

There is no engine to compile: TensorRT-LLM loads HF checkpoints (optionally ModelOpt-quantized)
plus this config. `trtllm-build` and the TensorRT engine backend were removed upstream and never
ran gpt-oss, so a bundle holds checkpoints (or references), `llm_api.yaml` and the Triton
repository, never a TensorRT engine or a TensorRT plugin.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_trt.builder.gpus import GpuProfile
from dflash_trt.builder.llm_api import validate_llm_api
from dflash_trt.builder.plan import (
    CHECKPOINTS,
    MODEL_NAME,
    BuildPlan,
    BuildRequest,
    bundle_files,
    bundle_name,
    guided_decoding_args,
)
from dflash_trt.builder.remote_code import decide_remote_code
from dflash_trt.builder.shapes import (
    bytes_per_param,
    common_sections,
    estimate_params,
    is_moe,
    kv_bytes_per_token,
    text_config,
    triton_config,
    weights_native_format,
)
from dflash_trt.builder.source import ResolvedPair
from dflash_trt.errors import UsageError
from dflash_trt.models.dflash_config import DFlashConfig, max_draft_len_for

TRTLLM_MIN_VERSION = "1.3.0rc (first release with DFlash, TensorRT-LLM PR #12794)"
TRTLLM_IMAGE = "nvcr.io/nvidia/tritonserver:26.10-trtllm-python-py3"
MEMORY_UTILISATION = 0.9  # fraction of HBM a deployment may plan for

# ModelOpt 0.47 recipes and the TensorRT-LLM quant algo they produce.
RECIPES = {
    "fp8": ("FP8_DEFAULT_CFG", "FP8"),
    "nvfp4": ("NVFP4_DEFAULT_CFG", "NVFP4"),
}


def choose_quant(req: BuildRequest, profile: GpuProfile, native: str, family: str) -> tuple[str, str]:
    """(format, source): format in bf16|fp8|nvfp4|mxfp4; source native|modelopt|mxfp4-cast|checkpoint."""
    q = req.quant
    if native == "mxfp4":  # gpt-oss ships MXFP4 experts
        if profile.mxfp4 == "none":
            raise UsageError(
                f"--gpu {profile.name} (sm{profile.sm}): TensorRT-LLM runs MXFP4 (gpt-oss) weights on Hopper "
                "(W4A16, Triton MoE) and Blackwell only",
                hint="use --gpu h100/h200 or a Blackwell profile",
            )
        if q in ("auto", "none"):
            return "mxfp4", "native"
        if q == "fp8":
            raise UsageError(
                "--quant fp8 for an MXFP4 checkpoint (gpt-oss) up-casts its 4-bit experts to 8 bits: about twice "
                "the memory and no accuracy gain",
                hint="keep the default (native MXFP4, with --kv-cache-dtype fp8), or --quant nvfp4 on Blackwell",
            )
        _check_support("nvfp4", profile)
        return "nvfp4", "mxfp4-cast"
    if native in ("fp8", "nvfp4"):
        if q not in ("auto", "none", native):
            raise UsageError(
                f"--quant {q}: the target checkpoint is already {native.upper()}", hint="use --quant auto"
            )
        _check_support(native, profile)
        return native, "checkpoint"
    if q == "none":
        return "bf16", "checkpoint"
    if q == "auto":
        q = "nvfp4" if profile.nvfp4 else "fp8" if profile.fp8 else "none"
        if q == "none":
            return "bf16", "checkpoint"
    _check_support(q, profile)
    return q, "modelopt"


def check_requested_quant(req: BuildRequest, profile: GpuProfile) -> None:
    """What the GPU profile alone rules out, whatever the checkpoint: run before any config is read."""
    if req.quant in ("fp8", "nvfp4"):
        _check_support(req.quant, profile)
    if req.kv_cache_dtype == "fp8" and not profile.fp8:
        raise UsageError(f"--kv-cache-dtype fp8 on --gpu {profile.name}: needs sm89+", hint="use auto")


def _check_support(fmt: str, profile: GpuProfile) -> None:
    if fmt == "nvfp4" and not profile.nvfp4:
        raise UsageError(
            f"--quant nvfp4 on --gpu {profile.name} (sm{profile.sm}): NVFP4 W4A4 needs Blackwell "
            "(sm100/103/120)",
            hint="use --quant auto (FP8 on Hopper, native MXFP4 for gpt-oss) or --quant fp8, or --gpu "
            "b200/b300/gb200/gb300",
        )
    if fmt == "fp8" and not profile.fp8:
        raise UsageError(
            f"--quant fp8 on --gpu {profile.name}: FP8 compute needs sm89 or newer",
            hint="use --quant none on this GPU",
        )


def check_parallelism(req: BuildRequest, cfg: dict[str, Any], profile: GpuProfile) -> int:
    t = text_config(cfg)
    heads = int(t["num_attention_heads"])
    kv = int(t.get("num_key_value_heads") or heads)
    tp, ep = req.tp, req.ep
    if heads % tp:
        raise UsageError(
            f"--tp={tp} does not divide the target's num_attention_heads={heads}",
            hint=f"use a --tp among {[d for d in (1, 2, 4, 8, 16) if heads % d == 0]}",
        )
    if kv % tp and tp % kv:
        raise UsageError(
            f"--tp={tp} and num_key_value_heads={kv}: one must divide the other (KV heads are split or replicated)",
            hint=f"use --tp {kv} or a divisor of {kv}",
        )
    if tp > profile.per_node and tp % profile.per_node:
        raise UsageError(
            f"--tp={tp} spans nodes of {profile.per_node} {profile.name} GPUs unevenly",
            hint=f"use --tp <= {profile.per_node} or a multiple of {profile.per_node}",
        )
    experts = int(t.get("num_local_experts") or t.get("num_experts") or t.get("n_routed_experts") or 0)
    if ep != 1:
        if not experts:
            raise UsageError(f"--ep={ep}: the target is not a mixture of experts", hint="drop --ep")
        if tp % ep:
            raise UsageError(
                f"--ep={ep} must divide --tp={tp} (expert and tensor parallelism share the GPUs)"
            )
        if experts % ep:
            raise UsageError(f"--ep={ep} does not divide the number of experts ({experts})")
    return tp


def memory_check(
    pair: ResolvedPair, profile: GpuProfile, fmt: str, kv_dtype: str, limits: dict[str, int], tp: int
) -> dict[str, Any]:
    """Weights + KV cache for max_batch_size x max_seq_len per GPU vs the GPU's memory."""
    weights, source = _target_bytes(pair, fmt)
    drafter_bytes = _drafter_bytes(pair)
    kv_tokens = limits["max_batch_size"] * limits["max_seq_len"]
    kv = kv_bytes_per_token(pair.target.config, kv_dtype, limits["max_seq_len"]) * kv_tokens
    per_gpu = (weights + kv) / tp + drafter_bytes
    budget = profile.memory_gb * 1e9 * MEMORY_UTILISATION
    result = {
        "weights_gb": round(weights / 1e9, 2),
        "weights_source": source,
        "drafter_gb": round(drafter_bytes / 1e9, 2),
        "kv_cache_gb": round(kv / 1e9, 2),
        "kv_tokens": kv_tokens,
        "per_gpu_gb": round(per_gpu / 1e9, 2),
        "budget_per_gpu_gb": round(budget / 1e9, 2),
        "tp": tp,
        "ok": per_gpu <= budget,
    }
    if result["ok"]:
        return result
    need_tp = next(
        (n for n in (2, 4, 8, 16, 32, 64) if n > tp and (weights + kv) / n + drafter_bytes <= budget),
        None,
    )
    fixes = [f"--tp {need_tp}"] if need_tp else []
    fixes.append("lower --max-batch-size or --max-seq-len")
    if fmt == "bf16":
        fixes.append("--quant fp8")
    raise UsageError(
        f"memory: weights {result['weights_gb']} GB + KV {result['kv_cache_gb']} GB "
        f"({kv_tokens} tokens, {kv_dtype}) over TP={tp} + drafter {result['drafter_gb']} GB = "
        f"{result['per_gpu_gb']} GB per GPU > {result['budget_per_gpu_gb']} GB usable on {profile.name} "
        f"({profile.memory_gb:g} GB x {MEMORY_UTILISATION})",
        hint=" or ".join(fixes),
    )


def _target_bytes(pair: ResolvedPair, fmt: str) -> tuple[float, str]:
    """The target's weights in `fmt`: from its checkpoint index when it has one, else estimated
    from the parameter count; and which of the two."""
    cfg = pair.target.config
    native = weights_native_format(cfg)
    native_bytes = pair.target.extra.get("weights_bytes")
    if native_bytes and fmt == native:
        return float(native_bytes), "checkpoint index"
    if native_bytes and native == "bf16":
        return float(native_bytes) * bytes_per_param(fmt) / 2.0, "checkpoint index, rescaled"
    return estimate_params(cfg) * bytes_per_param(fmt), "parameter estimate"


def _drafter_bytes(pair: ResolvedPair) -> float:
    """The drafter's weights (bf16): from its checkpoint index, else from its config's shapes."""
    if pair.drafter is None:
        return 0.0
    indexed = float(pair.drafter.extra.get("weights_bytes") or 0)
    if indexed:
        return indexed
    d = pair.drafter.config
    h = int(d["num_attention_heads"])
    kvh = int(d.get("num_key_value_heads") or h)
    dd = int(d["hidden_size"])
    hd = int(d.get("head_dim") or dd // h)
    ids = (d.get("dflash_config") or {}).get("target_layer_ids") or [0] * int(d["num_hidden_layers"])
    per_layer = 2 * dd * h * hd + 2 * dd * kvh * hd + 3 * dd * int(d["intermediate_size"])
    return 2.0 * (int(d["num_hidden_layers"]) * per_layer + len(ids) * dd * dd)


def _kv_cache_dtype(req: BuildRequest, profile: GpuProfile, *, family: str, fmt: str) -> str:
    """--kv-cache-dtype, or auto: the profile's for gpt-oss, FP8 beside FP8/NVFP4 weights, else auto."""
    if req.kv_cache_dtype != "auto":
        return req.kv_cache_dtype
    if family == "gpt_oss":
        return profile.kv_cache_dtype
    return "fp8" if fmt in ("fp8", "nvfp4") else "auto"


def _limits(req: BuildRequest, text_cfg: dict, *, family: str) -> dict[str, int]:
    return {
        "max_batch_size": req.max_batch_size or 64,
        "max_seq_len": req.max_seq_len or min(int(text_cfg.get("max_position_embeddings") or 8192), 8192),
        "max_num_tokens": req.max_num_tokens or (16384 if family == "gpt_oss" else 8192),
    }


def plan_trtllm(
    req: BuildRequest,
    pair: ResolvedPair,
    profile: GpuProfile,
    dcfg: DFlashConfig,
    block: int,
    detected_count: int | None,
) -> BuildPlan:
    """The TensorRT-LLM plan: quantization and KV dtype, parallelism, limits and memory, then the
    LLM-API config and the plan's sections."""
    cfg = pair.target.config
    t = text_config(cfg)
    family = str(t.get("model_type") or cfg.get("model_type"))
    fmt, source = choose_quant(req, profile, weights_native_format(cfg), family)
    kv_dtype = _kv_cache_dtype(req, profile, family=family, fmt=fmt)
    tp = check_parallelism(req, cfg, profile)
    if detected_count is not None and tp > detected_count:
        raise UsageError(
            f"--tp={tp} needs {tp} GPUs, nvidia-smi shows {detected_count}", hint=f"use --tp {detected_count}"
        )
    limits = _limits(req, t, family=family)
    memory = memory_check(pair, profile, fmt, kv_dtype, limits, tp)
    target_ref = f"{CHECKPOINTS}/target-{fmt}" if source in ("modelopt", "mxfp4-cast") else pair.target.ref
    assert pair.drafter is not None
    drafter_ref = f"{CHECKPOINTS}/drafter-fp8" if req.quantize_drafter else pair.drafter.ref
    remote = decide_remote_code(pair, refuse=req.no_remote_code)
    target, drafter, speculative = common_sections(
        req, pair, dcfg, block, target_ref=target_ref, drafter_ref=drafter_ref
    )
    llm_api = _llm_api_config(
        req, profile, dcfg, block, family=family, moe=is_moe(cfg), tp=tp, kv_dtype=kv_dtype, limits=limits,
        target_ref=target_ref, drafter_ref=drafter_ref, trust_remote_code=remote.trust,
    )  # fmt: skip
    validation = {"llm_api": validate_llm_api(llm_api), "memory": memory}
    validation["pair"] = {"ok": True, "block_size": block, "trained_block_size": dcfg.block_size}
    return BuildPlan(
        request=req,
        name=bundle_name(req.target),
        backend="trtllm",
        target=target,
        drafter=drafter,
        speculative=speculative,
        gpu=_gpu_section(req, profile, tp),
        quantization=_quantization_section(req, profile, fmt, source, kv_dtype),
        limits=limits,
        llm_api=llm_api,
        triton_config=triton_config("tensorrt_llm"),
        serving=_serving(memory["weights_gb"] + memory["drafter_gb"]),
        validation=validation,
        files=bundle_files(serve_script=True),
        copies={},
        notes=[*_notes(req, source), remote.note],
    )


def _serving(weights_gb: float) -> dict[str, Any]:
    return {
        "model_name": MODEL_NAME,
        "image": TRTLLM_IMAGE,
        "startup_budget_s": int(600 + 25 * weights_gb),
        "weights_gb": round(weights_gb, 2),
        "engine": "tensorrt_llm",
        "trtllm_min_version": TRTLLM_MIN_VERSION,
    }


def _llm_api_config(
    req: BuildRequest,
    profile: GpuProfile,
    dcfg: DFlashConfig,
    block: int,
    *,
    family: str,
    moe: bool,
    tp: int,
    kv_dtype: str,
    limits: dict[str, int],
    target_ref: str,
    drafter_ref: str,
    trust_remote_code: bool,
) -> dict[str, Any]:
    """TensorRT-LLM's LLM-API arguments (PyTorch backend) with the DFlash speculative config."""
    spec: dict[str, Any] = {
        "decoding_type": "DFlash",
        "max_draft_len": max_draft_len_for(block),
        "speculative_model": drafter_ref,
        # TensorRT-LLM fills these from the drafter's config.json only for local directories.
        "mask_token_id": dcfg.mask_token_id,
        "target_layer_ids": list(dcfg.target_layer_ids),
    }
    llm_api: dict[str, Any] = {
        "model": target_ref,
        "backend": "pytorch",
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": 1,
        "max_batch_size": limits["max_batch_size"],
        "max_num_tokens": limits["max_num_tokens"],
        "max_seq_len": limits["max_seq_len"],
        "kv_cache_config": {
            "dtype": kv_dtype,
            "free_gpu_memory_fraction": 0.85,
            "enable_block_reuse": req.prefix_caching,
        },
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": limits["max_batch_size"]},
        "enable_attention_dp": False,
        "speculative_config": spec,
        # structured outputs; TensorRT-LLM refuses DFlash's use_rejection_sampling (never set here) beside
        # it (llm_api.py)
        **guided_decoding_args(req),
    }
    if trust_remote_code:  # only when a repository needs it (builder/remote_code.py); default False
        llm_api["trust_remote_code"] = True
    if moe:
        llm_api["moe_expert_parallel_size"] = req.ep
    if family == "gpt_oss" and profile.gpt_oss_moe_backend:
        llm_api["moe_config"] = {"backend": profile.gpt_oss_moe_backend}
    return llm_api


def _quantization_section(
    req: BuildRequest, profile: GpuProfile, fmt: str, source: str, kv_dtype: str
) -> dict[str, Any]:
    """What is quantized, how, and the TensorRT-LLM quant algorithm it maps to."""
    algo = {"mxfp4": "W4A8_MXFP4_MXFP8" if profile.is_blackwell else "W4A16_MXFP4", "fp8": "FP8",
            "nvfp4": "NVFP4", "bf16": "NO_QUANT"}[fmt]  # fmt: skip
    recipe = None
    if source == "modelopt":
        recipe = RECIPES[fmt][0]
    elif source == "mxfp4-cast":
        recipe = "MXFP4 -> NVFP4 lossless cast (ModelOpt)"
    return {
        "target": {
            "format": fmt,
            "source": source,
            "recipe": recipe,
            "trtllm_quant_algo": algo,
            "kv_cache": kv_dtype,
            "calibration": {"dataset": req.calib_data or "builtin", "samples": req.calib_samples}
            if source == "modelopt"
            else None,
        },
        "drafter": {"format": "fp8" if req.quantize_drafter else "checkpoint",
                    "recipe": "weight-only FP8 (calibration-free)" if req.quantize_drafter else None},
    }  # fmt: skip


def _gpu_section(req: BuildRequest, profile: GpuProfile, tp: int) -> dict[str, Any]:
    return {
        "profile": profile.name,
        "count": tp,
        "tp": tp,
        "ep": req.ep,
        "per_node": profile.per_node,
        "nodes": max(1, math.ceil(tp / profile.per_node)),
        "product_label": profile.product_label,
        "memory_gb": profile.memory_gb,
        "sm": profile.sm,
        "bandwidth_tbs": profile.bandwidth_tbs,
    }


def _notes(req: BuildRequest, source: str) -> list[str]:
    notes = [
        "TensorRT-LLM runs DFlash only in its PyTorch backend: this bundle holds checkpoints (or Hub "
        "references) and an LLM-API config; no TensorRT engine or TensorRT plugin is built (trtllm-build and "
        "the TensorRT engine backend were removed upstream, and never ran gpt-oss).",
        f"needs TensorRT-LLM >= {TRTLLM_MIN_VERSION}",
        "kv_cache_config.enable_block_reuse is on (TensorRT-LLM's default; --no-prefix-caching turns it off): "
        "dflash-trt's embedded engine keeps the drafter's context with the cached pages and is tested to keep "
        "DFlash's acceptance; that TensorRT-LLM's DFlash worker does the same is unverified.",
    ]
    if req.guided_decoding:
        notes.append(
            "guided_decoding_backend: xgrammar, so the model serves structured outputs (JSON schema, regex, "
            "grammar). TensorRT-LLM does not combine it with DFlash's rejection sampling: "
            "speculative_config.use_rejection_sampling (off by default, never set here) is refused beside it. "
            "--no-guided-decoding leaves the backend out."
        )
    if source == "mxfp4-cast":
        notes.append(
            "serving an NVFP4-cast gpt-oss checkpoint in TensorRT-LLM is undocumented upstream [unverified]"
        )
    if req.quantize_drafter:
        notes.append(
            "TensorRT-LLM loading a quantized DFlash drafter is unverified; the embedded engine loads it"
        )
    return notes
