# SPDX-License-Identifier: Apache-2.0
"""bench/paged_attention.py: dflash-trt's CPU paged attention against the gather-and-SDPA path, on
small heads. Timings are not asserted (the machine is shared); the points it measures, the arithmetic
of its rates and the two paths' agreement are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.layers import cpu_attention

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "paged_attention.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_point_is_measured_and_both_paths_agree(dtype) -> None:
    proc = _run("--heads", "tiny,4,1,24", "--batch-sizes", "1,3", "--rows", "1,16", "--contexts", "40",
                "--repeats", "1", "--bandwidth-gib", "0.01", "--dtype", dtype, "--json")  # fmt: skip
    assert proc.returncode == 2 and "--heads 'tiny,4,1,24'" in proc.stderr  # names or one custom shape
    proc = _run("--heads", "4,1,24", "--batch-sizes", "1,3", "--rows", "1,16", "--contexts", "40",
                "--repeats", "1", "--bandwidth-gib", "0.01", "--dtype", dtype, "--json")  # fmt: skip
    if not cpu_attention.available():  # no AVX2 and FMA, or no g++: the script says so and exits 1
        assert proc.returncode == 1 and "dflash_cpu::paged_attention does not run here" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["config"]["heads"] == {"custom": [4, 1, 24]} and r["config"]["read_bandwidth_gb_s"] > 0
    assert [(p["batch"], p["rows"]) for p in r["points"]] == [(1, 1), (1, 16), (3, 1), (3, 16)]
    for p in r["points"]:
        kv_bytes = 2 * p["batch"] * 40 * 1 * 24 * (4 if dtype == "float32" else 2)
        assert p["ours_gb_s"] == pytest.approx(kv_bytes / p["ours_us"] / 1e3, rel=1e-9)
        assert p["speedup"] == pytest.approx(p["gather_sdpa_us"] / p["ours_us"], rel=1e-9)
        assert p["max_abs_diff"] < (1e-5 if dtype == "float32" else 0.05)


def test_bad_options_exit_2_naming_the_option() -> None:
    proc = _run("--rows", "1,x")
    assert proc.returncode == 2 and "--rows '1,x'" in proc.stderr
    proc = _run("--heads", "6,4,32")
    assert proc.returncode == 2 and "multiple of the KV heads" in proc.stderr
    proc = _run("--bandwidth-gib", "0")
    assert proc.returncode == 2 and "--bandwidth-gib 0.0: must be > 0" in proc.stderr
