# SPDX-License-Identifier: Apache-2.0
"""Metric definitions on hand-built responses: every number is checked against its closed form."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from dflash_trt.bench.metrics import (
    DEFINITIONS,
    RawResult,
    RequestRecord,
    Retokenizer,
    Slo,
    build_record,
    percentile,
    summarize_point,
    weighted_percentile,
)

_STAT = re.compile(r"_(mean|p\d+(?:_\d+)?)(?=(_s)?$)")


def definition_for(key: str) -> str | None:
    """The definition of a point key: exact, or of its family (ttft_p90_s -> ttft_s, ..._p50 -> ..._pX)."""
    if key in DEFINITIONS:
        return DEFINITIONS[key]
    for candidate in (_STAT.sub("", key), _STAT.sub("_pX", key), _STAT.sub("", key) + "_s"):
        if candidate in DEFINITIONS:
            return DEFINITIONS[candidate]
    return None


def itls_of(r: RequestRecord) -> list[float]:
    """DEFINITIONS['itl_s'] for one request, written out token by token."""
    ct, co = r.chunk_tokens or [], r.chunk_offsets_s
    out = [0.0] * (ct[0] - 1) if ct else []
    for j in range(1, len(co)):
        out += [(co[j] - co[j - 1]) / ct[j]] * ct[j]
    return out


def _raw(
    index: int, send: float, times: list[float], counts: list[int | None], *, text: bool = True
) -> RawResult:
    """Responses at `times` carrying cumulative `counts` tokens (one 'x' per token as text)."""
    raw = RawResult(index=index, send_t=send)
    prev = 0
    for t, c in zip(times, counts):
        n = (c if c is not None else prev) - prev
        raw.add_delta(t, c, "x" * n if text else "")
        prev = c if c is not None else prev
    raw.count_source = "num_output_tokens"
    raw.done_t = times[-1] if times else send
    return raw


def _rec(raw: RawResult, **kw):
    defaults = dict(
        point="p",
        phase="measure",
        t_ref=0.0,
        input_tokens_client=10,
        requested_output_tokens=None,
        retokenizer=None,
    )
    defaults.update(kw)
    return build_record(raw, **defaults)


def test_multi_token_chunks_ttft_tpot_itl_exact() -> None:
    # sent at 1.0; first chunk (2 tokens) at 1.1; then chunks of 4, 4, 3 tokens every 0.03 s
    raw = _raw(0, 1.0, [1.1, 1.13, 1.16, 1.19], [2, 6, 10, 13])
    r = _rec(raw)
    assert r.ok and r.output_tokens == 13 and r.output_tokens_source == "num_output_tokens"
    assert r.ttft_s == pytest.approx(0.1)
    assert r.e2el_s == pytest.approx(0.19)
    assert r.tpot_s == pytest.approx(0.09 / 12)  # (E2EL - TTFT) / (OSL - 1)
    assert r.chunk_tokens == [2, 4, 4, 3]
    assert r.icls == pytest.approx([0.03, 0.03, 0.03])
    itl = itls_of(r)
    assert len(itl) == 12  # OSL - 1 intervals
    assert itl[0] == 0.0  # the second token of the first chunk arrived with the first
    assert itl[1:5] == pytest.approx([0.0075] * 4) and itl[-3:] == pytest.approx([0.01] * 3)
    assert sum(itl) / len(itl) == pytest.approx(r.tpot_s)  # mean ITL == TPOT by construction
    p = summarize_point([r], num_gpus=1, concurrency=1, slo=Slo())
    assert p["itl_mean_s"] == pytest.approx(sum(itl) / len(itl))
    for q in ("p50", "p90", "p99"):  # the pooled, token-weighted percentiles of the same intervals
        assert p[f"itl_{q}_s"] == pytest.approx(float(np.percentile(itl, float(q[1:]))))


def test_tokens_are_never_counted_per_chunk() -> None:
    # 1 + 3 chunks of 5 tokens: a chunk-counting harness would report OSL 4 and TPOT 3x too large
    raw = _raw(0, 0.0, [0.05, 0.07, 0.09, 0.11], [1, 6, 11, 16])
    p = summarize_point([_rec(raw)], num_gpus=1, concurrency=1, slo=Slo())
    assert p["output_tokens_total"] == 16
    assert p["tpot_p50_s"] == pytest.approx(0.06 / 15)
    assert p["tokens_per_s_per_user_p50"] == pytest.approx(15 / 0.06)
    assert p["icl_p50_s"] == pytest.approx(0.02)  # vLLM-style "ITL" = chunk gap
    assert p["itl_p50_s"] == pytest.approx(0.004)
    assert p["tokens_per_chunk_hist"] == {"1": 1, "5": 3}
    assert p["mean_tokens_per_chunk_after_first"] == pytest.approx(5.0)


def test_responses_without_new_tokens_are_not_chunks() -> None:
    # a role-only first response (count 0) and an empty final response carry no token
    raw = _raw(0, 0.0, [0.01, 0.05, 0.08, 0.09], [0, 3, 7, 7])
    r = _rec(raw)
    assert r.num_responses == 4 and r.num_chunks == 2
    assert r.ttft_s == pytest.approx(0.05) and r.e2el_s == pytest.approx(0.08)
    assert r.done_s == pytest.approx(0.09)


def test_point_throughput_interactivity_and_goodput_exact() -> None:
    # 3 requests, 2 in flight: known send times, TTFTs and TPOTs; one error
    recs = [
        _rec(_raw(0, 0.0, [0.1, 0.3], [1, 11]), input_tokens_client=100),  # TPOT 0.02
        _rec(_raw(1, 0.0, [0.2, 0.6], [1, 11]), input_tokens_client=100),  # TPOT 0.04
        _rec(_raw(2, 0.3, [0.35, 0.45], [1, 11]), input_tokens_client=100),  # TPOT 0.01
    ]
    bad = RawResult(index=3, send_t=0.6, error="HTTP 500: boom", done_t=0.61)
    recs.append(_rec(bad))
    p = summarize_point(recs, num_gpus=2, concurrency=2, slo=Slo(ttft_s=0.15, tpot_s=0.03))
    assert p["num_requests"] == 4 and p["num_completed"] == 3 and p["num_errors"] == 1
    assert p["errors"] == {"HTTP 500: boom": 1}
    assert p["duration_s"] == pytest.approx(0.61)  # first send -> last response (the error at 0.61)
    assert p["output_tokens_per_s"] == pytest.approx(33 / 0.61)
    assert p["total_tokens_per_s"] == pytest.approx(333 / 0.61)
    assert p["total_tokens_per_s_per_gpu"] == pytest.approx(333 / 0.61 / 2)
    assert p["output_tokens_per_s_per_gpu"] == pytest.approx(33 / 0.61 / 2)
    assert p["request_throughput_per_s"] == pytest.approx(3 / 0.61)
    assert p["ttft_p50_s"] == pytest.approx(0.1)
    assert p["tpot_p50_s"] == pytest.approx(0.02)
    assert p["tokens_per_s_per_user_p50"] == pytest.approx(50.0)
    assert p["tokens_per_s_per_user_mean"] == pytest.approx((50 + 25 + 100) / 3)
    assert p["interactivity_aiperf_mean"] == p["tokens_per_s_per_user_mean"]
    assert p["interactivity_inferencex_p90"] == pytest.approx(1 / np.percentile([0.02, 0.04, 0.01], 90))
    assert p["interactivity_vllm_aggregate"] == pytest.approx(33 / 0.61 / 2)
    assert p["interactivity_e2e_norm_p90"] == pytest.approx(
        1 / np.percentile([0.3 / 11, 0.6 / 11, 0.15 / 11], 90)
    )
    assert p["prefill_tokens_per_s_per_user_p50"] == pytest.approx(1000.0)  # median of 100 / TTFT
    # good: request 0 (ttft 0.1, tpot 0.02) and request 2 (0.05, 0.01); request 1 misses TTFT; the error counts
    assert p["goodput_requests_per_s"] == pytest.approx(2 / 0.61)
    assert p["goodput_output_tokens_per_s"] == pytest.approx(22 / 0.61)
    assert p["good_fraction"] == pytest.approx(0.5)
    busy = 0.3 + 0.6 + 0.15 + 0.01
    assert p["achieved_concurrency"] == pytest.approx(busy / 0.61)


def test_acceptance_length_pooled_vs_request_mean_and_never_guessed() -> None:
    a = _raw(0, 0.0, [0.1, 0.2], [1, 9])
    a.spec = {"total_accepted_draft_tokens": 6, "num_rounds": 2, "total_draft_tokens": 14}  # tau 4
    b = _raw(1, 0.0, [0.1, 0.2], [1, 9])
    b.spec = {"total_accepted_draft_tokens": 2, "num_rounds": 6, "total_draft_tokens": 42}  # tau 4/3
    ra, rb = _rec(a), _rec(b)
    assert (
        ra.acceptance_length == pytest.approx(4.0) and ra.acceptance_length_source == "1 + accepted / rounds"
    )
    p = summarize_point([ra, rb], num_gpus=1, concurrency=2, slo=Slo())
    assert p["mean_acceptance_length_pooled"] == pytest.approx(1 + 8 / 8)
    assert p["mean_acceptance_length_request_mean"] == pytest.approx((4 + 4 / 3) / 2)
    assert p["mean_acceptance_length"] == p["mean_acceptance_length_pooled"]
    assert p["acceptance_rate_pooled"] == pytest.approx(8 / 56)

    # the server's own tau wins per request
    c = _raw(2, 0.0, [0.1, 0.2], [1, 9])
    c.spec = {"mean_acceptance_length": 3.25, "total_accepted_draft_tokens": 9, "num_rounds": 4}
    assert _rec(c).acceptance_length == pytest.approx(3.25)

    # NVIDIA's model: accepted and drafted but no rounds -> tau is unknown, not derived from a guessed K
    d = _raw(3, 0.0, [0.1, 0.2], [1, 9])
    d.spec = {"total_accepted_draft_tokens": 6, "total_draft_tokens": 14, "acceptance_rate": 6 / 14}
    rd = _rec(d)
    assert rd.acceptance_length is None
    p = summarize_point([rd], num_gpus=1, concurrency=1, slo=Slo())
    assert p["mean_acceptance_length"] is None and p["mean_acceptance_length_source"] is None
    assert p["acceptance_rate_pooled"] == pytest.approx(6 / 14)

    # no speculative statistics at all
    p = summarize_point([_rec(_raw(4, 0.0, [0.1, 0.2], [1, 9]))], num_gpus=1, concurrency=1, slo=Slo())
    assert p["mean_acceptance_length"] is None and p["acceptance_rate_pooled"] is None


def test_retokenized_counts_accumulated_and_delta(byte_tokenizer) -> None:
    retok = Retokenizer(byte_tokenizer)
    # accumulated text (NVIDIA's default): each response repeats the text so far
    raw = RawResult(index=0, send_t=0.0)
    for t, text in [(0.1, "ab"), (0.12, "abcdef"), (0.14, "abcdefghij")]:
        raw.add_accumulated(t, None, text)
    r = _rec(raw, retokenizer=retok)
    assert r.output_tokens == 10 and r.output_tokens_source == "retokenized"
    assert r.chunk_tokens == [2, 4, 4]
    # delta text: same stream as pieces
    raw = RawResult(index=1, send_t=0.0)
    for t, piece in [(0.1, "ab"), (0.12, "cdef"), (0.14, "ghij")]:
        raw.add_delta(t, None, piece)
    assert _rec(raw, retokenizer=retok).chunk_tokens == [2, 4, 4]
    # multi-byte characters: 'é' is 2 byte tokens, '€' is 3
    raw = RawResult(index=2, send_t=0.0)
    for t, piece in [(0.1, "é"), (0.12, "€a")]:
        raw.add_delta(t, None, piece)
    assert _rec(raw, retokenizer=retok).chunk_tokens == [2, 4]


def test_usage_final_only(byte_tokenizer) -> None:
    # OpenAI without continuous usage: the count arrives only with the last (usage-only) response
    def make() -> RawResult:
        raw = RawResult(index=0, send_t=0.0, count_source="usage")
        raw.add_delta(0.1, None, "abc")
        raw.add_delta(0.2, None, "defg")
        raw.add_delta(0.21, 7, "")
        return raw

    r = _rec(make(), retokenizer=Retokenizer(byte_tokenizer))
    assert r.output_tokens == 7 and r.chunk_tokens == [3, 4]
    assert r.output_tokens_source == "usage (final only); chunks re-tokenised"
    r = _rec(make(), retokenizer=None)  # no tokenizer: TPOT still exact, per-chunk counts unknown
    assert r.output_tokens == 7 and r.chunk_tokens is None and r.num_chunks == 2
    assert r.tpot_s == pytest.approx(0.1 / 6)


def test_empty_response_is_an_error() -> None:
    raw = RawResult(index=0, send_t=0.0, done_t=0.5)
    r = _rec(raw)
    assert not r.ok and r.error == "the response carried no output tokens"


def test_weighted_percentile_equals_expanded() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 12)
        values = [rng.uniform(0, 1) for _ in range(n)]
        weights = [rng.randint(0, 5) for _ in range(n)]
        if sum(weights) == 0:
            weights[0] = 1
        expanded = [v for v, w in zip(values, weights) for _ in range(w)]
        for q in (0, 10, 50, 90, 99, 99.9, 100):
            assert weighted_percentile(values, weights, q) == pytest.approx(float(np.percentile(expanded, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_every_point_metric_is_defined() -> None:
    p = summarize_point(
        [_rec(_raw(0, 0.0, [0.1, 0.2], [1, 9]))], num_gpus=1, concurrency=1, slo=Slo(ttft_s=1.0)
    )
    undefined = [k for k in p if definition_for(k) is None]
    assert not undefined, f"metrics without a definition: {undefined}"
    assert definition_for("ttft_p99_9_s") == DEFINITIONS["ttft_s"]
    assert definition_for("interactivity_inferencex_p90") == DEFINITIONS["interactivity_inferencex_pX"]
    assert definition_for("tokens_per_s_per_user_p10") == DEFINITIONS["tokens_per_s_per_user"]
    assert definition_for("no_such_metric") is None
