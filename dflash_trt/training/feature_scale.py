# SPDX-License-Identifier: Apache-2.0
"""`--feature-scaling`: train `fc` on the target's features divided by a fixed per-channel scale.

A real target's tapped layers differ in magnitude by an order of magnitude (SmolLM2-135M: median channel
RMS 1.3 at layer 1, 15 at layer 27) and a few channels by another (381 against 15 at layer 27). AdamW moves
every weight of `fc` by about the same step, so a weight on a large channel moves the context vector tens
of times further than one on a small channel. Scaling the input makes those steps comparable. Measured on
SmolLM2-135M (bench/README.md, 2026-12-06): the first 70 steps followed the unscaled run's curve step for
step; its effect over a whole run was not isolated.

It is a change of variables, not of architecture. Training keeps W' and feeds fc x / s, with
s = each channel's RMS over the real tokens of the first batch; the exported fc holds W = W' / s
(column-wise), so fc(x) = W x is exactly what was trained and the checkpoint keeps the z-lab layout
every consumer (our engine, vLLM's `method: dflash`) loads. Position 0 is left out of the statistic: on
Llama-family targets the first token carries massive activations (25k in SmolLM2's layers 14-27 against
a median of 10), which would otherwise set the scale of their channels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dflash_trt.models.drafter import DFlashDrafter

RELATIVE_FLOOR = 1e-2  # a channel's scale is at least this times the median channel's


def channel_scales(features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """features: [bs, S, C]; lengths: [bs] -> s: [C] float32, each channel's RMS over positions 1..len-1."""
    pos = torch.arange(features.shape[1], device=features.device)
    real = (pos[None, :] >= 1) & (pos[None, :] < lengths.to(features.device)[:, None])  # [bs, S]
    if not bool(real.any()):
        raise ValueError("channel_scales needs a sequence of at least two tokens")
    x = features[real].float()  # [M, C]
    rms = x.pow(2).mean(dim=0).sqrt()
    return rms.clamp_min(float(rms.median()) * RELATIVE_FLOOR).clamp_min(1e-6)


def scale_features(features: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The input fc trains on: x / s (unchanged without a scale)."""
    return features if scale is None else features.float() / scale


@contextmanager
def folded(drafter: DFlashDrafter, scale: torch.Tensor | None) -> Iterator[DFlashDrafter]:
    """Within the block, the drafter's fc holds W' / s (what a checkpoint stores); W' is put back after."""
    if scale is None:
        yield drafter
        return
    weight = drafter.fc.weight
    trained = weight.data
    weight.data = trained / scale.to(trained)[None, :]
    try:
        yield drafter
    finally:
        weight.data = trained
