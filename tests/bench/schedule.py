# SPDX-License-Identifier: Apache-2.0
"""Checks of a sweep against a known schedule that hold however busy the machine is.

A server that sleeps until each response's scheduled time is never early, but it can be late by
any amount on a loaded machine. So a test of the harness asserts three things, none of them an
upper bound on a latency:

- `assert_never_early`: every measured request carried the scheduled chunks, each arriving no
  sooner than scheduled (a sleep never returns early);
- `assert_point_is_its_records`: every latency and rate of the point equals its definition
  (bench/README.md) applied to the requests recorded in requests.jsonl, recomputed here with
  numpy, independently of dflash_trt.bench.metrics;
- exact counts (tokens, chunk sizes, tau), which the tests assert themselves.

How close measured latencies come to the schedule on an idle machine is a benchmark's result
(bench/client_overhead.py), not a unit test's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REL = 1e-9  # the point and its records hold the same rounded values


def records(run_dir: Path, *, phase: str = "measure") -> list[dict[str, Any]]:
    """The requests of one phase, as written to requests.jsonl."""
    lines = (Path(run_dir) / "requests.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def assert_never_early(
    recs: Sequence[dict[str, Any]], chunks: Sequence[int], offsets_s: Sequence[float]
) -> None:
    """Each request got `chunks` tokens per chunk, chunk i no sooner than offsets_s[i] after its send."""
    for r in recs:
        assert r["ok"], r
        assert r["chunk_tokens"] == list(chunks), r
        got = r["chunk_offsets_s"]
        assert len(got) == len(offsets_s) and all(g >= want for g, want in zip(got, offsets_s)), (
            got,
            offsets_s,
        )
        assert got == sorted(got)
        assert r["ttft_s"] == got[0] and r["e2el_s"] == got[-1]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _itls(r: dict[str, Any]) -> list[float]:
    """DEFINITIONS['itl_s'] of one request, token by token."""
    ct, co = r["chunk_tokens"], r["chunk_offsets_s"]
    out = [0.0] * (ct[0] - 1)
    for j in range(1, len(co)):
        out += [(co[j] - co[j - 1]) / ct[j]] * ct[j]
    return out


def assert_point_is_its_records(p: dict[str, Any], recs: Sequence[dict[str, Any]]) -> None:
    """Latencies, interactivity, throughput and concurrency of point `p` from its measured records."""
    ok = [r for r in recs if r["ok"]]
    for key in ("ttft", "e2el", "tpot"):
        values = [r[f"{key}_s"] for r in ok if r[f"{key}_s"] is not None]
        assert p[f"{key}_mean_s"] == pytest.approx(sum(values) / len(values), rel=REL)
        for q in (50, 90, 99):
            assert p[f"{key}_p{q}_s"] == pytest.approx(_pct(values, q), rel=REL), key
    icl = [b - a for r in ok for a, b in zip(r["chunk_offsets_s"], r["chunk_offsets_s"][1:])]
    assert p["icl_p50_s"] == pytest.approx(_pct(icl, 50), rel=REL)
    itl = [x for r in ok for x in _itls(r)]
    assert p["itl_mean_s"] == pytest.approx(sum(itl) / len(itl), rel=REL)
    assert p["itl_p50_s"] == pytest.approx(_pct(itl, 50), rel=1e-6)
    per_user = [1.0 / r["tpot_s"] for r in ok if r["tpot_s"]]
    assert p["tokens_per_s_per_user_p50"] == pytest.approx(_pct(per_user, 50), rel=REL)
    assert p["interactivity_inferencex_p50"] == pytest.approx(1 / p["tpot_p50_s"], rel=REL)
    duration = max(r["start_s"] + r["done_s"] for r in recs) - min(r["start_s"] for r in recs)
    assert p["duration_s"] == pytest.approx(duration, rel=REL)
    out_tokens = sum(r["output_tokens"] for r in ok)
    assert p["output_tokens_per_s"] == pytest.approx(out_tokens / duration, rel=REL)
    assert p["achieved_concurrency"] == pytest.approx(sum(r["done_s"] for r in recs) / duration, rel=REL)
