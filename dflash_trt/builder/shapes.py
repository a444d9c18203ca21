# SPDX-License-Identifier: Apache-2.0
"""What both backends' plans read from configs: shapes, formats, sizes, and the plan sections they share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_trt.builder.plan import BuildRequest
from dflash_trt.builder.source import ModelSource, ResolvedPair
from dflash_trt.models.dflash_config import DFlashConfig, max_draft_len_for


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
    if dcfg.dflash2 is not None:  # v1 manifests keep their exact shape
        drafter.update(architecture=dcfg.architecture, dflash2=dcfg.dflash2.to_dict())
    speculative = {
        "decoding_type": "DFlash",
        "block_size": block,
        "max_draft_len": max_draft_len_for(block),
        "trained_block_size": dcfg.block_size,
    }
    return target, drafter, speculative


def triton_config(engine: str) -> dict[str, Any]:
    cfg = {
        "max_batch_size": 0,
        "decoupled": True,
        "engine": engine,
        "cancellation_check_period_ms": 50,
        "bundle_root": "../../..",
    }
    if engine == "dflash_trt":
        cfg["engine_process"] = True  # the embedded engine in a process of its own (api/process.py)
    return cfg


def has_tokenizer(src: ModelSource) -> bool:
    if src.path is None:
        return True  # hub repos of instruct models ship their tokenizer
    return any(
        (src.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def checkpoint_gb(src: ModelSource | None) -> float:
    if src is None:
        return 0.0
    if "weights_bytes" in src.extra:
        return src.extra["weights_bytes"] / 1e9
    if src.path is not None:
        return sum(f.stat().st_size for f in Path(src.path).glob("*.safetensors")) / 1e9
    return 0.0
