# SPDX-License-Identifier: Apache-2.0
"""Load a transformers checkpoint directory into a NativeTarget by exact parameter name.

Handles tied embeddings, sharded safetensors and gpt-oss MXFP4 expert weights (`*_blocks` +
`*_scales`, dequantized on load by `models/dequant.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_trt.errors import CheckpointError
from dflash_trt.models.checkpoint import check_state_shapes, read_json, read_safetensors
from dflash_trt.models.decoder import NativeTarget
from dflash_trt.models.dequant import dequantize_mxfp4, dequantize_state
from dflash_trt.models.target_config import TargetConfig, parse_target_config

log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_native_target(path: str | Path, *, device: torch.device | str, dtype: torch.dtype) -> NativeTarget:
    directory = Path(path)
    cfg: TargetConfig = parse_target_config(read_json(directory / "config.json", what="target config"))
    state = read_safetensors(directory, what="target weights")
    for name in [n for n in state if n.endswith("_blocks")]:
        base = name[: -len("_blocks")]
        scales = state.pop(base + "_scales", None)
        if scales is None:
            raise CheckpointError(f"target weights: {name} has no matching {base}_scales", hint="re-download")
        state[base] = dequantize_mxfp4(state.pop(name), scales, dtype)
    for name in [n for n in state if n.endswith(_IGNORED_SUFFIXES)]:
        state.pop(name)
    state, quant = dequantize_state(state)
    if quant:
        log.info("target %s: %s weights dequantized on load", directory, quant)
    with torch.device("meta"):
        model = NativeTarget(cfg)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"target weights in {directory} do not match a {cfg.model_type} model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}",
            hint="the embedded engine supports unquantized or MXFP4 checkpoints of its listed families",
        )
    check_state_shapes(expected, state, what="target", hint="config.json and the weights disagree")
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rotary()
    return model.to(dtype=dtype).eval()
