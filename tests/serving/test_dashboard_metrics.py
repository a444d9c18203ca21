# SPDX-License-Identifier: Apache-2.0
"""Every metric the chart's Grafana dashboard and PrometheusRule query is served by a real
tritonserver's /metrics (the tiny bundle), with the labels the queries match on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from dflash_trt.deploy import chart as deploy
from tests.serving.conftest import http_generate

pytestmark = [pytest.mark.triton_server, pytest.mark.helm]

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "dflash-trt"
# labels Prometheus adds when it scrapes a pod; the server cannot serve them
SCRAPE_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint"}
# Grafana's range macros, replaced by a duration so that the query parses as PromQL
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def queried_series(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (operator, value)}) of every series an expression selects, from
    Prometheus' grammar (promql-parser); a syntax error fails here as it would in Prometheus."""
    import promql_parser

    for macro, duration in GRAFANA_MACROS.items():
        expr = expr.replace(macro, duration)
    ops = [(promql_parser.MatchOp.Equal, "="), (promql_parser.MatchOp.NotEqual, "!="),
           (promql_parser.MatchOp.Re, "=~"), (promql_parser.MatchOp.NotRe, "!~")]  # fmt: skip
    out: list[tuple[str, dict[str, tuple[str, str]]]] = []

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            labels = {
                m.name: (next(t for op, t in ops if op == m.op), m.value) for m in node.matchers.matchers
            }
            out.append((node.name or labels.pop("__name__", ("", ""))[1], labels))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return out


def dashboard_and_rule_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target, template variable and alert the chart renders."""
    values = {"metrics": {"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}}
    docs = deploy.render_chart(values, chart_dir=CHART_DIR, release="demo", namespace="llm").documents
    out = []
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            dashboard = json.loads(doc["data"]["dflash-trt.json"])
            for panel in dashboard["panels"]:
                out += [(f"panel {panel['title']!r}", t["expr"]) for t in panel["targets"]]
            for var in dashboard["templating"]["list"]:
                if var["type"] == "query":
                    inner = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
                    assert inner, var["query"]
                    out.append((f"variable {var['name']}", inner.group(1)))
                    out.append(
                        (
                            f"variable {var['name']} label",
                            f'{inner.group(1).split("{")[0]}{{{inner.group(2)}=~".*"}}',
                        )
                    )
        elif doc["kind"] == "PrometheusRule":
            for group in doc["spec"]["groups"]:
                out += [(f"alert {r['alert']}", r["expr"]) for r in group["rules"]]
    return out


def served(text: str) -> dict[str, list[dict[str, str]]]:
    """metric name -> label sets of its samples, from a /metrics page."""
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
        assert m, line
        labels = {k: v for k, _, v in _MATCHER.findall(m.group(3) or "")}
        out.setdefault(m.group(1), []).append(labels)
    return out


def missing(queries: list[tuple[str, str]], series: dict[str, list[dict[str, str]]]) -> list[str]:
    problems = []
    for where, expr in queries:
        for name, matchers in queried_series(expr):
            if name not in series:
                problems.append(f"{where}: {name} is not served")
                continue
            for label, (op, value) in matchers.items():
                if label in SCRAPE_LABELS:
                    continue
                if not any(label in s for s in series[name]):
                    problems.append(f"{where}: {name} has no label {label}")
                elif op == "=" and "$" not in value and not any(s.get(label) == value for s in series[name]):
                    problems.append(f'{where}: no {name} sample has {label}="{value}"')
    return problems


def test_query_parser_finds_names_and_matchers():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(a_bucket{model=~"$model",x="1"}[$__rate_interval])))'
            ' / on (pod) b_total and deriv(sum(c)[10m:1m]) > 1e-9')  # fmt: skip
    assert queried_series(expr) == [
        ("a_bucket", {"model": ("=~", "$model"), "x": ("=", "1")}),
        ("b_total", {}),
        ("c", {}),
    ]
    with pytest.raises(ValueError):
        queried_series("sum(rate(a_total[5m])")


@pytest.fixture(scope="module")
def metrics_page(server) -> str:
    # one streamed request so that every histogram (TTFT, inter-token latency, rounds) has samples
    events = http_generate(
        server,
        {"text_input": "def fibonacci(n):", "sampling_param_max_tokens": 12, "streaming": True},
        stream=True,
    )
    assert events, "no streamed response"
    return httpx.get(server.metrics_url, timeout=10).text


def test_every_dashboard_and_alert_metric_is_served(metrics_page):
    queries = dashboard_and_rule_queries()
    assert len(queries) > 25  # the panels, the variables and the three alerts
    series = served(metrics_page)
    assert missing(queries, series) == []
    # and the check is not a rubber stamp: a misspelt metric or a label value the server lacks is caught
    planted = [("planted", 'rate(dflash_output_token_total{model="tensorrt_llm"}[5m])'),
               ("planted", 'dflash_requests_active{model="other"}')]  # fmt: skip
    assert missing(planted, series) == [
        "planted: dflash_output_token_total is not served",
        'planted: no dflash_requests_active sample has model="other"',
    ]


def test_latency_and_drafter_metrics_have_samples(metrics_page):
    series = served(metrics_page)

    def value(name: str) -> float:
        for line in metrics_page.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(name)

    assert value("dflash_time_to_first_token_seconds_count") >= 1
    assert value("dflash_inter_token_latency_seconds_count") >= 1
    assert value("dflash_drafter_enabled") == 1.0  # the tiny bundle serves with its drafter
    assert all(s.get("model") == "tensorrt_llm" for s in series["dflash_drafter_enabled"])
