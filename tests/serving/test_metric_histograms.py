# SPDX-License-Identifier: Apache-2.0
"""The model's histograms as counter series (dflash_trt/triton/llmapi/metrics.py `CounterHistogram`):
a flush gives the buckets, sum and count a histogram of the same observations would expose, with at
most one update per series however many observations it holds. Served end to end: test_triton.py,
test_ddtree_serve.py and test_dashboard_metrics.py read them from a real tritonserver."""

from __future__ import annotations

from typing import ClassVar

from dflash_trt.triton.llmapi.metrics import CounterHistogram, MetricBatch


class FakeFamily:
    """pb_utils.MetricFamily's shape: a name, a kind, and metrics that record their increments."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: ClassVar[list[FakeFamily]] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.made.append(self)

    def Metric(self, labels: dict[str, str]) -> FakeMetric:  # the backend's name
        metric = FakeMetric(self.name, labels)
        self.metrics.append(metric)
        return metric


class FakeMetric:
    def __init__(self, name: str, labels: dict[str, str]) -> None:
        self.name, self.labels, self.value, self.calls = name, labels, 0.0, 0

    def increment(self, value: float) -> None:
        self.value += value
        self.calls += 1

    def set(self, value: float) -> None:
        self.value = value


def series(families: list[FakeFamily]) -> dict[tuple[str, str | None], float]:
    return {(m.name, m.labels.get("le")): m.value for f in families for m in f.metrics}


def test_a_flush_exposes_what_a_histogram_would_in_one_update_per_series():
    FakeFamily.made = []
    hist = CounterHistogram(FakeFamily, "dflash_x", "X", {"model": "m"}, [4.0, 1.0, 2.0, 0.5, 0.0025])
    assert [f.name for f in hist.families] == ["dflash_x_bucket", "dflash_x_sum", "dflash_x_count"]
    assert {f.kind for f in hist.families} == {"counter"}
    les = [m.labels["le"] for m in hist.families[0].metrics]
    assert les == ["0.0025", "0.5", "1", "2", "4", "+Inf"]  # Triton's own histograms print le this way
    assert all(m.labels["model"] == "m" for f in hist.families for m in f.metrics)
    batch = MetricBatch(lambda message: None)
    try:
        values = [1.0, 1.0, 0.7, 2.0, 3.0, 9.0, 0.001, 4.0] * 1000
        for v in values:
            batch.observe(hist, v)
        batch.flush()
        got = series(hist.families)
        for le, bound in zip(les, [0.0025, 0.5, 1.0, 2.0, 4.0, float("inf")]):
            assert got[("dflash_x_bucket", le)] == sum(v <= bound for v in values), (
                le
            )  # cumulative, le inclusive
        assert got[("dflash_x_count", None)] == len(values)
        assert abs(got[("dflash_x_sum", None)] - sum(values)) < 1e-6
        assert (
            max(m.calls for f in hist.families for m in f.metrics) == 1
        )  # 8000 observations, one update each
        batch.flush()  # nothing observed since: nothing sent
        assert max(m.calls for f in hist.families for m in f.metrics) == 1
        batch.observe(hist, 0.5)
        batch.flush()
        got = series(hist.families)
        assert got[("dflash_x_bucket", "0.5")] == 1001 and got[("dflash_x_bucket", "0.0025")] == 1000
        assert hist.families[0].metrics[0].calls == 1  # a bucket below the observation is left alone
    finally:
        batch.close()


def test_buckets_are_updated_from_inf_down():
    """A scrape between two of a flush's updates must still see counts that do not fall as le grows."""
    FakeFamily.made = []
    order: list[str] = []
    hist = CounterHistogram(FakeFamily, "h", "H", {}, [1.0, 2.0, 3.0])
    for metric in hist.families[0].metrics:
        metric.increment = lambda v, le=metric.labels["le"]: order.append(le)  # type: ignore[method-assign]
    hist.add(1.0)
    hist.add(3.0)
    hist.apply(*hist.take())
    assert order == ["+Inf", "3", "2", "1"]


def test_model_metrics_keep_every_histogram_family_alive():
    from dflash_trt.triton.llmapi.metrics import METRICS, ModelMetrics

    class FakePb:
        MetricFamily = FakeFamily

        class Logger:
            log_warn = staticmethod(lambda message: None)

    FakeFamily.made = []
    metrics = ModelMetrics(FakePb, model_name="tensorrt_llm", block_size=4, engine_counts_active=True)
    try:
        names = {f.name for f in metrics._families}
        for _, name, kind, _, _ in METRICS:
            expected = {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "HISTOGRAM" else {name}
            assert expected <= names, name
        accept = next(f for f in FakeFamily.made if f.name == "dflash_acceptance_length_bucket")
        les = [m.labels["le"] for m in accept.metrics]
        assert les == ["1", "2", "3", "4", "+Inf"]  # "block": 1 .. block size
    finally:
        metrics.close()
