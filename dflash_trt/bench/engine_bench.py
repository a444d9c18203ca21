# SPDX-License-Identifier: Apache-2.0
"""Offline engine benchmark: plain decoding (AR) vs DFlash (linear, and DDTree at given budgets)
across batch sizes.

Modes: `ar` (the target alone), `dflash` (linear DFlash), `ddtree-N` (DDTree, N nodes per round) and
`ddtree-auto` (the engine's cost-chosen budget), one engine each, all loaded at once. For each
batch size b, the prompts go in closed batches of b (greedy, ignore_eos, fixed output length; every
prompt once, cycled when there are fewer than b), each batch to every engine in turn before the next
(so that a noisy machine slows every mode alike), `repeats` times, each batch timed end to end; a
point pools its batches and repeats (tokens and seconds summed). Per point:
  output tokens/s          = generated tokens / wall time of the batch (prefill included)
  decode tokens/s          = generated tokens after the first / time from first token to last
  tau                      = mean round length over all rounds (bonus token included; pooled)
  overturn                 = drafts whose DFlash 2 selector pick is not the drafter's argmax / drafts
                             (0 for a v1 drafter; none for plain decoding)
  round split (ms/round)   = draft (context injection + block pass + draft sampling),
                             verify (target pass), accept (acceptance + sampling),
                             overhead (everything else in the step: scheduling, host copies)
  peak memory              = CUDA max allocated, or process peak RSS on CPU (monotone)
  tree budgets             = DDTree modes: request-rounds per budget (auto: how often each was chosen)
Phase times need synchronisation, so eager engines (`compile=False`) run with profile=True (on CPU
there is nothing to synchronise and the numbers are the same as without it). Compiled engines run
without it: the phase clock inside the round would break the compiled graph, so their split reads 0
and only `other ms` (the whole round) is measured.
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
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
    request_rounds: int = 0  # rounds summed over requests (tau's denominator)
    tree_budgets: dict[str, int] | None = None  # DDTree modes: request-rounds per budget (0 = linear)
    draft_lens: dict[str, int] | None = None  # linear DFlash: engine rounds per draft length (0 = plain)
    draft_tokens: int = 0  # drafts proposed (the overturn rate's denominator)
    overturned_draft_tokens: int = 0  # DFlash 2: drafts whose selector pick is not the drafter's argmax

    @property
    def overturn_rate(self) -> float | None:
        return self.overturned_draft_tokens / self.draft_tokens if self.draft_tokens else None


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
    tree_budget: int | str | list[int | str] = 0,
    draft_len: list[int | str] | None = None,
    enforce_eager: bool = False,
    compile: bool | None = None,
    repeats: int = 1,
    prompts: tuple[str, ...] = DEFAULT_PROMPTS,
    warmup: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    """Each mode (ar: the target alone; dflash: with the drafter, once per tree budget: 0 = linear,
    N = DDTree of N nodes, "auto" = the engine's choice; linear DFlash once per `draft_len`: "auto" =
    the engine's choice by cost, the default, or g = g drafts per round at every batch size) at each
    batch size: one greedy generate() of `max_tokens` per request, timed, with the round's phase
    times; `repeats` passes interleaved."""
    from dflash_trt.models.sources import resolve_models
    from dflash_trt.spec.decoding_config import parse_tree_budget

    budgets = tree_budget if isinstance(tree_budget, list) else [tree_budget]
    trees = [parse_tree_budget(b, field_name="tree_budget") for b in budgets]  # before any model loads
    models = resolve_models(target, drafter)
    config: dict[str, Any] = {
        "target": target, "target_dir": str(models.target_dir),
        "drafter_dir": str(models.drafter_dir) if models.drafter_dir else None, "batch_sizes": batch_sizes,
        "max_tokens": max_tokens, "greedy": True, "ignore_eos": True, "prompts": len(prompts),
        "enforce_eager": enforce_eager, "repeats": repeats,
    }  # fmt: skip
    lens = [_draft_len(g) for g in (draft_len or ["auto"])]  # before any model loads
    config["max_seq_len"] = _max_seq_len(models.target_dir, prompts, max_tokens)
    variants = _variants(modes, trees, lens)
    if lens != ["auto"]:
        config["draft_len"] = lens
    llms: dict[str, Any] = {}
    try:
        for mode, tree, g in variants:
            llms[mode] = _variant_engine(models, config, tree, g, block_size=block_size, trees=trees,
                                         batch_sizes=batch_sizes, device=device, dtype=dtype,
                                         enforce_eager=enforce_eager, compile=compile)  # fmt: skip
            if warmup:
                _warm_up(llms[mode], prompts)
        points = _measure_interleaved(llms, batch_sizes, prompts, max_tokens=max_tokens, repeats=repeats,
                                      progress=progress)  # fmt: skip
    finally:
        for llm in llms.values():
            llm.shutdown()
    config["environment"] = _environment()
    return {"config": config, "points": [{**asdict(p), "overturn_rate": p.overturn_rate} for p in points], "speedup": _speedups(points),
            "vs_linear": _vs_linear(points)}  # fmt: skip


def _warm_up(llm: Any, prompts: tuple[str, ...]) -> None:
    """A short untimed generate: the first calls allocate, capture graphs and fill caches."""
    from dflash_trt.api.llm import SamplingParams

    llm.generate(list(prompts[:2]), SamplingParams(max_tokens=_WARMUP_TOKENS, ignore_eos=True))


def _variant_engine(
    models: Any, config: dict[str, Any], tree: int | str | None, draft_len: int | str, *, block_size: int | None,
    trees: list[int | str], batch_sizes: list[int], device: str, dtype: str, enforce_eager: bool,
    compile: bool | None,
) -> Any:  # fmt: skip
    """The engine of one variant (plain decoding when `tree` is None), its facts recorded in `config`."""
    spec = (
        _speculative_config(models, block_size, tree, draft_len, max(batch_sizes))
        if tree is not None
        else None
    )
    if spec is not None:
        config["block_size"] = block_size_for(spec["max_draft_len"])
        config["tree_budget"] = trees[0] if len(trees) == 1 else trees
        config["drafter_architecture"] = _architecture(models)
    llm = _engine(models, spec, batch_sizes=batch_sizes, max_seq_len=config["max_seq_len"], device=device,
                  dtype=dtype, enforce_eager=enforce_eager, compile=compile)  # fmt: skip
    config["device"], config["dtype"] = str(llm.device), str(llm.dtype).removeprefix("torch.")
    config["compiled"] = bool(llm.engine.executor.compiled)
    return llm


def _variants(
    modes: tuple[str, ...], trees: list[int | str], lens: list[int | str]
) -> list[tuple[str, int | str | None, int | str]]:
    """(mode name, tree budget or None for plain decoding, draft length) of every engine to measure:
    linear DFlash once per draft length, each DDTree budget with the engine's own draft length."""
    variants: list[tuple[str, int | str | None, int | str]] = [("ar", None, "auto")] if "ar" in modes else []
    if "dflash" in modes:
        for budget in trees:
            variants += [(_mode_name(budget, g), budget, g) for g in (lens if budget == 0 else ["auto"])]
    return variants


def _mode_name(tree: int | str, draft_len: int | str = "auto") -> str:
    if tree != 0:
        return f"ddtree-{tree}"
    return "dflash" if draft_len == "auto" else f"dflash-g{draft_len}"


def _draft_len(value: int | str) -> int | str:
    """'auto' or a number of drafts >= 1 (a ConfigError naming the value otherwise)."""
    from dflash_trt.errors import ConfigError

    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise ConfigError("--draft-len", value, "must be 'auto' or a number of drafts >= 1")
    return int(text)


def _measure_interleaved(
    llms: dict[str, Any], batch_sizes: list[int], prompts: tuple[str, ...], *, max_tokens: int, repeats: int,
    progress: Any,
) -> list[Point]:  # fmt: skip
    """Per batch size, `repeats` passes over the modes in turn, each over every prompt in closed
    batches; each (mode, batch size) pools its batches and passes."""
    points = []
    for bs in batch_sizes:
        batches = [
            [prompts[i % len(prompts)] for i in range(lo, lo + bs)] for lo in range(0, len(prompts), bs)
        ]
        runs: dict[str, list[Point]] = {mode: [] for mode in llms}
        for _ in range(repeats):
            for batch in batches:  # every mode on a batch before the next: a drifting load slows them alike
                for mode, llm in llms.items():
                    runs[mode].append(_measure(llm, mode, batch, max_tokens=max_tokens))
        for mode in llms:
            points.append(_pool(runs[mode]))
            if progress is not None:
                progress(points[-1])
    return points


def _add_counts(counts: Any) -> dict[str, int] | None:
    """Counts per key summed over runs (None when no run has any)."""
    total: dict[str, int] | None = None
    for c in counts:
        for k, n in (c or {}).items():
            total = total or {}
            total[k] = total.get(k, 0) + n
    return total


def _pool(runs: list[Point]) -> Point:
    """One point from repeated measurements of the same (mode, batch): sums, then ratios."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    tokens = sum(p.output_tokens for p in runs)
    wall = sum(p.wall_s for p in runs)
    rounds = sum(p.rounds for p in runs)
    decode_s = sum(
        (p.output_tokens - p.batch_size) / p.decode_tokens_per_s for p in runs if p.decode_tokens_per_s > 0
    )
    request_rounds = sum(p.request_rounds for p in runs)
    tau_tokens = sum((p.tau or 0.0) * p.request_rounds for p in runs)

    def per_round(name: str) -> float:
        return sum(getattr(p, name) * p.rounds for p in runs) / max(1, rounds)

    return Point(
        mode=first.mode,
        batch_size=first.batch_size,
        output_tokens=tokens,
        wall_s=wall,
        output_tokens_per_s=tokens / wall,
        decode_tokens_per_s=(tokens - sum(p.batch_size for p in runs)) / decode_s
        if decode_s > 0
        else float("nan"),
        tau=tau_tokens / request_rounds if request_rounds else None,
        rounds=rounds,
        draft_ms_per_round=per_round("draft_ms_per_round"),
        verify_ms_per_round=per_round("verify_ms_per_round"),
        accept_ms_per_round=per_round("accept_ms_per_round"),
        overhead_ms_per_round=per_round("overhead_ms_per_round"),
        peak_memory_mb=max(p.peak_memory_mb for p in runs),
        request_rounds=request_rounds,
        tree_budgets=_add_counts(p.tree_budgets for p in runs),
        draft_lens=_add_counts(p.draft_lens for p in runs),
        draft_tokens=sum(p.draft_tokens for p in runs),
        overturned_draft_tokens=sum(p.overturned_draft_tokens for p in runs),
    )


def _architecture(models: Any) -> str:
    """The drafter's architecture (DFlashDraftModel or DFlash2DraftModel), for the report."""
    from dflash_trt.models.checkpoint import load_drafter_config

    return load_drafter_config(models.drafter_dir).architecture


def _speculative_config(
    models: Any, block_size: int | None, tree: int | str, draft_len: int | str = "auto", max_batch: int = 1
) -> dict[str, Any]:
    """DFlash at `block_size` (default: the drafter's trained block); DDTree when tree != 0; a number
    `draft_len` pins that many drafts per round at every batch size up to `max_batch`."""
    from dflash_trt.models.checkpoint import load_drafter_config

    if models.drafter_dir is None:
        from dflash_trt.errors import ConfigError

        raise ConfigError("--drafter", None, f"DFlash modes need a drafter and {models.target_dir.name} has no default",
                          hint="pass --drafter (a directory or a packaged drafter's name), or --modes ar")  # fmt: skip
    b = block_size or load_drafter_config(models.drafter_dir).block_size
    spec: dict[str, Any] = {
        "decoding_type": "DFlash",
        "max_draft_len": max_draft_len_for(b),
        "speculative_model": str(models.drafter_dir),
    }
    if tree != 0:
        spec["tree_budget"] = tree
    elif draft_len != "auto":
        if int(draft_len) > spec["max_draft_len"]:
            from dflash_trt.errors import ConfigError

            raise ConfigError("--draft-len", draft_len, f"exceeds the block's {spec['max_draft_len']} drafts")
        spec["max_draft_len"] = int(draft_len)
        spec["max_concurrency"] = max_batch  # every batch size drafts it
    return spec


_WARMUP_TOKENS = 8  # each engine's first generate(), untimed: allocations, captures, caches


def _max_seq_len(target_dir: Path, prompts: tuple[str, ...], max_tokens: int) -> int:
    """The engines' sequence limit: the longest prompt and its max_tokens (or the warm-up's) fit (at least max_tokens + 256,
    the limit before prompts were measured: the builtin prompts keep their compiled rounds)."""
    from dflash_trt.models.sources import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        return max_tokens + 256
    longest = max((len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts), default=0)
    return max(max_tokens + 256, longest + max(max_tokens, _WARMUP_TOKENS))


def _engine(
    models: Any, spec: dict[str, Any] | None, *, batch_sizes: list[int], max_seq_len: int, **kwargs: Any
) -> Any:
    """An LLM sized for the largest batch, with per-phase round times when its rounds are eager. Its
    compiled rounds are loaded or compiled before it returns (not in the background while it decodes
    eagerly, the serving default): the benchmark measures the compiled steady state."""
    from dflash_trt.api.llm import LLM
    from dflash_trt.engine.compile import foreground_compile

    max_b = max(batch_sizes)
    with foreground_compile():
        return LLM(
            str(models.target_dir),
            speculative_config=spec,
            max_batch_size=max_b,
            max_num_tokens=max(2048, max_b * 64),
            max_seq_len=max_seq_len,
            profile=kwargs.get("compile") is False,
            **kwargs,
        )


def _tree_budget_counts(metrics: list[Any]) -> dict[str, int] | None:
    """Rounds per DDTree budget over the requests (None when no request reports budgets)."""
    budgets: dict[str, int] | None = None
    for m in metrics:
        for b in m.speculative_decoding.tree_budgets or []:
            budgets = budgets or {}
            budgets[str(b)] = budgets.get(str(b), 0) + 1
    return budgets


def _new_counts(after: dict[int, int], before: dict[int, int]) -> dict[str, int]:
    """Rounds per draft length added since `before`."""
    return {str(g): n - before.get(g, 0) for g, n in sorted(after.items()) if n > before.get(g, 0)}


def _measure(llm: Any, mode: str, batch: list[str], *, max_tokens: int) -> Point:
    """One timed generate() of the whole batch, with the phase times its rounds added."""
    import torch

    from dflash_trt.api.llm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, return_perf_metrics=True)
    runner = llm.engine.runner
    before = dict(vars(runner.times))
    policy = llm.engine.planner.draft_lens
    lens_before = dict(policy.rounds) if policy is not None else {}
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
    lens = _new_counts(policy.rounds, lens_before) if policy is not None else None
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
        request_rounds=len(rounds_all),
        tree_budgets=_tree_budget_counts(metrics),
        draft_lens=lens,
        draft_tokens=sum(m.speculative_decoding.total_draft_tokens for m in metrics),
        overturned_draft_tokens=sum(m.speculative_decoding.total_overturned_draft_tokens for m in metrics),
    )


def _environment() -> dict[str, Any]:
    import torch

    from dflash_trt import __version__
    from dflash_trt.layers import cpu_gemm

    return {
        "dflash_trt": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "gemm_threads": cpu_gemm.threads(),  # dflash-trt's bf16 GEMM's own (layers/cpu_gemm.engine_threads)
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def _speedups(points: list[Point]) -> dict[str, float]:
    """Output tokens/s of DFlash (linear, or the one DDTree mode when it runs alone) over AR, per batch
    size (the keys stay batch sizes, as before DDTree modes existed)."""
    ar = {p.batch_size: p for p in points if p.mode == "ar"}
    spec_modes = [m for m in dict.fromkeys(p.mode for p in points) if m != "ar"]
    main = "dflash" if "dflash" in spec_modes else (spec_modes[0] if spec_modes else None)
    return {
        str(p.batch_size): p.output_tokens_per_s / ar[p.batch_size].output_tokens_per_s
        for p in points
        if p.mode == main and p.batch_size in ar
    }


def _vs_linear(points: list[Point]) -> dict[str, dict[str, float]]:
    """Every mode's output tokens/s over linear DFlash's, per batch size (ratios from one run)."""
    linear = {p.batch_size: p for p in points if p.mode == "dflash"}
    out: dict[str, dict[str, float]] = {}
    for p in points:
        if p.batch_size in linear and p.mode not in ("dflash", "ar"):
            out.setdefault(p.mode, {})[str(p.batch_size)] = (
                p.output_tokens_per_s / linear[p.batch_size].output_tokens_per_s
            )
    return out


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# dflash-trt engine benchmark: " + json.dumps({k: v for k, v in cfg.items() if k != "environment"}),
        "# environment: " + json.dumps(cfg["environment"]),
        f"{'mode':<12} {'batch':>5} {'out tok/s':>10} {'decode tok/s':>12} {'tau':>5} {'overturn':>8} {'rounds':>6} "
        f"{'draft ms':>8} {'verify ms':>9} {'accept ms':>9} {'other ms':>8} {'peak MB':>8}  budgets / draft lengths",
    ]
    for p in result["points"]:
        tau = f"{p['tau']:.2f}" if p["tau"] is not None else "-"
        overturn = f"{p['overturn_rate']:.2f}" if p.get("overturn_rate") is not None else "-"
        budgets = " ".join(
            f"{b}:{n}" for b, n in sorted((p.get("tree_budgets") or {}).items(), key=lambda x: int(x[0]))
        )
        if p.get("draft_lens"):
            budgets += " g " + " ".join(f"{g}:{n}" for g, n in p["draft_lens"].items())
        lines.append(
            f"{p['mode']:<12} {p['batch_size']:>5} {p['output_tokens_per_s']:>10.1f} {p['decode_tokens_per_s']:>12.1f} "
            f"{tau:>5} {overturn:>8} {p['rounds']:>6} {p['draft_ms_per_round']:>8.2f} {p['verify_ms_per_round']:>9.2f} "
            f"{p['accept_ms_per_round']:>9.2f} {p['overhead_ms_per_round']:>8.2f} {p['peak_memory_mb']:>8.0f}  {budgets}"
        )
    if result["speedup"]:
        lines.append(
            "DFlash / AR output tokens/s: "
            + ", ".join(f"b={b}: {s:.2f}x" for b, s in result["speedup"].items())
        )
    for mode, ratios in result.get("vs_linear", {}).items():
        lines.append(
            f"{mode} / linear DFlash output tokens/s: "
            + ", ".join(f"b={b}: {s:.2f}x" for b, s in ratios.items())
        )
    return "\n".join(lines)
