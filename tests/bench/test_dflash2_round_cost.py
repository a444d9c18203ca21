# SPDX-License-Identifier: Apache-2.0
"""bench/dflash2_round_cost.py: DFlash 2 vs v1 round cost, τ and tok/s on the tiny pair, with its configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "dflash2_round_cost.py"


def test_tiny_run_records_ratios_and_configuration(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--round-batches", "1,2", "--context", "20", "--rounds", "3", "--sampled",
         "--batches", "2", "--prompts", "3", "--max-tokens", "24", "--trials", "2", "--json", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["config"]["rounds"] == 3 and r["config"]["compile"] is False
    assert r["environment"]["threads"] == 1 and r["environment"]["date"].startswith("20")
    assert [(x["batch_size"], x["temperature"]) for x in r["rounds"]] == [
        (1, 0.0),
        (2, 0.0),
        (1, 0.7),
        (2, 0.7),
    ]
    for x in r["rounds"]:
        assert x["ratio"] > 0 and x["v1"]["round_ms_median"] > 0 and x["v1"]["draft_ms"] > 0
        assert x["v1"]["overturn_rate"] == 0.0 and x["dflash2"]["overturn_rate"] > 0
    (point,) = r["serving"]
    assert point["concurrency"] == 2 and len(point["v1"]) == len(point["dflash2"]) == 2
    v1, d2 = point["v1"][0], point["dflash2"][0]
    assert v1["output_tokens"] == d2["output_tokens"] == 3 * 24
    assert point["tau_ratio"] == d2["tau_pooled"] / v1["tau_pooled"] and d2["overturn_rate"] > 0
    assert "DFlash 2 ms" in proc.stdout and "tok/s ratio" in proc.stdout


def test_bad_arguments_exit_2() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--batches", "1,x"], capture_output=True, text=True)
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
