# SPDX-License-Identifier: Apache-2.0
"""Per-request records and per-point statistics. Every metric's formula is in `DEFINITIONS`.

Timing is taken on the client with `time.perf_counter()`: a request's clock starts just before
it is sent, and a response's time is when its bytes reached the client. A *chunk* is a streamed
response that carries at least one new output token; output tokens are counted from the server
(`num_output_tokens`, OpenAI `usage`) or by re-tokenising the streamed text, never one per chunk.
Speculative decoding puts several tokens into one chunk.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# The formula of every metric written to summary.json (also documented in bench/README.md).
DEFINITIONS: dict[str, str] = {
    "clock": "client time.perf_counter(); a request starts just before it is sent; a response counts when its bytes arrive",
    "chunk": "a streamed response that carries >= 1 new output token (under speculative decoding a chunk carries ~tau tokens)",
    "output_tokens": "counted from the server's num_output_tokens / OpenAI usage.completion_tokens, else by re-tokenising the streamed text with --tokenizer; never one token per chunk (see output_tokens_source)",
    "input_tokens": "the server's num_input_tokens / usage.prompt_tokens when reported, else the client's count with --tokenizer (see input_tokens_source)",
    "ttft_s": "time to first token: arrival of the first chunk - request send",
    "e2el_s": "end-to-end latency: arrival of the last chunk - request send",
    "tpot_s": "time per output token, per request: (e2el - ttft) / (output_tokens - 1); undefined when output_tokens < 2",
    "itl_s": "inter-token latency, pooled over requests: a chunk of k tokens arriving g s after the previous chunk contributes k intervals of g/k; tokens beyond the first in the first chunk contribute intervals of 0; so a request's mean ITL equals its TPOT",
    "icl_s": "inter-chunk latency, pooled over requests: gaps between consecutive chunks (what vLLM/SGLang call ITL; a gap covers ~tau tokens under speculation)",
    "percentiles": "numpy linear interpolation over requests (or over pooled intervals for itl/icl); p99_9 = 99.9th percentile",
    "duration_s": "first request send -> last response arrival, measured phase only (warm-up excluded)",
    "output_tokens_per_s": "sum(output_tokens of successful requests) / duration_s",
    "input_tokens_per_s": "sum(input_tokens of successful requests) / duration_s",
    "total_tokens_per_s": "sum(input_tokens + output_tokens of successful requests) / duration_s",
    "request_throughput_per_s": "successful requests / duration_s",
    "total_tokens_per_s_per_gpu": "total_tokens_per_s / num_gpus (InferenceX tput_per_gpu); the default y axis of plots",
    "output_tokens_per_s_per_gpu": "output_tokens_per_s / num_gpus (vLLM plot_pareto uses output tokens)",
    "tokens_per_s_per_user": "PRIMARY interactivity: per request 1 / tpot_s, then mean / p10 / p50 / p90 over requests (p90 is the fast tail, p10 the slow tail); excludes TTFT",
    "interactivity_inferencex_pX": "InferenceX intvty: 1 / (pX of tpot_s), taken per statistic, so p90 is the slow tail",
    "interactivity_aiperf_mean": "AIPerf output_token_throughput_per_user: mean over requests of 1 / tpot_s (= tokens_per_s_per_user_mean)",
    "interactivity_vllm_aggregate": "vLLM plot_pareto tokens/s/user: output_tokens_per_s / concurrency (includes TTFT and idle time; not 1/TPOT); null in request-rate mode without --max-concurrency",
    "interactivity_e2e_norm_p90": "InferenceX AgentX E2E-normalised interactivity: 1 / p90 over requests of (e2el_s / output_tokens); includes TTFT",
    "prefill_tokens_per_s_per_user_p50": "median over requests of input_tokens / ttft_s",
    "e2e_output_tokens_per_s_per_user_p50": "median over requests of output_tokens / e2el_s",
    "goodput_requests_per_s": "requests that succeeded and met every SLO given (--slo-ttft, --slo-tpot, --slo-e2el) / duration_s; a request with < 2 output tokens has no TPOT and meets the TPOT SLO vacuously",
    "goodput_output_tokens_per_s": "sum(output_tokens of good requests) / duration_s",
    "good_fraction": "good requests / all measured requests, errors included",
    "acceptance_length": "tau, per request: the server's mean_acceptance_length, else 1 + total_accepted_draft_tokens / num_rounds when the server reports rounds; never guessed (null otherwise). tau includes the bonus token",
    "mean_acceptance_length_pooled": "1 + sum(accepted draft tokens) / sum(rounds) over requests that report both (counter ratio, as vLLM / AIPerf)",
    "mean_acceptance_length_request_mean": "mean over requests of the per-request acceptance_length (as z-lab benchmark.py)",
    "mean_acceptance_length": "mean_acceptance_length_pooled when available, else mean_acceptance_length_request_mean (see mean_acceptance_length_source); null when the server reports no speculative statistics",
    "acceptance_rate_pooled": "sum(accepted draft tokens) / sum(drafted tokens)",
    "overturned_draft_tokens": "per request: drafts whose DFlash 2 selector pick is not the drafter's argmax (the server's total_overturned_draft_tokens; 0 with v1 drafters, null when the server does not report it)",
    "overturn_rate_pooled": "sum(overturned draft tokens) / sum(drafted tokens) over requests that report both: the DFlash 2 selector's overturn rate (0 with v1 drafters)",
    "tokens_per_chunk_hist": "histogram of tokens per chunk over all chunks (a free tau proxy when the server streams every step)",
    "mean_tokens_per_chunk_after_first": "sum(tokens in chunks after the first) / number of such chunks",
    "achieved_concurrency": "sum(request durations, send -> final response) / duration_s (SGLang 'Concurrency'); compare with the target to spot a client-bound run",
    "isl_discrepancy_pct": "mean over requests of |server input tokens - client input tokens| / client input tokens * 100",
    "osl_shortfall_pct": "mean over requests of (requested - generated output tokens) / requested * 100 (0 when the server honours ignore_eos / min_tokens)",
    "server_ttft_p50_s": "median of (first_token_time_ns - arrival_time_ns) / 1e9 from the server's perf metrics; ttft_p50_s minus this is front-end + network overhead",
    "client_cpu_s": "client process CPU time (user + system, all threads) during the measured phase",
    "client_cpu_us_per_output_token": "client_cpu_s * 1e6 / sum(output_tokens)",
    "client_cpu_us_per_chunk": "client_cpu_s * 1e6 / number of chunks",
    "client_loop_lag_p99_ms": "99th percentile of the event loop's wake-up delay, sampled every 10 ms during the measured phase",
    "client_loop_lag_max_ms": "largest event-loop wake-up delay during the measured phase",
    "client_cpu_util": "client_cpu_s / client_wall_s (1.0 = one core busy)",
    "client_wall_s": "wall time of the measured phase as the client saw it",
    "mean_tokens_per_chunk": "sum(tokens in chunks) / number of chunks (first chunks included)",
    "num_requests": "measured requests (warm-up excluded), errors included",
    "num_completed": "measured requests that succeeded",
    "num_errors": "measured requests that failed (HTTP/gRPC error, error event, timeout, no output token); never fatal",
    "num_resends": "POSTs sent again because the server had closed their kept-alive connection before answering (never an error)",
    "errors": "the most frequent error messages with their counts",
    "num_chunks": "chunks received by successful requests",
    "num_requests_with_spec_stats": "successful requests whose acceptance length is known",
    "output_tokens_total": "sum(output_tokens) of successful requests",
    "input_tokens_total": "sum(input_tokens) of successful requests",
    "output_tokens_mean": "output_tokens_total / num_completed",
    "input_tokens_mean": "input_tokens_total / successful requests with a known input count",
    "output_tokens_source": "where output tokens were counted: num_output_tokens | usage | retokenized (with counts per source when mixed)",
    "input_tokens_source": "where input tokens were counted: server | client tokenizer",
    "mean_acceptance_length_source": "which of the two tau aggregates mean_acceptance_length holds",
    "intended_concurrency": "the closed-loop target (request-rate mode: the --max-concurrency gate, or null)",
    "achieved_request_rate": "request-rate mode: (measured requests - 1) / (last send - first send)",
    "warmup": "the warm-up phase, reported apart: requests, errors, duration_s, ttft_p50_s, tpot_p50_s",
}


def definitions_markdown() -> str:
    """DEFINITIONS as a Markdown table (bench/README.md embeds it; a test keeps the two equal)."""
    rows = ["| metric | definition |", "|---|---|"]
    rows += [f"| `{k}` | {v.replace('|', '&#124;')} |" for k, v in DEFINITIONS.items()]
    return "\n".join(rows) + "\n"


@dataclass(slots=True)
class RawResult:
    """What a client saw for one request (absolute perf_counter times). Filled on the hot path."""

    index: int
    send_t: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each response
    counts: list[int | None] = field(default_factory=list)  # cumulative output tokens the server reported
    text_lens: list[int] = field(default_factory=list)  # cumulative characters of generated text
    pieces: list[str] = field(default_factory=list)  # delta mode: the text pieces
    accumulated: str | None = None  # accumulated mode: the latest full text
    count_source: str | None = None  # "num_output_tokens" | "usage" when the server counts
    done_t: float | None = None  # final response (or end of stream)
    error: str | None = None
    input_tokens_server: int | None = None
    finish_reason: str | None = None
    spec: dict[str, float] = field(default_factory=dict)  # latest server perf metrics
    resends: int = 0  # sent again after failing before the server answered (a closed keep-alive)

    def add_delta(self, t: float, count: int | None, piece: str) -> None:
        self.times.append(t)
        self.counts.append(count)
        if piece:
            self.pieces.append(piece)
        self.text_lens.append((self.text_lens[-1] if self.text_lens else 0) + len(piece))

    def add_accumulated(self, t: float, count: int | None, text: str) -> None:
        self.times.append(t)
        self.counts.append(count)
        self.accumulated = text
        self.text_lens.append(len(text))

    @property
    def text(self) -> str:
        return self.accumulated if self.accumulated is not None else "".join(self.pieces)


@dataclass(slots=True)
class RequestRecord:
    """One request, as written to requests.jsonl (times in seconds, relative to its send)."""

    point: str
    phase: str  # "warmup" | "measure"
    index: int
    ok: bool
    error: str | None
    start_s: float  # send time, relative to the start of the point's phase
    ttft_s: float | None
    e2el_s: float | None
    done_s: float | None  # final response (or error) - send
    tpot_s: float | None
    input_tokens: int | None
    input_tokens_source: str | None
    input_tokens_client: int | None
    input_tokens_server: int | None
    output_tokens: int | None
    output_tokens_source: str | None
    requested_output_tokens: int | None
    finish_reason: str | None
    num_responses: int
    num_chunks: int
    chunk_offsets_s: list[float]
    chunk_tokens: list[int] | None
    accepted_draft_tokens: int | None = None
    draft_tokens: int | None = None
    num_rounds: int | None = None
    acceptance_length: float | None = None
    acceptance_length_source: str | None = None
    acceptance_rate: float | None = None
    overturned_draft_tokens: int | None = None  # DFlash 2: drafts the selector picked over the argmax
    server_ttft_s: float | None = None
    server_decode_s: float | None = None
    resends: int = 0  # sent again after the server closed its kept-alive connection unanswered

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def icls(self) -> list[float]:
        c = self.chunk_offsets_s
        return [c[j] - c[j - 1] for j in range(1, len(c))]


class Retokenizer:
    """Counts the tokens of streamed text at response boundaries, off the hot path."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def cumulative_counts(self, text: str, boundaries: Sequence[int]) -> list[int]:
        """Tokens fully contained in text[:b] for each boundary b (the last one is the total)."""
        tok = self.tokenizer
        if getattr(tok, "is_fast", False):
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ends = [end for _, end in enc["offset_mapping"]]
            # offsets are non-decreasing for left-to-right tokenizers; guard anyway
            for i in range(1, len(ends)):
                ends[i] = max(ends[i], ends[i - 1])
            total = len(ends)
            return [total if b >= len(text) else bisect.bisect_right(ends, b) for b in boundaries]
        return [len(tok(text[:b], add_special_tokens=False)["input_ids"]) for b in boundaries]


def _round(x: float | None, nd: int = 7) -> float | None:
    return None if x is None else round(x, nd)


def build_record(
    raw: RawResult,
    *,
    point: str,
    phase: str,
    t_ref: float,
    input_tokens_client: int | None,
    requested_output_tokens: int | None,
    retokenizer: Retokenizer | None,
) -> RequestRecord:
    """Turn what the client saw into a record (token counts, chunks, TTFT, TPOT, tau)."""
    counts = _token_counts(raw, retokenizer)
    error = raw.error
    if error is None and not counts.chunk_times:
        error = "the response carried no output tokens"
    ok = error is None
    chunk_times, osl = counts.chunk_times, counts.total
    ttft = chunk_times[0] - raw.send_t if chunk_times else None
    e2el = chunk_times[-1] - raw.send_t if chunk_times else None
    tpot = None
    if ok and ttft is not None and e2el is not None and osl is not None and osl >= 2:
        tpot = (e2el - ttft) / (osl - 1)
    done_t = raw.done_t if raw.done_t is not None else (raw.times[-1] if raw.times else None)
    in_server = raw.input_tokens_server
    if in_server is not None:
        input_tokens, in_source = in_server, "server"
    elif input_tokens_client is not None:
        input_tokens, in_source = input_tokens_client, "client tokenizer"
    else:
        input_tokens, in_source = None, None
    return RequestRecord(
        point=point,
        phase=phase,
        index=raw.index,
        ok=ok,
        error=error,
        start_s=round(raw.send_t - t_ref, 7),
        ttft_s=_round(ttft),
        e2el_s=_round(e2el),
        done_s=_round(done_t - raw.send_t) if done_t is not None else None,
        tpot_s=_round(tpot, 9),
        input_tokens=input_tokens,
        input_tokens_source=in_source,
        input_tokens_client=input_tokens_client,
        input_tokens_server=in_server,
        output_tokens=osl if ok else None,
        output_tokens_source=counts.source,
        requested_output_tokens=requested_output_tokens,
        finish_reason=raw.finish_reason,
        num_responses=len(raw.times),
        num_chunks=len(chunk_times),
        chunk_offsets_s=[round(t - raw.send_t, 7) for t in chunk_times],
        chunk_tokens=counts.chunk_tokens,
        **_speculation(raw.spec),
        resends=raw.resends,
    )


@dataclass(slots=True)
class _Counts:
    """Output tokens of one request: in all, per chunk and where the counts came from."""

    total: int | None
    source: str | None
    chunk_times: list[float]  # arrival of every response that carried new tokens
    chunk_tokens: list[int] | None  # tokens each of them carried (None: unknown per chunk)


def _token_counts(raw: RawResult, retokenizer: Retokenizer | None) -> _Counts:
    """Cumulative counts from the server on every response that grew the text; else the text
    re-tokenised at response boundaries; else the server's final count alone."""
    n = len(raw.times)
    lens = raw.text_lens
    grew = [lens[k] > (lens[k - 1] if k else 0) for k in range(n)]
    server_counts = [c for c in raw.counts if c is not None]
    per_response = bool(server_counts) and all(raw.counts[k] is not None for k in range(n) if grew[k])
    cum: list[int] | None = None
    osl: int | None = None
    source: str | None = None
    if per_response:
        cum, last = [], 0
        for c in raw.counts:
            last = last if c is None else c
            cum.append(last)
        source = raw.count_source or "server"
    elif retokenizer is not None and n:
        text = raw.text
        cum = retokenizer.cumulative_counts(text, [min(b, len(text)) for b in lens])
        source = "retokenized"
        if server_counts:
            osl = server_counts[-1]
            source = f"{raw.count_source or 'server'} (final only); chunks re-tokenised"
    elif server_counts:
        osl = server_counts[-1]
        source = f"{raw.count_source or 'server'} (final only); no per-chunk counts"
    if cum is None:
        return _Counts(total=osl, source=source, chunk_times=[raw.times[k] for k in range(n) if grew[k]],
                       chunk_tokens=None)  # fmt: skip
    chunk_times: list[float] = []
    chunk_tokens: list[int] = []
    prev = 0
    for k in range(n):
        if cum[k] > prev:
            chunk_times.append(raw.times[k])
            chunk_tokens.append(cum[k] - prev)
            prev = cum[k]
    return _Counts(total=prev if osl is None else osl, source=source, chunk_times=chunk_times,
                   chunk_tokens=chunk_tokens)  # fmt: skip


def _speculation(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The record's speculative and server-timing fields from the latest server perf metrics."""
    accepted = _as_int(spec.get("total_accepted_draft_tokens"))
    rounds = _as_int(spec.get("num_rounds"))
    tau_server = spec.get("mean_acceptance_length")
    tau: float | None = None
    tau_source: str | None = None
    if tau_server is not None and tau_server > 0:
        tau, tau_source = float(tau_server), "server mean_acceptance_length"
    elif rounds and accepted is not None:
        tau, tau_source = 1.0 + accepted / rounds, "1 + accepted / rounds"
    rate = spec.get("acceptance_rate")
    arrival, first, last_ns = (
        spec.get(k) for k in ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns")
    )
    return {
        "accepted_draft_tokens": accepted,
        "draft_tokens": _as_int(spec.get("total_draft_tokens")),
        "num_rounds": rounds,
        "acceptance_length": tau,
        "acceptance_length_source": tau_source,
        "acceptance_rate": None if rate is None else float(rate),
        "overturned_draft_tokens": _as_int(spec.get("total_overturned_draft_tokens")),
        "server_ttft_s": _round((first - arrival) / 1e9 if arrival and first else None),
        "server_decode_s": _round((last_ns - first) / 1e9 if first and last_ns else None),
    }


def _as_int(v: Any) -> int | None:
    return None if v is None else int(v)


# ------------------------------------------------------------------------------------ statistics
STATS = (("mean", None), ("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99_9", 99.9))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    import numpy as np

    if len(values) == 0:
        raise ValueError("percentile of an empty sequence")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def weighted_percentile(values: Sequence[float], weights: Sequence[int], q: float) -> float:
    """The percentile of the sequence in which values[i] is repeated weights[i] times (no expansion)."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.int64)
    keep = w > 0
    v, w = v[keep], w[keep]
    if v.size == 0:
        raise ValueError("percentile of an empty sequence")
    order = np.argsort(v, kind="stable")
    v, cw = v[order], np.cumsum(w[order])
    pos = (int(cw[-1]) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, int(cw[-1]) - 1)
    at = np.searchsorted(cw, [lo, hi], side="right")
    return float(v[at[0]] + (v[at[1]] - v[at[0]]) * (pos - lo))


def _stats(
    prefix: str, values: Sequence[float], weights: Sequence[int] | None = None, suffix: str = "_s"
) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    total = sum(weights) if weights is not None else len(values)
    for name, q in STATS:
        key = f"{prefix}_{name}{suffix}"
        if total == 0:
            out[key] = None
        elif q is None:
            s = sum(v * w for v, w in zip(values, weights)) if weights is not None else sum(values)
            out[key] = s / total
        elif weights is not None:
            out[key] = weighted_percentile(values, weights, q)
        else:
            out[key] = percentile(values, q)
    return out


def _itl_weighted(records: Iterable[RequestRecord]) -> tuple[list[float], list[int]]:
    """ITL (DEFINITIONS['itl_s']) as (value, multiplicity) pairs: one pair per chunk."""
    values: list[float] = []
    weights: list[int] = []
    for r in records:
        ct, co = r.chunk_tokens, r.chunk_offsets_s
        if not ct or not co:
            continue
        if ct[0] > 1:
            values.append(0.0)
            weights.append(ct[0] - 1)
        for j in range(1, len(co)):
            if ct[j] > 0:
                values.append((co[j] - co[j - 1]) / ct[j])
                weights.append(ct[j])
    return values, weights


def _safe_div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2el_s))

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft_s is None or r.ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and r.tpot_s is not None and r.tpot_s > self.tpot_s:
            return False
        return not (self.e2el_s is not None and (r.e2el_s is None or r.e2el_s > self.e2el_s))


def duration_of(records: Iterable[RequestRecord]) -> float:
    starts, ends = [], []
    for r in records:
        starts.append(r.start_s)
        ends.append(r.start_s + (r.done_s or 0.0))
    return (max(ends) - min(starts)) if starts else 0.0


def summarize_point(
    records: Sequence[RequestRecord],
    *,
    num_gpus: int,
    concurrency: int | None,
    slo: Slo,
) -> dict[str, Any]:
    """Every per-point metric of DEFINITIONS from the measured requests (errors included)."""
    ok = [r for r in records if r.ok]
    errs = [r for r in records if not r.ok]
    duration = duration_of(records)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_errors": len(errs),
        "num_resends": sum(r.resends for r in records),
        "errors": dict(Counter((r.error or "")[:200] for r in errs).most_common(10)),
        "duration_s": duration,
    }
    out.update(_latency_metrics(ok))
    out.update(_throughput_metrics(ok, duration, num_gpus))
    out.update(_interactivity_metrics(ok, out, concurrency))
    out.update(_goodput_metrics(records, slo, duration))
    out.update(_speculation_metrics(ok))
    out.update(_chunk_metrics(ok))
    out.update(_accounting_metrics(records, ok, duration))
    return out


def _latency_metrics(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """Mean and percentiles of TTFT, TPOT, E2EL, ICL and (token-weighted) ITL."""
    out: dict[str, Any] = {}
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2el = [r.e2el_s for r in ok if r.e2el_s is not None]
    icl = [x for r in ok for x in r.icls]
    for prefix, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el), ("icl", icl)):
        out.update(_stats(prefix, values))
    itl_values, itl_weights = _itl_weighted(ok)
    out.update(_stats("itl", itl_values, itl_weights))
    return out


def _throughput_metrics(ok: Sequence[RequestRecord], duration: float, num_gpus: int) -> dict[str, Any]:
    """Token totals and means, and token and request rates over the point (also per GPU)."""
    out: dict[str, Any] = {}
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_known = [r for r in ok if r.input_tokens is not None]
    in_tokens = sum(r.input_tokens or 0 for r in in_known)
    out["output_tokens_total"] = out_tokens
    out["input_tokens_total"] = in_tokens if in_known else None
    out["output_tokens_mean"] = _safe_div(out_tokens, len(ok))
    out["input_tokens_mean"] = _safe_div(in_tokens, len(in_known)) if in_known else None
    out["output_tokens_per_s"] = _safe_div(out_tokens, duration) if ok else None
    out["input_tokens_per_s"] = _safe_div(in_tokens, duration) if in_known else None
    total = (out_tokens + in_tokens) if in_known and len(in_known) == len(ok) else None
    out["total_tokens_per_s"] = _safe_div(total, duration)
    out["request_throughput_per_s"] = _safe_div(len(ok), duration)
    out["total_tokens_per_s_per_gpu"] = _safe_div(out["total_tokens_per_s"], num_gpus)
    out["output_tokens_per_s_per_gpu"] = _safe_div(out["output_tokens_per_s"], num_gpus)
    return out


def _interactivity_metrics(
    ok: Sequence[RequestRecord], metrics: Mapping[str, Any], concurrency: int | None
) -> dict[str, Any]:
    """Per-user token rates under each tool's definition; reads the TPOT percentiles and
    output_tokens_per_s already in `metrics`."""
    out: dict[str, Any] = {}
    per_user = [1.0 / r.tpot_s for r in ok if r.tpot_s is not None and r.tpot_s > 0]
    out["tokens_per_s_per_user_mean"] = sum(per_user) / len(per_user) if per_user else None
    for name, q in (("p10", 10.0), ("p50", 50.0), ("p90", 90.0)):
        out[f"tokens_per_s_per_user_{name}"] = percentile(per_user, q) if per_user else None
    for name in ("p50", "p90", "p99"):
        out[f"interactivity_inferencex_{name}"] = _safe_div(1.0, metrics[f"tpot_{name}_s"])
    out["interactivity_aiperf_mean"] = out["tokens_per_s_per_user_mean"]
    out["interactivity_vllm_aggregate"] = _safe_div(metrics["output_tokens_per_s"], concurrency)
    e2e_norm = [r.e2el_s / r.output_tokens for r in ok if r.e2el_s and r.output_tokens]
    out["interactivity_e2e_norm_p90"] = _safe_div(1.0, percentile(e2e_norm, 90.0)) if e2e_norm else None
    prefill = [r.input_tokens / r.ttft_s for r in ok if r.input_tokens and r.ttft_s]
    out["prefill_tokens_per_s_per_user_p50"] = percentile(prefill, 50.0) if prefill else None
    e2e_out = [r.output_tokens / r.e2el_s for r in ok if r.output_tokens and r.e2el_s]
    out["e2e_output_tokens_per_s_per_user_p50"] = percentile(e2e_out, 50.0) if e2e_out else None
    return out


def _goodput_metrics(records: Sequence[RequestRecord], slo: Slo, duration: float) -> dict[str, Any]:
    """Requests and output tokens per second that met the SLO (None without an SLO)."""
    if not slo.any:
        return {"goodput_requests_per_s": None, "goodput_output_tokens_per_s": None, "good_fraction": None}
    good = [r for r in records if slo.met(r)]
    return {
        "goodput_requests_per_s": _safe_div(len(good), duration) if records else None,
        "goodput_output_tokens_per_s": _safe_div(sum(r.output_tokens or 0 for r in good), duration),
        "good_fraction": _safe_div(len(good), len(records)),
    }


def _speculation_metrics(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """Speculative decoding: tau (pooled over rounds where the server reports them, else the mean
    of per-request values) and the pooled draft acceptance rate."""
    out: dict[str, Any] = {}
    pooled = [r for r in ok if r.accepted_draft_tokens is not None and r.num_rounds]
    tau_pooled = (
        1.0 + sum(r.accepted_draft_tokens or 0 for r in pooled) / sum(r.num_rounds or 0 for r in pooled)
        if pooled
        else None
    )
    taus = [r.acceptance_length for r in ok if r.acceptance_length is not None]
    tau_mean = sum(taus) / len(taus) if taus else None
    out["mean_acceptance_length"] = tau_pooled if tau_pooled is not None else tau_mean
    out["mean_acceptance_length_source"] = (
        "pooled: 1 + sum(accepted) / sum(rounds)"
        if tau_pooled is not None
        else "mean of per-request values"
        if tau_mean is not None
        else None
    )
    out["mean_acceptance_length_pooled"] = tau_pooled
    out["mean_acceptance_length_request_mean"] = tau_mean
    drafted = [r for r in ok if r.draft_tokens and r.accepted_draft_tokens is not None]
    out["acceptance_rate_pooled"] = (
        sum(r.accepted_draft_tokens or 0 for r in drafted) / sum(r.draft_tokens or 0 for r in drafted)
        if drafted
        else None
    )
    selected = [r for r in ok if r.draft_tokens and r.overturned_draft_tokens is not None]
    out["overturn_rate_pooled"] = (
        sum(r.overturned_draft_tokens or 0 for r in selected) / sum(r.draft_tokens or 0 for r in selected)
        if selected
        else None
    )
    out["num_requests_with_spec_stats"] = len(taus)
    return out


def _chunk_metrics(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """Tokens per streamed chunk: the histogram, the count and the means (also after the first)."""
    hist: Counter[int] = Counter()
    after_tokens = after_chunks = 0
    for r in ok:
        if r.chunk_tokens:
            hist.update(r.chunk_tokens)
            after_tokens += sum(r.chunk_tokens[1:])
            after_chunks += len(r.chunk_tokens) - 1
    return {
        "tokens_per_chunk_hist": {str(k): hist[k] for k in sorted(hist)},
        "num_chunks": sum(r.num_chunks for r in ok),
        "mean_tokens_per_chunk": _safe_div(sum(hist.elements()), sum(hist.values())) if hist else None,
        "mean_tokens_per_chunk_after_first": _safe_div(after_tokens, after_chunks),
    }


def _accounting_metrics(
    records: Sequence[RequestRecord], ok: Sequence[RequestRecord], duration: float
) -> dict[str, Any]:
    """Achieved concurrency, and how far token counts strayed (client vs server ISL, requested vs
    produced OSL), where the counts came from, and the server-side TTFT."""
    out: dict[str, Any] = {}
    busy = sum(r.done_s or 0.0 for r in records)
    out["achieved_concurrency"] = _safe_div(busy, duration)
    both = [r for r in ok if r.input_tokens_server is not None and r.input_tokens_client]
    out["isl_discrepancy_pct"] = (
        100.0
        * sum(
            abs((r.input_tokens_server or 0) - (r.input_tokens_client or 0)) / (r.input_tokens_client or 1)
            for r in both
        )
        / len(both)
        if both
        else None
    )
    req = [r for r in ok if r.requested_output_tokens and r.output_tokens is not None]
    out["osl_shortfall_pct"] = (
        100.0
        * sum(
            ((r.requested_output_tokens or 0) - (r.output_tokens or 0)) / (r.requested_output_tokens or 1)
            for r in req
        )
        / len(req)
        if req
        else None
    )
    out["output_tokens_source"] = _dominant(r.output_tokens_source for r in ok)
    out["input_tokens_source"] = _dominant(r.input_tokens_source for r in ok)
    sttft = [r.server_ttft_s for r in ok if r.server_ttft_s is not None]
    out["server_ttft_p50_s"] = percentile(sttft, 50.0) if sttft else None
    return out


def _dominant(values: Iterable[str | None]) -> str | None:
    c = Counter(v for v in values if v)
    if not c:
        return None
    if len(c) == 1:
        return next(iter(c))
    return "; ".join(f"{k} ({n})" for k, n in c.most_common())


def summarize_warmup(records: Sequence[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "duration_s": duration_of(records),
        "ttft_p50_s": percentile(ttft, 50.0) if ttft else None,
        "tpot_p50_s": percentile(tpot, 50.0) if tpot else None,
    }
