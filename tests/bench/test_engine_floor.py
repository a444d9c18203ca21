# SPDX-License-Identifier: Apache-2.0
"""bench/engine_floor.py: the engine against the weight-streaming floor, on the `toy` shapes.

Timings are not asserted (the machine is shared); the structure of the result, the arithmetic of
the floor and the ratios, the parameter counts the floor rests on, and the correctness check are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_trt.layers import cpu_gemm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "engine_floor.py"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_TRT_COMPILE": "0"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


def _check_arithmetic(r: dict[str, Any], *, itemsize: int) -> None:
    bw, floor, params = r["bandwidth"], r["floor"], r["parameters"]
    assert bw["gb_s"] == pytest.approx(bw["bytes"] / min(bw["times_s"]) / 1e9)
    assert floor["weight_bytes_per_step"] == params["streamed_parameters"] * itemsize
    assert floor["steps_per_s"] == pytest.approx(bw["gb_s"] * 1e9 / floor["weight_bytes_per_step"])
    assert floor["tok_s_batch1"] == floor["steps_per_s"]
    for run in r["ours"]:
        for row in run["batches"]:
            assert row["tokens"] == row["batch"] * r["config"]["max_tokens"]  # ignore_eos: every token
            assert row["seconds"] == min(row["all_seconds"]) and len(row["all_seconds"]) == 2
            assert row["tok_s"] == pytest.approx(row["tokens"] / row["seconds"])
            assert row["floor_tok_s"] == pytest.approx(row["batch"] * floor["steps_per_s"])
            assert row["ratio_to_floor"] == pytest.approx(row["tok_s"] / row["floor_tok_s"])


def test_toy_json_structure_and_arithmetic(tmp_path: Path) -> None:
    out = tmp_path / "out"
    common = (
        "--max-tokens",
        "8",
        "--batch-sizes",
        "1,2",
        "--bandwidth-gib",
        "0.0625",
        "--work",
        str(tmp_path),
    )
    proc = _run("--shape", "toy", "--no-vllm", *common, "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)  # stdout is one JSON object; the table went to stderr
    assert json.loads((out / "engine_floor.json").read_text()) == r
    cfg = r["config"]
    assert cfg["shape"] == "toy" and cfg["family"] == "qwen3" and cfg["batch_sizes"] == [1, 2]
    assert cfg["max_tokens"] == 8 and cfg["prompt_len"] == 32 and cfg["check_tokens"] == 8
    assert cfg["compile_env"]["DFLASH_TRT_COMPILE"] == "0" and cfg["versions"]["torch"]
    assert Path(cfg["checkpoint"], "model.safetensors").is_file()
    # toy ties its embeddings: every target parameter is read once per step
    assert r["parameters"]["streamed_parameters"] == r["parameters"]["target_parameters"] > 0
    [run] = r["ours"]
    assert run["label"] == "default" and run["compile_argument"] is None  # LLM's own defaults
    assert run["dtype"] == "float32"  # 'auto' keeps a model this narrow in float32 on a CPU
    assert run["compiled"] is False and run["cpu_threads"] == r["bandwidth"]["threads"] == 1
    assert [b["batch"] for b in run["batches"]] == [1, 2]
    _check_arithmetic(r, itemsize=4)
    assert r["vllm"] == {"status": "skipped", "reason": "--no-vllm"} and r["ours_vs_vllm"] == {}
    assert r["check"]["kind"] == "reference" and r["check"]["runs"]["default"]["identical"] is True
    assert r["ok"] is True
    assert (
        "# read bandwidth:" in proc.stderr
        and "x floor" in proc.stderr
        and "default: identical" in proc.stderr
    )


def test_llama_shape_untied_floor_and_checkpoint_reuse(tmp_path: Path) -> None:
    args = ("--shape", "llama-toy", "--no-vllm", "--max-tokens", "4", "--batch-sizes", "1", "--repeats", "2")
    args += ("--also-eager", "--also-onednn", "--bandwidth-gib", "0.0625", "--work", str(tmp_path), "--json")
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    config = json.loads(Path(r["config"]["checkpoint"], "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    # untied: the input embedding is looked up (one row), the LM head read whole
    p, s = r["parameters"], r["config"]["shape_fields"]
    assert p["streamed_parameters"] == p["target_parameters"] - s["vocab"] * s["hidden"] + s["hidden"]
    labels = ["default", "eager", "default, oneDNN GEMM"]
    assert [x["label"] for x in r["ours"]] == labels and r["ours"][1]["compile_argument"] is False
    # a toy shape stays in float32: dflash-trt's fp32 operator where it runs, MKL's with the switch off
    own = "dflash_trt fp32" if cpu_gemm.f32_available() else "torch (float32)"
    assert [x["gemm"] for x in r["ours"]] == [own, own, "torch (float32)"]
    assert {x["weights_dtype"] for x in r["ours"]} == {"float32"}  # too narrow to keep bf16 weights
    assert set(r["check"]["runs"]) == set(labels) and r["check"]["identical"] is True
    _check_arithmetic(r, itemsize=4)
    assert "writing the random" in proc.stderr
    again = _run(*args[:-1])  # the checkpoint is written once, then reused; no --json: the table on stdout
    assert again.returncode == 0, again.stderr[-3000:]
    assert "writing the random" not in again.stderr and "dflash_trt (eager)" in again.stdout


def test_bad_arguments_exit_2_naming_the_option() -> None:
    for args, needle in (
        (("--shape", "nope"), "--shape 'nope'"),
        (("--batch-sizes", "1,x"), "--batch-sizes '1,x'"),
        (("--max-tokens", "4", "--check-tokens", "5"), "--check-tokens 5"),
        (("--prompt-len", "2000", "--max-tokens", "100"), "max_model_len"),
    ):
        proc = _run(*args)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
