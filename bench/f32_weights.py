# SPDX-License-Identifier: Apache-2.0
"""A float32 engine with its bf16-valued weights kept as bf16 (dflash-trt's AVX2 GEMM, the default on
CPUs without native bf16 for models at least 1024 wide) against the same engine on dense fp32 weights
(torch's GEMM, DFLASH_TRT_CPU_GEMM=0), in one process, loads interleaved, greedy plain decoding.

Prints the configuration, each load's tokens/s per batch size, then the best of each and whether the
two produced the same greedy ids for the first prompt.

    python bench/f32_weights.py /tmp/dflash-engine-floor/qwen3-0.3b-seed0-bfloat16/target
    python bench/f32_weights.py TARGET --batch-sizes 1 --max-tokens 16 --repeats 1 --compile
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from script_args import positive_ints


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="a target checkpoint directory (bf16 weights, e.g. engine_floor.py's)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument(
        "--repeats", type=int, default=2, help="loads of each engine, interleaved; the best counts"
    )
    p.add_argument("--compile", action="store_true", help="compiled rounds (default: eager, for a quick A/B)")
    args = p.parse_args(argv)
    batches = positive_ints(p, "--batch-sizes", args.batch_sizes)
    if not os.path.isdir(args.target):
        p.error(f"target {args.target!r}: not a directory; pass a checkpoint directory")
    import torch

    from dflash_trt import LLM, SamplingParams
    from dflash_trt.layers import cpu_gemm

    if not cpu_gemm.available(torch.float32):
        print(
            "error: dflash-trt's AVX2 GEMM does not run here (AVX2 and FMA, and a C compiler)",
            file=sys.stderr,
        )
        return 1
    print("# f32_weights configuration: " + json.dumps({
        "target": args.target, "dtype": "float32", "batch_sizes": batches, "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len, "repeats": args.repeats, "compile": args.compile,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}), flush=True)  # fmt: skip
    prompts = [[100 + i + j for j in range(args.prompt_len)] for i in range(max(batches))]
    best: dict[tuple[str, int], float] = {}
    ids: dict[tuple[str, int], list[int]] = {}
    for _ in range(args.repeats):
        for label, ours in (("bf16 weights (ours)", True), ("fp32 weights (torch)", False)):
            with cpu_gemm.switched(ours):  # the kernel is bound to the weights when they are packed
                llm = LLM(args.target, device="cpu", dtype="float32", compile=args.compile,
                          max_batch_size=max(batches), max_seq_len=args.prompt_len + args.max_tokens + 32)  # fmt: skip
            try:
                rates = {}
                for b in batches:
                    llm.generate(prompts[:b], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
                    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
                    t = time.perf_counter()
                    outs = llm.generate(prompts[:b], sp)
                    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
                    rates[b] = round(rate, 2)
                    best[(label, b)] = max(best.get((label, b), 0.0), rate)
                    ids[(label, b)] = list(outs[0].outputs[0].token_ids)
                print(
                    f"{label}: {llm.engine.packed_weights} weights packed; tok/s by batch {rates}", flush=True
                )
            finally:
                llm.shutdown()
    for b in batches:
        ours, base = best[("bf16 weights (ours)", b)], best[("fp32 weights (torch)", b)]
        same = ids[("bf16 weights (ours)", b)] == ids[("fp32 weights (torch)", b)]
        print(f"batch {b}: bf16 weights {ours:.2f} tok/s, fp32 weights {base:.2f} tok/s, x{ours / base:.2f}; "
              f"same greedy ids: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
