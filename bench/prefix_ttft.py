# SPDX-License-Identifier: Apache-2.0
"""Time to first token with a long shared system prompt, prefix cache on against off (issue #46's goal:
the second request's TTFT at most 1/4 of the first's).

  engine   `LLM(TARGET)`, default settings (prefix caching on) and the same with
           kv_cache_config.enable_block_reuse false; --eager / --compile as elsewhere
  work     chats: one system prompt of about --system-tokens tokens (the pair's held-out texts joined),
           then --turns different user messages, each sent alone (batch 1) after the previous ended,
           through the target's chat template; 16 tokens each, greedy
  figures  per request, the time from submission to its first streamed token; request 1 pays the whole
           prompt, the next ones hit the cache; the ratio is the median of requests 2.. over request 1,
           for a fresh engine each --repeats time, the two settings alternating

    .venv/bin/python bench/prefix_ttft.py --target smollm2-135m --eager
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
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="compile", action="store_false", default=None)
    mode.add_argument("--compile", dest="compile", action="store_true")
    p.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    return p.parse_args(argv)


def prompts(llm: Any, target: str, system_tokens: int, turns: int) -> list[list[int]]:
    """The chats' token ids: one system prompt of about `system_tokens` tokens, `turns` user messages."""
    from dflash_trt import pairs

    texts = pairs.heldout_texts(target)
    tok = llm.tokenizer
    system, i = "", 0
    while len(tok(system, add_special_tokens=False)["input_ids"]) < system_tokens:
        system += texts[i % len(texts)] + "\n"
        i += 1
    users = texts[-turns:]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": u}] for u in users]
    rendered = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [list(tok(r, add_special_tokens=False)["input_ids"]) for r in rendered]


def first_token_s(llm: Any, ids: list[int]) -> float:
    from dflash_trt import SamplingParams

    t0 = time.perf_counter()
    for _ in llm.generate_async(ids, SamplingParams(max_tokens=16, ignore_eos=True), streaming=True):
        return time.perf_counter() - t0
    raise RuntimeError("no output")


def run(args: argparse.Namespace, cache: bool) -> dict[str, Any]:
    from dflash_trt import LLM

    kwargs: dict[str, Any] = {} if args.compile is None else {"compile": args.compile}
    with LLM(args.target, max_batch_size=4, kv_cache_config={"enable_block_reuse": cache}, **kwargs) as llm:
        chats = prompts(llm, args.target, args.system_tokens, args.turns)
        llm.generate([1, 2, 3], None)  # one-time costs out of the timed requests
        ttft = [first_token_s(llm, ids) for ids in chats]
        stats = llm.get_stats()
        compiled = llm.engine.executor.compiled
    return {"cache": cache, "prompt_tokens": [len(c) for c in chats], "ttft_s": ttft, "compiled": compiled,
            "hits": stats.get("prefix_cache_hits", 0), "queries": stats.get("prefix_cache_queries", 0),
            "ratio": statistics.median(ttft[1:]) / ttft[0]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dflash_trt.utils.figures import machine_label, machine_record

    runs = [run(args, cache) for _ in range(args.repeats) for cache in (True, False)]
    machine = machine_record()
    for r in runs:
        print(f"cache {'on ' if r['cache'] else 'off'}: prompt {r['prompt_tokens'][0]} tokens, TTFT "
              + " / ".join(f"{t * 1e3:.0f}" for t in r["ttft_s"])
              + f" ms; later / first {r['ratio']:.3f}; hits {r['hits']} of {r['queries']} prompt tokens")  # fmt: skip
    on = statistics.median(r["ratio"] for r in runs if r["cache"])
    off = statistics.median(r["ratio"] for r in runs if not r["cache"])
    print(f"{args.target}, {machine_label(machine)}, rounds {'compiled' if runs[0]['compiled'] else 'eager'}: "
          f"the later requests' TTFT over the first's: {on:.3f} with the prefix cache, {off:.3f} without")  # fmt: skip
    config = {"target": args.target, "system_tokens": args.system_tokens, "turns": args.turns,
              "repeats": args.repeats, "compile": "default" if args.compile is None else args.compile,
              "machine": machine, "date": datetime.date.today().isoformat()}  # fmt: skip
    result = {"config": config, "ratio_on": on, "ratio_off": off, "runs": runs}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
