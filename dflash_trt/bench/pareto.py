# SPDX-License-Identifier: Apache-2.0
"""Pareto frontiers of throughput (per GPU) against interactivity (per user), both maximised.

A point is on the frontier when no other point is at least as good on both axes and strictly
better on one. Between frontier points the achievable trade-off is taken as the straight line
joining them (linear interpolation, no extrapolation beyond the measured range): this is how
two configurations are compared "at matched interactivity" or "at matched throughput".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

DEFAULT_X = "tokens_per_s_per_user_p50"
DEFAULT_Y = "total_tokens_per_s_per_gpu"

# Axis choices offered by `bench plot` / `bench compare`, with their labels.
X_AXES: dict[str, str] = {
    "tokens_per_s_per_user_p50": "tokens/s/user (median over requests of 1/TPOT)",
    "tokens_per_s_per_user_mean": "tokens/s/user (mean over requests of 1/TPOT; AIPerf)",
    "interactivity_inferencex_p50": "tokens/s/user (1 / median TPOT; InferenceX)",
    "interactivity_inferencex_p90": "tokens/s/user (1 / p90 TPOT; InferenceX, slow tail)",
    "interactivity_vllm_aggregate": "tokens/s/user (output tok/s / concurrency; vLLM)",
    "interactivity_e2e_norm_p90": "tokens/s/user (1 / p90 of E2EL/OSL; InferenceX AgentX)",
}
Y_AXES: dict[str, str] = {
    "total_tokens_per_s_per_gpu": "tokens/s/GPU (input + output; InferenceX)",
    "output_tokens_per_s_per_gpu": "output tokens/s/GPU (vLLM)",
    "goodput_output_tokens_per_s": "goodput output tokens/s (requests meeting the SLOs)",
}


def _value(p: dict[str, Any], key: str) -> float | None:
    v = p.get(key)
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def frontier(
    points: Sequence[dict[str, Any]], *, x: str = DEFAULT_X, y: str = DEFAULT_Y
) -> list[dict[str, Any]]:
    """The non-dominated points (maximising x and y), sorted by x ascending (so y descending).

    Points missing either value are ignored; of identical points the first is kept.
    """
    valid = [(_value(p, x), _value(p, y), i, p) for i, p in enumerate(points)]
    ranked = sorted(
        ((px, py, i, p) for px, py, i, p in valid if px is not None and py is not None),
        key=lambda t: (-t[0], -t[1], t[2]),
    )
    kept: list[dict[str, Any]] = []
    best_y = -math.inf
    for _, py, _, p in ranked:
        if py > best_y:
            kept.append(p)
            best_y = py
    kept.reverse()
    return kept


def interpolate(xs: Sequence[float], ys: Sequence[float], q: float) -> float | None:
    """Piecewise-linear y(q) through (xs, ys); xs monotonic (either direction); None outside."""
    if not xs:
        return None
    pairs = sorted(zip(xs, ys))
    if q < pairs[0][0] or q > pairs[-1][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(pairs):
        if x0 <= q <= x1:
            if x1 == x0:
                return max(y0, y1)
            return y0 + (y1 - y0) * (q - x0) / (x1 - x0)
    return pairs[0][1]  # a single point, q equal to it


def y_at_x(
    front: Sequence[dict[str, Any]], q: float, *, x: str = DEFAULT_X, y: str = DEFAULT_Y
) -> float | None:
    """Throughput the frontier reaches at interactivity q (None outside its measured range)."""
    return interpolate([float(p[x]) for p in front], [float(p[y]) for p in front], q)


def x_at_y(
    front: Sequence[dict[str, Any]], q: float, *, x: str = DEFAULT_X, y: str = DEFAULT_Y
) -> float | None:
    """Interactivity the frontier reaches at throughput q (None outside its measured range)."""
    return interpolate([float(p[y]) for p in front], [float(p[x]) for p in front], q)


def overlap(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """The common range of two sets of values, or None when they do not overlap."""
    if not a or not b:
        return None
    lo, hi = max(min(a), min(b)), min(max(a), max(b))
    return (lo, hi) if lo <= hi else None


def grid(lo: float, hi: float, n: int) -> list[float]:
    """n log-spaced values from lo to hi (linear when lo <= 0)."""
    if n <= 1 or hi <= lo:
        return [lo]
    if lo > 0:
        r = (hi / lo) ** (1.0 / (n - 1))
        return [lo * r**i for i in range(n - 1)] + [hi]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]
