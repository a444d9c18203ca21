# SPDX-License-Identifier: Apache-2.0
"""Run directories: summary.json / requests.jsonl / points.csv, resume, refusal, Ctrl-C."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_trt.bench.sweep import SweepConfig, run_sweep
from dflash_trt.errors import UsageError
from tests.bench.scripted_server import Script
from tests.conftest import INTERRUPTIBLE_CLI

FAST = Script(ttft_s=0.01, chunk_gap_s=0.005, tokens_per_chunk=(4,))
REQUIRED_POINT_KEYS = (
    "concurrency",
    "ttft_p50_s",
    "tpot_p50_s",
    "output_tokens_per_s",
    "tokens_per_s_per_user_p50",
    "mean_acceptance_length",
    "num_errors",
)


def _cfg(server: Any, out: Path, tok: Path, **kw: Any) -> SweepConfig:
    args: dict[str, Any] = dict(
        url=server.http_url,
        out=str(out),
        protocol="triton-http",
        concurrency=(1, 2),
        num_requests=4,
        warmup=1,
        isl=16,
        osl=9,
        tokenizer=str(tok),
    )
    args.update(kw)
    return SweepConfig(**args)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_directory_contents(scripted, tmp_path, byte_tokenizer_dir) -> None:
    out = tmp_path / "run"
    with scripted(FAST) as server:
        summary = run_sweep(_cfg(server, out, byte_tokenizer_dir, label="DFlash", meta=(("gpu", "none"),)))
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["points"] == json.loads(json.dumps(summary["points"]))
    assert on_disk["schema"] == "dflash-trt.bench.sweep/1" and on_disk["status"] == "complete"
    assert on_disk["config"]["concurrency"] == [1, 2] and on_disk["config"]["meta"] == {"gpu": "none"}
    assert on_disk["label"] == "DFlash"
    assert {"python", "packages", "hostname", "cpu_count"} <= set(on_disk["environment"])
    assert on_disk["server"]["output_length_control"] == "sampling_param_ignore_eos"
    assert on_disk["workload"]["kind"] == "synthetic" and on_disk["workload"]["sd_realistic"] is False
    assert "tpot_s" in on_disk["definitions"] and "tokens_per_s_per_user" in on_disk["definitions"]
    assert [p["concurrency"] for p in on_disk["points"]] == [1, 2]
    for p in on_disk["points"]:
        for key in REQUIRED_POINT_KEYS:
            assert key in p, key
        assert p["warmup"]["num_requests"] == 1
    reqs = _lines(out / "requests.jsonl")
    assert len(reqs) == 2 * (4 + 1)
    assert sum(r["phase"] == "warmup" for r in reqs) == 2
    r = next(r for r in reqs if r["phase"] == "measure")
    assert r["chunk_tokens"] == [1, 4, 4] and r["output_tokens"] == 9 and r["input_tokens"] == 16
    assert len(r["chunk_offsets_s"]) == 3 and r["acceptance_length"] == pytest.approx(4.0)
    rows = list(csv.DictReader((out / "points.csv").open()))
    assert [row["key"] for row in rows] == ["concurrency=1", "concurrency=2"]
    assert float(rows[1]["tpot_p50_s"]) == pytest.approx(on_disk["points"][1]["tpot_p50_s"])
    assert "tokens_per_chunk_hist" not in rows[0]


def test_resume_skips_completed_points(scripted, tmp_path, byte_tokenizer_dir) -> None:
    out = tmp_path / "run"
    with scripted(FAST) as server:
        run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1, 2)))
        before = server.log.count
        first = json.loads((out / "summary.json").read_text())["points"]
        summary = run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1, 2, 4), label="renamed"))
        sent = server.log.count - before
        # nothing left to do: nothing sent, nothing lost
        again = run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1, 2, 4)))
        assert server.log.count - before == sent
    assert sent == 1 + 4  # only concurrency=4 ran: 1 warm-up + 4 measured requests
    assert [p["key"] for p in summary["points"]] == ["concurrency=1", "concurrency=2", "concurrency=4"]
    assert summary["points"][:2] == first
    assert len(_lines(out / "requests.jsonl")) == 2 * 5 + (1 + 4)
    assert again["points"] == summary["points"] and again["status"] == "complete"
    assert (
        again["server"]["output_length_control"] == "sampling_param_ignore_eos"
        and again["workload"]["isl"] == 16
    )


def test_other_configuration_is_refused_unless_overwrite(scripted, tmp_path, byte_tokenizer_dir) -> None:
    out = tmp_path / "run"
    with scripted(FAST) as server:
        run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1,)))
        with pytest.raises(UsageError, match=r"another configuration \(osl: 9 -> 5"):
            run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1,), osl=5))
        summary = run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1,), osl=5), overwrite=True)
    assert summary["points"][0]["output_tokens_mean"] == 5
    assert {r["output_tokens"] for r in _lines(out / "requests.jsonl")} == {5}
    (out / "summary.json").write_text("{not json")
    with pytest.raises(UsageError, match="is unreadable"):
        run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1,), osl=5))


def test_orphan_request_lines_are_dropped_on_resume(scripted, tmp_path, byte_tokenizer_dir) -> None:
    out = tmp_path / "run"
    with scripted(FAST) as server:
        run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1,)))
        with (out / "requests.jsonl").open("a") as f:  # a point that died before summary.json was written
            f.write(json.dumps({"point": "concurrency=2", "phase": "measure"}) + "\n")
        run_sweep(_cfg(server, out, byte_tokenizer_dir, concurrency=(1, 2)))
    reqs = _lines(out / "requests.jsonl")
    assert sum(r["point"] == "concurrency=2" for r in reqs) == 5 and all("ok" in r for r in reqs)


@pytest.mark.timing
def test_ctrl_c_keeps_completed_points_and_rerun_resumes(scripted, tmp_path, byte_tokenizer_dir) -> None:
    out = tmp_path / "run"
    # point 1 is requests 1-3; the server holds request 4 on (point 2) until released, so the
    # interrupt lands inside point 2 however slow the machine is
    held = Script(ttft_s=0.01, chunk_gap_s=0.01, tokens_per_chunk=(1,), hold_from=4)
    with scripted(held) as server:
        cmd = [
            *INTERRUPTIBLE_CLI, "bench", "sweep",
            "--url", server.http_url, "--protocol", "triton-http", "--concurrency", "1,2,3",
            "--num-requests", "3", "--warmup", "0", "--isl", "16", "--osl", "9",
            "--tokenizer", str(byte_tokenizer_dir), "--out", str(out), "--no-progress",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 120  # a bound on a hang, not a timing
        summary_path = out / "summary.json"
        while server.log.count < 4 and proc.poll() is None:  # until point 2's first request is held
            assert time.monotonic() < deadline, "the sweep never reached its second point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert "interrupted: 1 completed point(s) kept" in stderr
        kept = json.loads(summary_path.read_text())
        assert kept["status"] == "interrupted" and [p["key"] for p in kept["points"]] == ["concurrency=1"]
        assert {r["point"] for r in _lines(out / "requests.jsonl")} == {"concurrency=1"}

        before = server.log.count
        server.release_held()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert server.log.count - before == 6  # concurrency 2 and 3, three requests each
        # the resume is announced: the server itself is not part of the fingerprint
        assert "resuming, 1 of 3 point(s) kept" in done.stderr and "--overwrite" in done.stderr
    final = json.loads(summary_path.read_text())
    assert final["status"] == "complete"
    assert [p["key"] for p in final["points"]] == ["concurrency=1", "concurrency=2", "concurrency=3"]
    assert final["points"][0] == kept["points"][0]
