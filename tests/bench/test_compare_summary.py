# SPDX-License-Identifier: Apache-2.0
"""bench/compare_summary.py: tok/s per run and concurrency, the peer's best of its runs, ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, label: str, tok_s: dict[int, float]) -> None:
    d = out / label
    d.mkdir(parents=True)
    points = [{"concurrency": c, "num_completed": 8, "output_tokens_per_s": v} for c, v in tok_s.items()]
    (d / "summary.json").write_text(json.dumps({"points": points}))


def test_ratios_use_the_peers_best_run(tmp_path):
    _run(tmp_path, "ours-eager-dflash", {1: 300.0, 4: 600.0})
    _run(tmp_path, "vllm-dflash-1", {1: 200.0, 4: 500.0})
    _run(tmp_path, "vllm-dflash-2", {1: 150.0, 4: 750.0})
    _run(tmp_path, "ours-eager-ar", {1: 100.0})
    out = subprocess.run([sys.executable, str(ROOT / "bench/compare_summary.py"), str(tmp_path),
                          "--json", str(tmp_path / "s.json")], capture_output=True, text=True, check=True)  # fmt: skip
    assert "ours-eager-dflash" in out.stdout and "vllm-dflash-2" in out.stdout
    ratios = json.loads((tmp_path / "s.json").read_text())["ratios"]
    assert ratios == {
        "ours-eager-dflash / best vllm-dflash": {"1": 1.5, "4": 0.8},
        "ours-eager-dflash / best vllm (any)": {"1": 1.5, "4": 0.8},
    }  # no vllm-ar run: no AR ratio


def test_against_a_peers_best_configuration_whatever_its_mode(tmp_path):
    _run(tmp_path, "ours-default-dflash", {1: 600.0})
    _run(tmp_path, "llama-dflash-n15", {1: 500.0})
    _run(tmp_path, "llama-dflash-n3", {1: 800.0})
    _run(tmp_path, "llama-ar", {1: 1000.0})
    subprocess.run([sys.executable, str(ROOT / "bench/compare_summary.py"), str(tmp_path), "--peer", "llama",
                    "--json", str(tmp_path / "s.json")], capture_output=True, text=True, check=True)  # fmt: skip
    ratios = json.loads((tmp_path / "s.json").read_text())["ratios"]
    assert ratios == {
        "ours-default-dflash / best llama-dflash": {"1": 0.75},  # its best draft length
        "ours-default-dflash / best llama (any)": {"1": 0.6},  # llama's plain decoding wins
    }


def test_our_ddtree_runs_are_compared_with_the_peers_dflash(tmp_path):
    _run(tmp_path, "ours-default-dflash", {1: 300.0})
    _run(tmp_path, "ours-default-ddtree", {1: 360.0})
    _run(tmp_path, "vllm-dflash-1", {1: 200.0})
    subprocess.run([sys.executable, str(ROOT / "bench/compare_summary.py"), str(tmp_path),
                    "--json", str(tmp_path / "s.json")], capture_output=True, text=True, check=True)  # fmt: skip
    ratios = json.loads((tmp_path / "s.json").read_text())["ratios"]
    assert ratios["ours-default-ddtree / best vllm-dflash"] == {"1": 1.8}
    assert ratios["ours-default-dflash / best vllm-dflash"] == {"1": 1.5}


def test_empty_directory_is_an_error(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench/compare_summary.py"), str(tmp_path)],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 1 and "no sweep results" in out.stderr


def test_a_baseline_drafter_served_in_the_same_run_gets_its_own_ratio(tmp_path):
    _run(tmp_path, "ours-default-dflash", {1: 900.0, 4: 1500.0})  # e.g. DFlash 2
    _run(tmp_path, "ours-default-baseline-dflash", {1: 750.0, 4: 1600.0})  # e.g. v1, same run
    _run(tmp_path, "llama-ar", {1: 600.0, 4: 1200.0})
    subprocess.run([sys.executable, str(ROOT / "bench/compare_summary.py"), str(tmp_path), "--peer", "llama",
                    "--json", str(tmp_path / "s.json")], capture_output=True, text=True, check=True)  # fmt: skip
    ratios = json.loads((tmp_path / "s.json").read_text())["ratios"]
    assert ratios["ours-default-dflash / ours-default-baseline-dflash"] == {"1": 1.2, "4": 0.9375}
    assert ratios["ours-default-baseline-dflash / best llama (any)"] == {"1": 1.25, "4": 1600.0 / 1200.0}
