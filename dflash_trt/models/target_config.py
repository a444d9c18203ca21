# SPDX-License-Identifier: Apache-2.0
"""Target architecture description, parsed from a transformers `config.json` in one function."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_trt.errors import ConfigError
from dflash_trt.layers.rope_config import RopeConfig, parse_rope

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt_oss")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    top_k: int
    swiglu_alpha: float = 1.702  # gpt-oss: glu = gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # gpt-oss clamps gate (above) and up (both sides)


@dataclass(frozen=True, slots=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int | None
    qkv_bias: bool  # q/k/v projections carry biases (qwen2, gpt-oss, llama attention_bias)
    o_bias: bool  # o_proj carries a bias (gpt-oss, llama attention_bias; not qwen2)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_sinks: bool  # gpt-oss: a learned per-head logit that takes softmax mass
    moe: MoeConfig | None
    tie_word_embeddings: bool
    norm_weight_in_fp32: bool = False  # gpt-oss multiplies the norm weight before the cast
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None  # "bfloat16", "float16", "float32" as config.json states it
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def num_step_parameters(self) -> int:
        """The parameters one decode step at batch 1 reads: the LM head and every layer's projections
        (a MoE layer's top-k experts), not the embedding table (one row a token)."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        experts = self.moe.top_k if self.moe is not None else 1
        layer = self.hidden_size * (2 * q + 2 * kv) + experts * 3 * self.hidden_size * self.intermediate_size
        return self.vocab_size * self.hidden_size + self.num_hidden_layers * layer

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size


def _req(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"target.{key}", value, "must be a positive integer in the target config.json")
    return value


def _attention_layers(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, list[str]]:
    """(sliding window or None, per-layer attention type), from `layer_types` when the config has
    it, else from each family's own rule (Qwen: from max_window_layers on, when use_sliding_window)."""
    sliding = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        sliding = None
    if sliding is None:
        return None, ["full_attention"] * layers
    if layer_types is not None:
        return sliding, list(layer_types)
    if model_type == "mistral":
        return sliding, ["sliding_attention"] * layers
    if model_type in ("qwen2", "qwen3"):
        mwl = cfg.get("max_window_layers", layers)
        return sliding, ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
    return sliding, ["full_attention"] * layers


def parse_target_config(hf_config: dict[str, Any]) -> TargetConfig:
    cfg = dict(hf_config.get("text_config") or hf_config)
    model_type = cfg.get("model_type") or hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            "target.model_type",
            model_type,
            f"not supported by the embedded engine (supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
            hint="use the reference loop (`dflash-trt generate`) or TensorRT-LLM for this architecture",
        )
    layers = _req(cfg, "num_hidden_layers")
    heads = _req(cfg, "num_attention_heads")
    hidden = _req(cfg, "hidden_size")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    sliding, layer_types = _attention_layers(cfg, model_type, layers)
    attention_bias = bool(cfg.get("attention_bias", False))
    moe = None
    if model_type == "gpt_oss":
        moe = MoeConfig(
            num_experts=_req(cfg, "num_local_experts"),
            top_k=_req(cfg, "num_experts_per_tok"),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )
    eos = cfg.get("eos_token_id", hf_config.get("eos_token_id"))
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return TargetConfig(
        model_type=model_type,
        vocab_size=_req(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_req(cfg, "intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(cfg, prefix="target."),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        qkv_bias=model_type in ("qwen2", "gpt_oss") or attention_bias,
        o_bias=model_type == "gpt_oss" or (attention_bias and model_type in ("llama", "mistral")),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        layer_types=tuple(layer_types),
        sliding_window=sliding,
        attention_sinks=model_type == "gpt_oss",
        moe=moe,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))),
        norm_weight_in_fp32=model_type == "gpt_oss",
        eos_token_ids=eos_ids,
        checkpoint_dtype=_dtype_name(
            cfg.get("dtype") or cfg.get("torch_dtype") or hf_config.get("torch_dtype")
        ),
    )


def _dtype_name(value: Any) -> str | None:
    """config.json's dtype ("bfloat16", or "torch.bfloat16" in older files) as a plain name."""
    if not isinstance(value, str):
        return None
    name = value.removeprefix("torch.")
    return name if name in ("bfloat16", "float16", "float32") else None
