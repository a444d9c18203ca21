# SPDX-License-Identifier: Apache-2.0
"""README.md's headline figures are the recorded ones, and no performance figure in README.md or docs/
goes without its machine, date and results directory (issue #49)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dflash_trt.utils.figures import BLOCK, check_headline_figures, machine_label, parse_rows, table_row

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# What counts as a performance figure: a speedup or ratio (1.4x), a rate (843 tok/s), an acceptance length.
FIGURE = re.compile(r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)? ?tok/s\b|τ ?[≈=]? ?\d")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"AMD|Intel|EPYC|Xeon|H100|H200|B200|B300")
RESULTS = re.compile(r"bench/results/[\w.-]+")


def test_readme_headline_figures_are_the_recorded_ones() -> None:
    errors = check_headline_figures(README.read_text(), REPO)
    assert not errors, "\n".join(errors)


def test_the_block_has_rows_for_each_figure_kind() -> None:
    keys = {row.key for row in parse_rows(README.read_text())}
    assert {"demo_speedup", "demo_tau_pooled", "served_ratio_c1", "served_ratio_c16"} <= keys


def _first_row(text: str) -> str:
    block = BLOCK.search(text)
    assert block
    return next(line for line in block.group(1).splitlines() if "](bench/results/" in line)


@pytest.mark.parametrize(
    ("cell", "field"),
    [(1, "value"), (3, "date"), (2, "machine"), (4, "commit")],
)
def test_an_edited_row_fails_naming_the_figure_the_file_and_the_fix(cell: int, field: str) -> None:
    text = README.read_text()
    row = _first_row(text)
    cells = row.split("|")
    cells[cell + 1] = (
        " 9.99x " if field == "value" else " 2026-01-01 " if field == "date" else " other machine "
    )
    if field == "commit":
        cells[cell + 1] = " 0000000 "
    errors = check_headline_figures(text.replace(row, "|".join(cells), 1), REPO)
    assert len(errors) == 1, errors
    key = parse_rows(text)[0].key
    assert f"`{key}`" in errors[0] and f"its {field} is" in errors[0]
    assert "figures.json" in errors[0] and "fix:" in errors[0] and "\n" not in errors[0]


def test_a_row_without_results_or_without_its_figure_fails() -> None:
    text = README.read_text()
    row = _first_row(text)
    unknown = text.replace(row, row.replace("`)", "_x`)", 1), 1)
    assert "records no figure" in check_headline_figures(unknown, REPO)[0]
    missing = text.replace(row, re.sub(r"bench/results/[\w.-]+/", "bench/results/nowhere/", row), 1)
    assert "does not exist" in check_headline_figures(missing, REPO)[0]
    assert "no headline-figures block" in check_headline_figures("# a README\n", REPO)[0]


def test_figures_json_that_drifts_from_its_source_fails(tmp_path: Path) -> None:
    def sourced(row) -> bool:  # a figure read from a raw results file (the demo's are recorded directly)
        return "source" in json.loads((REPO / row.results / "figures.json").read_text())["figures"][row.key]

    row = next(r for r in parse_rows(README.read_text()) if sourced(r))
    results = tmp_path / row.results
    shutil.copytree(REPO / row.results, results)
    record = json.loads((results / "figures.json").read_text())
    fig = record["figures"][row.key]
    fig["value"] += 0.5
    (results / "figures.json").write_text(json.dumps(record))
    readme = table_row(row.key, fig, record, row.results)
    text = (
        f"<!-- headline-figures:begin -->\n| figure | value | machine | date | commit | results |\n{readme}\n"
    )
    errors = check_headline_figures(text + "<!-- headline-figures:end -->\n", tmp_path)
    assert len(errors) == 1 and "differs from" in errors[0], errors


def test_machine_label_names_the_flags_that_matter() -> None:
    rec = {"cpu": "AMD EPYC 9R14", "cores": 2, "flags": ["avx512_bf16", "avx512f", "avx2"]}
    assert machine_label(rec) == "AMD EPYC 9R14 (2 cores; AVX-512, AVX512-BF16)"
    assert machine_label({**rec, "flags": ["avx2"]}) == "AMD EPYC 9R14 (2 cores; no AVX-512)"
    assert machine_label({**rec, "flags": None}) == "AMD EPYC 9R14 (2 cores; flags not recorded)"


def _paragraphs(path: Path) -> list[tuple[int, str]]:
    """Prose paragraphs with their first line: code blocks and the headline block left out."""
    text = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    out, start, lines = [], 1, []
    for i, line in enumerate([*text.split("\n"), ""], start=1):
        if line.strip() and not line.startswith("    "):
            start = start if lines else i
            lines.append(line)
        elif lines:
            out.append((start, "\n".join(lines)))
            lines = []
    return out


@pytest.mark.parametrize("path", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_performance_figure_names_its_machine_date_and_results(path: Path) -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line}: {FIGURE.search(par).group(0)!r} needs a date, a machine and "  # type: ignore[union-attr]
        "a bench/results/<dir>/ in its paragraph (or move it to the headline table, or remove it)"
        for line, par in _paragraphs(path)
        if FIGURE.search(par) and not (DATE.search(par) and MACHINE.search(par) and RESULTS.search(par))
    ]
    assert not bad, "\n".join(bad)


def test_readme_and_make_demo_define_the_batch_1_speedup_in_the_same_words() -> None:
    from dflash_trt.demo import HELDOUT_SPEEDUP

    assert HELDOUT_SPEEDUP in " ".join(README.read_text().split())


def test_demo_figures_pool_total_tokens_over_total_time() -> None:
    from dflash_trt.demo import heldout_figures

    runs = {
        "plain": [([1] * 128, 1.0, 127, 127), ([2] * 128, 3.0, 127, 127)],
        "DFlash": [([1] * 128, 0.5, 8, 127), ([2] * 128, 1.5, 56, 127)],  # the prefill made each first token
    }
    figs = heldout_figures(runs)
    assert figs["demo_speedup"]["value"] == pytest.approx(4.0 / 2.0)  # not the mean of per-prompt ratios
    assert figs["demo_tau_pooled"]["value"] == pytest.approx(254 / 64)
    assert figs["demo_plain_tok_s"]["value"] == pytest.approx(64.0)


def test_a_recorded_run_yields_rows_the_check_accepts(tmp_path: Path) -> None:
    from dflash_trt.utils.figures import write_figures

    out = tmp_path / "bench" / "results" / "readme-figures-x"
    write_figures(out, {"a": {"label": "A", "value": 2.345, "unit": "x", "definition": "d"}}, versions={})
    record = json.loads(
        write_figures(out, {"b": {"label": "B", "value": 843.2, "unit": "tok/s"}}, versions={}).read_text()
    )
    assert set(record["figures"]) == {"a", "b"} and record["machine"]["cores"]
    rows = [table_row(k, f, record, "bench/results/readme-figures-x/") for k, f in record["figures"].items()]
    text = "<!-- headline-figures:begin -->\n" + "\n".join(rows) + "\n<!-- headline-figures:end -->\n"
    assert check_headline_figures(text, tmp_path) == []
    assert "2.35x" in rows[0] and "843 tok/s" in rows[1]


def test_the_remeasurement_script_reads_the_recorded_runs_as_the_readme_rows_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_figures", REPO / "bench" / "readme_figures.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    served = script.served_figures(REPO / "bench" / "results" / "tiny-cpu")
    recorded = json.loads((REPO / "bench" / "results" / "tiny-cpu" / "figures.json").read_text())["figures"]
    assert {k: f["value"] for k, f in served.items()} == {k: f["value"] for k, f in recorded.items()}
    v1 = script.llamacpp_figures(REPO / "bench" / "results" / "llamacpp-cpu-2026-11-28e" / "summary.json")
    recorded = json.loads(
        (REPO / "bench" / "results" / "llamacpp-cpu-2026-11-28e" / "figures.json").read_text()
    )
    assert {k: f["value"] for k, f in v1.items()} == {k: f["value"] for k, f in recorded["figures"].items()}
    script.print_rows(REPO / parse_rows(README.read_text())[0].results)  # the run the README quotes
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 6 and all(row in README.read_text() for row in rows)
