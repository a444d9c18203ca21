# SPDX-License-Identifier: Apache-2.0
"""Checkpoint I/O: z-lab layout round trip, and clear errors for missing or corrupt files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.errors import CheckpointError
from dflash_trt.models.checkpoint import load_drafter, save_drafter
from tests.conftest import make_drafter, make_target


@pytest.mark.parametrize("variant", ["plain", "gpt_oss", "swa", "scaled"])
def test_round_trip_z_lab_layout(tmp_path, variant):
    target = make_target()
    drafter = make_drafter(target, variant=variant)
    save_drafter(drafter, tmp_path / "d")
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    layers = drafter.config.num_hidden_layers
    per_layer = 11 + (4 if drafter.config.attention_bias else 0)
    assert len(names) == per_layer * layers + 3  # 11 L + 3 (58 for the 5-layer Qwen3-8B drafter)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any(n.startswith("model.") for n in names)
    if drafter.config.attention_bias:
        assert "layers.0.self_attn.o_proj.bias" in names
    again = load_drafter(tmp_path / "d")
    assert again.config == drafter.config
    for k, v in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)


def test_bf16_save_and_dtype_override(tmp_path):
    drafter = make_drafter(make_target())
    save_drafter(drafter, tmp_path / "d", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_drafter(tmp_path / "d").fc.weight.dtype == torch.bfloat16
    assert load_drafter(tmp_path / "d", dtype=torch.float32).fc.weight.dtype == torch.float32


@pytest.fixture
def saved(tmp_path):
    save_drafter(make_drafter(make_target()), tmp_path / "d")
    return tmp_path / "d"


def test_missing_directory_and_files(tmp_path, saved):
    with pytest.raises(CheckpointError, match=r"drafter directory .*nope does not exist"):
        load_drafter(tmp_path / "nope")
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model.safetensors in"):
        load_drafter(saved)
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json not found"):
        load_drafter(saved)


def test_corrupt_files(saved):
    (saved / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(
        CheckpointError, match=r"model.safetensors is corrupt or unreadable.*fix: re-download"
    ):
        load_drafter(saved)
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        load_drafter(saved)


def test_truncated_safetensors(saved):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"corrupt or unreadable"):
        load_drafter(saved)


def test_missing_unexpected_and_misshaped_tensors(saved):
    state = load_file(str(saved / "model.safetensors"))
    broken = dict(state)
    broken.pop("layers.1.mlp.up_proj.weight")
    save_file(broken, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\).*layers.1.mlp.up_proj.weight"):
        load_drafter(saved)
    save_file({f"model.{k}": v for k, v in state.items()}, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.' prefix"):
        load_drafter(saved)
    broken = dict(state)
    broken["fc.weight"] = torch.zeros(3, 3)
    save_file(broken, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(3, 3\)"):
        load_drafter(saved)
    cfg = json.loads((saved / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg.pop("layer_types")
    (saved / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing .* tensor"):
        load_drafter(saved)


def test_sharded_checkpoint(tmp_path, saved):
    state = load_file(str(saved / "model.safetensors"))
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"a.safetensors": keys[:half], "b.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(saved / name))
    (saved / "model.safetensors").unlink()
    index = {"weight_map": {k: name for name, ks in shards.items() for k in ks}}
    (saved / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_drafter(saved).config.num_hidden_layers == 2
    (saved / "b.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard .*b.safetensors is missing"):
        load_drafter(saved)
