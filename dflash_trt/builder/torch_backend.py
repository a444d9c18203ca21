# SPDX-License-Identifier: Apache-2.0
"""The embedded-engine (torch backend) plan: one CPU or CUDA device, no TensorRT-LLM."""

from __future__ import annotations

from typing import Any

from dflash_trt.builder.gpus import GpuProfile
from dflash_trt.builder.plan import (
    CHECKPOINTS,
    MODEL_NAME,
    BuildPlan,
    BuildRequest,
    bundle_files,
    bundle_name,
    guided_decoding_args,
)
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
from dflash_trt.spec.decoding_config import parse_tree_budget

SERVED_MAX_BATCH = 64  # a bundle's max_batch_size unless --max-batch-size says otherwise


def check_torch_target(pair: ResolvedPair, *, dflash2: bool) -> str:
    """The target's model_type, refused by name when the embedded engine has no native model for it
    (the hint offers TensorRT-LLM, except for DFlash 2 drafters, which it cannot run)."""
    from dflash_trt.models.target_config import SUPPORTED_MODEL_TYPES

    t = text_config(pair.target.config)
    model_type = t.get("model_type") or pair.target.config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = (pair.target.config.get("architectures") or ["?"])[0]
        raise ConfigError(
            "target.model_type",
            model_type,
            f"({arch}) is not supported by the embedded engine ({', '.join(SUPPORTED_MODEL_TYPES)})",
            hint="no backend of dflash-trt runs a DFlash 2 drafter on this target yet"
            if dflash2
            else "use --backend trtllm --gpu ... for this target",
        )
    return str(model_type)


def _limits(req: BuildRequest, pair: ResolvedPair) -> dict[str, int]:
    max_seq = req.max_seq_len or min(
        int(text_config(pair.target.config).get("max_position_embeddings") or 2048), 2048
    )
    return {
        # 64 sequences at once: at 16 a served c=64 ran in four waves (time to first token 1.2-3.9 s on
        # `tiny`); the CPU's KV cache stays sized for 16 full-length ones (engine/assemble.py)
        "max_batch_size": req.max_batch_size or SERVED_MAX_BATCH,
        "max_seq_len": max_seq,
        "max_num_tokens": req.max_num_tokens or 2048,
    }


def plan_torch(
    req: BuildRequest, pair: ResolvedPair, profile: GpuProfile, dcfg: DFlashConfig, block: int
) -> BuildPlan:
    """The plan of a bundle for the embedded engine: checkpoints (copied, or quantized by ModelOpt
    and dequantized on load), the LLM arguments, and one device."""
    model_type = check_torch_target(pair, dflash2=dcfg.dflash2 is not None)
    quant = "none" if req.quant == "auto" else req.quant
    limits = _limits(req, pair)
    target_rel = f"{CHECKPOINTS}/target" if quant == "none" else f"{CHECKPOINTS}/target-{quant}"
    drafter_rel = f"{CHECKPOINTS}/drafter" if not req.quantize_drafter else f"{CHECKPOINTS}/drafter-fp8"
    target, drafter, speculative = common_sections(
        req, pair, dcfg, block, target_ref=target_rel, drafter_ref=drafter_rel
    )
    copies = {}
    if quant == "none":
        copies[target_rel] = pair.target.ref
    if not req.quantize_drafter:
        assert pair.drafter is not None
        copies[drafter_rel] = pair.drafter.ref
    weights_gb = checkpoint_gb(pair.target) + checkpoint_gb(pair.drafter)
    serving = {"model_name": MODEL_NAME, "image": None, "startup_budget_s": int(120 + 30 * weights_gb),
               "weights_gb": round(weights_gb, 3), "engine": "dflash_trt"}  # fmt: skip
    validation = {
        "pair": {"ok": True, "checks": ["hidden_size", "mask_token_id in target vocab", "target_layer_ids < layers",
                                        f"block_size {block} <= trained {dcfg.block_size}"]},
        "llm_api": {"method": "dflash_trt.LLM signature (embedded engine)", "ok": True},
        "engine_support": {"model_type": model_type, "ok": True},
    }  # fmt: skip
    notes = ["embedded engine: the bundle runs on CPU or one CUDA GPU without TensorRT-LLM"]
    if quant != "none":
        notes.append(
            f"the embedded engine dequantizes the {quant.upper()} weights on load; it does not emulate "
            "activation or KV-cache quantization (TensorRT-LLM does)"
        )
    return BuildPlan(
        request=req,
        name=bundle_name(req.target),
        backend="torch",
        target=target,
        drafter=drafter,
        speculative=speculative,
        gpu=_gpu(req, profile),
        quantization=_quantization(req, quant),
        limits=limits,
        llm_api=_llm_api(req, pair, speculative, limits, target_rel=target_rel, drafter_rel=drafter_rel),
        triton_config=triton_config("dflash_trt"),
        serving=serving,
        validation=validation,
        files=bundle_files(serve_script=False),
        copies=copies,
        notes=notes,
    )


def _llm_api(
    req: BuildRequest, pair: ResolvedPair, speculative: dict[str, Any], limits: dict[str, int], *,
    target_rel: str, drafter_rel: str,
) -> dict[str, Any]:  # fmt: skip
    """dflash_trt.LLM's arguments (engine/llm_api.yaml and the Triton model's model.yaml)."""
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
        "kv_cache_config": {"enable_block_reuse": req.prefix_caching},
        **guided_decoding_args(req),
    }
    tree = parse_tree_budget(req.tree_budget, field_name="--tree-budget")
    if tree != 0:
        llm_api["speculative_config"]["tree_budget"] = tree
        speculative["tree_budget"] = tree
    if has_tokenizer(pair.target):
        llm_api["tokenizer"] = target_rel
    if req.device:
        llm_api["device"] = req.device
    return llm_api


def _gpu(req: BuildRequest, profile: GpuProfile) -> dict[str, Any]:
    device = req.device or ("cuda" if profile.is_gpu else "cpu")
    gpu: dict[str, Any] = {"profile": profile.name, "count": 1 if device == "cuda" else 0, "tp": 1, "ep": 1}
    if profile.is_gpu:
        gpu.update(per_node=profile.per_node, product_label=profile.product_label, memory_gb=profile.memory_gb,
                   sm=profile.sm)  # fmt: skip
    return gpu


def _quantization(req: BuildRequest, quant: str) -> dict[str, Any]:
    """What each checkpoint is stored as (make_plan refused --kv-cache-dtype fp8 for this backend)."""
    none = quant == "none"
    return {
        "target": {"format": "bf16" if none else quant, "source": "checkpoint" if none else "modelopt",
                   "recipe": None if none else {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}[quant],
                   "kv_cache": "auto",
                   "calibration": None if none else {"dataset": req.calib_data or "builtin", "samples": req.calib_samples}},
        "drafter": {"format": "fp8" if req.quantize_drafter else "checkpoint"},
    }  # fmt: skip
