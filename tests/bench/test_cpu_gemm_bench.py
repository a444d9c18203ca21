# SPDX-License-Identifier: Apache-2.0
"""bench/cpu_gemm.py: dflash-trt's bf16 GEMM against oneDNN's and the read bandwidth, on the `toy`
shape. Timings are not asserted (the machine is shared); the weights it measures, the arithmetic of
its rates and the kernels' errors are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_trt.layers import cpu_gemm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "cpu_gemm.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_toy_shape_both_kernels_every_row_count(dtype) -> None:
    if not cpu_gemm.available(getattr(torch, dtype)):
        pytest.skip(
            "this CPU has no AVX512-BF16 (or no C compiler): dflash-trt's bf16 GEMM does not run here"
        )
    proc = _run("--shape", "toy", "--rows", "1,3", "--threads", "1", "--bandwidth-gib", "0.01",
                "--repeats", "1", "--stream-gb", "0.05", "--dtype", dtype, "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["config"]["shape"] == "toy" and r["config"]["read_bandwidth_gb_s"] > 0
    assert r["config"]["dtype"] == dtype and r["config"]["baseline"] and r["config"]["stream_gb"] == 0.05
    names = [p["weight"] for p in r["points"]]
    assert names == [w for w in ("qkv", "o_proj", "gate_up", "down_proj", "lm_head") for _ in (1, 3)]
    for p in r["points"]:
        for kernel, itemsize in (("dflash", 2), ("baseline", 2 if dtype == "bfloat16" else 4)):
            assert p[f"{kernel}_gb_s"] == pytest.approx(
                p["n"] * p["k"] * itemsize / p[f"{kernel}_us"] / 1e3, rel=1e-9
            )
            assert p[f"{kernel}_max_err"] < 0.05  # bf16 outputs of an fp32 product
        assert p["speedup"] == pytest.approx(p["baseline_us"] / p["dflash_us"], rel=1e-9)


def test_bad_rows_exit_2_naming_the_option() -> None:
    proc = _run("--rows", "1,x")
    assert proc.returncode == 2 and "--rows '1,x'" in proc.stderr
    proc = _run("--stream-gb", "0")
    assert proc.returncode == 2 and "--stream-gb 0.0: must be > 0" in proc.stderr
