# SPDX-License-Identifier: Apache-2.0
"""The GPU check, verified where no GPU is: shell syntax, the scripts' --help and exit codes, the
`env` part end to end, and P1's whole path on a toy shape on the CPU (random weights made at load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _py(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_shell_syntax(script: str) -> None:
    proc = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", ["p1_qwen3_8b.py", "reference_speed.py", "plugin_kernels.py"])
def test_help(script: str) -> None:
    proc = _py(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "--json" in proc.stdout


def _check_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OUT=str(tmp_path / "out"),
        PYTHON=sys.executable,
        GPU_WHEELS=str(tmp_path / "no-wheels"),  # nothing carried: the check says so and goes on
        GPU_SITE=str(tmp_path / "site"),
        PYTHONPATH=str(REPO),
    )
    return env


def test_unknown_part_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "bogus"],
        capture_output=True,
        text=True,
        env=_check_env(tmp_path),
    )
    assert proc.returncode == 2 and "unknown part 'bogus'" in proc.stderr


def test_env_part_writes_its_files_under_out(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "env"],
        capture_output=True, text=True, env=_check_env(tmp_path), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["env.txt", "gpu_check.log", "summary.txt"]
    env_txt = (out / "env.txt").read_text()
    assert "torch" in env_txt and "dflash_trt" in env_txt and "cuda available" in env_txt
    summary = (out / "summary.txt").read_text()
    assert "no wheels in" in summary and "failed parts: 0" in summary


def test_every_output_file_of_a_full_check_fits_the_device_limits() -> None:
    """At most 8 files come back from $OUT, named in letters, digits, '.', '_' and '-'."""
    text = (BENCH / "gpu_check.sh").read_text()
    names = {"summary.txt", "env.txt", "gpu_check.log"}
    for token in text.split('"$OUT/')[1:]:
        names.add(token.split('"', 1)[0])
    names.discard("")
    assert len(names) <= 8, names
    assert all(n.replace(".", "").replace("_", "").replace("-", "").isalnum() for n in names), names


def test_p1_on_a_toy_shape_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "p1.json"
    proc = _py(
        "p1_qwen3_8b.py", "--shape", "toy", "--device", "cpu", "--dtype", "float32", "--batch", "2",
        "--prompt-len", "12", "--max-tokens", "6", "--reps", "2", "--json", str(out), "--compiled-dflash",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    compiled = r["dflash_compiled"]  # measured in a child process, against this process's eager round
    assert compiled["compiled"] and compiled["rounds_at_full_batch"] > 0
    assert compiled["x_eager_round"] == compiled["round_ms_median"] / r["dflash"]["round_ms_median"]
    assert "DFlash round, compiled:" in proc.stdout
    assert r["config"]["shape"] == "toy" and r["config"]["weights"].startswith("random on cpu")
    # toy: tied embeddings, so every target parameter is streamed once
    assert r["streamed_weight_bytes"] == r["config"]["parameters"]["target"] * 4
    assert r["floor_ms"] == pytest.approx(r["streamed_weight_bytes"] / (r["copy_bandwidth_gbs"] * 1e9) * 1e3)
    assert r["plain"]["batch"] == 1 and r["plain_batch"]["batch"] == 2 and r["dflash"]["batch"] == 2
    for part in ("plain", "plain_batch", "dflash"):
        assert r[part]["rounds_at_full_batch"] >= 1 and r[part]["round_ms_median"] > 0
    assert r["plain"]["output_tokens"] == 6 and r["dflash"]["output_tokens"] == 12
    assert r["dflash"]["x_plain_step"] == pytest.approx(
        r["dflash"]["round_ms_median"] / r["plain"]["round_ms_median"]
    )
    assert "DFlash round (batch 2)" in proc.stdout and "floor" in proc.stdout


def test_p1_refuses_cuda_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _py("p1_qwen3_8b.py", "--shape", "toy")
    assert proc.returncode == 3 and "torch.cuda.is_available() is False" in proc.stderr
