# SPDX-License-Identifier: Apache-2.0
"""bench/client_overhead.py: 256 concurrent streams against the scripted server (its own process).

What is asserted holds on a loaded machine: the server holds every first chunk until 256 requests
are in (`--start-together`), so only a client that keeps 256 streams open at once gets past it,
and token counts are the schedule's. How far the measured latencies sit from the schedule is the
benchmark's result (bench/README.md), not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STREAMS, OSL, TTFT = 256, 32, 0.05

pytestmark = pytest.mark.timing


def test_sustains_256_concurrent_streams_with_exact_token_counts() -> None:
    cmd = [
        sys.executable, str(REPO / "bench" / "client_overhead.py"), "--streams", str(STREAMS),
        "--requests-per-stream", "2", "--protocol", "triton-http", "--osl", str(OSL), "--ttft", str(TTFT),
        "--chunk-gap", "0.02", "--tokens-per-chunk", "4", "--start-together", str(STREAMS), "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["num_errors"] == 0
    assert r["server_peak_in_flight"] == STREAMS  # all 256 streams were open at the server at once
    # counted from the server, never one token per chunk: 1 + 7 x 4 + 3 tokens per request
    measured = 2 * STREAMS
    assert r["output_tokens_total"] == measured * OSL
    assert r["tokens_per_chunk_hist"] == {"1": measured, "3": measured, "4": 7 * measured}
    assert r["ttft_p50_s"] >= TTFT  # a schedule is never early, however loaded the machine
    assert r["client_cpu_us_per_output_token"] > 0
