# SPDX-License-Identifier: Apache-2.0
"""The clients against a real tritonserver: Triton's own SSE and gRPC stream framing.

tests/bench/triton_repo/tensorrt_llm is a decoupled Python model with our I/O contract: first
chunk (1 token) at 40 ms, then 4 tokens every 15 ms, each later chunk one round of 3 accepted
drafts out of 7. With OSL 17: E2EL >= 40 ms + 4 x 15 ms, tau = 4. As in test_scripted_e2e.py,
latencies are checked as never earlier than the schedule and as their definitions of the recorded
requests (tests/bench/schedule.py), so the test passes on a loaded machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_trt.bench.sweep import SweepConfig, run_sweep
from tests.bench.schedule import assert_never_early, assert_point_is_its_records, records

pytestmark = [pytest.mark.triton_server, pytest.mark.timing]

TTFT, GAP, OSL = 0.04, 0.015, 17
CHUNKS = (1, 4, 4, 4, 4)
OFFSETS = tuple(TTFT + i * GAP for i in range(len(CHUNKS)))


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc"])
def test_sweep_against_real_triton(protocol, triton_server, tmp_path, byte_tokenizer_dir) -> None:
    url = triton_server["grpc_url"] if protocol == "triton-grpc" else triton_server["http_url"]
    summary = run_sweep(
        SweepConfig(
            url=url,
            out=str(tmp_path / "run"),
            protocol=protocol,
            concurrency=(1, 3),
            num_requests=6,
            warmup=1,
            isl=20,
            osl=OSL,
            tokenizer=str(byte_tokenizer_dir),
        )
    )
    assert summary["server"]["server"]["name"] == "triton"
    assert summary["server"]["output_length_control"] == "sampling_param_ignore_eos"
    all_records = records(tmp_path / "run")
    for p in summary["points"]:
        assert p["num_errors"] == 0
        assert p["output_tokens_total"] == 6 * OSL and p["output_tokens_source"] == "num_output_tokens"
        assert p["tokens_per_chunk_hist"] == {"1": 6, "4": 24}
        recs = [r for r in all_records if r["point"] == p["key"]]
        assert_never_early(recs, CHUNKS, OFFSETS)
        assert_point_is_its_records(p, recs)
        assert p["mean_acceptance_length"] == pytest.approx(4.0)
        assert p["acceptance_rate_pooled"] == pytest.approx(3 / 7, rel=1e-6)
        assert p["isl_discrepancy_pct"] == 0.0
        assert p["server_ttft_p50_s"] >= TTFT  # the model's own clock: never early either


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc"])
def test_model_errors_are_counted(protocol, triton_server, tmp_path: Path) -> None:
    url = triton_server["grpc_url"] if protocol == "triton-grpc" else triton_server["http_url"]
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(
        "\n".join(json.dumps({"prompt": t}) for t in ("ok one", "FAIL two", "ok three")) + "\n"
    )
    summary = run_sweep(
        SweepConfig(
            url=url,
            out=str(tmp_path / "run"),
            protocol=protocol,
            concurrency=(2,),
            num_requests=9,
            warmup=0,
            dataset=str(dataset),
            osl=9,
        )
    )
    (p,) = summary["points"]
    assert p["num_errors"] == 3 and p["num_completed"] == 6
    assert list(p["errors"]) == [("HTTP 400: " if protocol == "triton-http" else "") + "scripted failure"]
    assert p["input_tokens_source"] == "server" and p["output_tokens_total"] == 6 * 9
