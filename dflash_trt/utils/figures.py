# SPDX-License-Identifier: Apache-2.0
"""Recorded figures: the `figures.json` a results directory keeps, and the check that the README's
headline figures are the recorded ones.

A results directory (`bench/results/<name>/`) that backs a headline figure holds `figures.json`:

    {"schema": "dflash-trt-figures/1", "date": "2026-11-29", "commit": "<40 hex>",
     "machine": {"cpu": "AMD EPYC 9R14", "cores": 2, "flags": ["avx512f", "avx512_bf16"]},
     "versions": {...}, "figures": {"<key>": {"value": 2.31, "unit": "x", "definition": "..."}}}

A figure may name the raw result it was read from (`"source": {"file": "summary.json", "path": ["ratios",
"a / b", "1"]}`): the check then reads that value too, so `figures.json` cannot drift from the run's own files.

README.md keeps its headline figures in one table between `<!-- headline-figures:begin -->` and
`<!-- headline-figures:end -->`, one row per figure and machine:

    | figure (`key`) | value | machine | date | commit | results |

`check_headline_figures` returns one line per row that its `figures.json` does not back (value, machine,
date or commit). Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "dflash-trt-figures/1"
FILE_NAME = "figures.json"
BLOCK = re.compile(r"<!-- headline-figures:begin -->\n(.*?)<!-- headline-figures:end -->", re.S)
# The CPU flags that change which kernels run, and the names the README gives them.
FLAG_NAMES = {"avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX"}
FIX = "fix: copy the row `python bench/readme_figures.py --print-rows DIR` prints, or re-run bench/readme_figures.py"


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the README's headline table."""

    key: str  # the figure's key in figures.json
    value: str  # as written, e.g. "2.44x"
    machine: str
    date: str
    commit: str
    results: str  # bench/results/<name>/, the directory holding figures.json
    line: int  # 1-based line in the README


def machine_label(machine: dict[str, Any]) -> str:
    """How the README names a machine: its CPU model, cores and the flags that matter."""
    flags = machine.get("flags")
    named = (
        "flags not recorded" if flags is None else ", ".join(FLAG_NAMES[f] for f in FLAG_NAMES if f in flags)
    )
    return f"{machine['cpu']} ({machine['cores']} cores; {named or 'no AVX-512'})"


def machine_record() -> dict[str, Any]:
    """This machine, as figures.json records it (imports torch through utils.device)."""
    import os

    from dflash_trt.utils.device import cpu_flags, cpu_model_name

    return {
        "cpu": cpu_model_name(),
        "cores": os.cpu_count(),
        "flags": sorted(FLAG_NAMES.keys() & cpu_flags()),
    }


def value_text(value: float, unit: str, digits: int = 2) -> str:
    """A figure as the README writes it: `2.44x`, `4.15`, `843 tok/s`."""
    if unit == "tok/s":
        return f"{value:.0f} tok/s"
    return f"{value:.{digits}f}{unit}"


def table_row(key: str, fig: dict[str, Any], record: dict[str, Any], results: str) -> str:
    """The README row for one recorded figure (what `bench/readme_figures.py --print-rows` prints)."""
    cells = (f"{fig['label']} (`{key}`)", value_text(fig["value"], fig.get("unit", "")),
             machine_label(record["machine"]), record["date"], record["commit"][:7], f"[{results}]({results})")  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def parse_rows(text: str) -> list[Row]:
    """The headline table's rows (header and rule lines skipped); [] when the README has no block."""
    match = BLOCK.search(text)
    if not match:
        return []
    first = text[: match.start(1)].count("\n") + 1
    rows = []
    for i, line in enumerate(match.group(1).splitlines()):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or cells[0].startswith(("figure", "---")):
            continue
        key = re.findall(r"`([^`]+)`", cells[0])
        link = re.search(r"bench/results/[\w.-]+/", cells[5])
        rows.append(Row(key=key[-1] if key else "", value=cells[1], machine=cells[2], date=cells[3],
                        commit=cells[4], results=link.group(0) if link else "", line=first + i))  # fmt: skip
    return rows


def read_source(results_dir: Path, source: dict[str, Any]) -> Any:
    """The value a figure was read from: `{"file": "summary.json", "path": ["ratios", "a / b", "1"]}`, the
    path's parts being keys of nested JSON objects or indices of lists."""
    node: Any = json.loads((results_dir / source["file"]).read_text())
    for part in source["path"]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def check_row(row: Row, repo: Path) -> list[str]:
    """What is wrong with one README row, one line each (empty when the recorded results back it)."""
    where = f"README.md:{row.line} `{row.key}` = {row.value}"
    if not row.key or not row.results:
        return [f"{where}: the row needs a `key` in its first cell and a bench/results/<dir>/ link; {FIX}"]
    path = repo / row.results / FILE_NAME
    if not path.is_file():
        return [f"{where}: {row.results}{FILE_NAME} does not exist; {FIX}"]
    record = json.loads(path.read_text())
    fig = record.get("figures", {}).get(row.key)
    if fig is None:
        return [f"{where}: {row.results}{FILE_NAME} records no figure `{row.key}`; {FIX}"]
    errors = []
    digits = len(m.group(1)) if (m := re.search(r"\.(\d+)", row.value)) else 0
    expected = {
        "value": value_text(fig["value"], fig.get("unit", ""), digits),
        "machine": machine_label(record["machine"]),
        "date": record["date"],
        "commit": record["commit"][: max(7, len(row.commit))],
    }
    written = {"value": row.value, "machine": row.machine, "date": row.date, "commit": row.commit}
    for field, want in expected.items():
        if written[field] != want:
            errors.append(
                f"{where}: its {field} is {written[field]!r}, {row.results}{FILE_NAME} records {want!r}; {FIX}"
            )
    if "source" in fig and abs(float(read_source(path.parent, fig["source"])) - fig["value"]) > 1e-9:
        errors.append(
            f"{where}: {row.results}{FILE_NAME} value {fig['value']} differs from {fig['source']['file']} {fig['source']['path']}"
        )
    return errors


def check_headline_figures(text: str, repo: Path) -> list[str]:
    """Every problem with the README's headline table, one line each; empty when all rows are backed."""
    rows = parse_rows(text)
    if not rows:
        return ["README.md has no headline-figures block with rows (<!-- headline-figures:begin --> ... end)"]
    return [err for row in rows for err in check_row(row, repo)]


def write_figures(out: Path, figures: dict[str, dict[str, Any]], *, versions: dict[str, Any]) -> Path:
    """Write `out/figures.json` for this machine, today and this checkout's commit. Figures already there
    from the same commit, machine and date are kept (the stages of one re-measurement add to one file)."""
    import subprocess
    import time

    from dflash_trt.utils.io import atomic_write_text

    repo = Path(__file__).resolve().parents[2]
    git = ["git", "-C", str(repo)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())  # fmt: skip
    record: dict[str, Any] = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%d"), "commit": commit or "unknown",
              "dirty": dirty, "machine": machine_record(), "versions": versions, "figures": {}}  # fmt: skip
    path = out / FILE_NAME
    if path.is_file():
        old = json.loads(path.read_text())
        if any(old.get(k) != record[k] for k in ("commit", "machine", "date")):
            raise SystemExit(
                f"{path} was recorded at another commit, machine or date; fix: use a new directory"
            )
        record["figures"] = old["figures"]
        record["versions"] = {**old.get("versions", {}), **versions}
    record["figures"].update(figures)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return path
