# SPDX-License-Identifier: Apache-2.0
"""`make demo`: the main job on the embedded `tiny` default.

Runs the same prompt with DFlash and with plain decoding through `dflash-trt generate`, checks the
outputs are identical (greedy is lossless) and prints the statistics.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROMPT = "def fibonacci(n):\n"


def _generate(*extra: str) -> dict:
    cmd = [sys.executable, "-m", "dflash_trt", "generate", "--target", "tiny", "--prompt", PROMPT,
           "--max-new-tokens", "128", "--json", *extra]  # fmt: skip
    print("$ dflash-trt " + " ".join(repr(a) if " " in a or "\n" in a else a for a in cmd[3:]), flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> int:
    spec = _generate()
    plain = _generate("--no-draft")
    print(f"\nprompt: {PROMPT!r}\ncompletion: {spec['text']!r}\n")
    toks = len(spec["output_ids"])
    rows = [
        ("DFlash", spec["mean_acceptance_length"], spec["decode_s"], spec["num_rounds"]),
        ("plain", plain["mean_acceptance_length"], plain["decode_s"], plain["num_rounds"]),
    ]
    print(f"{'mode':<8} {'tau':>6} {'rounds':>7} {'decode ms':>10} {'tok/s':>8}")
    for name, tau, dec, rounds in rows:
        print(f"{name:<8} {tau:6.2f} {rounds:7d} {dec * 1e3:10.1f} {(toks - 1) / dec:8.1f}")
    same = spec["output_ids"] == plain["output_ids"]
    print(f"\ngreedy outputs identical: {same}; decode speedup {plain['decode_s'] / spec['decode_s']:.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
