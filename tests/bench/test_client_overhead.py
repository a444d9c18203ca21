# SPDX-License-Identifier: Apache-2.0
"""The client is not the bottleneck: 256 concurrent streams against the scripted server (its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sustains_256_concurrent_streams_with_exact_tpot() -> None:
    cmd = [
        sys.executable, str(REPO / "bench" / "client_overhead.py"), "--streams", "256", "--requests-per-stream", "2",
        "--protocol", "triton-http", "--osl", "32", "--ttft", "0.05", "--chunk-gap", "0.02", "--tokens-per-chunk", "4", "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["num_errors"] == 0
    assert r["server_peak_in_flight"] == 256  # all 256 streams were open at the server at once
    assert r["achieved_concurrency"] > 0.7 * 256  # synchronized waves of 256 leave short gaps between them
    # the measured schedule is the served one: TPOT within 20 % (TTFT absorbs the 256-request burst;
    # counting a 4-token chunk as one token would be off by 300 %). 20 %, not 10 %: on a 2-core
    # machine shared with other work the scripted server's own timers slip by ~10 %.
    assert abs(r["tpot_p50_inflation_pct"]) < 20.0
    assert r["client_cpu_us_per_output_token"] > 0 and r["client_cpu_util"] < 1.0
