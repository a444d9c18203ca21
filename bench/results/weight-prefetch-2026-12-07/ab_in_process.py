# SPDX-License-Identifier: Apache-2.0
"""Experiment harness (2026-12-07, not a maintained benchmark): batch-1 plain decoding of smollm2-135m in one
process, the variants of experiment.diff alternated per generate through XX_PREFETCH, which that patch reads on
every call (0: no prefetch; 1: prefetch and the uneven split; 2: prefetch, even split).

    (experiment.diff applied) GOMP_SPINCOUNT=1000 .venv/bin/python ab_in_process.py 0,1 128 30
"""

import os
import statistics
import sys
import time

from dflash_trt import LLM
from dflash_trt.api.llm import SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


def main() -> None:
    modes = sys.argv[1].split(",")
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    llm = LLM("smollm2-135m")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], params)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(pairs):
        for mode in modes:
            os.environ["XX_PREFETCH"] = mode
            t0 = time.perf_counter()
            llm.generate([PROMPT], params)
            rates[mode].append(tokens / (time.perf_counter() - t0))
    for mode, r in rates.items():
        print(
            f"{mode} median {statistics.median(r):.1f} mean {statistics.mean(r):.1f} min {min(r):.1f} max {max(r):.1f}"
        )
    for mode in modes[1:]:
        ratios = [a / b for a, b in zip(rates[mode], rates[modes[0]], strict=True)]
        print(f"{mode}/{modes[0]} pairwise median {statistics.median(ratios):.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
