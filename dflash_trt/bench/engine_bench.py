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

from dflash_trt.models.dflash_config import block_size_for, max_draft_len_for

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
    """Each mode (ar: the target alone; dflash: with the drafter) at each batch size: one greedy
    generate() of `max_tokens` per request, timed, with the round's phase times."""
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
    for mode in modes:
        spec = _speculative_config(models, block_size, tree) if mode == "dflash" else None
        if spec is not None:
            config["block_size"] = block_size_for(spec["max_draft_len"])
            config["tree_budget"] = tree
        llm = _engine(models, spec, batch_sizes=batch_sizes, max_tokens=max_tokens, device=device, dtype=dtype,
                      enforce_eager=enforce_eager)  # fmt: skip
        config["device"], config["dtype"] = str(llm.device), str(llm.dtype).removeprefix("torch.")
        try:
            if warmup:  # first calls allocate, capture graphs and fill caches
                from dflash_trt.api.llm import SamplingParams

                llm.generate(list(prompts[:2]), SamplingParams(max_tokens=8, ignore_eos=True))
            for bs in batch_sizes:
                batch = [prompts[i % len(prompts)] for i in range(bs)]
                points.append(_measure(llm, mode, batch, max_tokens=max_tokens))
                if progress is not None:
                    progress(points[-1])
        finally:
            llm.shutdown()
    config["environment"] = _environment()
    return {"config": config, "points": [asdict(p) for p in points], "speedup": _speedups(points)}


def _speculative_config(models: Any, block_size: int | None, tree: int | str) -> dict[str, Any]:
    """DFlash at `block_size` (default: the drafter's trained block); DDTree when tree != 0."""
    from dflash_trt.models.checkpoint import load_drafter_config

    if models.drafter_dir is None:
        raise ValueError("DFlash mode needs a drafter")
    b = block_size or load_drafter_config(models.drafter_dir).block_size
    spec: dict[str, Any] = {
        "decoding_type": "DFlash",
        "max_draft_len": max_draft_len_for(b),
        "speculative_model": str(models.drafter_dir),
    }
    if tree != 0:
        spec["tree_budget"] = tree
    return spec


def _engine(
    models: Any, spec: dict[str, Any] | None, *, batch_sizes: list[int], max_tokens: int, **kwargs: Any
) -> Any:
    """An LLM sized for the largest batch, with per-phase round times (profile=True)."""
    from dflash_trt.api.llm import LLM

    max_b = max(batch_sizes)
    return LLM(
        str(models.target_dir),
        speculative_config=spec,
        max_batch_size=max_b,
        max_num_tokens=max(2048, max_b * 64),
        max_seq_len=max_tokens + 256,
        profile=True,
        **kwargs,
    )


def _measure(llm: Any, mode: str, batch: list[str], *, max_tokens: int) -> Point:
    """One timed generate() of the whole batch, with the phase times its rounds added."""
    import torch

    from dflash_trt.api.llm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, return_perf_metrics=True)
    runner = llm.engine.runner
    before = dict(vars(runner.times))
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    outs: list[Any] = llm.generate(batch, sp)
    wall = time.perf_counter() - t0
    after = vars(runner.times)
    delta = {k: after[k] - before[k] for k in ("draft_s", "verify_s", "accept_s", "round_s", "rounds")}
    metrics = [o.outputs[0].request_perf_metrics for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    rounds_all = [a for m in metrics for a in m.speculative_decoding.acceptance_lengths]
    decode_window = (
        max(m.timing_metrics.last_token_time for m in metrics)
        - min(m.timing_metrics.first_token_time for m in metrics)
    ).total_seconds()
    r = max(1, int(delta["rounds"]))
    overhead = delta["round_s"] - delta["draft_s"] - delta["verify_s"] - delta["accept_s"]
    bs = len(batch)
    return Point(
        mode=mode,
        batch_size=bs,
        output_tokens=n_out,
        wall_s=wall,
        output_tokens_per_s=n_out / wall,
        decode_tokens_per_s=(n_out - bs) / decode_window if decode_window > 0 else float("nan"),
        tau=(sum(rounds_all) / len(rounds_all)) if rounds_all else None,
        rounds=int(delta["rounds"]),
        draft_ms_per_round=1e3 * delta["draft_s"] / r,
        verify_ms_per_round=1e3 * delta["verify_s"] / r,
        accept_ms_per_round=1e3 * delta["accept_s"] / r,
        overhead_ms_per_round=1e3 * overhead / r,
        peak_memory_mb=_peak_memory_mb(llm.device.type),
    )


def _environment() -> dict[str, Any]:
    import torch

    from dflash_trt import __version__

    return {
        "dflash_trt": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


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
