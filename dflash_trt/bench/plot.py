# SPDX-License-Identifier: Apache-2.0
"""Charts of several runs on one pair of axes: every point faint, each run's Pareto frontier as a
line, frontier points annotated with their concurrency (or rate) and mean acceptance length tau.

- PNG via matplotlib (imported lazily, Agg backend).
- HTML: one self-contained file, an inline SVG drawn here (no matplotlib, no CDN, no script
  needed to read it; hover a point for its numbers), plus a table of every point.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_trt.bench.pareto import DEFAULT_X, DEFAULT_Y, X_AXES, Y_AXES, frontier
from dflash_trt.errors import EnvironmentMissing, UsageError

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def run_label(summary: dict[str, Any], fallback: str) -> str:
    return str(summary.get("label") or (summary.get("config") or {}).get("label") or fallback)


def point_tag(p: dict[str, Any]) -> str:
    if p.get("mode") == "request_rate":
        head = f"r={p.get('request_rate'):g}"
    else:
        head = f"c={p.get('concurrency')}"
    tau = p.get("mean_acceptance_length")
    return head if tau is None else f"{head} τ={tau:.2f}"


def _xy(points: Sequence[dict[str, Any]], x: str, y: str) -> list[tuple[float, float, dict[str, Any]]]:
    out = []
    for p in points:
        px, py = p.get(x), p.get(y)
        if (
            isinstance(px, (int, float))
            and isinstance(py, (int, float))
            and math.isfinite(px)
            and math.isfinite(py)
        ):
            out.append((float(px), float(py), p))
    return out


def _distinct(values: Sequence[str]) -> list[str]:
    """The values in first-seen order, each once."""
    return list(dict.fromkeys(values))


def _workload_text(s: dict[str, Any]) -> str | None:
    w = s.get("workload") or {}
    if w.get("kind") == "synthetic":
        return f"synthetic ISL {w.get('isl')} / OSL {w.get('osl')}"
    if w.get("dataset"):
        return f"dataset {Path(str(w['dataset'])).name}"
    return None


def run_protocols(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Every protocol the runs used, in run order, each once."""
    return _distinct([str((s.get("config") or {}).get("protocol")) for _, s in runs])


def legend_labels(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Run labels; with several protocols each label also names its run's protocol."""
    if len(run_protocols(runs)) <= 1:
        return [label for label, _ in runs]
    return [f"{label} ({(s.get('config') or {}).get('protocol')})" for label, s in runs]


def _subtitle(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """What the runs share, over all of them: workloads, protocols and GPU counts (each listed once,
    so runs over different protocols are never drawn under one protocol's name)."""
    if not runs:
        return ""
    parts = _distinct([t for _, s in runs if (t := _workload_text(s)) is not None])
    protocols = run_protocols(runs)
    parts.append(("protocol " if len(protocols) == 1 else "protocols ") + ", ".join(protocols))
    gpus = _distinct([str((s.get("config") or {}).get("num_gpus", 1)) for _, s in runs])
    parts.append(f"{'/'.join(gpus)} GPU(s)")
    return ", ".join(parts)


def plot_png(
    runs: Sequence[tuple[str, dict[str, Any]]],
    out: Path,
    *,
    x: str = DEFAULT_X,
    y: str = DEFAULT_Y,
    log: bool = False,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in the bench extra
        raise EnvironmentMissing(
            "PNG plots need matplotlib", hint="pip install 'dflash-trt[bench]', or write .html"
        ) from exc

    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for i, (label, (_, s)) in enumerate(zip(legend_labels(runs), runs)):
        color = PALETTE[i % len(PALETTE)]
        pts = _xy(s.get("points", []), x, y)
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, alpha=0.25, s=18)
        front = _xy(frontier(s.get("points", []), x=x, y=y), x, y)
        if front:
            ax.plot(
                [p[0] for p in front], [p[1] for p in front], "-o", color=color, label=label, markersize=5
            )
            for fx, fy, p in front:
                ax.annotate(
                    point_tag(p), (fx, fy), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color
                )
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(X_AXES.get(x, x))
    ax.set_ylabel(Y_AXES.get(y, y))
    ax.set_title("Throughput vs interactivity (Pareto frontiers)\n" + _subtitle(runs), fontsize=10)
    ax.grid(True, alpha=0.3)
    if runs:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- HTML/SVG
def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    return [
        10.0**k * m for k in range(a, b + 1) for m in (1, 2, 5) if lo * 0.999 <= 10.0**k * m <= hi * 1.001
    ] or [lo, hi]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


class _Scale:
    def __init__(self, lo: float, hi: float, a: float, b: float, log: bool) -> None:
        self.log = log and lo > 0
        if self.log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi <= lo:
            hi = lo + 1.0
        self.lo, self.hi, self.a, self.b = lo, hi, a, b

    def __call__(self, v: float) -> float:
        if self.log:
            v = math.log10(max(v, 1e-300))
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)


_W, _H = 900, 560  # the SVG's size, and its plot area's margins
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 200, 40, 60


def render_svg(
    runs: Sequence[tuple[str, dict[str, Any]]], *, x: str = DEFAULT_X, y: str = DEFAULT_Y, log: bool = False
) -> str:
    allpts = [t for _, s in runs for t in _xy(s.get("points", []), x, y)]
    if not allpts:
        raise UsageError(
            f"no point has both {x} and {y}",
            hint="pick other axes with --x/--y, or check the runs' num_errors",
        )
    xs, ys = [t[0] for t in allpts], [t[1] for t in allpts]
    if log and (min(xs) <= 0 or min(ys) <= 0):
        log = False
    if log:
        xt, yt = _log_ticks(min(xs), max(xs)), _log_ticks(min(ys), max(ys))
    else:
        xt, yt = nice_ticks(0.0, max(xs) * 1.05), nice_ticks(0.0, max(ys) * 1.05)
    sx = _Scale(min(xt[0], min(xs)), max(xt[-1], max(xs)), _LEFT, _W - _RIGHT, log)
    sy = _Scale(min(yt[0], min(ys)), max(yt[-1], max(ys)), _H - _BOTTOM, _TOP, log)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{_W}" height="{_H}" fill="white"/>',
        *_svg_axes(sx, sy, xt, yt, x=x, y=y),
    ]
    for i, (label, (_, s)) in enumerate(zip(legend_labels(runs), runs)):
        parts += _svg_run(s, label, PALETTE[i % len(PALETTE)], i, sx, sy, x=x, y=y)
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_axes(sx: _Scale, sy: _Scale, xt: list[float], yt: list[float], *, x: str, y: str) -> list[str]:
    """Grid lines with their tick labels, the plot frame and the axis titles."""
    left, right, top, bottom, W, H = _LEFT, _RIGHT, _TOP, _BOTTOM, _W, _H
    e = html.escape
    parts = []
    for v in xt:
        px = sx(v)
        parts.append(f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{H - bottom}" stroke="#e5e5e5"/>')
        parts.append(f'<text x="{px:.1f}" y="{H - bottom + 16}" text-anchor="middle">{_fmt(v)}</text>')
    for v in yt:
        py = sy(v)
        parts.append(f'<line x1="{left}" y1="{py:.1f}" x2="{W - right}" y2="{py:.1f}" stroke="#e5e5e5"/>')
        parts.append(f'<text x="{left - 6}" y="{py + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    parts.append(
        f'<rect x="{left}" y="{top}" width="{W - left - right}" height="{H - top - bottom}" fill="none" stroke="#333"/>'
    )
    parts.append(
        f'<text x="{(left + W - right) / 2}" y="{H - 18}" text-anchor="middle">{e(X_AXES.get(x, x))}</text>'
    )
    parts.append(
        f'<text x="18" y="{(top + H - bottom) / 2}" text-anchor="middle" transform="rotate(-90 18 {(top + H - bottom) / 2})">'
        f"{e(Y_AXES.get(y, y))}</text>"
    )
    return parts


def _svg_run(
    s: dict[str, Any], label: str, color: str, i: int, sx: _Scale, sy: _Scale, *, x: str, y: str
) -> list[str]:
    """One run: every point faint, its frontier as a line of tagged points, its legend entry (row i)."""
    e = html.escape
    parts = []
    for fx, fy, p in _xy(s.get("points", []), x, y):
        parts.append(
            f'<circle cx="{sx(fx):.1f}" cy="{sy(fy):.1f}" r="3.5" fill="{color}" fill-opacity="0.3">'
            f"<title>{e(_tooltip(label, p, x, y))}</title></circle>"
        )
    front = _xy(frontier(s.get("points", []), x=x, y=y), x, y)
    if front:
        path = " ".join(f"{sx(fx):.1f},{sy(fy):.1f}" for fx, fy, _ in front)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for fx, fy, p in front:
            parts.append(
                f'<circle cx="{sx(fx):.1f}" cy="{sy(fy):.1f}" r="4.5" fill="{color}">'
                f"<title>{e(_tooltip(label, p, x, y))}</title></circle>"
            )
            parts.append(
                f'<text x="{sx(fx) + 6:.1f}" y="{sy(fy) - 6:.1f}" font-size="10" fill="{color}">{e(point_tag(p))}</text>'
            )
    ly = _TOP + 10 + 20 * i
    parts.append(
        f'<line x1="{_W - _RIGHT + 15}" y1="{ly}" x2="{_W - _RIGHT + 40}" y2="{ly}" stroke="{color}" stroke-width="2"/>'
    )
    parts.append(f'<text x="{_W - _RIGHT + 46}" y="{ly + 4}">{e(label)}</text>')
    return parts


def _tooltip(label: str, p: dict[str, Any], x: str, y: str) -> str:
    bits = [f"{label} {point_tag(p)}", f"{x} = {p.get(x)}", f"{y} = {p.get(y)}"]
    for k in ("ttft_p50_s", "tpot_p50_s", "output_tokens_per_s", "num_errors"):
        if p.get(k) is not None:
            bits.append(f"{k} = {p[k]:.4g}" if isinstance(p[k], float) else f"{k} = {p[k]}")
    return "\n".join(bits)


_TABLE_COLS = (
    ("key", "point"),
    ("tokens_per_s_per_user_p50", "tok/s/user p50"),
    ("total_tokens_per_s_per_gpu", "tok/s/GPU"),
    ("output_tokens_per_s_per_gpu", "out tok/s/GPU"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("tpot_p50_s", "TPOT p50 s"),
    ("mean_acceptance_length", "τ"),
    ("achieved_concurrency", "achieved conc."),
    ("num_errors", "errors"),
)


def render_html(
    runs: Sequence[tuple[str, dict[str, Any]]], *, x: str = DEFAULT_X, y: str = DEFAULT_Y, log: bool = False
) -> str:
    e = html.escape
    svg = render_svg(runs, x=x, y=y, log=log)
    tables = []
    for label, s in runs:
        front_keys = {p.get("key") for p in frontier(s.get("points", []), x=x, y=y)}
        rows = []
        for p in s.get("points", []):
            cells = []
            for k, _ in _TABLE_COLS:
                v = p.get(k)
                cells.append(
                    f"<td>{e(_fmt(v) if isinstance(v, float) else str('-' if v is None else v))}</td>"
                )
            cells.append(f"<td>{'yes' if p.get('key') in front_keys else ''}</td>")
            rows.append("<tr>" + "".join(cells) + "</tr>")
        head = "".join(f"<th>{e(h)}</th>" for _, h in _TABLE_COLS) + "<th>frontier</th>"
        cfg = s.get("config") or {}
        tables.append(
            f"<h2>{e(label)}</h2><p class=meta>{e(str(cfg.get('url')))} · {e(str(cfg.get('protocol')))} · "
            f"model {e(str(cfg.get('model')))} · status {e(str(s.get('status')))}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        )
    data = json.dumps([{"label": label, "points": s.get("points", [])} for label, s in runs], default=str)
    data = data.replace("</", "<\\/")  # keep the JSON inert inside <script>
    defs = (runs[0][1].get("definitions") or {}) if runs else {}
    def_rows = "".join(f"<tr><td>{e(k)}</td><td>{e(str(v))}</td></tr>" for k, v in defs.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dflash-trt bench: throughput vs interactivity</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 16px; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; }}
.meta {{ color: #666; font-size: 13px; }}
details td {{ text-align: left; }}
</style></head><body>
<h1>Throughput vs interactivity</h1>
<p class=meta>{e(_subtitle(runs))}. Lines: Pareto frontiers (no other point of the run is better on both axes);
faint dots: every point. Labels: concurrency (c) or request rate (r) and mean acceptance length τ (bonus token included).
Hover a point for its numbers.</p>
{svg}
{"".join(tables)}
<details><summary>Metric definitions</summary><table>{def_rows}</table></details>
<script type="application/json" id="dflash-trt-bench-data">{data}</script>
</body></html>
"""


def plot_runs(
    summaries: Sequence[tuple[str, dict[str, Any]]],
    out: Path,
    *,
    x: str = DEFAULT_X,
    y: str = DEFAULT_Y,
    log: bool = False,
) -> Path:
    """Write the chart; the format follows the suffix of `out` (.png or .html)."""
    suffix = out.suffix.lower()
    runs = [(run_label(s, fallback), s) for fallback, s in summaries]
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".png":
        plot_png(runs, out, x=x, y=y, log=log)
    elif suffix in (".html", ".htm"):
        out.write_text(render_html(runs, x=x, y=y, log=log), encoding="utf-8")
    else:
        raise UsageError(
            f"--out={out}: unknown format {suffix or '(none)'}", hint="end the file name in .png or .html"
        )
    return out
