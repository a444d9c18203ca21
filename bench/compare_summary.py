# SPDX-License-Identifier: Apache-2.0
"""Summarise a bench/compare_vllm_cpu.sh or bench/compare_llamacpp.sh run: output tok/s per
concurrency for every run, the best of repeated peer runs, and ours / peer ratios taken from this
one run (with --peer llama also ours against the peer's best configuration, whatever its mode, and
ours against a baseline drafter served in the same run: ours-V-dflash / ours-V-baseline-dflash).

usage: .venv/bin/python bench/compare_summary.py OUT [--peer vllm|llama] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_runs(out: Path) -> dict[str, dict[int, dict[str, float]]]:
    """label -> concurrency -> {tok_s, tau}, for every sweep directory under `out`."""
    runs: dict[str, dict[int, dict[str, float]]] = {}
    for summary in sorted(out.glob("*/summary.json")):
        data = json.loads(summary.read_text())
        points = {}
        for p in data.get("points", []):
            if p.get("concurrency") is None or not p.get("num_completed"):
                continue
            tau = p.get("mean_acceptance_length") or p.get("tau")
            points[int(p["concurrency"])] = {"tok_s": float(p["output_tokens_per_s"]), "tau": tau}
        runs[summary.parent.name] = points
    return runs


def best_of(
    runs: dict[str, dict[int, dict[str, float]]], prefix: str, *, any_suffix: bool = False
) -> dict[int, float]:
    """Per concurrency, the best output tok/s over the runs named `prefix` or `prefix-...` (repeated
    peer runs, or its variants: draft lengths, slot counts), or over every run whose name starts with
    `prefix` (`any_suffix`: all of a peer's configurations, whatever the mode)."""
    best: dict[int, float] = {}
    for label, points in runs.items():
        if label.startswith(prefix) if any_suffix else (label == prefix or label.startswith(prefix + "-")):
            for c, p in points.items():
                best[c] = max(best.get(c, 0.0), p["tok_s"])
    return best


# Our run names end in the mode; DDTree runs are DFlash runs (compared against the peer's DFlash).
OUR_MODES = {"dflash": ("-dflash", "-ddtree"), "ar": ("-ar",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--peer", default="vllm", help="the peer's run-name prefix (vllm, llama)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = load_runs(args.out)
    if not runs:
        raise SystemExit(f"error: no sweep results under {args.out}")
    conc = sorted({c for points in runs.values() for c in points})
    print("output tokens/s by run and concurrency")
    print(f"{'run':28s}" + "".join(f"{f'c={c}':>10s}" for c in conc))
    for label, points in runs.items():
        print(
            f"{label:28s}"
            + "".join(f"{points[c]['tok_s']:10.1f}" if c in points else f"{'-':>10s}" for c in conc)
        )
    ratios: dict[str, dict[int, float]] = {}
    targets = [(mode, f"{args.peer}-{mode}", False) for mode in ("dflash", "ar")]
    targets.append(("dflash", f"{args.peer}-", True))  # the peer's best configuration, any mode
    for mode, prefix, any_suffix in targets:
        peer = best_of(runs, prefix, any_suffix=any_suffix)
        if not peer:
            continue
        name = f"best {args.peer} (any)" if any_suffix else f"best {prefix}"
        for label in sorted(runs):
            if label.startswith("ours-") and label.endswith(OUR_MODES[mode]):
                ratios[f"{label} / {name}"] = {
                    c: runs[label][c]["tok_s"] / peer[c] for c in conc if c in runs[label] and peer.get(c)
                }
    # a second drafter served in the same run (compare_llamacpp.sh BASELINE_DRAFTER)
    for label in sorted(runs):
        if label.startswith("ours-") and label.endswith("-baseline-dflash"):
            ours = label.removesuffix("-baseline-dflash") + "-dflash"
            if ours in runs:
                ratios[f"{ours} / {label}"] = {
                    c: runs[ours][c]["tok_s"] / runs[label][c]["tok_s"]
                    for c in conc
                    if c in runs[ours] and runs[label].get(c, {}).get("tok_s")
                }
    if ratios:
        print("\nratios (this run; the peer's best of its repeated runs)")
        print(f"{'':40s}" + "".join(f"{f'c={c}':>8s}" for c in conc))
        for key, by_c in ratios.items():
            print(f"{key:40s}" + "".join(f"{by_c[c]:8.2f}" if c in by_c else f"{'-':>8s}" for c in conc))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=2) + "\n")


if __name__ == "__main__":
    main()
