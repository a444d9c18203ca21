# SPDX-License-Identifier: Apache-2.0
"""bench/serving_path.py end to end on a small grid: it serves the stand-in, checks that it is the
stand-in, drives every protocol and accounts every process on the path. What the numbers are is the
benchmark's result (bench/README.md), not a test: only their presence and the token counts are checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "serving_path.py"
ROLES = {"tritonserver", "stub", "engine", "serve", "client"}


def test_bad_arguments_exit_2_naming_the_flag():
    for args, message in [(["--protocols", "triton-http,ws"], "--protocols ws: pick from triton-http"),
                          (["--concurrency", "0"], "--concurrency '0': give positive integers"),
                          (["--osl", "1"], "--osl must be >= 2")]:  # fmt: skip
        out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.triton_server
@pytest.mark.timing
def test_small_grid_measures_every_protocol_and_process(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPT), "--concurrency", "2", "--tokens-per-round", "3", "--round-ms", "5",
           "--osl", "13", "--warmup", "0.5", "--duration", "2", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(p["protocol"], p["concurrency"], p["tokens_per_round"]) for p in result["phases"]] == [
        ("triton-http", 2, 3), ("triton-grpc", 2, 3), ("openai-completions", 2, 3)
    ]  # fmt: skip
    for phase in result["phases"]:
        assert phase["errors"] == [] and phase["output_tokens"] > 0, phase
        assert set(phase["cpu_s"]) == ROLES and all(v >= 0 for v in phase["cpu_s"].values())
        assert all(v is not None for v in phase["cpu_us_per_token"].values())
    env = result["environment"]
    assert env["cpu_count"] >= 1 and env["git_commit"] and env["versions"]["tritonserver"]
    assert "| openai-completions | 2 | 3 |" in run.stdout and f"commit {env['git_commit']}" in run.stdout
    assert result["config"]["rounds"] == "overlap" and "stand-in rounds of 5 ms (overlap)" in run.stdout
