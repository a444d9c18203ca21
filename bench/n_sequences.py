# SPDX-License-Identifier: Apache-2.0
"""n = 4 against four requests sent one after another (issue #44's goal: the four choices in at most
0.6x the time): one prefill of the prompt and four sequences decoded side by side, against the same
four sequences as separate requests, each waiting for the one before.

  engine   `LLM(TARGET)` with the pair's DFlash drafter (its default, else its packaged v1 drafter;
           --plain: none), default settings unless --eager / --compile
  work     each held-out prompt of the pair, T = --temperature, --max-tokens with ignore_eos; sequence i
           is seeded sequence_seed(seed, i) both ways, so both sides emit exactly the same tokens
  figures  wall time of the n = 4 request over the four separate requests, per prompt, the two sides
           alternating which goes first; the median ratio and the totals'

    .venv/bin/python bench/n_sequences.py --target tiny --eager
    .venv/bin/python bench/n_sequences.py --target smollm2-135m --eager --prompts 6
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="tiny")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--plain", action="store_true", help="plain decoding (no drafter)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="compile", action="store_false", default=None)
    mode.add_argument("--compile", dest="compile", action="store_true")
    p.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    return p.parse_args(argv)


def measure(
    llm: Any, prompt: str, seed: int, args: argparse.Namespace, *, group_first: bool
) -> dict[str, Any]:
    """One prompt both ways; checks that both emitted the same tokens."""
    from dflash_trt import SamplingParams
    from dflash_trt.engine.admission import sequence_seed

    def params(**kw: Any) -> Any:
        return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, **kw)

    def grouped() -> list[list[int]]:
        return [c.token_ids for c in llm.generate(prompt, params(n=args.n, seed=seed)).outputs]

    def one_by_one() -> list[list[int]]:
        return [
            llm.generate(prompt, params(seed=sequence_seed(seed, i))).outputs[0].token_ids
            for i in range(args.n)
        ]

    times, tokens = {}, {}
    for name, fn in (("group", grouped), ("separate", one_by_one))[:: 1 if group_first else -1]:
        t0 = time.perf_counter()
        tokens[name] = fn()
        times[name] = time.perf_counter() - t0
    if tokens["group"] != tokens["separate"]:
        raise SystemExit("n sequences and the separate requests emitted different tokens: not a fair compare")
    return {
        "group_s": times["group"],
        "separate_s": times["separate"],
        "ratio": times["group"] / times["separate"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dflash_trt import LLM, pairs
    from dflash_trt.utils.figures import machine_label, machine_record

    texts = pairs.heldout_texts(args.target)[: args.prompts]
    kwargs = {} if args.compile is None else {"compile": args.compile}
    if not args.plain:
        drafter = pairs.default_drafter(pairs.packaged_pair(args.target)) or pairs.packaged_drafter(
            f"{args.target}-dflash"
        )
        kwargs["speculative_config"] = {"decoding_type": "DFlash", "speculative_model": str(drafter),
                                        "max_draft_len": json.loads((drafter / "config.json").read_text())["block_size"] - 1}  # fmt: skip
    with LLM(args.target, max_batch_size=max(8, args.n), **kwargs) as llm:
        compiled = llm.engine.executor.compiled
        drafter = llm.engine.drafter is not None
        llm.generate(texts[0], None)  # the first request pays one-time costs; keep them out
        points = [measure(llm, text, 1000 + i, args, group_first=i % 2 == 0) for i, text in enumerate(texts)]
    ratio = statistics.median(p["ratio"] for p in points)
    total = sum(p["group_s"] for p in points) / sum(p["separate_s"] for p in points)
    machine = machine_record()
    print(f"{args.target}, n={args.n}, T={args.temperature}, {args.max_tokens} tokens, {len(points)} prompts, "
          f"{'DFlash' if drafter else 'plain decoding'}, rounds {'compiled' if compiled else 'eager'}, "
          f"{machine_label(machine)}: n={args.n} takes {ratio:.3f}x the time of {args.n} separate requests "
          f"(median of prompts; totals {total:.3f}x)", flush=True)  # fmt: skip
    config = {"target": args.target, "n": args.n, "temperature": args.temperature, "max_tokens": args.max_tokens,
              "prompts": len(points), "drafter": drafter, "compiled": compiled, "machine": machine,
              "date": datetime.date.today().isoformat()}  # fmt: skip
    result = {"config": config, "median_ratio": ratio, "total_ratio": total, "points": points}
    print(json.dumps({k: v for k, v in result.items() if k != "points"}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
