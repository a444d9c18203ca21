# SPDX-License-Identifier: Apache-2.0
"""Offline engine benchmark: plain decoding (AR) vs DFlash across batch sizes.

For each mode and batch size b, b requests are submitted at once (closed batch, greedy,
ignore_eos, fixed output length) to the embedded engine and timed end to end. Reported per point:
  output tokens/s          = generated tokens / wall time of the batch (prefill included)
  decode tokens/s          = generated tokens after the first / time from first token to last
  tau                      = mean round length over all rounds (bonus token included; pooled)
  round split (ms/round)   = draft (context injection + block pass + draft sampling),
                             verify (target pass), accept (acceptance + sampling),
                             overhead (everything else in the step: scheduling, host copies)
  peak memory              = CUDA max allocated, or process peak RSS on CPU (monotone)
Phase times need synchronisation, so the engine runs with profile=True (on CPU there is nothing
to synchronise and the numbers are the same as without it).
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "# Parse the configuration file\nwith open(path) as f:\n",
    "def quicksort(items):\n    if len(items) <= 1:\n",
    "x = {'a': 1, 'b': 2}\nfor key, value in x.items():\n",
    "try:\n    import numpy as np\nexcept ImportError:\n",
)


@dataclass
class Point:
    mode: str
    batch_size: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    decode_tokens_per_s: float
    tau: float | None
    rounds: int
    draft_ms_per_round: float
    verify_ms_per_round: float
    accept_ms_per_round: float
    overhead_ms_per_round: float
    peak_memory_mb: float


def _peak_memory_mb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage / 1024 if sys.platform != "darwin" else usage / 2**20


def run_engine_benchmark(
    *,
    target: str,
    drafter: str | None,
    block_size: int | None,
    batch_sizes: list[int],
    max_tokens: int,
    modes: tuple[str, ...] = ("ar", "dflash"),
    device: str = "auto",
    dtype: str = "auto",
    tree_budget: int | str = 0,
    enforce_eager: bool = False,
    prompts: tuple[str, ...] = DEFAULT_PROMPTS,
    warmup: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    import torch

    from dflash_trt import __version__
    from dflash_trt.api.llm import LLM, SamplingParams
    from dflash_trt.models.checkpoint import load_drafter_config
    from dflash_trt.models.sources import resolve_models
    from dflash_trt.spec.decoding_config import parse_tree_budget

    tree = parse_tree_budget(tree_budget, field_name="tree_budget")  # before any model loads
    models = resolve_models(target, drafter)
    points: list[Point] = []
    config: dict[str, Any] = {
        "target": target,
        "target_dir": str(models.target_dir),
        "drafter_dir": str(models.drafter_dir) if models.drafter_dir else None,
        "batch_sizes": batch_sizes,
        "max_tokens": max_tokens,
        "greedy": True,
        "ignore_eos": True,
        "prompts": len(prompts),
        "enforce_eager": enforce_eager,
    }
    max_b = max(batch_sizes)
    for mode in modes:
        spec = None
        if mode == "dflash":
            if models.drafter_dir is None:
                raise ValueError("DFlash mode needs a drafter")
            trained = load_drafter_config(models.drafter_dir).block_size
            b = block_size or trained
            spec = {
                "decoding_type": "DFlash",
                "max_draft_len": b - 1,
                "speculative_model": str(models.drafter_dir),
            }
            if tree != 0:
                spec["tree_budget"] = tree
            config["block_size"], config["tree_budget"] = b, tree
        llm = LLM(
            str(models.target_dir),
            speculative_config=spec,
            max_batch_size=max_b,
            max_num_tokens=max(2048, max_b * 64),
            max_seq_len=max_tokens + 256,
            device=device,
            dtype=dtype,
            enforce_eager=enforce_eager,
            profile=True,
        )
        config["device"], config["dtype"] = str(llm.device), str(llm.dtype).removeprefix("torch.")
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, return_perf_metrics=True)
        try:
            if warmup:  # first calls allocate, capture graphs and fill caches
                llm.generate(list(prompts[:2]), SamplingParams(max_tokens=8, ignore_eos=True))
            for bs in batch_sizes:
                batch = [prompts[i % len(prompts)] for i in range(bs)]
                runner = llm.engine.runner
                before = dict(vars(runner.times))
                if llm.device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                outs: list[Any] = llm.generate(batch, sp)  # type: ignore[assignment]
                wall = time.perf_counter() - t0
                after = vars(runner.times)
                delta = {
                    k: after[k] - before[k] for k in ("draft_s", "verify_s", "accept_s", "round_s", "rounds")
                }
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                rounds_all = [
                    a
                    for o in outs
                    for a in o.outputs[0].request_perf_metrics.speculative_decoding.acceptance_lengths
                ]
                firsts = [o.outputs[0].request_perf_metrics.timing_metrics.first_token_time for o in outs]
                lasts = [o.outputs[0].request_perf_metrics.timing_metrics.last_token_time for o in outs]
                decode_window = (max(lasts) - min(firsts)).total_seconds()
                r = max(1, int(delta["rounds"]))
                overhead = delta["round_s"] - delta["draft_s"] - delta["verify_s"] - delta["accept_s"]
                points.append(
                    Point(
                        mode=mode,
                        batch_size=bs,
                        output_tokens=n_out,
                        wall_s=wall,
                        output_tokens_per_s=n_out / wall,
                        decode_tokens_per_s=(n_out - bs) / decode_window
                        if decode_window > 0
                        else float("nan"),
                        tau=(sum(rounds_all) / len(rounds_all)) if rounds_all else None,
                        rounds=int(delta["rounds"]),
                        draft_ms_per_round=1e3 * delta["draft_s"] / r,
                        verify_ms_per_round=1e3 * delta["verify_s"] / r,
                        accept_ms_per_round=1e3 * delta["accept_s"] / r,
                        overhead_ms_per_round=1e3 * overhead / r,
                        peak_memory_mb=_peak_memory_mb(llm.device.type),
                    )
                )
                if progress is not None:
                    progress(points[-1])
        finally:
            llm.shutdown()
    config["environment"] = {
        "dflash_trt": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }
    return {"config": config, "points": [asdict(p) for p in points], "speedup": _speedups(points)}


def _speedups(points: list[Point]) -> dict[str, float]:
    ar = {p.batch_size: p for p in points if p.mode == "ar"}
    out = {}
    for p in points:
        if p.mode == "dflash" and p.batch_size in ar:
            out[str(p.batch_size)] = p.output_tokens_per_s / ar[p.batch_size].output_tokens_per_s
    return out


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# dflash-trt engine benchmark: " + json.dumps({k: v for k, v in cfg.items() if k != "environment"}),
        "# environment: " + json.dumps(cfg["environment"]),
        f"{'mode':<7} {'batch':>5} {'out tok/s':>10} {'decode tok/s':>12} {'tau':>5} {'rounds':>6} "
        f"{'draft ms':>8} {'verify ms':>9} {'accept ms':>9} {'other ms':>8} {'peak MB':>8}",
    ]
    for p in result["points"]:
        tau = f"{p['tau']:.2f}" if p["tau"] is not None else "-"
        lines.append(
            f"{p['mode']:<7} {p['batch_size']:>5} {p['output_tokens_per_s']:>10.1f} {p['decode_tokens_per_s']:>12.1f} "
            f"{tau:>5} {p['rounds']:>6} {p['draft_ms_per_round']:>8.2f} {p['verify_ms_per_round']:>9.2f} "
            f"{p['accept_ms_per_round']:>9.2f} {p['overhead_ms_per_round']:>8.2f} {p['peak_memory_mb']:>8.0f}"
        )
    if result["speedup"]:
        lines.append(
            "DFlash / AR output tokens/s: "
            + ", ".join(f"b={b}: {s:.2f}x" for b, s in result["speedup"].items())
        )
    return "\n".join(lines)
