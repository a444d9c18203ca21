# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt build` with DFlash 2 drafters: the torch backend plans and writes a bundle for a target
it runs; a target it has no native model for is refused by architecture; `--backend trtllm` refuses
every DFlash 2 drafter by name; the registered Qwen3.8-27B pair plans offline from shipped configs."""

from __future__ import annotations

import json

from dflash_trt.builder.registry import ENTRIES, lookup
from tests.conftest import make_drafter, make_target


def _dflash2_pair(tmp_path):
    from dflash_trt.models.checkpoint import save_drafter

    target = make_target("qwen3")
    tdir, ddir = tmp_path / "t", tmp_path / "d"
    target.save_pretrained(tdir)
    save_drafter(make_drafter(target, dflash2=True), ddir)
    return tdir, ddir


def test_torch_backend_builds_a_dflash2_bundle(tmp_path, cli):
    tdir, ddir = _dflash2_pair(tmp_path)
    out = tmp_path / "b"
    code, _, err = cli(["build", "--target", str(tdir), "--drafter", str(ddir), "--backend", "torch",
                        "--output", str(out)])  # fmt: skip
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "torch" and manifest["drafter"]["architecture"] == "DFlash2DraftModel"
    assert manifest["drafter"]["dflash2"] == {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6,
                                              "selector_top_k": 4}  # fmt: skip
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.dflash2 import DFlash2Drafter

    copied = next(p.parent for p in out.rglob("config.json") if "DFlash2DraftModel" in p.read_text())
    assert isinstance(load_drafter(copied), DFlash2Drafter)


def test_trtllm_backend_refuses_a_dflash2_drafter(tmp_path, cli):
    tdir, ddir = _dflash2_pair(tmp_path)
    code, _, err = cli(["build", "--target", str(tdir), "--drafter", str(ddir), "--gpu", "h100",
                        "--output", str(tmp_path / "b")])  # fmt: skip
    assert code == 2, err
    assert "is a DFlash2DraftModel: TensorRT-LLM cannot run DFlash 2 drafters" in err
    assert "only an RFC" in err and "--backend torch" in err
    assert not (tmp_path / "b").exists()


def test_tree_budget_with_a_dflash2_drafter_is_refused(tmp_path, cli):
    tdir, ddir = _dflash2_pair(tmp_path)
    code, _, err = cli(["build", "--target", str(tdir), "--drafter", str(ddir), "--backend", "torch",
                        "--tree-budget", "16", "--output", str(tmp_path / "b")])  # fmt: skip
    assert code == 2 and "--tree-budget=16: DDTree verification does not run DFlash 2 drafters" in err, err
    assert "set --tree-budget 0" in err and not (tmp_path / "b").exists()


def test_registered_qwen38_pair_plans_offline_into_named_refusals(cli):
    """Planned from the configs shipped with dflash-trt (no Hub): TensorRT-LLM is refused for the
    drafter, the embedded engine for the target's architecture, each in one line with exit 2."""
    entry = lookup("qwen3.8-27b")
    assert entry is not None and entry.architecture == "DFlash2DraftModel"
    code, _, err = cli(["build", "--target", "qwen3.8-27b", "--gpu", "h100", "--offline", "--dry-run"])
    assert code == 2 and "TensorRT-LLM cannot run DFlash 2 drafters" in err, err
    code, _, err = cli(["build", "--target", "qwen3.8-27b", "--backend", "torch", "--offline", "--dry-run"])
    assert code == 2, err
    assert "target.model_type='qwen3_5_text': (Qwen3_5ForConditionalGeneration) is not supported" in err
    assert "no backend of dflash-trt runs a DFlash 2 drafter on this target yet" in err


def test_models_lists_the_dflash2_pairs(cli):
    code, out, _ = cli(["models", "--json"])
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    for name in ("qwen3.8-27b", "glm-5.3-flash", "beam-1.0"):
        assert rows[name]["architecture"] == "DFlash2DraftModel" and rows[name]["block_size"] == 8
    assert rows["qwen3.8-27b"]["shipped_configs"] and rows["qwen3.8-27b"]["hidden_size"] == 5120
    assert rows["qwen3-8b"]["architecture"] == "DFlashDraftModel"
    assert sum(e.architecture == "DFlash2DraftModel" for e in ENTRIES) == 3
