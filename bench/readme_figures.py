# SPDX-License-Identifier: Apache-2.0
"""Re-measure README.md's headline figures on this checkout and machine, into one results directory
whose figures.json the README's rows cite (tests/test_headline_figures.py checks them).

    .venv/bin/python bench/readme_figures.py [--out DIR] [--skip-served] [--llamacpp]
    .venv/bin/python bench/readme_figures.py --print-rows DIR     # the README rows of a finished run

Run it on a quiet machine (nothing else on the cores), from a clean checkout of the commit to quote.
Stages, each reusing the project's own measurement:

1. `python -m dflash_trt.demo --heldout-only --record DIR`: `make demo`'s batch-1 figure (its
   HELDOUT_SPEEDUP says how it is defined), τ and both tok/s; about 1-2 min on 2 cores.
2. `bench/tiny_cpu_sweep.py --out DIR/served` with DFLASH_TRT_COMPILE_BACKGROUND=0 (rounds compiled
   before the server is ready, as after `dflash-trt precompile`): DFlash / plain output tok/s served at
   concurrency 1 and 16; about 8-10 min (the cold compile included).
3. `--llamacpp`: `bench/compare_llamacpp.sh DIR/llamacpp` (builds llama.cpp the first time): v1 DFlash
   over llama.cpp's best at concurrency 1 / 4 / 16; about 15 min more, plus the build.

At the end it prints the rows to paste between the README's headline-figures markers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_trt.utils.figures import FILE_NAME, table_row, write_figures  # noqa: E402

SERVED = "output tokens/s of `dflash-trt serve` over `serve --no-draft` at concurrency {c}, compiled rounds, " \
    "the 32 held-out prompts, 128 tokens each (ignore_eos), greedy, gRPC streaming, tokens counted by the server"  # fmt: skip
LLAMA = "output tokens/s of `dflash-trt serve` (v1 drafter) over the best of llama.cpp's llama-server " \
    "configurations (plain, or its DFlash at 15/7/3 drafts) at concurrency {c}, same pair, prompts and client"  # fmt: skip


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env=env)


def served_figures(served: Path) -> dict[str, dict]:
    """DFlash / plain at concurrency 1 and 16 from tiny_cpu_sweep's compare.json (equal token counts, so
    its total-token ratio is the output-token ratio)."""
    per = json.loads((served / "compare.json").read_text())["per_concurrency"]
    figs = {}
    for c in (1, 16):
        i = next(i for i, p in enumerate(per) if p["concurrency"] == c)
        figs[f"served_ratio_c{c}"] = {
            "label": f"DFlash / plain output tok/s, `tiny` served by Triton, concurrency {c}",
            "value": per[i]["throughput_ratio"], "unit": "x", "definition": SERVED.format(c=c),
            "source": {"file": "served/compare.json", "path": ["per_concurrency", str(i), "throughput_ratio"]},
        }  # fmt: skip
    return figs


def llamacpp_figures(summary: Path) -> dict[str, dict]:
    ratios = json.loads(summary.read_text())["ratios"]["ours-default-dflash / best llama (any)"]
    return {
        f"llamacpp_v1_c{c}": {
            "label": f"DFlash (v1) served / llama.cpp's best, `tiny`, concurrency {c}",
            "value": ratios[str(c)],
            "unit": "x",
            "definition": LLAMA.format(c=c),
            "source": {
                "file": "llamacpp/summary.json",
                "path": ["ratios", "ours-default-dflash / best llama (any)", str(c)],
            },
        }
        for c in (1, 4, 16)
    }


def print_rows(out: Path) -> None:
    record = json.loads((out / FILE_NAME).read_text())
    where = f"{out.resolve().relative_to(REPO)}/"
    print(
        "\nPaste into README.md between the headline-figures markers (replacing the rows of these keys), "
        "then run: .venv/bin/pytest tests/test_headline_figures.py\n"
    )
    for key, fig in record["figures"].items():
        print(table_row(key, fig, record, where))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / f"readme-figures-{time.strftime('%Y-%m-%d')}"
    )
    ap.add_argument("--skip-served", action="store_true", help="leave out stage 2")
    ap.add_argument("--llamacpp", action="store_true", help="add stage 3 (llama.cpp side by side)")
    ap.add_argument("--print-rows", type=Path, metavar="DIR", help="only print the README rows of DIR")
    args = ap.parse_args()
    if args.print_rows:
        print_rows(args.print_rows)
        return 0
    out = args.out.resolve()
    run([sys.executable, "-m", "dflash_trt.demo", "--heldout-only", "--record", str(out)])
    if not args.skip_served:
        env = {**os.environ, "DFLASH_TRT_COMPILE_BACKGROUND": "0"}
        run([sys.executable, "bench/tiny_cpu_sweep.py", "--out", str(out / "served")], env=env)
        write_figures(out, served_figures(out / "served"), versions={})
    if args.llamacpp:
        run(["bash", "bench/compare_llamacpp.sh", str(out / "llamacpp")])
        write_figures(out, llamacpp_figures(out / "llamacpp" / "summary.json"), versions={})
    print_rows(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
