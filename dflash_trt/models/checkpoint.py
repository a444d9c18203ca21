# SPDX-License-Identifier: Apache-2.0
"""z-lab DFlash checkpoints on disk: JSON and safetensors reading, drafter load and save.

A checkpoint directory holds `config.json` and `model.safetensors` (or a sharded index) with
weight names *without* a prefix (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...). The
token embedding and LM head are not stored: they come from the target.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_trt.errors import CheckpointError
from dflash_trt.models.dflash_config import DFlashConfig, parse_dflash_config
from dflash_trt.utils.io import read_json_object

if TYPE_CHECKING:
    import torch

    from dflash_trt.models.drafter import DFlashDrafter

log = logging.getLogger(__name__)


def read_json(path: Path, *, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{what}: {path} not found", hint=f"check the {what} directory")
    return read_json_object(
        path, lambda problem: CheckpointError(f"{what}: {path} {problem}", hint="re-download the checkpoint")
    )


def load_drafter_config(path: str | Path, *, mask_token_id: int | None = None) -> DFlashConfig:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"drafter directory {directory} does not exist", hint="pass --drafter DIR")
    return parse_dflash_config(
        hf_config=read_json(directory / "config.json", what="drafter config"), mask_token_id=mask_token_id
    )


def read_safetensors(directory: Path, *, what: str) -> dict[str, torch.Tensor]:
    """Load `model.safetensors` or a sharded `model.safetensors.index.json`, with clear errors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index, what=f"{what} index").get("weight_map", {})
        files = sorted({directory / f for f in weight_map.values()})
    else:
        raise CheckpointError(
            f"{what}: no model.safetensors in {directory}", hint="re-download the checkpoint"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{what}: shard {f} is missing", hint="re-download the checkpoint")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"{what}: {f} is corrupt or unreadable ({exc})", hint="re-download the checkpoint"
            ) from exc
    return tensors


def check_state_shapes(
    expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], *, what: str, hint: str
) -> None:
    """Every expected tensor has the shape its config implies (names were checked before)."""
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{what} tensor {name} has shape {tuple(state[name].shape)}, config implies {tuple(tensor.shape)}",
                hint=hint,
            )


def load_drafter(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    mask_token_id: int | None = None,
) -> DFlashDrafter:
    """Load a z-lab DFlash drafter directory. Unknown or missing tensors are refused."""
    import torch

    from dflash_trt.models.drafter import DFlashDrafter

    directory = Path(path)
    cfg = load_drafter_config(directory, mask_token_id=mask_token_id)
    state = read_safetensors(directory, what="drafter weights")
    from dflash_trt.models.dequant import dequantize_state

    state, quant = dequantize_state(state)  # FP8 weight-only drafters (dflash-trt build --quantize-drafter)
    if quant:
        log.info("drafter %s: %s weights dequantized on load", directory, quant)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if unexpected and all(k.startswith("model.") for k in unexpected):
        hint = "weights carry a 'model.' prefix (vLLM layout); z-lab checkpoints have none"
        raise CheckpointError(f"drafter weights: unexpected names such as {unexpected[0]!r}", hint=hint)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s), e.g. {unexpected[:3]}")
        raise CheckpointError(
            f"drafter weights in {directory} do not match its config.json: " + "; ".join(parts),
            hint="check num_hidden_layers/attention_bias in config.json or re-download",
        )
    check_state_shapes(
        expected, state, what="drafter", hint="config.json and model.safetensors are from different drafters"
    )
    target_dtype = dtype or state["fc.weight"].dtype
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(target_dtype) for k, v in state.items()}, strict=True)
    model.reset_rotary()
    model.to(device=device, dtype=target_dtype)
    model.eval()
    log.info("drafter %s: %s", directory, json.dumps(cfg.to_log_dict(), default=str))
    return model


def save_drafter(model: DFlashDrafter, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors in the z-lab layout, atomically."""
    from safetensors.torch import save_file

    from dflash_trt.utils.io import atomic_dir

    state = {
        k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in model.state_dict().items()
    }
    cfg = model.config.to_hf_config()
    if dtype is not None:
        cfg["dtype"] = str(dtype).removeprefix("torch.")
    else:
        cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    with atomic_dir(Path(path), overwrite=True) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(path)
