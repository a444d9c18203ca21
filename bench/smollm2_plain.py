# SPDX-License-Identifier: Apache-2.0
"""Plain decoding of the real pair's target (`smollm2-135m`) in process, per dtype and thread count,
against this machine's weight-streaming floor, in one run: what the CPU dtype and thread policy
(utils/device.streams_weights) rests on.

  configs   (dtype, threads): the defaults before the policy followed bytes (float32, 1 thread: hidden 576
            was under the old 1024 line), bf16 on 1 thread, and today's default (bf16 where the CPU has
            native bf16, every core); --configs picks others
  engine    `LLM("smollm2-135m", dtype=..., cpu_threads=...)`, no drafter, compiled rounds unless --eager
            (each configuration compiles its own), greedy, ignore_eos; per batch size a warm-up call, then
            --repeats timed calls of all B prompts at once, the fastest counts; configurations interleave
  prompts   the pair's held-out chats (MT-Bench, HumanEval), rendered with the chat template
  floor     weight bytes one step reads (TargetConfig.num_step_parameters x the dtype's size) over the read
            bandwidth of `x.sum()` on 1 GiB of bf16 with all cores (bench/engine_floor.py): tok/s = B x that

    .venv/bin/python bench/smollm2_plain.py --out bench/results/smollm2-plain-2026-11-29
    .venv/bin/python bench/smollm2_plain.py --configs bfloat16:2 --batch-sizes 1 --max-tokens 16 --eager
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_CONFIGS = "float32:1,bfloat16:1,bfloat16:auto"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help="DTYPE:THREADS,... (THREADS auto = the default)"
    )
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="eager rounds (compile=False)")
    p.add_argument("--out", default=None, help="write DIR/results.json")
    args = p.parse_args(argv)
    try:
        args.configs = [
            (d, None if t == "auto" else int(t)) for d, t in (c.split(":") for c in args.configs.split(","))
        ]
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error("--configs is DTYPE:THREADS,... and --batch-sizes a comma-separated list of integers")
    return args


def prompts(count: int) -> list[list[int]]:
    from dflash_trt import pairs
    from dflash_trt.models.sources import load_tokenizer

    tok = load_tokenizer(pairs.packaged_pair("smollm2-135m").target)
    texts = pairs.heldout_texts("smollm2-135m")
    return [tok(texts[i % len(texts)], add_special_tokens=False)["input_ids"] for i in range(count)]


def measure(llm: Any, batch: list[list[int]], *, max_tokens: int) -> tuple[int, float]:
    from dflash_trt.api.params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, sp)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from engine_floor import floor_for, read_bandwidth

    from dflash_trt.api.llm import LLM
    from dflash_trt.api.params import SamplingParams
    from dflash_trt.models.sources import resolve_models
    from dflash_trt.models.target_config import parse_target_config
    from dflash_trt.utils.device import cpu_flags, cpu_model_name

    target = resolve_models("smollm2-135m").target_dir
    params = parse_target_config(json.loads((target / "config.json").read_text())).num_step_parameters()
    bandwidth = read_bandwidth(gib=1.0, threads=os.cpu_count() or 1)
    ids = prompts(max(args.batch_sizes))
    llms = {}
    default_threads = torch.get_num_threads()
    for dtype, threads in args.configs:
        label = f"{dtype}, {threads or 'default'} thread(s)"
        torch.set_num_threads(default_threads)  # `auto` is the machine's default, not the last LLM's count
        llms[label] = LLM("smollm2-135m", dtype=dtype, cpu_threads=threads, compile=not args.eager,
                          max_batch_size=max(args.batch_sizes))  # fmt: skip
        llms[label].generate(ids[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    rows: dict[str, dict[int, list[float]]] = {label: {b: [] for b in args.batch_sizes} for label in llms}
    for b in args.batch_sizes:
        for llm in llms.values():  # warm-up at this batch size
            measure(llm, ids[:b], max_tokens=8)
        for _ in range(args.repeats):
            for label, llm in llms.items():  # interleaved: a load change slows every configuration alike
                n, s = measure(llm, ids[:b], max_tokens=args.max_tokens)
                rows[label][b].append(n / s)
    result = {
        "config": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model_name(),
            "flags": sorted({"avx2", "avx512f", "avx512_bf16", "amx_bf16"} & cpu_flags()),
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "target": str(target), "step_parameters": params, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "rounds": "eager" if args.eager else "compiled",
        },
        "bandwidth_gb_s": bandwidth["gb_s"],
        "points": [],
    }  # fmt: skip
    for label, llm in llms.items():
        floor = floor_for({"streamed_parameters": params}, dtype=str(llm.dtype).removeprefix("torch."),
                          gb_s=bandwidth["gb_s"])  # fmt: skip
        for b, rates in rows[label].items():
            best = max(rates)
            result["points"].append({"config": label, "dtype": floor["dtype"], "threads": llm.cpu_threads,
                                     "batch": b, "tok_s": best, "all_tok_s": rates,
                                     "floor_tok_s": b * floor["steps_per_s"],
                                     "ratio_to_floor": best / (b * floor["steps_per_s"])})  # fmt: skip
        llm.shutdown()
    return result


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"# smollm2-135m plain decoding, {c['rounds']} rounds, {c['max_tokens']} tokens, best of {c['repeats']}; "
        f"{c['cpu']} ({', '.join(c['flags'])}), {c['cores']} cores, torch {c['torch']}, {c['date']}",
        f"# read bandwidth {result['bandwidth_gb_s']:.1f} GB/s; {c['step_parameters'] / 1e6:.1f} M parameters a step",
        f"{'configuration':<28} {'batch':>5} {'tok/s':>8} {'floor':>8} {'of floor':>9}",
    ]
    for p in result["points"]:
        lines.append(f"{p['config']:<28} {p['batch']:>5} {p['tok_s']:8.1f} {p['floor_tok_s']:8.1f} "
                     f"{p['ratio_to_floor']:8.2f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = table(result)
    print(text)
    if args.out:
        from dflash_trt.utils.io import atomic_write_text

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "results.json", json.dumps(result, indent=1) + "\n")
        atomic_write_text(out / "table.txt", text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
