# SPDX-License-Identifier: Apache-2.0
"""The frontier function, interpolation at matched interactivity/throughput, and `compare`."""

from __future__ import annotations

import itertools
import random

import pytest

from dflash_trt.bench.compare import compare_runs, cost_per_million, crossover_concurrency, format_text
from dflash_trt.bench.pareto import frontier, grid, interpolate, overlap, x_at_y, y_at_x


def P(x: float | None, y: float | None, **kw) -> dict:
    return {"x": x, "y": y, **kw}


def keys(points: list[dict]) -> list[tuple]:
    return [(p["x"], p["y"]) for p in points]


def test_frontier_basic_dominance_and_order() -> None:
    pts = [P(1, 10), P(2, 8), P(3, 9), P(4, 2), P(2, 1), P(5, 1)]
    # (2, 8) is dominated by (3, 9); (2, 1) by many; the rest trade off
    assert keys(frontier(pts, x="x", y="y")) == [(1, 10), (3, 9), (4, 2), (5, 1)]


def test_frontier_ties_missing_values_and_single_point() -> None:
    pts = [P(1, 5, k="a"), P(1, 5, k="b"), P(1, 4), P(None, 9), P(2, None), P(float("nan"), 3)]
    f = frontier(pts, x="x", y="y")
    assert [p.get("k") for p in f] == ["a"]  # duplicates keep the first; equal x keeps the higher y
    assert frontier([], x="x", y="y") == []
    assert keys(frontier([P(3, 3)], x="x", y="y")) == [(3, 3)]
    # same y, larger x dominates
    assert keys(frontier([P(1, 5), P(2, 5)], x="x", y="y")) == [(2, 5)]


def test_frontier_equals_brute_force_definition() -> None:
    rng = random.Random(0)
    for _ in range(200):
        pts = [P(rng.randint(0, 6), rng.randint(0, 6)) for _ in range(rng.randint(1, 9))]
        f = keys(frontier(pts, x="x", y="y"))
        brute = {
            (p["x"], p["y"])
            for p in pts
            if not any(
                q["x"] >= p["x"] and q["y"] >= p["y"] and (q["x"], q["y"]) != (p["x"], p["y"]) for q in pts
            )
        }
        assert set(f) == brute and len(f) == len(brute)
        assert f == sorted(f)  # x ascending
        assert all(a[1] > b[1] for a, b in itertools.pairwise(f))  # so y strictly descending


def test_interpolation_on_the_frontier() -> None:
    front = frontier([P(10, 1000), P(20, 600), P(40, 200)], x="x", y="y")
    assert y_at_x(front, 10, x="x", y="y") == 1000
    assert y_at_x(front, 15, x="x", y="y") == pytest.approx(800)
    assert y_at_x(front, 30, x="x", y="y") == pytest.approx(400)
    assert (
        y_at_x(front, 5, x="x", y="y") is None and y_at_x(front, 41, x="x", y="y") is None
    )  # no extrapolation
    assert x_at_y(front, 800, x="x", y="y") == pytest.approx(15)
    assert x_at_y(front, 100, x="x", y="y") is None
    assert interpolate([], [], 1.0) is None
    assert interpolate([2.0], [7.0], 2.0) == 7.0
    assert overlap([1, 5], [3, 9]) == (3, 5) and overlap([1, 2], [3, 4]) is None
    g = grid(10, 1000, 3)
    assert g == pytest.approx([10, 100, 1000])


def _run(label: str, rows: list[tuple[int, float, float, float | None]]) -> dict:
    """rows: (concurrency, tokens/s/user, tokens/s/GPU, tau)."""
    return {
        "label": label,
        "points": [
            {
                "key": f"concurrency={c}",
                "concurrency": c,
                "tokens_per_s_per_user_p50": x,
                "total_tokens_per_s_per_gpu": y,
                "mean_acceptance_length": tau,
            }
            for c, x, y, tau in rows
        ],
    }


def test_compare_speedup_cost_and_crossover() -> None:
    # B: AR. A: twice B's throughput at every interactivity in the common range; slower at c=16
    b = _run("AR", [(1, 100, 100, None), (4, 80, 400, None), (16, 40, 1600, None)])
    a = _run("DFlash", [(1, 200, 200, 3.5), (4, 160, 800, 3.0), (16, 70, 1200, 2.0)])
    r = compare_runs(a, b, gpu_hour_usd=3.6, levels=[50, 80, 100])
    assert r["a"] == "DFlash" and r["b"] == "AR"
    by_x = {row["tokens_per_s_per_user_p50"]: row for row in r["iso_interactivity"]}
    # at 80 tok/s/user: A's frontier between (70, 1200) and (160, 800): 1200 - 400 * 10/90
    ya = 1200 - 400 * 10 / 90
    assert by_x[80]["total_tokens_per_s_per_gpu_a"] == pytest.approx(ya)
    assert by_x[80]["speedup"] == pytest.approx(ya / 400)
    assert by_x[100]["speedup"] == pytest.approx((1200 - 400 * 30 / 90) / 100)
    assert by_x[50]["total_tokens_per_s_per_gpu_a"] is None  # below A's measured range
    assert by_x[80]["cost_per_mtok_b"] == pytest.approx(3.6 / (400 * 3600) * 1e6)
    per_c = {row["concurrency"]: row for row in r["per_concurrency"]}
    assert per_c[4]["throughput_ratio"] == pytest.approx(2.0) and per_c[16][
        "throughput_ratio"
    ] == pytest.approx(0.75)
    assert per_c[1]["mean_acceptance_length_a"] == 3.5
    # throughput ratio 2.0 at c=4 and 0.75 at c=16: crosses 1 at log2 c = 2 + 2 * (1/1.25)
    assert r["crossover_concurrency"] == pytest.approx(2 ** (2 + 2 * 0.8))
    iso_y = r["iso_throughput"]
    assert iso_y and all(
        row["interactivity_ratio"] is None or row["interactivity_ratio"] > 0 for row in iso_y
    )
    text = format_text(r)
    assert "Speculation stops paying at concurrency: 12.1" in text and "DFlash" in text


def test_crossover_edge_cases_and_cost() -> None:
    assert (
        crossover_concurrency(
            [{"concurrency": 1, "throughput_ratio": 1.5}, {"concurrency": 8, "throughput_ratio": 1.1}]
        )[0]
        is None
    )
    c, note = crossover_concurrency([{"concurrency": 2, "throughput_ratio": 0.9}])
    assert c == 2 and "already slower" in note
    assert crossover_concurrency([])[0] is None
    assert cost_per_million(1000.0, 2.0) == pytest.approx(2.0 / 3.6)
    assert cost_per_million(None, 2.0) is None and cost_per_million(10.0, None) is None
