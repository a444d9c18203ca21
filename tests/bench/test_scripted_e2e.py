# SPDX-License-Identifier: Apache-2.0
"""Sweeps against the scripted server over every protocol: counts equal the schedule, latencies are
never earlier than it, and every metric equals its definition applied to the recorded requests.

Schedule used throughout: first chunk of 2 tokens at TTFT = 60 ms, then chunks of 3, 6, 3, 3
tokens every 25 ms (OSL 17). So E2EL >= 160 ms, 4 rounds accept 2 + 5 + 2 + 2 = 11 drafts
(tau = 3.75) out of 4 x 7 drafted. No assertion bounds a latency from above: the tests pass on a
loaded machine (tests/bench/schedule.py), and `make test-under-load` runs them beside busy processes.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from dflash_trt.bench.sweep import SweepConfig, run_sweep
from tests.bench.schedule import assert_never_early, assert_point_is_its_records, records
from tests.bench.scripted_server import Script, plan_request

TTFT, GAP, OSL = 0.06, 0.025, 17
SCRIPT = Script(ttft_s=TTFT, chunk_gap_s=GAP, first_chunk_tokens=2, tokens_per_chunk=(3, 6), draft_len=7)
PLAN = plan_request(SCRIPT, max_tokens=OSL, ignore_eos=True)
PROTOCOLS = ("triton-http", "triton-grpc", "openai-completions", "openai-chat")


def _url(server: Any, protocol: str) -> str:
    return server.grpc_url if protocol == "triton-grpc" else server.http_url


def _sweep(
    server: Any, tmp_path: Path, tokenizer: Path, protocol: str = "triton-http", **kw: Any
) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        url=_url(server, protocol),
        out=str(tmp_path / f"run-{protocol}"),
        protocol=protocol,
        concurrency=(2,),
        num_requests=6,
        warmup=2,
        isl=24,
        osl=OSL,
        tokenizer=str(tokenizer),
    )
    args.update(kw)
    return run_sweep(SweepConfig(**args))


pytestmark = pytest.mark.timing


def test_schedule_is_what_the_docstring_says() -> None:
    assert PLAN.chunks == (2, 3, 6, 3, 3)
    assert PLAN.offsets_s == pytest.approx((0.06, 0.085, 0.11, 0.135, 0.16))
    assert PLAN.stats_after(4)["mean_acceptance_length"] == pytest.approx(3.75)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_metric_matches_the_schedule(
    protocol, scripted, tmp_path, byte_tokenizer_dir, chat_tokenizer_dir
) -> None:
    tok = chat_tokenizer_dir if protocol == "openai-chat" else byte_tokenizer_dir
    with scripted(SCRIPT) as server:
        summary = _sweep(server, tmp_path, tok, protocol, slo_ttft_s=TTFT + 0.05, slo_tpot_s=GAP)
        seen = list(server.log.requests)
    (p,) = summary["points"]
    recs = records(tmp_path / f"run-{protocol}")
    assert p["num_errors"] == 0 and p["num_completed"] == 6 == len(recs)
    # counts: from the server, exact
    assert p["output_tokens_total"] == 6 * OSL
    assert p["output_tokens_source"] == ("usage" if protocol.startswith("openai") else "num_output_tokens")
    assert p["tokens_per_chunk_hist"] == {"2": 6, "3": 18, "6": 6}
    assert p["mean_tokens_per_chunk_after_first"] == pytest.approx(15 / 4)
    # latencies: never earlier than the schedule, and every statistic is its definition of the records
    assert_never_early(recs, PLAN.chunks, PLAN.offsets_s)
    assert_point_is_its_records(p, recs)
    assert p["ttft_p50_s"] >= TTFT and p["e2el_p50_s"] >= TTFT + 4 * GAP
    assert p["total_tokens_per_s_per_gpu"] == pytest.approx(p["total_tokens_per_s"])
    # three waves of two: each slot sends 3 requests one after the other, each at least E2EL long
    assert p["duration_s"] >= 3 * (TTFT + 4 * GAP) and 0 < p["achieved_concurrency"] <= 2.0 + 1e-9
    slo_met = [r["ttft_s"] <= TTFT + 0.05 and r["tpot_s"] <= GAP for r in recs]
    assert p["good_fraction"] == pytest.approx(sum(slo_met) / len(recs))
    # speculative statistics: reported by the Triton model, absent from OpenAI
    if protocol.startswith("triton"):
        assert p["mean_acceptance_length"] == pytest.approx(3.75)
        assert p["mean_acceptance_length_pooled"] == pytest.approx(3.75)
        assert p["mean_acceptance_length_request_mean"] == pytest.approx(3.75)
        assert p["acceptance_rate_pooled"] == pytest.approx(11 / 28)
        assert p["isl_discrepancy_pct"] == 0.0
        assert p["server_ttft_p50_s"] >= TTFT  # the server's own clock: never early either
    else:
        assert p["mean_acceptance_length"] is None
    # what the server was sent: fixed length, perf metrics, delta streaming where declared
    measured = [r for r in seen if r.get("sampling_param_max_tokens", r.get("max_tokens")) == OSL]
    assert len(measured) == 8  # 2 warm-up + 6 measured
    if protocol.startswith("triton"):
        assert all(
            r["sampling_param_ignore_eos"]
            and r["streaming_delta"]
            and r["sampling_param_return_perf_metrics"]
            for r in measured
        )
        assert all(len(r["text_input"].encode()) == 24 for r in measured)
    else:
        assert all(r["ignore_eos"] and r["stream_options"]["continuous_usage_stats"] for r in measured)
    assert summary["status"] == "complete"
    assert p["warmup"]["num_requests"] == 2 and p["warmup"]["num_errors"] == 0


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc"])
def test_nvidia_model_without_our_additions(protocol, scripted, tmp_path, byte_tokenizer_dir) -> None:
    """NVIDIA's llmapi model: no token counts, no ignore_eos, no rounds; Triton rejects unknown inputs."""
    script = Script(
        ttft_s=TTFT,
        chunk_gap_s=GAP,
        first_chunk_tokens=2,
        tokens_per_chunk=(3, 6),
        flavor="trtllm",
        natural_output_tokens=11,
    )
    with scripted(script) as server:
        summary = _sweep(server, tmp_path, byte_tokenizer_dir, protocol)
    (p,) = summary["points"]
    assert p["num_errors"] == 0  # nothing undeclared was sent (Triton would answer 400)
    assert summary["server"]["output_length_control"].startswith("none")
    assert p["output_tokens_source"] == "retokenized"
    assert p["output_tokens_total"] == 6 * 11  # actual lengths, not the requested 17
    assert p["osl_shortfall_pct"] == pytest.approx(100 * 6 / 17)
    assert p["tokens_per_chunk_hist"] == {"2": 6, "3": 6, "6": 6}  # 2 + 3 + 6 = 11
    assert p["mean_acceptance_length"] is None  # accepted/drafted known, rounds unknown: not guessed
    assert p["acceptance_rate_pooled"] == pytest.approx((2 + 5) / 14)
    assert p["input_tokens_source"] == "client tokenizer"
    recs = records(tmp_path / f"run-{protocol}")
    assert_never_early(recs, (2, 3, 6), PLAN.offsets_s[:3])
    assert_point_is_its_records(p, recs)


def test_output_length_control(scripted, tmp_path, byte_tokenizer_dir) -> None:
    script = Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), natural_output_tokens=5)
    with scripted(script) as server:
        fixed = _sweep(server, tmp_path / "a", byte_tokenizer_dir, "triton-http")
        natural = _sweep(server, tmp_path / "b", byte_tokenizer_dir, "triton-http", ignore_eos=False)
        sent = server.log.requests
    assert fixed["points"][0]["output_tokens_mean"] == OSL and fixed["points"][0]["osl_shortfall_pct"] == 0.0
    assert natural["points"][0]["output_tokens_mean"] == 5
    assert natural["server"]["output_length_control"] == "natural EOS (--no-ignore-eos)"
    assert "sampling_param_ignore_eos" not in sent[-1] and "sampling_param_min_tokens" not in sent[-1]


@pytest.mark.parametrize(
    ("protocol", "script"),
    [
        ("triton-http", Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), json_lists=True)),
        (
            "triton-grpc",
            Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), grpc_separate_final=True),
        ),
        (
            "triton-grpc",
            Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), max_tokens_datatype="UINT32"),
        ),
        (
            "openai-completions",
            Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), openai_usage=False),
        ),
        (
            "triton-http",
            Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), metrics_as_strings=True),
        ),
        (
            "triton-grpc",
            Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), metrics_as_strings=True),
        ),
    ],
    ids=[
        "http-json-lists",
        "grpc-empty-final",
        "grpc-uint32-max-tokens",
        "openai-no-usage",
        "http-metrics-as-strings",  # NVIDIA's model sends its metric tensors as BYTES
        "grpc-metrics-as-strings",
    ],
)
def test_protocol_variants(protocol, script, scripted, tmp_path, byte_tokenizer_dir) -> None:
    with scripted(script) as server:
        summary = _sweep(server, tmp_path, byte_tokenizer_dir, protocol)
    (p,) = summary["points"]
    assert p["num_errors"] == 0
    assert p["output_tokens_total"] == 6 * OSL
    assert p["tokens_per_chunk_hist"] == {"1": 6, "4": 24}
    expected_source = "retokenized" if not script.openai_usage else "num_output_tokens"
    assert p["output_tokens_source"] == expected_source
    recs = records(tmp_path / f"run-{protocol}")
    plan = plan_request(script, max_tokens=OSL, ignore_eos=True)
    assert_never_early(recs, plan.chunks, plan.offsets_s)
    assert_point_is_its_records(p, recs)
    if protocol.startswith("triton"):
        assert p["mean_acceptance_length"] == pytest.approx(4.0) and p[
            "acceptance_rate_pooled"
        ] == pytest.approx(3 / 7)
        assert p["isl_discrepancy_pct"] == 0.0  # num_input_tokens parsed too


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc", "openai-completions"])
@pytest.mark.parametrize("midstream", [False, True])
def test_errors_are_counted_not_fatal(protocol, midstream, scripted, tmp_path, byte_tokenizer_dir) -> None:
    script = Script(
        ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(4,), fail_every=3, fail_midstream=midstream
    )
    with scripted(script) as server:
        summary = _sweep(
            server, tmp_path, byte_tokenizer_dir, protocol, num_requests=9, warmup=0, concurrency=(3,)
        )
    (p,) = summary["points"]
    assert p["num_requests"] == 9 and p["num_errors"] == 3 and p["num_completed"] == 6
    assert sum(p["errors"].values()) == 3 and all("scripted failure" in m for m in p["errors"])
    assert p["output_tokens_total"] == 6 * OSL  # failed requests add nothing
    assert summary["status"] == "complete"


def test_unreachable_server_and_unknown_model(scripted, tmp_path, byte_tokenizer_dir) -> None:
    from dflash_trt.errors import DFlashTrtError, UsageError

    with pytest.raises(DFlashTrtError, match="cannot reach the server"):
        run_sweep(
            SweepConfig(
                url="http://127.0.0.1:9",
                out=str(tmp_path / "x"),
                protocol="triton-http",
                concurrency=(1,),
                isl=8,
                osl=4,
                tokenizer=str(byte_tokenizer_dir),
            )
        )
    with scripted(SCRIPT) as server:
        for protocol in ("triton-http", "triton-grpc", "openai-completions"):
            with pytest.raises(UsageError, match="--model='nope'"):
                _sweep(server, tmp_path / protocol, byte_tokenizer_dir, protocol, model="nope")


def test_request_rate_mode_poisson_arrivals(scripted, tmp_path, byte_tokenizer_dir) -> None:
    rate, n = 40.0, 16
    with scripted(Script(ttft_s=0.01, chunk_gap_s=0.005, tokens_per_chunk=(8,))) as server:
        summary = _sweep(
            server,
            tmp_path,
            byte_tokenizer_dir,
            concurrency=(),
            request_rate=(rate,),
            num_requests=n,
            warmup=1,
        )
    (p,) = summary["points"]
    assert p["mode"] == "request_rate" and p["request_rate"] == rate and p["num_errors"] == 0
    # the same seeded gamma(1) draws the sweep made: request i is sent no sooner than the sum of
    # draws 1..i after the phase starts (late arrivals are sent at once, never early)
    rng = random.Random(f"dflash-trt-bench-arrivals:0:request_rate={rate:g}")
    due = list(itertools.accumulate(rng.gammavariate(1.0, 1.0 / rate) for _ in range(n)))
    starts = sorted(r["start_s"] for r in records(tmp_path / "run-triton-http"))
    assert len(starts) == n and all(got >= want for got, want in zip(starts, due)), (starts, due)
    assert p["achieved_request_rate"] == pytest.approx((n - 1) / (starts[-1] - starts[0]))
    assert p["interactivity_vllm_aggregate"] is None  # no concurrency to divide by


def test_max_concurrency_gate_and_duration_mode(scripted, tmp_path, byte_tokenizer_dir) -> None:
    with scripted(Script(ttft_s=0.02, chunk_gap_s=0.01, tokens_per_chunk=(8,))) as server:
        gated = _sweep(
            server,
            tmp_path / "g",
            byte_tokenizer_dir,
            concurrency=(),
            request_rate=(500.0,),
            max_concurrency=2,
            num_requests=8,
            warmup=0,
        )
        assert server.log.peak_active <= 2
        timed = _sweep(
            server,
            tmp_path / "d",
            byte_tokenizer_dir,
            concurrency=(2,),
            num_requests=None,
            duration_s=0.4,
            warmup=0,
        )
    assert gated["points"][0]["num_completed"] == 8
    p = timed["points"][0]
    # each request takes at least 40 ms, and a slot starts one only before the 0.4 s deadline: two
    # slots start at most 2 x 10 requests (and at least the first of each)
    assert 2 <= p["num_requests"] == len(records(tmp_path / "d" / "run-triton-http")) <= 20
    assert p["num_errors"] == 0
