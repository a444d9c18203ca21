# SPDX-License-Identifier: Apache-2.0
"""The embedded-engine (torch backend) plan: one CPU or CUDA device, no TensorRT-LLM."""

from __future__ import annotations

from typing import Any

from dflash_trt.builder.gpus import GpuProfile
from dflash_trt.builder.plan import CHECKPOINTS, MODEL_NAME, BuildPlan, BuildRequest, bundle_name
from dflash_trt.builder.shapes import (
    checkpoint_gb,
    common_sections,
    has_tokenizer,
    text_config,
    triton_config,
)
from dflash_trt.builder.source import ResolvedPair
from dflash_trt.errors import ConfigError
from dflash_trt.models.dflash_config import DFlashConfig


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

    kv = "auto"  # make_plan refused --kv-cache-dtype fp8 for this backend
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
            "max_draft_len": speculative["max_draft_len"],
            "speculative_model": drafter_rel,
        },
        "max_batch_size": limits["max_batch_size"],
        "max_num_tokens": limits["max_num_tokens"],
        "max_seq_len": limits["max_seq_len"],
    }
    if has_tokenizer(pair.target):
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
    weights_gb = checkpoint_gb(pair.target) + checkpoint_gb(pair.drafter)
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
