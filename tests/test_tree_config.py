# SPDX-License-Identifier: Apache-2.0
"""The `tree_budget` extension of the DFlash speculative config, end to end through the user-facing
entry points: the config class, LLM(...) (refused until the engine verifies trees), build (the
torch backend writes it into the bundle's engine config; trtllm refuses it before reading any
config), serve (a real tritonserver whose Triton model builds LLM from the bundle), generate and
bench engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from dflash_trt.cli import main
from dflash_trt.errors import ConfigError
from dflash_trt.spec.decoding_config import MAX_TREE_BUDGET, DFlashDecodingConfig, parse_tree_budget

SPEC = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}
REFUSED = r"tree_budget=16: DDTree verification is not in the embedded engine yet"


@pytest.mark.parametrize(
    ("value", "want", "uses_tree"),
    [
        (None, None, False),
        (0, 0, False),
        (16, 16, True),
        ("64", 64, True),
        ("auto", "auto", True),
        ("AUTO", "auto", True),
        (MAX_TREE_BUDGET, MAX_TREE_BUDGET, True),
    ],
)
def test_config_values(value, want, uses_tree):
    cfg = DFlashDecodingConfig.from_any({**SPEC, "tree_budget": value})
    assert cfg.tree_budget == want and cfg.uses_tree is uses_tree
    assert cfg.to_dict().get("tree_budget") == want
    assert "tree_budget" not in DFlashDecodingConfig.from_any(SPEC).to_dict()  # the default is unchanged


@pytest.mark.parametrize("bad", [-1, MAX_TREE_BUDGET + 1, True, 2.5, "many", "", [16]])
def test_config_errors_name_the_field(bad):
    with pytest.raises(
        ConfigError, match=r"^speculative_config\.tree_budget=.*must be an integer in \[0, 1024\] or 'auto'"
    ):
        DFlashDecodingConfig.from_any({**SPEC, "tree_budget": bad})
    with pytest.raises(ConfigError, match=r"^--tree-budget="):
        parse_tree_budget(bad, field_name="--tree-budget")


def test_llm_refuses_a_tree_before_loading_weights(monkeypatch):
    from dflash_trt.api import llm as llm_mod

    def never(*_a, **_k):
        raise AssertionError("models were resolved before the refusal")

    monkeypatch.setattr(llm_mod, "_resolve_pair", never)
    for value in (16, "auto"):
        with pytest.raises(
            ConfigError, match=r"DDTree verification is not in the embedded engine yet"
        ) as err:
            llm_mod.LLM("tiny", speculative_config={**SPEC, "tree_budget": value})
        assert "generate --engine reference --tree-budget" in (err.value.hint or "")


def test_llm_stores_a_zero_budget_and_runs_linear_dflash():
    from dflash_trt import LLM, SamplingParams

    with LLM("tiny", speculative_config={**SPEC, "tree_budget": 0}, max_batch_size=1, max_seq_len=64) as llm:
        assert llm.speculative_config.tree_budget == 0 and not llm.speculative_config.uses_tree
        assert llm.args["speculative_config"]["tree_budget"] == 0
        out = llm.generate([3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 6


@pytest.fixture(scope="module")
def tree_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("tree") / "bundle"
    with pytest.raises(SystemExit) as done:
        main(["build", "--target", "tiny", "--tree-budget", "32", "--output", str(out)])
    assert done.value.code == 0
    return out


def test_build_writes_the_budget_into_the_torch_bundle(tree_bundle, cli):
    manifest = json.loads((tree_bundle / "manifest.json").read_text())
    assert manifest["speculative"]["tree_budget"] == 32 and manifest["inputs"]["tree_budget"] == "32"
    llm_api = yaml.safe_load((tree_bundle / "engine" / "llm_api.yaml").read_text())
    assert llm_api["speculative_config"]["tree_budget"] == 32
    model_yaml = yaml.safe_load((tree_bundle / "model_repository/tensorrt_llm/1/model.yaml").read_text())
    assert model_yaml["speculative_config"]["tree_budget"] == 32
    # no budget (or 0): the bundle is exactly the linear one
    code, out_json, err = cli(["build", "--target", "tiny", "--tree-budget", "0", "--dry-run", "--json"])
    assert code == 0, err
    plan = json.loads(out_json)
    assert (
        "tree_budget" not in plan["llm_api"]["speculative_config"]
        and "tree_budget" not in plan["speculative"]
    )
    code, out_json, err = cli(["build", "--target", "tiny", "--tree-budget", "auto", "--dry-run", "--json"])
    assert code == 0, err
    assert json.loads(out_json)["llm_api"]["speculative_config"]["tree_budget"] == "auto"


@pytest.mark.triton_server
def test_serve_hands_the_budget_to_the_engine_through_the_triton_model(tree_bundle):
    """A real tritonserver loads the bundle's Triton model, which builds LLM(**model.yaml): the
    budget arrives there and, until the engine verifies trees, serve stops with its message."""
    from tests.serving.conftest import free_ports

    http, grpc, metrics = free_ports(3)
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tree_bundle), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--ready-timeout", "120", "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tree_budget=32: DDTree verification is not in the embedded engine yet" in proc.stderr


def test_build_refuses_a_tree_for_trtllm_before_reading_configs(cli):
    # the target does not exist: a refusal after config resolution would complain about it instead
    code, out, err = cli(["build", "--target", "no-such/model", "--gpu", "h100", "--tree-budget", "16",
                          "--dry-run"])  # fmt: skip
    assert code == 2 and out == ""
    assert "TensorRT-LLM has no DFlash tree verification" in err and "--backend torch" in err
    assert err.count("\n") == 1
    code, _, err = cli(["build", "--target", "tiny", "--tree-budget", "-3", "--dry-run"])
    assert code == 2 and "--tree-budget='-3': must be an integer in [0, 1024] or 'auto'" in err


def test_generate_reference_tree_and_the_embedded_refusal(cli):
    base = ["generate", "--target", "tiny", "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--ignore-eos",
            "--json", "--engine", "reference"]  # fmt: skip
    code, linear, err = cli([*base, "--tree-budget", "0"])
    assert code == 0, err
    code, tree, err = cli([*base, "--tree-budget", "16"])
    assert code == 0, err
    a, b = json.loads(linear), json.loads(tree)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    assert b["mean_acceptance_length"] >= 1
    code, _, err = cli([*base[:-2], "--engine", "embedded", "--tree-budget", "16"])
    assert code == 2 and re.search(REFUSED, err), err
    code, _, err = cli([*base, "--no-draft", "--tree-budget", "4"])
    assert code == 2 and "needs a drafter" in err


def test_bench_engine_option_reaches_the_engine(cli):
    code, _, err = cli(["bench", "engine", "--modes", "dflash", "--batch-sizes", "1", "--max-tokens", "4",
                        "--tree-budget", "16"])  # fmt: skip
    assert code == 2 and re.search(REFUSED, err), err
    code, _, err = cli(["bench", "engine", "--modes", "dflash", "--tree-budget", "lots"])
    assert code == 2 and "tree_budget='lots'" in err
