# SPDX-License-Identifier: Apache-2.0
"""make_plan: resolve, validate and decide everything before heavy work (configs only)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dflash_trt.builder.gpus import GpuProfile, detect_gpu, get_profile
from dflash_trt.builder.plan import CHECKPOINTS, MODEL_NAME, BuildPlan, BuildRequest, bundle_name
from dflash_trt.builder.resolve import ModelSource, ResolvedPair, resolve_pair
from dflash_trt.errors import ConfigError, UsageError
from dflash_trt.models.dflash_config import (
    DFlashConfig,
    TargetInfo,
    check_runtime_block_size,
    parse_dflash_config,
    validate_pair,
)

log = logging.getLogger(__name__)

QUANT_CHOICES = ("auto", "none", "fp8", "nvfp4")
KV_CHOICES = ("auto", "fp8")
BACKEND_CHOICES = ("trtllm", "torch")
TRTLLM_MIN_VERSION = "1.3.0rc (first release with DFlash, TensorRT-LLM PR #12794)"
TRTLLM_IMAGE = "nvcr.io/nvidia/tritonserver:26.10-trtllm-python-py3"
MEMORY_UTILISATION = 0.9  # fraction of HBM a deployment may plan for


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(cfg.get("text_config") or cfg)


def is_moe(cfg: dict[str, Any]) -> bool:
    t = text_config(cfg)
    return any(k in t for k in ("num_local_experts", "num_experts", "n_routed_experts"))


def weights_native_format(cfg: dict[str, Any]) -> str:
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":
        return "mxfp4"
    if method in ("fp8", "modelopt") and "FP8" in str(q.get("quant_algo", "FP8")).upper():
        return "fp8"
    if method == "modelopt" and "NVFP4" in str(q.get("quant_algo", "")).upper():
        return "nvfp4"
    return "bf16"


def estimate_params(cfg: dict[str, Any]) -> int:
    """Parameter count from a transformers config (attention, MLP/MoE, embeddings)."""
    t = text_config(cfg)
    d = int(t["hidden_size"])
    layers = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    kv = int(t.get("num_key_value_heads") or heads)
    hd = int(t.get("head_dim") or d // heads)
    vocab = int(t["vocab_size"])
    attn = d * heads * hd * 2 + d * kv * hd * 2
    experts = int(t.get("num_local_experts") or t.get("num_experts") or t.get("n_routed_experts") or 0)
    if experts:
        inter = int(t.get("moe_intermediate_size") or t.get("intermediate_size") or 0)
        mlp = experts * 3 * d * inter + experts * d
        shared = int(t.get("shared_expert_intermediate_size") or 0)
        mlp += 3 * d * shared
    else:
        mlp = 3 * d * int(t["intermediate_size"])
    emb = vocab * d * (1 if t.get("tie_word_embeddings", cfg.get("tie_word_embeddings")) else 2)
    return layers * (attn + mlp) + emb


def bytes_per_param(fmt: str) -> float:
    return {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5625, "mxfp4": 0.53125}[fmt]


def kv_bytes_per_token(cfg: dict[str, Any], kv_dtype: str, max_seq_len: int) -> float:
    t = text_config(cfg)
    layers = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    kv = int(t.get("num_key_value_heads") or heads)
    hd = int(t.get("head_dim") or int(t["hidden_size"]) // heads)
    elt = 1 if kv_dtype == "fp8" else 2
    per_layer = 2 * kv * hd * elt
    window = t.get("sliding_window")
    types = t.get("layer_types") or []
    sliding = sum(1 for x in types if x == "sliding_attention") if window else 0
    # sliding layers hold at most `window` tokens: charge them pro rata of the sequence
    frac = min(1.0, float(window) / max_seq_len) if sliding and window else 1.0
    return per_layer * ((layers - sliding) + sliding * frac)


def _positive(value: int | None, flag: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UsageError(f"{flag}={value!r} must be a positive integer")


def make_plan(req: BuildRequest) -> BuildPlan:
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

    pair = resolve_pair(req.target, req.drafter, offline=req.offline)
    if req.gpu:
        profile = get_profile(req.gpu)
        detected_count = None
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
    if pair.drafter is None:
        raise UsageError(
            f"--target={req.target!r} has no registered DFlash drafter", hint="pass --drafter DIR_OR_HF_ID"
        )
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

    if backend == "trtllm":
        from dflash_trt.builder.trtllm_backend import plan_trtllm

        return plan_trtllm(req, pair, profile, dcfg, block, detected_count)
    return plan_torch(req, pair, profile, dcfg, block)


def common_sections(
    req: BuildRequest,
    pair: ResolvedPair,
    dcfg: DFlashConfig,
    block: int,
    *,
    target_ref: str,
    drafter_ref: str,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    t = text_config(pair.target.config)
    target = {
        "name": pair.name,
        **pair.target.describe(),
        "ref": target_ref,
        "architecture": (pair.target.config.get("architectures") or ["?"])[0],
        "model_type": t.get("model_type") or pair.target.config.get("model_type"),
        "num_hidden_layers": t["num_hidden_layers"],
        "hidden_size": t["hidden_size"],
        "vocab_size": t["vocab_size"],
        "moe": is_moe(pair.target.config),
        "native_weights": weights_native_format(pair.target.config),
    }
    assert pair.drafter is not None
    drafter = {
        **pair.drafter.describe(),
        "ref": drafter_ref,
        "block_size": dcfg.block_size,
        "mask_token_id": dcfg.mask_token_id,
        "target_layer_ids": list(dcfg.target_layer_ids),
        "num_hidden_layers": dcfg.num_hidden_layers,
        "attention": ",".join(sorted(set(dcfg.layer_types))),
    }
    speculative = {
        "decoding_type": "DFlash",
        "block_size": block,
        "max_draft_len": block - 1,  # the one place the build derives it
        "trained_block_size": dcfg.block_size,
    }
    return target, drafter, speculative


def plan_torch(
    req: BuildRequest, pair: ResolvedPair, profile: GpuProfile, dcfg: DFlashConfig, block: int
) -> BuildPlan:
    from dflash_trt.models.target_config import SUPPORTED_MODEL_TYPES

    t = text_config(pair.target.config)
    model_type = t.get("model_type") or pair.target.config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            "target.model_type",
            model_type,
            f"is not supported by the embedded engine ({', '.join(SUPPORTED_MODEL_TYPES)})",
            hint="use --backend trtllm --gpu ... for this target",
        )
    quant = req.quant
    if quant == "auto":
        quant = "none"

    kv = "auto"
    if req.kv_cache_dtype == "fp8":
        raise UsageError(
            "--kv-cache-dtype fp8 with --backend torch: the embedded engine keeps its KV cache in the model dtype",
            hint="drop --kv-cache-dtype or use --backend trtllm",
        )
    max_seq = req.max_seq_len or min(int(t.get("max_position_embeddings") or 2048), 2048)
    limits = {
        "max_batch_size": req.max_batch_size or 16,
        "max_seq_len": max_seq,
        "max_num_tokens": req.max_num_tokens or 2048,
    }
    target_rel = f"{CHECKPOINTS}/target" if quant == "none" else f"{CHECKPOINTS}/target-{quant}"
    drafter_rel = f"{CHECKPOINTS}/drafter" if not req.quantize_drafter else f"{CHECKPOINTS}/drafter-fp8"
    target, drafter, speculative = common_sections(
        req, pair, dcfg, block, target_ref=target_rel, drafter_ref=drafter_rel
    )
    llm_api: dict[str, Any] = {
        "model": target_rel,
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": block - 1,
            "speculative_model": drafter_rel,
        },
        "max_batch_size": limits["max_batch_size"],
        "max_num_tokens": limits["max_num_tokens"],
        "max_seq_len": limits["max_seq_len"],
    }
    if _has_tokenizer(pair.target):
        llm_api["tokenizer"] = target_rel
    if req.device:
        llm_api["device"] = req.device
    device = req.device or ("cuda" if profile.is_gpu else "cpu")
    gpu: dict[str, Any] = {"profile": profile.name, "count": 1 if device == "cuda" else 0, "tp": 1, "ep": 1}
    if profile.is_gpu:
        gpu.update(per_node=profile.per_node, product_label=profile.product_label, memory_gb=profile.memory_gb,
                   sm=profile.sm)  # fmt: skip
    quantization = {
        "target": {"format": "bf16" if quant == "none" else quant, "source": "checkpoint" if quant == "none" else "modelopt",
                   "recipe": None if quant == "none" else {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}[quant],
                   "kv_cache": kv,
                   "calibration": None if quant == "none" else {"dataset": req.calib_data or "builtin", "samples": req.calib_samples}},
        "drafter": {"format": "fp8" if req.quantize_drafter else "checkpoint"},
    }  # fmt: skip
    weights_gb = _weights_gb(pair.target) + _weights_gb(pair.drafter)
    serving = {"model_name": MODEL_NAME, "image": None, "startup_budget_s": int(120 + 30 * weights_gb),
               "weights_gb": round(weights_gb, 3), "engine": "dflash_trt"}  # fmt: skip
    copies = {}
    if quant == "none":
        copies[target_rel] = pair.target.ref
    if not req.quantize_drafter:
        assert pair.drafter is not None
        copies[drafter_rel] = pair.drafter.ref
    files = {
        "manifest": "manifest.json",
        "llm_api": "engine/llm_api.yaml",
        "model_repository": "model_repository",
        "helm_values": "helm-values.yaml",
        "bench_plan": "bench-plan.yaml",
        "readme": "BUNDLE.md",
    }
    validation = {
        "pair": {"ok": True, "checks": ["hidden_size", "mask_token_id in target vocab", "target_layer_ids < layers",
                                        f"block_size {block} <= trained {dcfg.block_size}"]},
        "llm_api": {"method": "dflash_trt.LLM signature (embedded engine)", "ok": True},
        "engine_support": {"model_type": model_type, "ok": True},
    }  # fmt: skip
    return BuildPlan(
        request=req,
        name=bundle_name(req.target),
        backend="torch",
        target=target,
        drafter=drafter,
        speculative=speculative,
        gpu=gpu,
        quantization=quantization,
        limits=limits,
        llm_api=llm_api,
        triton_config=triton_config("dflash_trt"),
        serving=serving,
        validation=validation,
        files=files,
        copies=copies,
        notes=["embedded engine: the bundle runs on CPU or one CUDA GPU without TensorRT-LLM"]
        + (
            [
                f"the embedded engine dequantizes the {quant.upper()} weights on load; it does not emulate "
                "activation or KV-cache quantization (TensorRT-LLM does)"
            ]
            if quant != "none"
            else []
        ),
    )


def triton_config(engine: str) -> dict[str, Any]:
    return {
        "max_batch_size": 0,
        "decoupled": True,
        "engine": engine,
        "cancellation_check_period_ms": 50,
        "bundle_root": "../../..",
    }


def _has_tokenizer(src: ModelSource) -> bool:
    if src.path is None:
        return True  # hub repos of instruct models ship their tokenizer
    return any(
        (src.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def _weights_gb(src: ModelSource | None) -> float:
    if src is None:
        return 0.0
    if "weights_bytes" in src.extra:
        return src.extra["weights_bytes"] / 1e9
    if src.path is not None:
        return sum(f.stat().st_size for f in Path(src.path).glob("*.safetensors")) / 1e9
    return 0.0
