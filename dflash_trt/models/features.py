# SPDX-License-Identifier: Apache-2.0
"""Which target layers feed the drafter, and how their outputs are tapped.

Target layer l's *output* (the residual stream before the final norm) is what DFlash conditions on.
In Hugging Face `output_hidden_states`, index 0 is the embedding output, so layer l is
`hidden_states[l + 1]`. Engines that hook a layer's input must tap layer l + 1 instead.
One exception: transformers' last entry is taken *after* the final norm, so a tap of the last
layer sees the normed state. The native models reproduce that (published drafters never tap it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HF_HIDDEN_STATE_OFFSET = 1


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default tapped layers when a checkpoint lists none.

    One draft layer taps the middle layer. Otherwise L ids are spread evenly over [1, T - 3]:
    id_i = round(1 + i * (T - 4) / (L - 1)). Python's round() is round-half-to-even, and ties
    do occur (T=30, L=5 gives 7.5 -> 8 and 20.5 -> 20); the published checkpoints rely on it.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"need positive layer counts, got T={num_target_layers}, L={num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    span = last - first
    return [round(first + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def extract_context_feature(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate target layer outputs in config order.

    hidden_states: HF tuple, each [batch, seq, D], index 0 = embeddings.
    returns: [batch, seq, K * D]
    """
    import torch

    return torch.cat([hidden_states[i + HF_HIDDEN_STATE_OFFSET] for i in layer_ids], dim=-1)
