# SPDX-License-Identifier: Apache-2.0
"""Sweeps against the scripted server over every protocol: each metric equals its known schedule.

Schedule used throughout: first chunk of 2 tokens at TTFT = 60 ms, then chunks of 3, 6, 3, 3
tokens every 25 ms (OSL 17). So E2EL = 160 ms, TPOT = 100 ms / 16 = 6.25 ms, the inter-chunk
gap is 25 ms, 4 rounds accept 2 + 5 + 2 + 2 = 11 drafts (tau = 3.75) out of 4 x 7 drafted.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from dflash_trt.bench.sweep import SweepConfig, run_sweep
from tests.bench.scripted_server import Script, plan_request

TTFT, GAP, OSL = 0.06, 0.025, 17
SCRIPT = Script(ttft_s=TTFT, chunk_gap_s=GAP, first_chunk_tokens=2, tokens_per_chunk=(3, 6), draft_len=7)
TPOT = 4 * GAP / (OSL - 1)
OVERHEAD = 0.02  # loopback + parsing + scheduler wake-up, generously (2-core CI)
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


def test_schedule_is_what_the_docstring_says() -> None:
    plan = plan_request(SCRIPT, max_tokens=OSL, ignore_eos=True)
    assert plan.chunks == (2, 3, 6, 3, 3)
    assert plan.offsets_s == pytest.approx((0.06, 0.085, 0.11, 0.135, 0.16))
    assert plan.stats_after(4)["mean_acceptance_length"] == pytest.approx(3.75)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_metric_matches_the_schedule(
    protocol, scripted, tmp_path, byte_tokenizer_dir, chat_tokenizer_dir
) -> None:
    tok = chat_tokenizer_dir if protocol == "openai-chat" else byte_tokenizer_dir
    with scripted(SCRIPT) as server:
        summary = _sweep(server, tmp_path, tok, protocol, slo_ttft_s=TTFT + 0.05, slo_tpot_s=TPOT * 1.5)
        seen = list(server.log.requests)
    (p,) = summary["points"]
    assert p["num_errors"] == 0 and p["num_completed"] == 6
    # counts: from the server, exact
    assert p["output_tokens_total"] == 6 * OSL
    assert p["output_tokens_source"] == ("usage" if protocol.startswith("openai") else "num_output_tokens")
    assert p["tokens_per_chunk_hist"] == {"2": 6, "3": 18, "6": 6}
    assert p["mean_tokens_per_chunk_after_first"] == pytest.approx(15 / 4)
    # latencies: the schedule, within timer tolerance
    for stat in ("p50", "p90", "p99"):
        assert TTFT <= p[f"ttft_{stat}_s"] < TTFT + OVERHEAD
        assert TTFT + 4 * GAP <= p[f"e2el_{stat}_s"] < TTFT + 4 * GAP + OVERHEAD
        assert p[f"tpot_{stat}_s"] == pytest.approx(TPOT, rel=0.08)
    assert p["icl_p50_s"] == pytest.approx(GAP, abs=0.004)
    # per-token ITL: 1 zero, then the gap spread over 3 or 6 tokens; the mean equals TPOT
    assert p["itl_mean_s"] == pytest.approx(TPOT, rel=0.08)
    assert p["itl_p50_s"] == pytest.approx(GAP / 3, rel=0.15)
    assert p["tokens_per_s_per_user_p50"] == pytest.approx(1 / TPOT, rel=0.08)
    assert p["interactivity_inferencex_p50"] == pytest.approx(1 / p["tpot_p50_s"])
    # throughput: the definitions, and three waves of two requests
    assert p["output_tokens_per_s"] == pytest.approx(6 * OSL / p["duration_s"])
    assert p["total_tokens_per_s_per_gpu"] == pytest.approx(p["total_tokens_per_s"])
    assert 3 * (TTFT + 4 * GAP) <= p["duration_s"] < 3 * (TTFT + 4 * GAP + 2 * OVERHEAD)
    assert p["achieved_concurrency"] == pytest.approx(2.0, rel=0.1)
    assert p["good_fraction"] == 1.0
    # speculative statistics: reported by the Triton model, absent from OpenAI
    if protocol.startswith("triton"):
        assert p["mean_acceptance_length"] == pytest.approx(3.75)
        assert p["mean_acceptance_length_pooled"] == pytest.approx(3.75)
        assert p["mean_acceptance_length_request_mean"] == pytest.approx(3.75)
        assert p["acceptance_rate_pooled"] == pytest.approx(11 / 28)
        assert p["isl_discrepancy_pct"] == 0.0
        assert TTFT <= p["server_ttft_p50_s"] < TTFT + OVERHEAD
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
    assert p["tpot_p50_s"] == pytest.approx(2 * GAP / 10, rel=0.08)


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
    assert p["tpot_p50_s"] == pytest.approx(4 * 0.01 / 16, rel=0.1)
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
    # the same seeded gamma(1) draws the sweep made: sends are spaced by draws 2..n
    rng = random.Random(f"dflash-trt-bench-arrivals:0:request_rate={rate:g}")
    draws = [rng.gammavariate(1.0, 1.0 / rate) for _ in range(n)]
    assert p["achieved_request_rate"] == pytest.approx((n - 1) / sum(draws[1:]), rel=0.1)
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
    # each request takes 40 ms: two slots for 0.4 s start ~20 requests, none after the deadline
    assert 12 <= p["num_requests"] <= 24 and p["num_errors"] == 0
