# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt bench engine` with several DFlash modes: plain decoding, linear DFlash and DDTree
(fixed budgets and auto) in one run, every prompt at every batch size, passes interleaved and
pooled, ratios against linear DFlash, the budgets the tree rounds ran."""

from __future__ import annotations

import json


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
            assert set(p["tree_budgets"]) <= {"0", "16", "32", "64"}
        else:
            assert p["tree_budgets"] is None
    assert set(result["vs_linear"]) == {"ddtree-8", "ddtree-auto"} and set(result["speedup"]) == {"1", "2"}
    ratio = points["ddtree-8", 1]["output_tokens_per_s"] / points["dflash", 1]["output_tokens_per_s"]
    assert result["vs_linear"]["ddtree-8"]["1"] == ratio
    code, _, err = cli(["bench", "engine", "--prompts", str(tmp_path / "none.jsonl")])
    assert code == 2 and "is not builtin, heldout or a JSONL file" in err
