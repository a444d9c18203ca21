# SPDX-License-Identifier: Apache-2.0
"""bench/reference_speed.py: ours vs the authors' dflash_generate on the same weights, in process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "reference_speed.py"

pytestmark = pytest.mark.oracle


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, timeout=timeout
    )


def test_tiny_one_prompt_identical_with_full_configuration(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    proc = _run("--prompts", "1", "--max-new-tokens", "16", "--warmup-tokens", "4", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    cfg = r["config"]
    assert cfg["shape"] == "tiny" and cfg["device"] == "cpu" and cfg["dtype"] == "float32"
    assert cfg["prompts"] == 1 and cfg["max_new_tokens"] == 16 and cfg["block_size"] == 16
    assert cfg["torch_threads"] == 1 and cfg["engine_threads"] == 1
    assert (
        cfg["versions"]["dflash"] == "0.1.0" and cfg["versions"]["torch"] and cfg["versions"]["transformers"]
    )
    assert cfg["machine"]["cpu_count"] >= 1 and cfg["date"].startswith("20")
    assert r["identical"] is True and r["mismatched_prompts"] == []
    [row] = r["per_prompt"]
    assert row["ours_tokens"] == row["reference_tokens"] == 16 and row["identical"]
    assert row["ours_tau"] == row["reference_tau"]  # same rounds, not only the same tokens
    for side in ("ours", "reference"):
        assert r[side]["tokens"] == 16 and r[side]["seconds"] > 0
    assert r["ratio"] == pytest.approx(r["ours"]["tokens_per_s"] / r["reference"]["tokens_per_s"])
    # the printed summary carries the configuration next to the numbers
    assert '"torch_threads": 1' in proc.stdout and "ratio ours / reference:" in proc.stdout
    assert "outputs identical: yes" in proc.stdout


def test_random_shape_and_engine_kwargs_reach_the_engine(tmp_path: Path) -> None:
    out = tmp_path / "toy.json"
    proc = _run(
        "--shape", "toy", "--prompts", "2", "--max-new-tokens", "8", "--warmup-tokens", "2",
        "--engine-kwargs", '{"enforce_eager": true}', "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["config"]["engine_kwargs"] == {"enforce_eager": True}
    assert r["config"]["weights"].startswith("random") and r["config"]["parameters"]["target"] > 0
    assert r["identical"] and len(r["per_prompt"]) == 2


def test_bad_arguments_exit_2_naming_the_option() -> None:
    proc = _run("--engine-kwargs", "[1]")
    assert proc.returncode == 2 and "--engine-kwargs" in proc.stderr and "JSON object" in proc.stderr
    proc = _run("--shape", "nope")
    assert proc.returncode == 2 and "--shape 'nope'" in proc.stderr
    # an unknown engine keyword is the engine's own one-line error, not a silent no-op
    proc = _run("--prompts", "1", "--max-new-tokens", "2", "--engine-kwargs", '{"no_such_option": 1}')
    assert proc.returncode != 0 and "no_such_option" in proc.stderr
