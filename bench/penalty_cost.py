# SPDX-License-Identifier: Apache-2.0
"""What penalties cost a DFlash round: the same batch of greedy requests with and without
presence/frequency/repetition penalties and a logit bias, in one engine, interleaved, as round-time
ratios taken in one run (issue #44's goal: a penalized round at most 1.10x an unpenalized one).

  engine   `LLM(TARGET)` with its packaged drafter, default settings unless --eager / --compile
  batch    B of the pair's held-out prompts at once, greedy, ignore_eos, --max-tokens each
  figure   seconds per round (`LLMEngine.runner.times`: round_s / rounds) over --repeats calls of each kind,
           alternating; the penalized over the plain. A penalized batch verifies the chain and runs a
           pass over [B x block x vocabulary]; its shape class is not compiled by the warm-up, so with
           compiled rounds it runs eagerly (serving freezes the classes after the warm-up): the eager
           figure compares like with like, the default figure is what a server does today.

    .venv/bin/python bench/penalty_cost.py --target tiny --batch-sizes 1,16 --eager
    .venv/bin/python bench/penalty_cost.py --target smollm2-135m --batch-sizes 1,16 --eager --max-tokens 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="tiny")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="compile", action="store_false", default=None)
    mode.add_argument("--compile", dest="compile", action="store_true")
    p.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    return p.parse_args(argv)


def _per_round(llm: Any, prompts: list[str], sp: Any) -> tuple[float, int]:
    times = llm.engine.runner.times
    before = (times.round_s, times.rounds)
    llm.generate(prompts, sp)
    return times.round_s - before[0], times.rounds - before[1]


def measure(llm: Any, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from dflash_trt import SamplingParams

    base = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}
    plain = SamplingParams(**base)
    bias = {7: -2.0, 11: 1.5}  # two token ids every vocabulary has
    penalized = SamplingParams(**base, **PENALTIES, logit_bias=bias)
    _per_round(llm, prompts, plain)  # warm-up: allocations, the penalty buffers
    _per_round(llm, prompts, penalized)
    ms: dict[str, list[float]] = {"plain": [], "penalized": []}
    for r in range(args.repeats):
        for name in ("plain", "penalized") if r % 2 == 0 else ("penalized", "plain"):
            seconds, rounds = _per_round(llm, prompts, plain if name == "plain" else penalized)
            ms[name].append(1e3 * seconds / max(1, rounds))
    out = {k: statistics.median(v) for k, v in ms.items()}
    return {"plain_ms_per_round": out["plain"], "penalized_ms_per_round": out["penalized"],
            "ratio": out["penalized"] / out["plain"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dflash_trt import LLM, pairs
    from dflash_trt.utils.device import cpu_flags

    texts = pairs.heldout_texts(args.target)
    kwargs = {} if args.compile is None else {"compile": args.compile}
    results = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        with LLM(args.target, speculative_config=_spec(args.target), max_batch_size=bs, **kwargs) as llm:
            point = {
                "batch_size": bs,
                "compiled": llm.engine.executor.compiled,
                **measure(llm, texts[:bs], args),
            }
        results.append(point)
        print(f"batch {bs:>3}: plain {point['plain_ms_per_round']:.2f} ms/round, penalized "
              f"{point['penalized_ms_per_round']:.2f} ms/round, ratio {point['ratio']:.3f} "
              f"(compiled classes: {point['compiled']})", flush=True)  # fmt: skip
    flags = cpu_flags()
    config = {"target": args.target, "max_tokens": args.max_tokens, "repeats": args.repeats, "penalties": PENALTIES,
              "compile": "default" if args.compile is None else args.compile, "cpu": platform.processor(),
              "cpus": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_bf16" in flags,
              "date": datetime.date.today().isoformat()}  # fmt: skip
    print(json.dumps(config))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": config, "points": results}, indent=1) + "\n")
    return 0


def _spec(target: str) -> dict[str, Any]:
    """The packaged pair's drafter (smollm2-135m's is named, not its default)."""
    from dflash_trt import pairs

    pair = pairs.packaged_pair(target)
    drafter = pairs.default_drafter(pair) or pairs.packaged_drafter(f"{target}-dflash")
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    return {"decoding_type": "DFlash", "max_draft_len": block - 1, "speculative_model": str(drafter)}


if __name__ == "__main__":
    sys.exit(main())
