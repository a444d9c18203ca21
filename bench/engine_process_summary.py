# SPDX-License-Identifier: Apache-2.0
"""Summarise a bench/engine_process_ab.sh run: per mode and concurrency, every repetition's output tok/s,
TPOT p50 and served round time for the thread and the process layouts, the process / thread ratio of
each interleaved pair, and of the best runs (the best against the best, as this host swings).

usage: .venv/bin/python bench/engine_process_summary.py OUT [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

LABEL = re.compile(r"^(?P<mode>\w+)-(?P<layout>thread|process)-(?P<rep>\d+)-c(?P<conc>\d+)$")


def load(out: Path) -> list[dict]:
    rows = []
    for summary in sorted(out.glob("*/summary.json")):
        m = LABEL.match(summary.parent.name)
        if m is None:
            continue
        points = [p for p in json.loads(summary.read_text()).get("points", []) if p.get("num_completed")]
        if not points:
            continue
        p = points[0]
        row = {
            **m.groupdict(),
            "tok_s": float(p["output_tokens_per_s"]),
            "tpot_p50_ms": 1000 * p["tpot_p50_s"],
        }
        row["rep"], row["conc"] = int(row["rep"]), int(row["conc"])
        row["errors"] = int(p.get("num_errors") or 0)
        rounds = summary.parent / "round.txt"
        if rounds.is_file():
            c0, s0, c1, s1 = (float(x) for x in rounds.read_text().split())
            row["round_ms"] = 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> tuple[list[str], list[dict]]:
    lines, table = [], []
    for mode in sorted({r["mode"] for r in rows}):
        for conc in sorted({r["conc"] for r in rows if r["mode"] == mode}):
            sel = {(r["layout"], r["rep"]): r for r in rows if r["mode"] == mode and r["conc"] == conc}
            reps = sorted({rep for _, rep in sel})
            pairs = []
            lines.append(f"{mode} c={conc}:")
            for rep in reps:
                t, p = sel.get(("thread", rep)), sel.get(("process", rep))
                cells = []
                for name, r in (("thread", t), ("process", p)):
                    if r is None:
                        cells.append(f"{name} missing")
                        continue
                    rt = f", round {r['round_ms']:.2f} ms" if r.get("round_ms") else ""
                    err = f", {r['errors']} errors" if r["errors"] else ""
                    cells.append(
                        f"{name} {r['tok_s']:.1f} tok/s (TPOT p50 {r['tpot_p50_ms']:.2f} ms{rt}{err})"
                    )
                ratio = p["tok_s"] / t["tok_s"] if t and p else None
                if ratio:
                    pairs.append(ratio)
                lines.append(
                    f"  rep {rep}: " + "; ".join(cells) + (f"; process/thread {ratio:.2f}x" if ratio else "")
                )
            best = {
                name: max((r["tok_s"] for (lay, _), r in sel.items() if lay == name), default=None)
                for name in ("thread", "process")
            }
            entry = {
                "mode": mode,
                "concurrency": conc,
                "pair_ratios": pairs,
                **{f"best_{k}": v for k, v in best.items()},
            }
            if best["thread"] and best["process"]:
                entry["best_ratio"] = best["process"] / best["thread"]
                lines.append(
                    f"  best: thread {best['thread']:.1f}, process {best['process']:.1f} tok/s = "
                    f"{entry['best_ratio']:.2f}x; pairs: median {statistics.median(pairs):.2f}x, "
                    f"min {min(pairs):.2f}x, max {max(pairs):.2f}x"
                )
            table.append(entry)
    return lines, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = load(args.out)
    if not rows:
        raise SystemExit(
            f"error: no sweep results under {args.out}; fix: run bench/engine_process_ab.sh first"
        )
    config = args.out / "config.txt"
    if config.is_file():
        print(config.read_text().rstrip())
    lines, table = summarise(rows)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
