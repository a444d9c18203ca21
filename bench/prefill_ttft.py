# SPDX-License-Identifier: Apache-2.0
"""Time to first token in process: the compiled prefill pass against the eager one, in one engine.

A request with max_tokens=1 is one prefill step (its first token comes from the prefill; no round
runs), so its latency is the prefill pass plus the engine's per-request fixed cost. The script builds
one `LLM` with compiled rounds (from the compile cache; compiled first when the cache is cold) and
times 1-token requests over the held-out prompts, alternating between the engine's compiled code and
eager code (`executor.rounds` set to None) in every repeat, so that both see the same machine. The
first tokens of both modes must be equal, and so must a batch of 64-token greedy requests.

    python bench/prefill_ttft.py --bundle /tmp/tiny [--repeats 3] [--long 512]

The engine is the one `serve` runs for the bundle (its model.yaml), with the compile cache `serve` uses
($DFLASH_TRT_COMPILE_CACHE, else <bundle>/compile-cache).

--long N adds prompts of N tokens (the held-out prompts repeated) to show how the pass scales.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", required=True, type=Path, help="a bundle from `dflash-trt build`")
    p.add_argument(
        "--dataset", type=Path, default=Path(__file__).parent / "datasets/tiny-python-heldout.jsonl"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long", type=int, default=0, help="also time prompts of this many tokens (0: none)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be at least 1")
    if args.long < 0:
        p.error(f"--long {args.long}: must be 0 or more tokens")

    import torch

    from dflash_trt import LLM, SamplingParams
    from dflash_trt.bundle import bundle_path, load_manifest
    from dflash_trt.cli.precompile import model_args
    from dflash_trt.engine.compile import bundle_cache_root, foreground_compile

    # the engine `serve` runs for this bundle (its model.yaml), and so the compile cache it fills
    manifest = load_manifest(args.bundle)
    cfg = model_args(
        bundle_path(args.bundle, manifest, "model_repository"), args.bundle, manifest, no_draft=False
    )
    cache = bundle_cache_root(args.bundle)
    if cache is not None:
        cfg["compile_cache"] = str(cache)
    with foreground_compile():
        llm = LLM(**cfg)
    executor = llm.engine.executor
    compiled_rounds = executor.rounds
    if compiled_rounds is None:
        print("compiled rounds are off on this machine (see the log): nothing to compare", file=sys.stderr)
        return 1
    prompts = [json.loads(line)["text"] for line in args.dataset.read_text().splitlines() if line.strip()]
    sets = {"held-out": prompts}
    if args.long:
        ids = [t for text in prompts for t in llm.tokenizer.encode(text)]
        sets[f"{args.long} tokens"] = [
            llm.tokenizer.decode(ids[i * args.long : (i + 1) * args.long]) for i in range(4)
        ]
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    print(f"machine: {_cpu()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; dtype {llm.dtype}; bundle {args.bundle}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
    print(
        f"compiled classes in memory: {sorted(k[0] + ('-b1' if k[2] else '-bN') for k in compiled_rounds._fns)}"
    )
    ok = True
    for name, texts in sets.items():
        lens = [len(llm.tokenizer.encode(t)) for t in texts]
        times: dict[str, list[float]] = {"compiled": [], "eager": []}
        firsts: dict[str, list[list[int]]] = {"compiled": [], "eager": []}
        for _ in range(args.repeats):
            for mode in ("compiled", "eager"):
                executor.rounds = compiled_rounds if mode == "compiled" else None
                for text in texts:
                    t0 = time.perf_counter()
                    out = llm.generate([text], one)[0]
                    times[mode].append(time.perf_counter() - t0)
                    firsts[mode].append(out.outputs[0].token_ids)
        c, e = statistics.median(times["compiled"]), statistics.median(times["eager"])
        same = firsts["compiled"] == firsts["eager"]
        ok &= same
        print(f"{name}: {len(texts)} prompts of {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}), "
              f"{args.repeats} repeats: 1-token request median compiled {1e3 * c:.2f} ms, eager {1e3 * e:.2f} ms "
              f"= {e / c:.2f}x; first tokens equal: {same}")  # fmt: skip
    executor.rounds = compiled_rounds
    batch = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    outs = {}
    for mode in ("compiled", "eager"):
        executor.rounds = compiled_rounds if mode == "compiled" else None
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts[:16], batch)]
    executor.rounds = compiled_rounds
    same = outs["compiled"] == outs["eager"]
    ok &= same
    print(f"16 prompts at once, 64 greedy tokens each: compiled == eager: {same}")
    llm.shutdown()
    return 0 if ok else 1


def _cpu() -> str:
    """The CPU's model name and whether it computes bf16 natively."""
    from dflash_trt.utils.device import cpu_has_native_bf16, cpu_model_name

    return f"{cpu_model_name()} (native bf16: {'yes' if cpu_has_native_bf16() else 'no'})"


if __name__ == "__main__":
    sys.exit(main())
