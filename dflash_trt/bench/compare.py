# SPDX-License-Identifier: Apache-2.0
"""Run A against run B (typically DFlash against the same server with `--no-draft`).

- **At matched interactivity**: on each frontier, the throughput reachable at the same
  tokens/s/user (linear interpolation between frontier points, no extrapolation); speedup = A/B.
- **At matched throughput**: the interactivity reachable at the same tokens/s/GPU; ratio = A/B.
- **Per concurrency**: A/B throughput and per-user speed at each concurrency both runs measured.
- **Crossover**: the concurrency where A's throughput per GPU falls below B's (interpolated in
  log2(concurrency)), i.e. where speculation stops paying; and the interactivity below which A's
  frontier is under B's.
- **Cost** per million tokens of the y metric: gpu_hour_usd / (tokens/s/GPU * 3600) * 1e6.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from dflash_trt.bench.pareto import DEFAULT_X, DEFAULT_Y, frontier, grid, overlap, x_at_y, y_at_x

STANDARD_INTERACTIVITY = (50.0, 100.0, 200.0, 500.0)  # tok/s/user levels quoted in public comparisons


def cost_per_million(tokens_per_s_per_gpu: float | None, gpu_hour_usd: float | None) -> float | None:
    if tokens_per_s_per_gpu is None or gpu_hour_usd is None or tokens_per_s_per_gpu <= 0:
        return None
    return gpu_hour_usd / (tokens_per_s_per_gpu * 3600.0) * 1e6


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _label(summary: dict[str, Any], fallback: str) -> str:
    return str(summary.get("label") or (summary.get("config") or {}).get("label") or fallback)


def crossover_concurrency(rows: Sequence[dict[str, Any]]) -> tuple[float | None, str]:
    """Where throughput_ratio first drops below 1 as concurrency grows (log2 interpolation)."""
    pts = [(r["concurrency"], r["throughput_ratio"]) for r in rows if r.get("throughput_ratio") is not None]
    if not pts:
        return None, "no concurrency measured by both runs"
    if pts[0][1] < 1.0:
        return float(pts[0][0]), f"A is already slower at the lowest common concurrency ({pts[0][0]})"
    for (c0, r0), (c1, r1) in itertools.pairwise(pts):
        if r0 >= 1.0 > r1:
            l0, l1 = math.log2(c0), math.log2(c1)
            c = 2 ** (l0 + (l1 - l0) * (r0 - 1.0) / (r0 - r1))
            return c, f"A/B throughput crosses 1 between concurrency {c0} and {c1}"
    return None, f"A's throughput per GPU is >= B's at every common concurrency (up to {pts[-1][0]})"


def compare_runs(
    a: dict[str, Any],
    b: dict[str, Any],
    *,
    x: str = DEFAULT_X,
    y: str = DEFAULT_Y,
    gpu_hour_usd: float | None = None,
    levels: Sequence[float] | None = None,
    num_grid: int = 6,
) -> dict[str, Any]:
    """Run A against run B along their Pareto frontiers (y against x): at equal x, at equal y, at
    each shared concurrency, and where A stops paying (the definitions travel with the result)."""
    fa = frontier(a["points"], x=x, y=y)
    fb = frontier(b["points"], x=x, y=y)
    x_range = overlap([float(p[x]) for p in fa], [float(p[x]) for p in fb])
    y_range = overlap([float(p[y]) for p in fa], [float(p[y]) for p in fb])
    iso_x: list[dict[str, Any]] = []
    if x_range is not None:
        wanted = list(levels) if levels else sorted(
            {*grid(*x_range, num_grid), *(v for v in STANDARD_INTERACTIVITY if x_range[0] <= v <= x_range[1])}
        )  # fmt: skip
        iso_x = [_at_x(fa, fb, q, x=x, y=y, gpu_hour_usd=gpu_hour_usd) for q in wanted]
    iso_y: list[dict[str, Any]] = []
    if y_range is not None:
        for q in grid(*y_range, num_grid):
            xa, xb = x_at_y(fa, q, x=x, y=y), x_at_y(fb, q, x=x, y=y)
            iso_y.append({y: q, f"{x}_a": xa, f"{x}_b": xb, "interactivity_ratio": _ratio(xa, xb)})
    per_c = _per_concurrency(a["points"], b["points"], x=x, y=y, gpu_hour_usd=gpu_hour_usd)
    cross_c, cross_note = crossover_concurrency(per_c)
    return {
        "a": _label(a, "A"),
        "b": _label(b, "B"),
        "x": x,
        "y": y,
        "gpu_hour_usd": gpu_hour_usd,
        "definitions": _definitions(x, y),
        "frontier_a": [{"key": p.get("key"), x: p.get(x), y: p.get(y)} for p in fa],
        "frontier_b": [{"key": p.get("key"), x: p.get(x), y: p.get(y)} for p in fb],
        "iso_interactivity": iso_x,
        "iso_throughput": iso_y,
        "per_concurrency": per_c,
        "crossover_concurrency": cross_c,
        "crossover_note": cross_note,
        "crossover_interactivity": _crossover_x(fa, fb, x_range, x=x, y=y),
    }


def _definitions(x: str, y: str) -> dict[str, str]:
    return {
        "speedup": f"A's {y} / B's {y} at the same {x}, each read off its frontier by linear interpolation",
        "interactivity_ratio": f"A's {x} / B's {x} at the same {y} (iso-throughput) or the same concurrency",
        "throughput_ratio": f"A's {y} / B's {y} at the same concurrency",
        "cost_per_mtok": "gpu_hour_usd / (y tokens/s/GPU * 3600) * 1e6",
        "crossover_concurrency": "where throughput_ratio falls below 1 (log2-interpolated): speculation stops paying",
        "crossover_interactivity": f"the highest {x} at which A's frontier throughput is below B's (null: never)",
    }


def _at_x(
    fa: list[dict[str, Any]],
    fb: list[dict[str, Any]],
    q: float,
    *,
    x: str,
    y: str,
    gpu_hour_usd: float | None,
) -> dict[str, Any]:
    """Both frontiers read at x = q: their y, the speedup and the cost per million tokens."""
    ya, yb = y_at_x(fa, q, x=x, y=y), y_at_x(fb, q, x=x, y=y)
    return {
        x: q,
        f"{y}_a": ya,
        f"{y}_b": yb,
        "speedup": _ratio(ya, yb),
        "cost_per_mtok_a": cost_per_million(ya, gpu_hour_usd),
        "cost_per_mtok_b": cost_per_million(yb, gpu_hour_usd),
    }


def _per_concurrency(
    points_a: list[dict[str, Any]],
    points_b: list[dict[str, Any]],
    *,
    x: str,
    y: str,
    gpu_hour_usd: float | None,
) -> list[dict[str, Any]]:
    """The points both runs measured at the same concurrency, side by side."""
    by_c_a = {p["concurrency"]: p for p in points_a if p.get("concurrency")}
    by_c_b = {p["concurrency"]: p for p in points_b if p.get("concurrency")}
    rows: list[dict[str, Any]] = []
    for c in sorted(set(by_c_a) & set(by_c_b)):
        pa, pb = by_c_a[c], by_c_b[c]
        rows.append(
            {
                "concurrency": c,
                f"{y}_a": pa.get(y),
                f"{y}_b": pb.get(y),
                "throughput_ratio": _ratio(pa.get(y), pb.get(y)),
                f"{x}_a": pa.get(x),
                f"{x}_b": pb.get(x),
                "interactivity_ratio": _ratio(pa.get(x), pb.get(x)),
                "mean_acceptance_length_a": pa.get("mean_acceptance_length"),
                "mean_acceptance_length_b": pb.get("mean_acceptance_length"),
                "cost_per_mtok_a": cost_per_million(pa.get(y), gpu_hour_usd),
                "cost_per_mtok_b": cost_per_million(pb.get(y), gpu_hour_usd),
            }
        )
    return rows


def _crossover_x(
    fa: list[dict[str, Any]], fb: list[dict[str, Any]], x_range: tuple[float, float] | None, *, x: str, y: str
) -> float | None:
    """The highest interactivity (on a fine grid) at which A's frontier is below B's."""
    if x_range is None:
        return None
    below = [
        q
        for q in grid(*x_range, 64)
        if (r := _ratio(y_at_x(fa, q, x=x, y=y), y_at_x(fb, q, x=x, y=y))) is not None and r < 1.0
    ]
    return max(below) if below else None


def _f(v: Any, fmt: str = "{:.3g}") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fmt.format(v)
    return str(v)


def _cost_cells(row: dict[str, Any], money: bool) -> str:
    """The $/Mtok columns of a row (with --gpu-hour-usd)."""
    return (
        f" {_f(row['cost_per_mtok_a'], '{:.4g}'):>9} {_f(row['cost_per_mtok_b'], '{:.4g}'):>9}"
        if money
        else ""
    )


def _table(lines: list[str], title: str, head: str, rows: list[str], empty: str) -> None:
    lines += ["", title]
    lines += [head, *rows] if rows else [empty]


def format_text(r: dict[str, Any]) -> str:
    x, y = r["x"], r["y"]
    lines = [f"A = {r['a']}   B = {r['b']}   x = {x}   y = {y}"]
    money = r.get("gpu_hour_usd") is not None
    cost_head = f" {'$/Mtok A':>9} {'$/Mtok B':>9}" if money else ""
    _table(
        lines,
        f"At matched interactivity (speedup = A/B {y}):",
        f"  {'tok/s/user':>11} {'A':>11} {'B':>11} {'speedup':>8}" + cost_head,
        [f"  {_f(row[x]):>11} {_f(row[f'{y}_a']):>11} {_f(row[f'{y}_b']):>11} {_f(row['speedup'], '{:.2f}x'):>8}"
         + _cost_cells(row, money) for row in r["iso_interactivity"]],
        "  the two frontiers share no interactivity range",
    )  # fmt: skip
    _table(
        lines,
        f"At matched throughput (ratio = A/B {x}):",
        f"  {'tok/s/GPU':>11} {'A':>11} {'B':>11} {'ratio':>8}",
        [f"  {_f(row[y]):>11} {_f(row[f'{x}_a']):>11} {_f(row[f'{x}_b']):>11} {_f(row['interactivity_ratio'], '{:.2f}x'):>8}"
         for row in r["iso_throughput"]],
        "  the two frontiers share no throughput range",
    )  # fmt: skip
    _table(
        lines,
        "Per concurrency:",
        f"  {'conc':>5} {'tput A/B':>9} {'user A/B':>9} {'tau A':>6} {'tau B':>6}" + cost_head,
        [f"  {row['concurrency']:>5} {_f(row['throughput_ratio'], '{:.2f}x'):>9} {_f(row['interactivity_ratio'], '{:.2f}x'):>9}"
         f" {_f(row['mean_acceptance_length_a'], '{:.2f}'):>6} {_f(row['mean_acceptance_length_b'], '{:.2f}'):>6}"
         + _cost_cells(row, money) for row in r["per_concurrency"]],
        "  no concurrency measured by both runs",
    )  # fmt: skip
    lines.append("")
    c = r["crossover_concurrency"]
    lines.append(
        f"Speculation stops paying at concurrency: {_f(c, '{:.3g}') if c is not None else 'never (measured range)'} ({r['crossover_note']})"
    )
    cx = r["crossover_interactivity"]
    if cx is not None:
        lines.append(f"A's frontier is below B's at interactivity <= {cx:.3g} tok/s/user")
    return "\n".join(lines) + "\n"
