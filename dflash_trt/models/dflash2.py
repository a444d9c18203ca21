# SPDX-License-Identifier: Apache-2.0
"""The DFlash 2 drafter: v1's drafter plus two grouped dynamic causal convolutions per layer and a
candidate selector (dflash2.md §§1-3).

Layer i (pre-norm, as v1):
  h = input_layernorm(x);      h, c = attention_conv.prepare(h)   # conv with base[0] + dynamic half 0
  h = self_attn(h, context);   h = attention_conv.finish(h, c)    # conv with base[1] + dynamic half 1
  x = x + h; the MLP sublayer the same way with mlp_conv.
The conv runs along the block only, tap t of output slot i reading slot i - t (zero before the
anchor at slot 0), so a request's block never reads another's and nothing crosses rounds. Both halves'
coefficients come from one projection of the conv's input: c = kernel_projection(h) [.., B, 2, K, G],
one coefficient per group of `conv_group_size` channels:
  out[i, ch] = sum_t (base[half, t, ch] + c[i, half, t, ch // group_size]) * x[i - t, ch].

The selector's weights live here; its walk and the acceptance over its candidates are pure tensor
functions in `spec/selector.py` and `spec/accept.py`. Codebooks are stored without a `.weight`
suffix, as in the published checkpoints (`checkpoint.py` also accepts the suffixed spelling).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dflash_trt.layers.regions import repeated_region
from dflash_trt.models.dflash2_config import DFlash2Params
from dflash_trt.models.dflash_config import DFlashConfig
from dflash_trt.models.drafter import DFlashDrafter, DraftLayer


def grouped_dynamic_conv(
    x: torch.Tensor, coeff: torch.Tensor, base: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """The block-local causal conv (PyTorch reference of dflash::dynamic_conv).

    x: [..., B, D]; coeff: [..., B, K, G] dynamic coefficients of each output slot; base: [K, D].
    Returns [..., B, D]: out[i, ch] = sum_t (base[t, ch] + coeff[i, t, ch // group_size]) * x[i - t, ch],
    with x[i - t] = 0 for i - t < 0 (the anchor sees padding).
    """
    blk, d = x.shape[-2], x.shape[-1]
    groups = d // group_size
    xg = x.unflatten(-1, (groups, group_size))  # [..., B, G, gs]
    kernel = base.to(x.dtype).view(-1, groups, group_size)  # [K, G, gs]
    out = kernel[0] * xg  # tap 0 reads the slot itself
    out = torch.addcmul(out, coeff[..., 0, :, None], xg)
    for t in range(1, min(base.shape[0], blk)):  # taps past the block read only padding
        shifted = F.pad(xg[..., : blk - t, :, :], (0, 0, 0, 0, t, 0))  # slot i reads i - t, zeros before 0
        out = torch.addcmul(out, kernel[t], shifted)
        out = torch.addcmul(out, coeff[..., t, :, None], shifted)
    return out.flatten(-2)


class GroupedDynamicCausalConv(nn.Module):
    """Two convolutions sharing one coefficient projection: `prepare` before a sublayer, `finish`
    after it."""

    def __init__(self, hidden_size: int, params: DFlash2Params) -> None:
        super().__init__()
        self.kernel_size = params.conv_kernel_size
        self.group_size = params.conv_group_size
        self.num_groups = params.num_groups(hidden_size)
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, hidden_size))  # [2, K, D]
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.kernel_size * self.num_groups, bias=False)

    def coefficients(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., B, D] -> [..., B, 2, K, G] (half 0 for prepare, half 1 for finish)."""
        return self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, self.num_groups))

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [..., B, D] -> (conv of h with half 0 [..., B, D], coefficients [..., B, 2, K, G])."""
        coeff = self.coefficients(h)
        return grouped_dynamic_conv(
            h, coeff[..., 0, :, :], self.base_kernel[0], group_size=self.group_size
        ), coeff

    def finish(self, h: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
        """h: [..., B, D] (the sublayer's output); coeff from `prepare` -> [..., B, D] (half 1)."""
        return grouped_dynamic_conv(h, coeff[..., 1, :, :], self.base_kernel[1], group_size=self.group_size)

    @torch.no_grad()
    def reset_identity(self) -> None:
        """Tap 0 passes x through, every other tap and the dynamic part are zero: conv(x) = x."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0].fill_(1.0)
        self.kernel_projection.weight.zero_()


class CandidateSelector(nn.Module):
    """The selector's weights: codebooks [V, R] (published names, no `.weight`) and the hidden
    projection [R, D]. Its walk is `spec.selector.propose`."""

    def __init__(self, hidden_size: int, vocab_size: int, params: DFlash2Params) -> None:
        super().__init__()
        self.top_k = params.selector_top_k
        rank = params.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # [V, R]
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # [V, R]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # [R, D]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., D] final-normed drafter states -> [..., R]."""
        return self.hidden_projection(hidden)


class DFlash2DraftLayer(DraftLayer):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        assert cfg.dflash2 is not None
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.dflash2)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.dflash2)

    @property
    def convs(self) -> tuple[GroupedDynamicCausalConv, GroupedDynamicCausalConv]:
        return self.attention_conv, self.mlp_conv

    @repeated_region  # as v1's layer: one compiled subgraph serves every layer of the drafter
    def forward(self, x, cos, sin, k_pool, v_pool, ctx_index, mask):  # shapes as in DraftAttention.forward
        h, coeff = self.attention_conv.prepare(self.input_layernorm(x))
        attn = self.self_attn(h, cos, sin, k_pool, v_pool, ctx_index, mask)
        x = x + self.attention_conv.finish(attn, coeff)
        h, coeff = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), coeff)


class DFlash2Drafter(DFlashDrafter):
    """A `DFlash2DraftModel`: every layer convolved, plus `candidate_selector`. The block pass
    (`forward_block`) and the context injection are v1's; the convs run inside the layers."""

    layer_class = DFlash2DraftLayer

    def __init__(self, config: DFlashConfig) -> None:
        if config.dflash2 is None or config.vocab_size is None:
            raise ValueError("DFlash2Drafter needs a DFlash2DraftModel config (dflash2 and vocab_size set)")
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.dflash2)

    @property
    def selector(self) -> CandidateSelector:
        return self.candidate_selector

    def convs(self) -> list[GroupedDynamicCausalConv]:
        """Every layer's attention and MLP conv, in layer order."""
        out: list[GroupedDynamicCausalConv] = []
        for layer in self.layers:
            assert isinstance(layer, DFlash2DraftLayer)
            out += layer.convs
        return out

    def reset_convs(self) -> None:
        """Identity convolutions (training starts from a v1 drafter's function)."""
        for conv in self.convs():
            conv.reset_identity()

    @classmethod
    def random(cls, config: DFlashConfig, *, seed: int = 0, std: float = 0.02) -> DFlashDrafter:
        """Random weights as v1's, with each conv's tap 0 shifted by 1: identity plus noise, so random
        drafters keep activations of the right size."""
        model = super().random(config, seed=seed, std=std)
        assert isinstance(model, DFlash2Drafter)
        with torch.no_grad():
            for conv in model.convs():
                conv.base_kernel[:, 0] += 1.0
        return model


def drafter_class(config: DFlashConfig) -> type[DFlashDrafter]:
    """The module class of a checkpoint: DFlash2Drafter for DFlash2DraftModel, else DFlashDrafter."""
    return DFlash2Drafter if config.is_dflash2 else DFlashDrafter
