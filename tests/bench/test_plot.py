# SPDX-License-Identifier: Apache-2.0
"""`bench plot`: a PNG via matplotlib and a self-contained HTML file of several runs' frontiers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dflash_trt.bench.plot import nice_ticks, plot_runs, render_html
from dflash_trt.errors import UsageError


def _summary(label: str, rows: list[tuple[int, float, float, float | None]]) -> dict:
    return {
        "label": label,
        "status": "complete",
        "config": {"protocol": "triton-grpc", "url": "h:8001", "model": "tensorrt_llm", "num_gpus": 1},
        "workload": {"kind": "synthetic", "isl": 128, "osl": 64},
        "definitions": {"tpot_s": "(e2el - ttft) / (output_tokens - 1)"},
        "points": [
            {
                "key": f"concurrency={c}",
                "mode": "concurrency",
                "concurrency": c,
                "tokens_per_s_per_user_p50": x,
                "total_tokens_per_s_per_gpu": y,
                "output_tokens_per_s_per_gpu": y / 3,
                "mean_acceptance_length": tau,
                "ttft_p50_s": 0.05,
                "tpot_p50_s": 1 / x,
                "num_errors": 0,
            }
            for c, x, y, tau in rows
        ],
    }


DFLASH = _summary("DFlash", [(1, 200, 200, 3.5), (2, 190, 380, 3.4), (4, 150, 700, 3.1), (8, 60, 650, 2.2)])
AR = _summary("AR", [(1, 90, 90, None), (4, 80, 330, None), (16, 50, 1100, None)])


def test_png(tmp_path: Path) -> None:
    out = plot_runs([("a", DFLASH), ("b", AR)], tmp_path / "pareto.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_html_is_self_contained_and_annotated(tmp_path: Path) -> None:
    out = plot_runs([("a", DFLASH), ("b", AR)], tmp_path / "pareto.html")
    html = out.read_text()
    # nothing fetched from elsewhere: no external scripts, styles, images or fonts
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html
    assert [u for u in re.findall(r"https?://[^\s\"'<]+", html) if u != "http://www.w3.org/2000/svg"] == []
    assert html.count("<polyline") == 2  # one frontier per run
    # DFlash's frontier: c=8 (60, 650) is dominated by c=4 (150, 700)
    assert "c=4 τ=3.10" in html and "c=1 τ=3.50" in html and "c=8 τ=2.20</text>" not in html
    assert "c=16</text>" in html  # AR has no tau
    assert ">DFlash</text>" in html and ">AR</text>" in html
    data = json.loads(re.search(r'id="dflash-trt-bench-data">(.*?)</script>', html, re.S).group(1))  # type: ignore[union-attr]
    assert [r["label"] for r in data] == ["DFlash", "AR"]
    assert "(e2el - ttft) / (output_tokens - 1)" in html


def test_other_axes_log_scale_and_errors(tmp_path: Path) -> None:
    html = render_html([("DFlash", DFLASH)], y="output_tokens_per_s_per_gpu", log=True)
    assert "output tokens/s/GPU" in html
    with pytest.raises(UsageError, match="no point has both"):
        render_html([("DFlash", DFLASH)], x="no_such_metric")
    with pytest.raises(UsageError, match=r"end the file name in \.png or \.html"):
        plot_runs([("a", DFLASH)], tmp_path / "pareto.svgz")


def test_nice_ticks() -> None:
    assert nice_ticks(0, 1000) == [0, 200, 400, 600, 800, 1000]
    assert nice_ticks(0, 0.9) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])


def _with_protocol(summary: dict, label: str, protocol: str) -> dict:
    return {**summary, "label": label, "config": {**summary["config"], "protocol": protocol}}


def test_title_names_every_protocol_of_the_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM OpenAI run next to a Triton gRPC run is not drawn under "protocol triton-grpc"."""
    import matplotlib.axes

    runs = [("DFlash", DFLASH), ("vLLM", _with_protocol(AR, "vLLM", "openai"))]
    titles: list[str] = []
    legends: list[list[str]] = []
    real_title, real_legend = matplotlib.axes.Axes.set_title, matplotlib.axes.Axes.legend

    def set_title(ax, text, *a, **kw):
        titles.append(text)
        return real_title(ax, text, *a, **kw)

    def legend(ax, *a, **kw):
        out = real_legend(ax, *a, **kw)
        legends.append([t.get_text() for t in out.get_texts()])
        return out

    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", set_title)
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    plot_runs(runs, tmp_path / "pareto.png")
    assert "protocols triton-grpc, openai" in titles[0]
    assert "protocol triton-grpc," not in titles[0]
    assert legends == [["DFlash (triton-grpc)", "vLLM (openai)"]]
    html = render_html(runs)
    assert "protocols triton-grpc, openai" in html and ">vLLM (openai)</text>" in html
    # one protocol: named once, legend unchanged
    plot_runs([("a", DFLASH), ("b", AR)], tmp_path / "one.png")
    assert "protocol triton-grpc, 1 GPU(s)" in titles[-1]
    assert legends[-1] == ["DFlash", "AR"]
