# SPDX-License-Identifier: Apache-2.0
# Copied verbatim into model repositories as dflash_trt_llmapi/; edit dflash_trt/triton/llmapi/, never a copy.
"""The dflash_* metrics the model exports through Triton's metrics endpoint, and what feeds them.

Two sources: each request's outputs on the response path (acceptance lengths, tokens, latencies as
clients see them: `observe_output`, `observe_latency`), and the engine's own counters, polled every
POLL_S (`publish_engine_stats`: queue, KV use, round times, the draft length and tree budget chosen).

Each histogram is exposed as the counter series a Prometheus histogram has (`NAME_bucket{le}`,
`NAME_sum`, `NAME_count`; `CounterHistogram`), so every query of a histogram works on it, and a flush
applies any number of observations in a few updates.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_trt.api.serving import CompletionView, ServingLLM

POLL_S = 0.25  # engine counters, liveness and the batched metric updates
FLUSH_GAP_S = 0.1  # the least time between two flushes of the batched updates (a request's end asks for one)

# (attribute, metric name, kind, description, buckets); "block" buckets: 1 .. block_size
METRICS = (
    ("m_accept", "dflash_acceptance_length", "HISTOGRAM",
     "Tokens produced per DFlash round (accepted drafts + 1 bonus token)", "block"),
    ("m_drafted", "dflash_draft_tokens_total", "COUNTER", "Draft tokens proposed", None),
    ("m_accepted", "dflash_accepted_draft_tokens_total", "COUNTER", "Draft tokens accepted", None),
    ("m_overturned", "dflash_overturned_draft_tokens_total", "COUNTER",
     "Draft tokens the DFlash 2 candidate selector picked over the drafter's argmax (0 with v1 drafters); "
     "the overturn rate is this over dflash_draft_tokens_total", None),
    ("m_output", "dflash_output_tokens_total", "COUNTER", "Tokens generated (all requests)", None),
    ("m_rounds", "dflash_rounds_total", "COUNTER", "DFlash rounds (per request)", None),
    ("m_active", "dflash_requests_active", "GAUGE",
     "Requests being generated (holding a batch slot; queued requests are dflash_requests_queued)", None),
    ("m_queued", "dflash_requests_queued", "GAUGE",
     "Requests waiting for a batch slot or KV pages (embedded engine only)", None),
    ("m_kv", "dflash_kv_cache_utilization", "GAUGE",
     "Fraction of KV-cache pages reserved by requests (embedded engine only)", None),
    ("m_prefix_queries", "dflash_prefix_cache_queries_total", "COUNTER",
     "Prompt tokens looked up in the prefix cache (embedded engine only)", None),
    ("m_prefix_hits", "dflash_prefix_cache_hits_total", "COUNTER",
     "Of them, found cached: not prefilled again (embedded engine only); the hit rate is this over "
     "dflash_prefix_cache_queries_total", None),
    ("m_round", "dflash_round_duration_seconds", "HISTOGRAM",
     "Wall time of one engine step's DFlash round for the whole batch (embedded engine only)",
     [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]),
    # Latencies as clients see them, measured here: Triton's own first-response histogram is not in
    # every Triton build (2.51 lacks it) and Triton has no inter-token metric.
    ("m_ttft", "dflash_time_to_first_token_seconds", "HISTOGRAM",
     "Time from the request reaching the model to its first generated token",
     [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
    ("m_itl", "dflash_inter_token_latency_seconds", "HISTOGRAM",
     "Mean time per token after the first, per output step (DFlash emits several per round)",
     [0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0]),
    ("m_drafter", "dflash_drafter_enabled", "GAUGE",
     "1 when the model serves with a DFlash drafter (speculative_config), 0 without", None),
    ("m_draft_len", "dflash_draft_len", "GAUGE",
     "Draft tokens per request in the latest linear DFlash round (0 = plain decoding); with no "
     "draft_len_schedule, the engine's choice by measured cost for the batch (embedded engine only)", None),
    # DDTree (speculative_config.tree_budget; embedded engine only)
    ("m_tree_budget", "dflash_tree_budget", "GAUGE",
     "DDTree nodes per request verified by the latest round (0 = linear DFlash); "
     "with tree_budget auto, the engine's choice for the batch", None),
    ("m_tree_accept", "dflash_tree_acceptance_length", "HISTOGRAM",
     "Tokens produced per DDTree round (accepted path + 1 bonus token; rounds that verified a tree)", "block"),
)  # fmt: skip


class CounterHistogram:
    """A histogram kept as the counters Prometheus' text format shows for one: `NAME_bucket` with an
    `le` label per upper bound (cumulative, `+Inf` last), `NAME_sum` and `NAME_count`. The Python
    backend's HISTOGRAM metric takes one observation per call, each a round trip to the server: one per
    DFlash round and request (6,400 a second at 64 requests and 10 ms rounds) took a quarter of the
    stub's CPU. Here observations only count into their bucket (`add`), and `apply` adds a flush's
    counts with at most one update per series. The exposition's TYPE reads counter; the series, their
    names and labels are a histogram's. Not thread-safe: `MetricBatch` holds its lock around `add`
    and `take`."""

    def __init__(
        self, mf: Any, name: str, description: str, labels: dict[str, str], bounds: list[float]
    ) -> None:
        self.bounds = sorted(bounds)
        les = [f"{b:g}" for b in self.bounds] + ["+Inf"]
        self.families = [
            mf(name=f"{name}_bucket", description=f"{description} (observations <= le)", kind=mf.COUNTER),
            mf(name=f"{name}_sum", description=f"{description} (sum of observations)", kind=mf.COUNTER),
            mf(name=f"{name}_count", description=f"{description} (observations)", kind=mf.COUNTER),
        ]
        self._buckets = [self.families[0].Metric(labels={**labels, "le": le}) for le in les]
        self._sum = self.families[1].Metric(labels=labels)
        self._count = self.families[2].Metric(labels=labels)
        self._counts, self._total = [0] * len(les), 0.0

    def add(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value, else +Inf
        self._total += value

    def take(self) -> tuple[list[int], float]:
        """The counts and the sum observed since the last take."""
        taken = self._counts, self._total
        self._counts, self._total = [0] * len(self._counts), 0.0
        return taken

    def apply(self, counts: list[int], total: float) -> None:
        """Add taken counts to the series: the buckets from +Inf down, so that a scrape between two
        updates still sees counts that grow with le, then the count and the sum."""
        cumulative = list(itertools.accumulate(counts))
        if not cumulative[-1]:
            return
        for metric, n in zip(reversed(self._buckets), reversed(cumulative)):
            if n:
                metric.increment(float(n))
        self._count.increment(float(cumulative[-1]))
        self._sum.increment(total)


class MetricBatch:
    """Counter increments and histogram observations made on the response path, applied to Triton's
    metrics from a thread of their own. Each update of a Python-backend metric is a round trip to the
    server process; made per streamed response (five of them) they slowed every response and, through
    the GIL, the engine thread. Applied every POLL_S, soon after a request ends (`flush_soon`: at most
    every FLUSH_GAP_S, as requests end by the dozen a second under load), and at close: a counter's
    increments summed, a histogram's observations as bucket counts; gauges are set directly."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._pending: list[tuple[Any, float]] = []  # (counter, increment)
        self._histograms: set[CounterHistogram] = set()  # observed since the last flush
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dflash-metrics", daemon=True)
        self._thread.start()

    def increment(self, metric: Any, value: float) -> None:
        with self._lock:
            self._pending.append((metric, value))

    def observe(self, histogram: CounterHistogram, value: float) -> None:
        with self._lock:
            histogram.add(value)
            self._histograms.add(histogram)

    def flush_soon(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        last = 0.0
        while not self._closed:
            self._wake.wait(POLL_S)
            time.sleep(max(0.0, last + FLUSH_GAP_S - time.monotonic()))  # at once after a quiet spell
            self._wake.clear()
            last = time.monotonic()
            try:
                self.flush()
            except Exception as exc:  # metrics must never take the model down
                self._warn(f"metrics update failed: {exc}")

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            observed = [(h, *h.take()) for h in self._histograms]
            self._histograms = set()
        counters: dict[int, tuple[Any, float]] = {}
        for metric, value in batch:  # one increment per counter and flush
            counters[id(metric)] = (metric, counters.get(id(metric), (metric, 0.0))[1] + value)
        for metric, total in counters.values():
            metric.increment(total)
        for histogram, counts, total in observed:
            histogram.apply(counts, total)


class ModelMetrics:
    """The METRICS families of one model (labelled with its name), and the updates that feed them.

    `engine_counts_active`: the engine counts the requests it generates (the embedded engine; its
    stats set dflash_requests_active), so the count of requests in flight here does not."""

    # The metrics, one per METRICS row.
    m_accept: CounterHistogram
    m_drafted: Any
    m_accepted: Any
    m_overturned: Any
    m_output: Any
    m_rounds: Any
    m_active: Any
    m_queued: Any
    m_kv: Any
    m_prefix_queries: Any
    m_prefix_hits: Any
    m_round: CounterHistogram
    m_ttft: CounterHistogram
    m_itl: CounterHistogram
    m_drafter: Any
    m_draft_len: Any
    m_tree_budget: Any
    m_tree_accept: CounterHistogram

    def __init__(self, pb: Any, *, model_name: str, block_size: int, engine_counts_active: bool) -> None:
        mf = pb.MetricFamily
        labels = {"model": model_name}
        self._families = []  # MetricFamily objects must outlive their metrics
        for attr, name, kind, description, buckets in METRICS:
            if buckets == "block":
                buckets = [float(b) for b in range(1, max(2, block_size) + 1)]
            if kind == "HISTOGRAM":
                assert isinstance(buckets, list), name  # every histogram row names its buckets
                histogram = CounterHistogram(mf, name, description, labels, buckets)
                self._families += histogram.families
                setattr(self, attr, histogram)
                continue
            family = mf(name=name, description=description, kind=getattr(mf, kind))
            self._families.append(family)
            setattr(self, attr, family.Metric(labels=labels))
        self.m_drafter.set(1.0 if block_size > 1 else 0.0)
        self._engine_counts_active = engine_counts_active
        self._batch = MetricBatch(pb.Logger.log_warn)
        self._prefix_seen = (0, 0)  # the engine's prefix-cache counters already published

    def set_in_flight(self, count: int) -> None:
        """The number of requests in flight here (dflash_requests_active unless the engine counts)."""
        if not self._engine_counts_active:
            self.m_active.set(float(count))

    def observe_output(
        self, comp: CompletionView, seen: tuple[int, int], *, final: bool, skip: int = 0
    ) -> tuple[int, int]:
        """Feed the DFlash metrics with what is new since `seen` = (rounds, tokens) counted so far;
        returns the new `seen`. `skip`: prompt tokens echoed at the head of token_ids."""
        seen_rounds, seen_tokens = seen
        perf = comp.request_perf_metrics
        spec = perf.speculative_decoding if perf is not None else None
        # acceptance_lengths: a dflash-trt extension, absent from TensorRT-LLM's metrics
        lengths = list(getattr(spec, "acceptance_lengths", None) or [])
        budgets = list(getattr(spec, "tree_budgets", None) or [])  # DDTree: each round's budget
        for i, length in enumerate(lengths[seen_rounds:], start=seen_rounds):
            self._batch.observe(self.m_accept, float(length))
            if i < len(budgets) and budgets[i] > 0:
                self._batch.observe(self.m_tree_accept, float(length))
        if len(lengths) > seen_rounds:
            self._batch.increment(self.m_rounds, float(len(lengths) - seen_rounds))
            seen_rounds = len(lengths)
        tokens = len(comp.token_ids or []) - skip
        if tokens > seen_tokens:
            self._batch.increment(self.m_output, float(tokens - seen_tokens))
            seen_tokens = tokens
        if final and spec is not None:
            self._batch.increment(self.m_drafted, float(spec.total_draft_tokens or 0))
            self._batch.increment(self.m_accepted, float(spec.total_accepted_draft_tokens or 0))
            overturned = float(getattr(spec, "total_overturned_draft_tokens", 0) or 0)
            self._batch.increment(self.m_overturned, overturned)
        if final:
            self._batch.flush_soon()
        return seen_rounds, seen_tokens

    def observe_latency(self, started: float, last: float | None, new_tokens: int) -> float | None:
        """TTFT on the first new token, then the mean gap per token of each later step; returns the
        time of the latest new token."""
        if new_tokens <= 0:
            return last
        now = time.monotonic()
        if last is None:
            self._batch.observe(self.m_ttft, now - started)
        else:
            self._batch.observe(self.m_itl, (now - last) / new_tokens)
        return now

    def publish_engine_stats(self, llm: ServingLLM) -> None:
        """The engine's counters into the gauges and the round-time histogram."""
        stats = llm.get_stats()
        if "waiting" in stats:
            self.m_queued.set(float(stats["waiting"]))
        if "active" in stats:
            self.m_active.set(float(stats["active"]))
        cap = float(stats.get("kv_capacity_tokens") or 0)
        if cap:
            self.m_kv.set(1.0 - float(stats.get("kv_free_tokens", cap)) / cap)
        for seconds in llm.drain_round_times():
            self._batch.observe(self.m_round, seconds)
        if "tree_budget" in stats:
            self.m_tree_budget.set(float(stats["tree_budget"]))
        if "draft_len" in stats:
            self.m_draft_len.set(float(stats["draft_len"]))
        if "prefix_cache_queries" in stats:
            queries, hits = int(stats["prefix_cache_queries"]), int(stats["prefix_cache_hits"])
            self._batch.increment(self.m_prefix_queries, float(queries - self._prefix_seen[0]))
            self._batch.increment(self.m_prefix_hits, float(hits - self._prefix_seen[1]))
            self._prefix_seen = (queries, hits)

    def close(self) -> None:
        """Apply what is pending and stop the update thread."""
        self._batch.close()
