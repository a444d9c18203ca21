# SPDX-License-Identifier: Apache-2.0
"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on target features by
KV injection, drafting a whole block in one non-causal forward pass (arXiv 2602.06036).

Per round, for a sequence whose anchor sits at absolute position `start`:
  context   c_t = RMSNorm_hidden(W_fc f_t) for the newly committed positions t < start, where f_t
            concatenates the target's layer outputs at `target_layer_ids` (shared by all layers).
  block     [x_anchor, MASK, ..., MASK] at positions start .. start + B - 1, embedded with the
            *target's* embedding (times input_embedding_scale).
  layer i   h = RMSNorm_in(x); Q from h (q_norm before RoPE); K, V from [c ; h] through the same
            k_proj/k_norm/v_proj (c is never input-normalised); RoPE at absolute positions; the B
            queries attend to every cached context key and all B block keys (no mask on full
            layers); x += o_proj(attn); x += MLP(RMSNorm_post(x)).
  output    RMSNorm_norm(x); slot j (1..B-1) predicts the token at start + j through the target's
            LM head (times output_multiplier, then optional softcap).
Only context K/V is cached; block K/V is recomputed every round and never stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.nn import functional as F

from dflash_trt.layers.attention import attend_paged
from dflash_trt.layers.kv_cache import PagedKVCache
from dflash_trt.layers.linear import FusedLinear, Linear, in_features, linear
from dflash_trt.layers.masks import visibility_mask
from dflash_trt.layers.mlp import SwiGLU
from dflash_trt.layers.norm import RMSNorm
from dflash_trt.layers.regions import repeated_region
from dflash_trt.layers.rope import RotaryEmbedding, apply_rope
from dflash_trt.models.dflash_config import DFlashConfig

if TYPE_CHECKING:
    from dflash_trt.models.dflash2 import CandidateSelector, GroupedDynamicCausalConv


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        d, h, hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = Linear(d, h * self.head_dim, bias=bias)
        self.k_proj = Linear(d, hkv * self.head_dim, bias=bias)
        self.v_proj = Linear(d, hkv * self.head_dim, bias=bias)
        self.o_proj = Linear(h * self.head_dim, d, bias=bias)  # o bias too (gpt-oss drafters)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # After fuse(): [q; k; v] for the block and [k; v] (a view of its rows) for the context.
        self.qkv: FusedLinear | None = None
        self.kv: FusedLinear | None = None
        self.paged_kernel = False  # dflash_cpu::paged_attention (cpu_attention.enable)

    def fuse(self) -> None:
        """Run the block's q/k/v and the context's k/v as one GEMM each (inference only)."""
        self.qkv = FusedLinear.of([self.q_proj, self.k_proj, self.v_proj])
        self.kv = self.qkv.tail(1)

    def _kv_heads(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return apply_rope(k, cos, sin), v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., D] -> k, v: [..., Hkv, d] (k normalised and rotated, v raw)."""
        if self.kv is None:
            return self._kv_heads(self.k_proj(x), self.v_proj(x), cos, sin)
        k, v = self.kv(x)
        return self._kv_heads(k, v, cos, sin)

    def project_block(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's q [..., H, d] (normalised and rotated), k and v [..., Hkv, d] as the drafter
        computes them (one fused GEMM after fuse()); the drafting plugin calls this too."""
        if self.qkv is None:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        else:
            q, k, v = self.qkv(h)
        q = apply_rope(self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)
        k, v = self._kv_heads(k, v, cos, sin)
        return q, k, v

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        ctx_index: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """h: [bs, B, D] (input-normalised block); cos/sin: [bs, B, d]; k_pool/v_pool: this layer's
        draft-cache pool [slots, Hkv, d]; ctx_index: [bs, Lc] the context's slots; mask: [bs, 1, B or 1,
        Lc + B] bool (context columns, then the block's)."""
        bs, blk, _ = h.shape
        q, k_blk, v_blk = self.project_block(h, cos, sin)  # [bs, B, H, d], [bs, B, Hkv, d] x 2
        out = attend_paged(q, k_pool, v_pool, ctx_index, mask, scale=self.head_dim**-0.5, k_new=k_blk,
                           v_new=v_blk, kernel=self.paged_kernel)  # fmt: skip
        return self.o_proj(out.reshape(bs, blk, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.causal = cfg.layer_is_causal(layer_idx)
        self.window = cfg.layer_window(layer_idx)

    @property
    def convs(self) -> tuple[GroupedDynamicCausalConv, GroupedDynamicCausalConv] | None:
        """A DFlash 2 layer's (attention_conv, mlp_conv); None for a v1 layer."""
        return None

    @repeated_region
    def forward(self, x, cos, sin, k_pool, v_pool, ctx_index, mask):  # shapes as in DraftAttention.forward
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_pool, v_pool, ctx_index, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Weight names match z-lab checkpoints exactly (no prefix). The embedding and LM head are
    the target's and are bound with `bind_target`; they are not part of the state dict."""

    layer_class: type[DraftLayer] = DraftLayer  # DFlash 2 drafters (models/dflash2.py) wrap it

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = Linear(config.num_target_features * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary: RotaryEmbedding = RotaryEmbedding(
            config.rope, config.head_dim, max_position_embeddings=config.max_position_embeddings
        )
        self._embed_weight: torch.Tensor | None = None  # [V, D] from the target
        self._head_weight: torch.Tensor | None = None  # [V, D] from the target
        self._head_bias: torch.Tensor | None = None

    # --- binding and housekeeping -------------------------------------------------------------
    def reset_rotary(self) -> None:
        """Recompute non-persistent rotary buffers (after meta-device construction)."""
        device = self.fc.weight.device
        fresh = RotaryEmbedding(
            self.config.rope,
            self.config.head_dim,
            max_position_embeddings=self.config.max_position_embeddings,
        )
        self.rotary = fresh.to(device)

    def bind_target(
        self, embed_weight: torch.Tensor, head_weight: torch.Tensor, head_bias: torch.Tensor | None = None
    ) -> None:
        """Share the target's token embedding [V, D] and LM head [V, D] (frozen in training); the head
        may be packed (layers/linear.py: a placeholder [V, 0], or fp32 blocks [V/16, D, 16])."""
        if embed_weight.shape[-1] != self.config.hidden_size or in_features(head_weight) not in (
            None,
            self.config.hidden_size,
        ):
            raise ValueError("target embedding/head width differs from the drafter hidden_size")
        self._embed_weight = embed_weight
        self._head_weight = head_weight
        self._head_bias = head_bias

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def selector(self) -> CandidateSelector | None:
        """DFlash 2's candidate selector, which proposes the drafts instead of the per-slot argmax; None
        for a v1 drafter. Whoever drafts asks this (never the class): `config.is_dflash2` says the same."""
        return None

    def fuse_projections(self) -> None:
        """q/k/v (block), k/v (context) and gate/up as one GEMM each (inference only; call once the
        weights are loaded and in their final device and dtype)."""
        for module in self.layers:
            layer = cast(DraftLayer, module)
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def make_cache(self, *, num_pages: int, page_size: int) -> PagedKVCache:
        return PagedKVCache.for_model(
            self.config, num_pages=num_pages, page_size=page_size, like=self.fc.weight
        )

    # --- the math -------------------------------------------------------------------------
    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids: [bs, B] -> [bs, B, D]: raw target embedding rows times input_embedding_scale."""
        assert self._embed_weight is not None, "call bind_target() first"
        x = F.embedding(block_ids, self._embed_weight)
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        return x.to(self.fc.weight.dtype)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """features: [N, K * D] target layer outputs -> c: [N, D]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def inject_context(
        self, cache: PagedKVCache, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """KV injection for newly committed tokens of every sequence in the batch.

        features: [N, K * D]; positions: [N] absolute; slots: [N] cache slots for those positions.
        Writes every draft layer's context K/V (k_norm + RoPE applied) into `cache`.
        """
        if features.shape[0] == 0:
            return
        c = self.fuse_context(features)  # [N, D]
        cos, sin = self.rotary(positions, c.dtype)  # [N, d]
        for i, module in enumerate(self.layers):
            k, v = cast(DraftLayer, module).self_attn.project_kv(c, cos, sin)  # [N, Hkv, d]
            cache.write(i, slots, k, v)

    def forward_block(
        self,
        cache: PagedKVCache,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_index: torch.Tensor,
        ctx_lens: torch.Tensor,
        block_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One non-causal block pass.

        block_embeds: [bs, B, D]; block_positions: [bs, B] (start_i + j); ctx_index: [bs, Lc] cache
        slots of positions 0..Lc-1 (see kv_cache.context_index); ctx_lens: [bs] = start_i, the number
        of valid context keys; block_lens: [bs] optional per-sequence block length B_i <= B (slots
        >= B_i are hidden from every query, which reproduces a block of size B_i exactly; their own
        outputs are garbage and must be ignored). Returns the final-normed hidden states [bs, B, D].
        """
        bs, blk, _ = block_embeds.shape
        lc = ctx_index.shape[1]
        device = block_embeds.device
        ctx_pos = torch.arange(lc, device=device).expand(bs, lc)  # [bs, Lc]
        k_pos = torch.cat([ctx_pos, block_positions], dim=1)  # [bs, Lc + B]
        if block_lens is None:
            blk_valid = torch.ones(bs, blk, dtype=torch.bool, device=device)
        else:
            blk_valid = torch.arange(blk, device=device)[None, :] < block_lens[:, None]
        k_valid = torch.cat([ctx_pos < ctx_lens[:, None], blk_valid], dim=1)
        masks: dict[tuple[bool, int | None], torch.Tensor] = {}
        cos, sin = self.rotary(block_positions, block_embeds.dtype)  # [bs, B, d]
        x = block_embeds
        for i, module in enumerate(self.layers):
            layer = cast(DraftLayer, module)
            key = (layer.causal, layer.window)
            if key not in masks:
                if not layer.causal and layer.window is None:
                    masks[key] = k_valid[:, None, None, :]  # [bs, 1, 1, Lc + B]: everything valid
                else:
                    masks[key] = visibility_mask(
                        block_positions, k_pos, k_valid, causal=layer.causal, window=layer.window
                    )
            x = layer(x, cos, sin, cache.k[i], cache.v[i], ctx_index, masks[key])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [..., D] -> logits [..., V] through the target's LM head; with `rows` ([V'] token ids,
        training's loss vocabulary) only those columns, [..., V']."""
        assert self._head_weight is not None, "call bind_target() first"
        head, bias = self._head_weight, self._head_bias
        if rows is not None:
            head, bias = head[rows], (bias[rows] if bias is not None else None)
        # As one 2-D matmul: a strided 3-D input (e.g. hidden[:, 1:]) makes F.linear on CPU fall back to
        # a bmm that first copies the whole [V, D] head per batch (seconds per round in bf16 at 150k vocab).
        flat = hidden.reshape(-1, hidden.shape[-1]).to(head.dtype)
        logits = linear(flat, head, bias)
        logits = logits.view(*hidden.shape[:-1], -1)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @classmethod
    def random(cls, config: DFlashConfig, *, seed: int = 0, std: float = 0.02) -> DFlashDrafter:
        """A randomly initialised drafter (tests, the untrained `tiny` default)."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.normal_(0.0, std, generator=gen)
                else:
                    p.normal_(0.0, std, generator=gen)
        return model
