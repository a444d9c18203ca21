# SPDX-License-Identifier: Apache-2.0
"""bench/ddtree_tau.py: DDTree vs linear DFlash on the tiny pair, with its configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "ddtree_tau.py"


def test_tiny_run_is_identical_and_records_its_configuration(tmp_path: Path) -> None:
    out = tmp_path / "tau.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--prompts", "2", "--max-new-tokens", "20", "--budgets", "4,24",
         "--repeats", "2", "--cost-batch-sizes", "1,3", "--json", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    cfg = r["config"]
    assert cfg["pair"] == "tiny" and cfg["prompts"] == 2 and cfg["max_new_tokens"] == 20
    assert (
        cfg["block_size"] == 16
        and cfg["greedy"]
        and cfg["torch_threads"] == 1
        and cfg["date"].startswith("20")
    )
    assert r["identical"] is True and r["mismatched_prompts"] == {}
    assert [row["tree_budget"] for row in r["tau"]] == [0, 4, 24]
    linear = r["tau"][0]
    assert linear["tau_ratio"] == 1.0 and linear["drafted_nodes_per_round"] <= 15
    for row in r["tau"][1:]:
        assert 1 <= row["tau"] <= 16 and row["tau_ratio"] == row["tau"] / linear["tau"]
        assert row["drafted_nodes_per_round"] <= row["tree_budget"]
    assert {(c["batch_size"], c["tree_budget"]) for c in r["tree_cost"]} == {(1, 4), (1, 24), (3, 4), (3, 24)}
    assert all(c["batched_us"] > 0 and c["heap_us"] > 0 for c in r["tree_cost"])
    verify = {(v["batch_size"], v["tokens"], v["tree"]): v for v in r["verify_cost"]}
    assert set(verify) == {(b, t, t != 16) for b in (1, 3) for t in (16, 5, 25)}
    assert all(verify[(b, 16, False)]["ratio_to_linear"] == 1.0 for b in (1, 3))
    assert all(v["ms"] > 0 for v in verify.values())
    assert "outputs identical to linear DFlash: yes" in proc.stdout


def test_bad_arguments_exit_2() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--budgets", "16,x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
