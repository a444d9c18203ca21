# SPDX-License-Identifier: Apache-2.0
"""What penalties (or log-probabilities) cost a DFlash round: the same batch of greedy requests with and
without presence/frequency/repetition penalties and a logit bias (--feature penalties), or with and
without logprobs=5 (--feature logprobs), or with and without 32 bad words of one to four tokens
(--feature bad_words), in one engine, interleaved, as round-time ratios taken in one
run (issue #44's goals: a penalized round, and a round with logprobs=5, at most 1.10x a plain one).

  engine   `LLM(TARGET)` with its packaged drafter drafting the full block (pinned: both kinds run the same
           round shape), default settings unless --eager / --compile
  batch    B of the pair's held-out prompts at once, greedy, ignore_eos, --max-tokens each
  figures  (a) the work a round adds: the time in the round's penalty steps (the pass over the block's
           logits, the count of the committed tokens) or its log-probability steps (log-softmax, rank and
           top-k over the block's logits; their parse after the read-back), timed where they run, per
           round of that kind, over the plain round's time: (plain + added) / plain is the penalized round's
           cost in the same state, the goal's ratio; (b) end to end, seconds per round of each kind
           (`runner.times`: round_s / rounds) over --repeats calls, alternating. (b) is confounded: the
           penalties change the outputs, so the kinds run different numbers of rounds at different batch
           sizes as requests finish; (a) is not. Log-probabilities do not change the tokens: for them (b)
           is clean too. A penalized batch verifies the chain, and its shape class
           is not compiled by the warm-up (with compiled rounds it runs eagerly: serving freezes the
           classes after the warm-up); --eager compares like with like.

    .venv/bin/python bench/penalty_cost.py --target tiny --batch-sizes 1,16 --eager
    .venv/bin/python bench/penalty_cost.py --target smollm2-135m --batch-sizes 1,16 --eager --max-tokens 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1}
# words of one to four tokens in either pair's tokenizer (byte-level for tiny), and two token ids
BAD_WORDS = ["import os", "return None", "self.", " the", "else:", "True", "lambda", "yield", "Hello", "assert",
             "def ", "class", "print(", "if __name__", "raise", "except", "width", "height", "while", "pass",
             "sorted(", "key=", "None", "with open(", "range(", "len(", "dict(", "list(", "str(", "int(", "x = ",
             "and"]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="tiny")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="compile", action="store_false", default=None)
    mode.add_argument("--compile", dest="compile", action="store_true")
    p.add_argument("--feature", choices=("penalties", "logprobs", "bad_words"), default="penalties")
    p.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    return p.parse_args(argv)


def _per_round(llm: Any, prompts: list[str], sp: Any) -> tuple[float, int]:
    times = llm.engine.runner.times
    before = (times.round_s, times.rounds)
    llm.generate(prompts, sp)
    return times.round_s - before[0], times.rounds - before[1]


def measure(llm: Any, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from dflash_trt import SamplingParams
    from dflash_trt.engine import round as round_mod

    base = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}
    plain = SamplingParams(**base)
    if args.feature == "penalties":
        penalized = SamplingParams(
            **base, **PENALTIES, logit_bias={7: -2.0, 11: 1.5}
        )  # ids every vocabulary has
        steps = ("_penalize_block", "_count_committed")
    elif args.feature == "bad_words":
        penalized = SamplingParams(**base, bad=BAD_WORDS[:30], bad_token_ids=[7, 11])
        steps = ("_penalize_block", "_count_committed")
    else:
        penalized = SamplingParams(**base, logprobs=5)
        steps = ("token_logprobs", "parse_logprobs")
    added = [0.0]
    for name in steps:  # the round's steps of the feature, timed where they run
        setattr(round_mod, name, _timed(getattr(round_mod, name), added))
    _per_round(llm, prompts, plain)  # warm-up: allocations, the penalty buffers
    _per_round(llm, prompts, penalized)
    ms: dict[str, list[float]] = {"plain": [], "penalized": [], "added": []}
    for r in range(args.repeats):
        for name in ("plain", "penalized") if r % 2 == 0 else ("penalized", "plain"):
            added[0] = 0.0
            seconds, rounds = _per_round(llm, prompts, plain if name == "plain" else penalized)
            ms[name].append(1e3 * seconds / max(1, rounds))
            if name == "penalized":
                ms["added"].append(1e3 * added[0] / max(1, rounds))
    out = {k: statistics.median(v) for k, v in ms.items()}
    return {"plain_ms_per_round": out["plain"], "penalized_ms_per_round": out["penalized"],
            "added_ms_per_round": out["added"], "ratio": (out["plain"] + out["added"]) / out["plain"],
            "end_to_end_ratio": out["penalized"] / out["plain"]}  # fmt: skip


def _timed(fn: Any, total: list[float]) -> Any:
    import time

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0

    return timed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dflash_trt import LLM, pairs
    from dflash_trt.utils.figures import machine_record

    texts = pairs.heldout_texts(args.target)
    kwargs = {} if args.compile is None else {"compile": args.compile}
    results = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        with LLM(args.target, speculative_config=_spec(args.target, bs), max_batch_size=bs, **kwargs) as llm:
            point = {
                "batch_size": bs,
                "compiled": llm.engine.executor.compiled,
                **measure(llm, texts[:bs], args),
            }
        results.append(point)
        print(f"batch {bs:>3}: plain round {point['plain_ms_per_round']:.2f} ms, {args.feature} work "
              f"{point['added_ms_per_round']:.2f} ms a round: ratio {point['ratio']:.3f}; end to end "
              f"{point['penalized_ms_per_round']:.2f} ms/round ({point['end_to_end_ratio']:.3f}"
              f"{', confounded' if args.feature == 'penalties' else ''}) "
              f"(compiled classes: {point['compiled']})", flush=True)  # fmt: skip
    config = {"target": args.target, "feature": args.feature, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "penalties": PENALTIES if args.feature == "penalties" else None, "logprobs": 5 if args.feature == "logprobs" else None,
              "bad_words": [*BAD_WORDS[:30], 7, 11] if args.feature == "bad_words" else None,
              "compile": "default" if args.compile is None else args.compile, "machine": machine_record(),
              "date": datetime.date.today().isoformat()}  # fmt: skip
    print(json.dumps(config))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": config, "points": results}, indent=1) + "\n")
    return 0


def _spec(target: str, batch: int) -> dict[str, Any]:
    """The packaged pair's drafter (smollm2-135m's is named, not its default), the full block at every
    batch size (`max_concurrency`: a draft length chosen by cost would differ between the two kinds)."""
    from dflash_trt import pairs

    pair = pairs.packaged_pair(target)
    drafter = pairs.default_drafter(pair) or pairs.packaged_drafter(f"{target}-dflash")
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    return {"decoding_type": "DFlash", "max_draft_len": block - 1, "speculative_model": str(drafter),
            "max_concurrency": batch}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
