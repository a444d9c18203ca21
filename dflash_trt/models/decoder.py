# SPDX-License-Identifier: Apache-2.0
"""One pre-norm decoder covering Llama, Mistral, Qwen2, Qwen3 and gpt-oss, on a paged KV cache.

A forward call takes a padded batch of new tokens per sequence, writes their K/V into the cache
first, then attends over each sequence's cached positions (causal, optionally windowed, with
gpt-oss attention sinks). Module names equal transformers' so checkpoints load by exact name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from dflash_trt.layers.attention import attend_paged
from dflash_trt.layers.kv_cache import PagedKVCache, store_kv
from dflash_trt.layers.linear import FusedLinear, Linear
from dflash_trt.layers.masks import block_visibility_mask, visibility_mask
from dflash_trt.layers.mlp import SwiGLU
from dflash_trt.layers.norm import RMSNorm
from dflash_trt.layers.regions import repeated_region
from dflash_trt.layers.rope import RotaryEmbedding, apply_rope
from dflash_trt.models.target_config import TargetConfig


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        d = cfg.hidden_size
        self.q_proj = Linear(d, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None
        self.layer = layer
        self.qkv: FusedLinear | None = None
        self.paged_kernel = False  # dflash_cpu::paged_attention for decode rounds (cpu_attention.enable)

    def fuse(self) -> None:
        """Run q, k and v as one GEMM from now on (inference; see layers/linear.py)."""
        self.qkv = FusedLinear.of([self.q_proj, self.k_proj, self.v_proj])

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [bs, T, D] -> q [bs, T, H, d], k and v [bs, T, Hkv, d] (before norms and RoPE)."""
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv(x)
        return (
            q.unflatten(-1, (self.num_heads, self.head_dim)),
            k.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            v.unflatten(-1, (self.num_kv_heads, self.head_dim)),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        ctx_index: torch.Tensor,
        mask: torch.Tensor,
        paged: bool = False,
    ) -> torch.Tensor:
        """x: [bs, T, D]; cos/sin: [bs, T, d]; k_pool/v_pool: this layer's paged K/V [slots, Hkv, d];
        slots: [bs, T]; ctx_index: [bs, Lc]; mask: [bs, 1, T, Lc]; paged: a decode round's few query
        rows, which read the pool in place where the kernel is enabled (prompt chunks gather it)."""
        bs, t, _ = x.shape
        q, k, v = self.project_qkv(x)  # [bs, T, H, d], [bs, T, Hkv, d] x 2
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store_kv(k_pool, v_pool, slots.reshape(-1), k.reshape(bs * t, self.num_kv_heads, self.head_dim),
                 v.reshape(bs * t, self.num_kv_heads, self.head_dim))  # fmt: skip
        out = attend_paged(q, k_pool, v_pool, ctx_index, mask, scale=self.head_dim**-0.5, sinks=self.sinks,
                           kernel=paged and self.paged_kernel, chunk=not paged)  # fmt: skip
        return self.o_proj(out.reshape(bs, t, self.num_heads * self.head_dim))


class Router(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.weight = nn.Parameter(torch.zeros(cfg.moe.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.moe.num_experts))


class Experts(nn.Module):
    """gpt-oss experts: gate/up interleaved in one [E, D, 2I] matrix, clamped SwiGLU, biases."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        e, d, i = cfg.moe.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, d, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, d))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d))


class MoE(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.top_k, self.alpha, self.limit = cfg.moe.top_k, cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # [N, D]
        logits = F.linear(h, self.router.weight, self.router.bias)  # [N, E]
        top_val, top_idx = torch.topk(logits, self.top_k, dim=-1)  # [N, k]
        weights = torch.softmax(top_val, dim=-1)  # softmax over the chosen experts only
        out = torch.zeros_like(h)
        ex = self.experts
        for e in torch.unique(top_idx).tolist():
            rows, slot = torch.where(top_idx == e)
            gate_up = h[rows] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]  # [n, 2I]
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
            y = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ ex.down_proj[e] + ex.down_proj_bias[
                e
            ]
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: nn.Module = (
            MoE(cfg)
            if cfg.moe is not None
            else SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        )
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=cfg.norm_weight_in_fp32
        )
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=cfg.norm_weight_in_fp32
        )

    @repeated_region
    def forward(self, x, cos, sin, k_pool, v_pool, slots, ctx_index, mask, paged=False):
        """Shapes as in Attention.forward."""
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, k_pool, v_pool, slots, ctx_index, mask, paged)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=cfg.norm_weight_in_fp32)


class NativeTarget(nn.Module):
    """Causal LM over the paged cache. Parameter names equal transformers' (`model.layers.0...`)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryEmbedding = RotaryEmbedding(
            cfg.rope, cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings
        )

    def reset_rotary(self) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(
            cfg.rope, cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings
        ).to(self.model.embed_tokens.weight.device)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one GEMM each (inference only; call once the weights are loaded and in
        their final device and dtype)."""
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            layer.self_attn.fuse()
            if isinstance(layer.mlp, SwiGLU):
                layer.mlp.fuse()

    def make_cache(self, *, num_pages: int, page_size: int) -> PagedKVCache:
        w = self.model.embed_tokens.weight
        return PagedKVCache.for_model(self.config, num_pages=num_pages, page_size=page_size, like=w)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        cache: PagedKVCache,
        slots: torch.Tensor,
        ctx_index: torch.Tensor,
        *,
        tap_layers: Sequence[int] | None = None,
        logits_index: torch.Tensor | None = None,
        block_mask: torch.Tensor | None = None,
        paged: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new tokens and return (logits, taps).

        input_ids/positions/slots: [bs, T] (padded rows point at the padding page);
        seq_lens: [bs] = tokens in the cache after this call (keys at positions >= it are masked);
        ctx_index: [bs, Lc] cache slots of positions 0..Lc-1 (Lc >= max seq_len);
        logits_index: [bs] row to keep per sequence (prefill), else logits for every row [bs, T, V];
        taps: [bs, T, K * D] concatenated outputs of `tap_layers` (hidden_states[l + 1] in HF terms).
        block_mask: [bs, T, T] bool, optional (DDTree verification): the new tokens' visibility among
        themselves ([i, j] = row i sees row j; a tree: ancestors and itself). Then row i's K/V must sit
        at cache column seq_lens - T + i (positions may repeat: they are the nodes' depths past the
        anchor), and every column before seq_lens - T stays visible as past context. None = causal.
        paged: a decode round (few rows per sequence): attention reads the pool in place where the
        model's attention was enabled for it (layers/cpu_attention.py); prompt chunks gather the context.
        """
        bs, _ = input_ids.shape
        lc = ctx_index.shape[1]
        k_pos = torch.arange(lc, device=input_ids.device).expand(bs, lc)
        k_valid = k_pos < seq_lens[:, None]
        masks: dict[int | None, torch.Tensor] = {}
        x = self.model.embed_tokens(input_ids)  # [bs, T, D]
        cos, sin = self.rotary(positions, x.dtype)
        wanted = set(tap_layers or ())
        taps: dict[int, torch.Tensor] = {}
        for i, module in enumerate(self.model.layers):
            layer = cast(DecoderLayer, module)
            window = self.config.layer_window(i)
            if window not in masks and block_mask is None:
                masks[window] = visibility_mask(positions, k_pos, k_valid, causal=True, window=window)
            elif window not in masks:
                assert block_mask is not None
                start = seq_lens - input_ids.shape[1]  # column of row 0's K/V
                masks[window] = block_visibility_mask(positions, k_valid, start, block_mask, window=window)
            x = layer(x, cos, sin, cache.k[i], cache.v[i], slots, ctx_index, masks[window], paged)
            if i in wanted:
                taps[i] = x
        h = self.model.norm(x)
        last = self.config.num_hidden_layers - 1
        if last in taps:
            # transformers' hidden_states[-1] is taken after the final norm; the reference drafters
            # were trained on that, so a tap of the last layer is the normed state.
            taps[last] = h
        tap = torch.cat([taps[layer] for layer in tap_layers], dim=-1) if tap_layers else None
        if logits_index is not None:
            h = h[torch.arange(bs, device=h.device), logits_index]  # [bs, D]
        return self.lm_head(h), tap
