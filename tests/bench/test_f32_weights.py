# SPDX-License-Identifier: Apache-2.0
"""bench/f32_weights.py on the packaged tiny target (too narrow for the engine to keep bf16 weights, so
both engines run dense fp32 weights: the script's plumbing, not the kernel, which
tests/engine/test_cpu_bf16.py covers). Timings are not asserted."""

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
SCRIPT = REPO / "bench" / "f32_weights.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_TRT_COMPILE": "0"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)  # fmt: skip


def test_tiny_runs_both_engines_and_compares_their_ids() -> None:
    if not cpu_gemm.available(torch.float32):
        pytest.skip("no AVX2/FMA or no C compiler: dflash-trt's fp32 GEMM on bf16 weights does not run here")
    from dflash_trt.tiny import ensure_tiny

    target = str(ensure_tiny().target)
    proc = _run(target, "--batch-sizes", "1,2", "--max-tokens", "4", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    config = json.loads(lines[0].removeprefix("# f32_weights configuration: "))
    assert config["dtype"] == "float32" and config["batch_sizes"] == [1, 2]
    assert sum("weights packed" in line for line in lines) == 2
    assert [line.split(":")[0] for line in lines if line.startswith("batch ")] == ["batch 1", "batch 2"]
    assert all("same greedy ids: True" in line for line in lines if line.startswith("batch "))


def test_bad_arguments_exit_2() -> None:
    assert _run("/nonexistent").returncode == 2
    proc = _run(str(REPO), "--batch-sizes", "0")
    assert proc.returncode == 2 and "--batch-sizes '0'" in proc.stderr
