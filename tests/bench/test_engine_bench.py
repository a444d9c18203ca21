# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt bench engine` with several DFlash modes: plain decoding, linear DFlash and DDTree
(fixed budgets and auto) in one run, every prompt at every batch size, passes interleaved and
pooled, ratios against linear DFlash, the budgets the tree rounds ran."""

from __future__ import annotations

import json

from dflash_trt.engine.tree_budget import AUTO_BUDGETS
from dflash_trt.models.sources import resolve_models


def test_modes_prompts_and_pooled_points(cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "def f(x):\\n"}\n\n{"text": "import os\\n"}\n{"other": 1}\n')
    code, out, err = cli(["bench", "engine", "--batch-sizes", "1,2", "--max-tokens", "6", "--tree-budget", "0,8,auto",
                          "--prompts", str(prompts), "--repeats", "2", "--eager", "--json"])  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["tree_budget"] == [0, 8, "auto"] and result["config"]["compiled"] is False
    points = {(p["mode"], p["batch_size"]): p for p in result["points"]}
    assert set(points) == {(m, b) for m in ("ar", "dflash", "ddtree-8", "ddtree-auto") for b in (1, 2)}
    for (mode, _bs), p in points.items():
        assert p["output_tokens"] == 2 * 2 * 6  # 2 passes x the 2 prompts x 6 tokens, at every batch size
        assert p["tau"] >= 1 and p["request_rounds"] >= p["rounds"]
        if mode == "ddtree-8":
            assert p["tree_budgets"] == {"8": p["request_rounds"]}
        elif mode == "ddtree-auto":
            assert sum(p["tree_budgets"].values()) == p["request_rounds"]
            assert set(p["tree_budgets"]) <= {str(b) for b in AUTO_BUDGETS}
        else:
            assert p["tree_budgets"] is None
    assert set(result["vs_linear"]) == {"ddtree-8", "ddtree-auto"} and set(result["speedup"]) == {"1", "2"}
    ratio = points["ddtree-8", 1]["output_tokens_per_s"] / points["dflash", 1]["output_tokens_per_s"]
    assert result["vs_linear"]["ddtree-8"]["1"] == ratio
    code, _, err = cli(["bench", "engine", "--prompts", str(tmp_path / "none.jsonl")])
    assert code == 2 and "is not builtin, heldout or a JSONL file" in err


def test_draft_lengths_auto_and_pinned(cli):
    """--draft-len: the engine's own choice (auto, the default) beside pinned draft lengths, one engine
    each; every point says how many rounds ran each draft length."""
    code, out, err = cli(["bench", "engine", "--batch-sizes", "1,4", "--max-tokens", "8", "--draft-len", "auto,15,3",
                          "--eager", "--json"])  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["draft_len"] == ["auto", 15, 3]
    points = {(p["mode"], p["batch_size"]): p for p in result["points"]}
    assert set(points) == {(m, b) for m in ("ar", "dflash", "dflash-g15", "dflash-g3") for b in (1, 4)}
    for bs in (1, 4):
        assert points["dflash-g15", bs]["draft_lens"] == {"15": points["dflash-g15", bs]["rounds"]}
        assert points["dflash-g3", bs]["draft_lens"] == {"3": points["dflash-g3", bs]["rounds"]}
        assert points["ar", bs]["draft_lens"] is None
    for bs in (1, 4):  # alone too: chosen by cost
        auto = points["dflash", bs]["draft_lens"]
        assert set(auto) <= {"0", "3", "7", "15"} and sum(auto.values()) == points["dflash", bs]["rounds"]
    assert set(result["vs_linear"]) == {"dflash-g15", "dflash-g3"}  # pinned lengths against the automatic one
    code, _, err = cli(["bench", "engine", "--draft-len", "auto,0"])
    assert code == 2 and "--draft-len" in err and "'0'" in err


def test_prompts_longer_than_the_old_fixed_limit_fit(cli, tmp_path):
    """The engines' sequence limit is sized from the prompts (it was max_tokens + 256 whatever they were:
    the held-out chats of smollm2-135m did not fit), and the limit is reported."""
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"text": "x = 1\n" * 60}) + "\n")  # 360 bytes: tiny's tokens are bytes
    code, out, err = cli(["bench", "engine", "--modes", "ar", "--batch-sizes", "1", "--max-tokens", "4",
                          "--prompts", str(prompts), "--eager", "--json"])  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["max_seq_len"] == 360 + 8 and result["points"][0]["output_tokens"] == 4
    # a target without a default drafter: DFlash modes name the option to pass
    target = str(resolve_models("tiny").target_dir)
    code, _, err = cli(["bench", "engine", "--target", target, "--modes", "dflash", "--eager"])
    assert code == 2 and "--drafter" in err and "--modes ar" in err, err
