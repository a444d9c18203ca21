# SPDX-License-Identifier: Apache-2.0
"""P1 on Qwen3-8B shapes with random weights: the plain decoding step against the weight-streaming
floor, and the DFlash round at batch 16 against the plain step. Nothing is downloaded.

The pair (dflash_trt/bench/shapes.py, default `qwen3-8b`: Qwen3-8B target, 5-layer drafter as
z-lab's Qwen3-8B-DFlash) is written as configs only; its random weights are made directly on the
device when the embedded engine loads it (`random_weights_on_load`).

  copy bandwidth   `dst.copy_(src)` over two 512 MiB buffers (64 MiB on CPU); bandwidth =
                   2 x bytes / time (bytes read + bytes written), median of --reps copies.
  streamed bytes   the target weights one decoding step must read: every target parameter once,
                   except the input embedding table when it is not tied to the LM head (a step
                   reads one row of it). KV-cache reads are not counted (short context here).
  floor            streamed bytes / copy bandwidth: no step can be faster on this device.
  plain step       the embedded engine without a drafter, 1 request (and --batch requests), greedy,
                   ignore_eos: median
                   wall time of `ModelRunner.decode_round` (it ends in the host read-back), over
                   the rounds of the timed request (after a warm-up request that captures graphs).
  DFlash round     the same with the random drafter and --batch requests at once: median round
                   time over rounds that ran the whole batch. A random drafter is almost never
                   accepted, so tau ~ 1: this measures the round's cost, not its yield.

    python bench/p1_qwen3_8b.py --json p1.json                        # on a GPU (bf16)
    python bench/p1_qwen3_8b.py --shape toy --device cpu --dtype float32 --batch 2 --max-tokens 8

Exit status: 0 measured, 2 bad arguments, 3 --device cuda without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXIT_NO_DEVICE = 3


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from dflash_trt.bench.shapes import SHAPES

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batch", type=int, default=16, help="requests in the DFlash round (default 16)")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per timed request")
    p.add_argument("--reps", type=int, default=20, help="copies timed for the bandwidth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-kwargs", default="{}", help="JSON object of extra keyword arguments for LLM")
    p.add_argument(
        "--compiled-dflash",
        action="store_true",
        help="also time the DFlash round compiled (compile=True; only the greedy batch-2+ class the timed "
        "rounds use is compiled) against the eager one; it runs first, in a child process of its own "
        "(an engine's GPU memory is not all given back within a process: three 8B engines do not fit on 80 GB)",
    )
    p.add_argument("--only-compiled-dflash", action="store_true", help=argparse.SUPPRESS)  # the child
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "max_tokens", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    try:
        args.engine_kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as exc:
        p.error(f"--engine-kwargs {args.engine_kwargs!r} is not JSON ({exc})")
    if not isinstance(args.engine_kwargs, dict):
        p.error(f"--engine-kwargs {args.engine_kwargs!r} must be a JSON object")
    return args


def copy_bandwidth_gbs(device: str, reps: int) -> float:
    """Median device copy bandwidth, counting bytes read and written."""
    import torch

    n = (512 if device == "cuda" else 64) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times) / 1e9


def streamed_weight_bytes(model: Any) -> int:
    """Bytes of target weights one decoding step reads (see the module docstring)."""
    seen: set[int] = set()
    total = 0
    # fp32 weights packed for dflash_f32::linear (CPU) are 3-D buffers; their dense parameters are empty
    for p in [*model.parameters(), *(b for b in model.buffers() if b.dim() == 3)]:
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    embed = model.model.embed_tokens.weight
    head_packed = getattr(model.lm_head, "packed", None)
    if model.lm_head.weight is not embed or (head_packed is not None and head_packed.dim() == 3):
        total -= embed.numel() * embed.element_size()  # the head reads its own copy; a lookup, one row
    return total


def _timed_rounds(llm: Any, prompts: list[list[int]], max_tokens: int, device: str) -> dict[str, Any]:
    """Run `prompts` at once; per-round wall times of decode_round over rounds with the whole batch."""
    import torch

    from dflash_trt import SamplingParams

    runner = llm.engine.runner
    log: list[tuple[int, float]] = []
    real = runner.decode_round

    def timed(reqs: Any, shape: Any) -> Any:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = real(reqs, shape)  # ends in the host read-back: the round is complete
        log.append((len(reqs), time.perf_counter() - t0))
        return out

    runner.decode_round = timed
    try:
        warm = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        llm.generate(prompts, warm)  # allocate, capture CUDA graphs, fill caches
        log.clear()
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, return_perf_metrics=True)
        t0 = time.perf_counter()
        outs: Any = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
    finally:
        runner.decode_round = real
    full = [t * 1e3 for n, t in log if n == len(prompts)]
    acc = [
        a
        for o in outs
        for a in (o.outputs[0].request_perf_metrics.speculative_decoding.acceptance_lengths or [])
    ]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "batch": len(prompts),
        "rounds_at_full_batch": len(full),
        "round_ms_median": statistics.median(full) if full else float("nan"),
        "round_ms_mean": statistics.fmean(full) if full else float("nan"),
        "round_ms_min": min(full) if full else float("nan"),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "tau": sum(acc) / len(acc) if acc else None,
    }


def _collect(device: str) -> None:
    """Give back the memory of engines no longer referenced (call after dropping the last reference:
    two Qwen3-8B engines do not fit on an 80 GB GPU at once)."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _greedy_batch_warm_up() -> Any:
    """The engine's warm-up limited to the greedy class of two or more requests: the only class the
    timed DFlash rounds run (a compilation takes minutes per class on a GPU with torch 2.11)."""

    from dflash_trt.engine import warmup

    real = warmup.variants

    def greedy_batch(engine: Any) -> Any:
        return [w for w in real(engine) if w.mode == "greedy" and w.batch > 1]

    warmup.variants = greedy_batch
    try:
        yield
    finally:
        warmup.variants = real


def _llm(
    args: argparse.Namespace, tdir: Any, max_seq_len: int, *, drafter: Any = None, **overrides: Any
) -> Any:
    """The engine every measurement uses: the target alone, or with the drafter (drafter = (its
    directory, the shape)) drafting the full block at every batch size (the round's cost, not a
    draft length chosen by load)."""
    from dflash_trt import LLM
    from dflash_trt.models.dflash_config import max_draft_len_for

    spec = None
    if drafter is not None:
        ddir, shape = drafter
        spec = {"decoding_type": "DFlash", "max_draft_len": max_draft_len_for(shape.block_size),
                "speculative_model": str(ddir), "max_concurrency": args.batch}  # fmt: skip
    return LLM(str(tdir), speculative_config=spec, max_batch_size=args.batch,
               max_num_tokens=max(2048, args.batch * args.prompt_len), max_seq_len=max_seq_len,
               device=args.device, dtype=args.dtype, **{**args.engine_kwargs, **overrides})  # fmt: skip


def _compiled_dflash(
    args: argparse.Namespace, tdir: Any, ddir: Any, shape: Any, prompts: list[list[int]], max_seq_len: int
) -> dict[str, Any]:  # fmt: skip
    """The DFlash round at --batch requests with compile=True."""

    t0 = time.perf_counter()
    with _greedy_batch_warm_up():
        llm = _llm(args, tdir, max_seq_len, drafter=(ddir, shape), compile=True)
    ready_s = time.perf_counter() - t0
    executor = llm.engine.executor
    out = _timed_rounds(llm, prompts, args.max_tokens, args.device)
    out["ready_s"] = ready_s
    out["compiled"] = executor.compiled
    graphs = list(executor._graphs.values())
    out["graphs_compiled"] = sum(1 for g in graphs if getattr(g, "compiled_fn", None) is not None)
    out["graphs"] = len(graphs)
    print(f"dflash round, compiled {json.dumps(out)}", flush=True)
    llm.shutdown()
    del llm, executor, graphs
    _collect(args.device)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from dflash_trt.bench.shapes import get_shape, parameter_count, random_weights_on_load, write_pair

    shape = get_shape(args.shape)
    gen = torch.Generator().manual_seed(args.seed)
    # byte-range ids: valid for every shape's vocabulary and for the byte tokenizer
    prompts = [torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    max_seq_len = args.prompt_len + args.max_tokens + 2 * shape.block_size + 16
    result: dict[str, Any] = {}
    bw = copy_bandwidth_gbs(args.device, args.reps)
    print(f"# copy bandwidth: {bw:.1f} GB/s (read + write, median of {args.reps})", flush=True)
    with tempfile.TemporaryDirectory(prefix="dflash-p1-") as tmp, random_weights_on_load():
        tdir, ddir = write_pair(
            shape, tmp, weights="on-load", dtype=args.dtype, seed=args.seed, device=args.device
        )
        if args.only_compiled_dflash:
            return {"dflash_compiled": _compiled_dflash(args, tdir, ddir, shape, prompts, max_seq_len)}
        t0 = time.perf_counter()
        llm = _llm(args, tdir, max_seq_len)
        load_s = time.perf_counter() - t0
        streamed = streamed_weight_bytes(llm.engine.target)
        floor_ms = streamed / (bw * 1e9) * 1e3
        plain = _timed_rounds(llm, prompts[:1], args.max_tokens, args.device)
        plain["floor_ms"] = floor_ms
        plain["x_floor"] = plain["round_ms_median"] / floor_ms
        print(f"plain step   {json.dumps(plain)}", flush=True)
        plain_b = _timed_rounds(llm, prompts, args.max_tokens, args.device)
        plain_b["x_floor"] = plain_b["round_ms_median"] / floor_ms
        print(f"plain step   {json.dumps(plain_b)}", flush=True)
        llm.shutdown()
        del llm
        _collect(args.device)
        llm = _llm(args, tdir, max_seq_len, drafter=(ddir, shape))
        dflash = _timed_rounds(llm, prompts, args.max_tokens, args.device)
        dflash["x_plain_step"] = dflash["round_ms_median"] / plain["round_ms_median"]
        dflash["x_plain_step_same_batch"] = dflash["round_ms_median"] / plain_b["round_ms_median"]
        dflash["x_floor"] = dflash["round_ms_median"] / floor_ms
        print(f"dflash round {json.dumps(dflash)}", flush=True)
        plugins = llm.engine.parts.backend.plugins
        graphs = bool(llm.engine.executor.cuda_graphs)
        llm.shutdown()
        del llm
        _collect(args.device)
    result["config"] = {
        "shape": shape.name,
        "description": shape.description,
        "parameters": parameter_count(shape),
        "weights": f"random on {args.device} (seed {args.seed}, std 0.02)",
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "block_size": shape.block_size,
        "cuda_graphs": graphs,
        "plugins": plugins,
        "engine_kwargs": args.engine_kwargs,
        "torch_threads": torch.get_num_threads(),
        "load_s": load_s,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "hostname": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    result["copy_bandwidth_gbs"] = bw
    result["streamed_weight_bytes"] = streamed
    result["floor_ms"] = floor_ms
    result["plain"] = plain
    result["plain_batch"] = plain_b
    result["dflash"] = dflash
    return result


def format_summary(r: dict[str, Any]) -> str:
    p, pb, d = r["plain"], r["plain_batch"], r["dflash"]
    return "\n".join(
        [
            "# p1 configuration: " + json.dumps(r["config"]),
            f"weights streamed per step: {r['streamed_weight_bytes'] / 1e9:.2f} GB; copy bandwidth "
            f"{r['copy_bandwidth_gbs']:.0f} GB/s; floor {r['floor_ms']:.3f} ms",
            f"plain step (batch 1):        {p['round_ms_median']:.3f} ms median = {p['x_floor']:.2f}x floor",
            f"plain step (batch {pb['batch']}):       {pb['round_ms_median']:.3f} ms median = {pb['x_floor']:.2f}x floor",
            f"DFlash round (batch {d['batch']}):     {d['round_ms_median']:.3f} ms median = "
            f"{d['x_plain_step']:.2f}x the batch-1 plain step, {d['x_plain_step_same_batch']:.2f}x the batch-"
            f"{pb['batch']} plain step, {d['x_floor']:.2f}x floor (tau {d['tau']})",
        ]
        + (
            [
                f"DFlash round, compiled:      {c['round_ms_median']:.3f} ms median = {c['x_eager_round']:.2f}x "
                f"the eager round ({'compiled' if c['compiled'] else 'EAGER: compile failed'}, "
                f"{c['graphs_compiled']}/{c['graphs']} graphs compiled, ready in {c['ready_s']:.0f} s)"
            ]
            if (c := r.get("dflash_compiled"))
            else []
        )
    )


def _compiled_in_child(argv: list[str]) -> dict[str, Any] | None:
    """Run the compiled DFlash measurement in a child process before this one allocates anything."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="dflash-p1-child-") as tmp:
        out = Path(tmp) / "compiled.json"
        child = [a for a in argv if a != "--compiled-dflash"]
        if "--json" in child:
            i = child.index("--json")
            del child[i : i + 2]
        cmd = [sys.executable, __file__, *child, "--only-compiled-dflash", "--json", str(out)]
        if subprocess.run(cmd, check=False).returncode != 0 or not out.is_file():
            print("# the compiled DFlash round could not be measured (see above)", flush=True)
            return {"round_ms_median": float("nan"), "compiled": False, "graphs": 0, "graphs_compiled": 0,
                    "ready_s": float("nan"), "failed": True}  # fmt: skip
        return json.loads(out.read_text())["dflash_compiled"]


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"bench/p1_qwen3_8b.py --device cuda: torch.cuda.is_available() is False (torch {torch.__version__}); "
            "nothing was measured (use --device cpu with a small --shape to try it)",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    compiled = _compiled_in_child(argv or sys.argv[1:]) if args.compiled_dflash else None
    result = run(args)
    if args.only_compiled_dflash:
        print(json.dumps(result), flush=True)
    else:
        if compiled is not None:
            compiled["x_eager_round"] = compiled["round_ms_median"] / result["dflash"]["round_ms_median"]
            result["dflash_compiled"] = compiled
        print(format_summary(result), flush=True)
    if args.json:
        tmp = Path(str(args.json) + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
