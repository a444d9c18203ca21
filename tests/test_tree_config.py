# SPDX-License-Identifier: Apache-2.0
"""The `tree_budget` extension of the DFlash speculative config through the user-facing entry
points: the config class, LLM(...) (a DFlash 2 drafter is refused), build (the torch backend writes
it into the bundle's engine config; trtllm refuses it before reading any config), generate (both
engines, --json's tree fields) and bench engine. Serving it end to end: tests/serving/test_ddtree_serve.py."""

from __future__ import annotations

import json

import pytest
import yaml

from dflash_trt.cli import main
from dflash_trt.engine.tree_budget import AUTO_BUDGETS
from dflash_trt.errors import ConfigError
from dflash_trt.spec.decoding_config import MAX_TREE_BUDGET, DFlashDecodingConfig, parse_tree_budget

SPEC = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}


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


def test_llm_refuses_a_tree_with_a_dflash2_drafter(tmp_path):
    """The engine asks the one rule (`check_tree_drafter`), as the reference loop and build do."""
    from dflash_trt import LLM
    from dflash_trt.models.checkpoint import save_drafter
    from tests.conftest import make_drafter, make_target

    target = make_target("qwen3", seed=1)
    target.save_pretrained(tmp_path / "t")
    save_drafter(make_drafter(target, dflash2=True), tmp_path / "d")
    cfg = {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": str(tmp_path / "d")}
    with pytest.raises(
        ConfigError,
        match=r"^speculative_config.tree_budget='auto': DDTree verification does not run DFlash 2",
    ):
        LLM(str(tmp_path / "t"), speculative_config={**cfg, "tree_budget": "auto"}, max_seq_len=64)


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


def test_build_refuses_a_tree_for_trtllm_before_reading_configs(cli):
    # the target does not exist: a refusal after config resolution would complain about it instead
    code, out, err = cli(["build", "--target", "no-such/model", "--gpu", "h100", "--tree-budget", "16",
                          "--dry-run"])  # fmt: skip
    assert code == 2 and out == ""
    assert "TensorRT-LLM has no DFlash tree verification" in err and "--backend torch" in err
    assert err.count("\n") == 1
    code, _, err = cli(["build", "--target", "tiny", "--tree-budget", "-3", "--dry-run"])
    assert code == 2 and "--tree-budget='-3': must be an integer in [0, 1024] or 'auto'" in err


def test_generate_tree_in_both_engines(cli):
    """--tree-budget in the reference loop and the embedded engine: the same tokens as linear
    DFlash, --json with each round's budget and the tree's tau (auto: the engine's choices)."""
    base = ["generate", "--target", "tiny", "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--ignore-eos",
            "--json"]  # fmt: skip
    runs = {}
    for engine, budget in (("reference", "0"), ("reference", "16"), ("embedded", "16"), ("embedded", "auto")):
        code, out, err = cli([*base, "--engine", engine, "--tree-budget", budget])
        assert code == 0, err
        runs[engine, budget] = json.loads(out)
    linear = runs["reference", "0"]
    assert "tree_budgets" not in linear
    for key in (("reference", "16"), ("embedded", "16"), ("embedded", "auto")):
        assert runs[key]["output_ids"] == linear["output_ids"] and runs[key]["text"] == linear["text"], key
    ref, emb = runs["reference", "16"], runs["embedded", "16"]
    assert emb["acceptance_lengths"] == ref["acceptance_lengths"]
    assert emb["tree_budgets"] == ref["tree_budgets"] == [16] * ref["num_rounds"]
    assert emb["tree_mean_acceptance_length"] == pytest.approx(emb["mean_acceptance_length"])
    auto = runs["embedded", "auto"]
    assert len(auto["tree_budgets"]) == auto["num_rounds"] and set(auto["tree_budgets"]) <= set(AUTO_BUDGETS)
    tree_rounds = [n for n, b in zip(auto["acceptance_lengths"], auto["tree_budgets"]) if b]
    assert auto["tree_mean_acceptance_length"] == pytest.approx(sum(tree_rounds) / len(tree_rounds))
    code, _, err = cli([*base, "--engine", "reference", "--tree-budget", "auto"])
    assert code == 2 and "cost model" in err
    code, _, err = cli([*base, "--no-draft", "--tree-budget", "4"])
    assert code == 2 and "needs a drafter" in err


def test_bench_engine_option_reaches_the_engine(cli):
    code, out, err = cli(["bench", "engine", "--modes", "dflash", "--batch-sizes", "1", "--max-tokens", "8",
                          "--tree-budget", "16", "--json"])  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["tree_budget"] == 16 and result["points"][0]["tau"] >= 1
    code, _, err = cli(["bench", "engine", "--modes", "dflash", "--tree-budget", "lots"])
    assert code == 2 and "tree_budget='lots'" in err
