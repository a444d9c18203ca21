# SPDX-License-Identifier: Apache-2.0
"""Two checkouts of dflash-trt, one `bench engine` configuration, interleaved: A/B throughput ratios
taken in one run (these machines drift; back-to-back pairs cancel most of it).

    python bench/engine_ab.py --a /path/to/before --b . --repeats 3 -- --target tiny \\
        --batch-sizes 1,16 --max-tokens 64 --eager

Each repeat runs `dflash-trt bench engine --json ARGS` once per checkout (A first on odd repeats, B
first on even ones), each in its own process with PYTHONPATH at that checkout. It prints the
configuration, the machine, each point's output tok/s per checkout (median over repeats) and B/A.
Compiled rounds: pass --compile and make sure both checkouts' compile caches are warm first (a cold
class compiles for minutes and is not what this measures), e.g. with `dflash-trt precompile`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def _run(checkout: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-c", "import sys; from dflash_trt.cli import main; sys.exit(main())",
           "bench", "engine", "--json", *args]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _points(result: dict) -> dict[tuple, float]:
    return {(p["mode"], p["batch_size"]): p["output_tokens_per_s"] for p in result["points"]}


def _machine() -> str:
    """The CPU's model, cores and the flags that matter here, as the README's figures name them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dflash_trt.utils.figures import machine_label, machine_record

    return machine_label(machine_record())


def _commit(checkout: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `bench engine` options")
    ns = parser.parse_args()
    args = [a for a in ns.bench_args if a != "--"]
    runs: dict[str, list[dict[tuple, float]]] = {"A": [], "B": []}
    config = None
    for r in range(ns.repeats):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            result = _run(ns.a if name == "A" else ns.b, args)
            config = config or result["config"]
            runs[name].append(_points(result))
            print(f"repeat {r + 1}/{ns.repeats} {name} done", file=sys.stderr)
    print(f"machine: {_machine()}; torch threads: engine default")
    print(f"A: {ns.a.resolve()} @ {_commit(ns.a)}   B: {ns.b.resolve()} @ {_commit(ns.b)}")
    print(f"bench engine {' '.join(args)}; repeats {ns.repeats} (interleaved; medians)")
    print(f"config: {json.dumps(config, sort_keys=True)}")
    print(f"{'mode':>10} {'batch':>6} {'A tok/s':>10} {'B tok/s':>10} {'B/A':>7}")
    for key in runs["A"][0]:
        a = statistics.median(p[key] for p in runs["A"])
        b = statistics.median(p[key] for p in runs["B"])
        print(f"{key[0]:>10} {key[1]:>6} {a:>10.1f} {b:>10.1f} {b / a:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
