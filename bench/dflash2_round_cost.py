# SPDX-License-Identifier: Apache-2.0
"""DFlash 2 against v1 in the embedded engine, in one process: the cost of one round, and τ and tok/s.

Pair: the packaged `tiny` target with its two shipped drafters of the same size (1 layer, hidden 128,
block 16, same target layers, same training data and budget): v1 (`DFlashDraftModel`) and
`tiny-dflash2` (`DFlash2DraftModel`: two dynamic convs per layer, selector rank 64, top-k 8).

  round      `ModelRunner.decode_round` of the same batch at the same state, timed alone: b requests
             (b = --round-batches) whose prompts are held-out prompts cut or cycled to --context
             tokens, prefilled, then R rounds of g = 15 drafts each without committing (every call
             recomputes the same round: identical shapes and work). The two drafters' engines
             alternate round by round (v1 first on even trials, DFlash 2 first on odd ones) so that
             drift in machine load hits both; median ms per round, the ratio DFlash 2 / v1 (the median
             over trials of the ratio of each trial's two adjacent rounds: the most robust to a shared,
             noisy machine; also the ratio of the medians and of the minima), and (eager
             rounds) the phase split (draft = injection + block pass + proposal, verify, accept) from
             the runner's phase clock. Greedy (--sampled adds T = 0.7 rounds: the sampled walk and the
             acceptance over candidates).
  serving    τ and output tok/s with continuous batching at concurrency c (--batches): the first
             --prompts held-out prompts, --max-tokens each (ignore_eos, greedy), max_batch_size c, one
             engine per drafter and c, stepped to completion; tok/s = generated tokens / wall time
             (prefill included); τ pooled = tokens from rounds / rounds. --trials runs per c, the
             drafters alternating; the tok/s ratio is the median over trials of each trial's ratio.
  mode       eager rounds (default), or --compile: torch.compile'd rounds (the CPU default of `serve`
             and `LLM`); each shape class compiles before it is timed (minutes on a cold cache).
  threads    torch intra-op threads set explicitly (--threads, default 1: the engine's default for
             this model).

    .venv/bin/python bench/dflash2_round_cost.py                      # eager, round at b=1,16, serving c=1,4,16
    .venv/bin/python bench/dflash2_round_cost.py --compile --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

G = 15  # drafts per round: the block of both shipped drafters minus the anchor


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--round-batches", default="1,16", help="batch sizes of the round timing (default 1,16)")
    p.add_argument("--context", type=int, default=96, help="prompt tokens of each timed request (default 96)")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds per drafter and batch (default 40)")
    p.add_argument("--sampled", action="store_true", help="also time sampled rounds (T = 0.7)")
    p.add_argument("--batches", default="1,4,16", help="concurrencies of the serving part (default 1,4,16)")
    p.add_argument(
        "--prompts", type=int, default=16, help="held-out prompts of the serving part (default 16)"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request in the serving part")
    p.add_argument("--trials", type=int, default=3, help="serving runs per drafter and c (default 3)")
    p.add_argument("--skip-serving", action="store_true", help="time rounds only")
    p.add_argument("--compile", action="store_true", help="torch.compile'd rounds (compiles before timing)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    for name in ("round_batches", "batches"):
        try:
            values = [int(x) for x in getattr(args, name).split(",") if x.strip()]
        except ValueError:
            p.error(
                f"--{name.replace('_', '-')} {getattr(args, name)!r}: pass comma-separated integers, e.g. 1,16"
            )
        if not values or min(values) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: batch sizes must be >= 1")
        setattr(args, name, values)
    for name in ("context", "rounds", "prompts", "max_tokens", "threads", "trials"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    return args


def _engine(drafter_dir: Path, *, max_batch_size: int, max_seq_len: int, compile: bool) -> Any:
    import torch

    from dflash_trt.engine.assemble import build_engine
    from dflash_trt.engine.config import EngineConfig
    from dflash_trt.spec.decoding_config import DFlashDecodingConfig
    from dflash_trt.tiny import ensure_tiny

    engine = build_engine(
        target_dir=ensure_tiny().target, drafter_dir=drafter_dir, spec=DFlashDecodingConfig(max_draft_len=G),
        tokenizer=None,
        # the phase clock reads the host clock inside the round: eager rounds only (a compiled round would break)
        config=EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len, profile=not compile),
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    if compile:
        from dflash_trt.engine.compile import use_cache_root

        use_cache_root(None, torch.device("cpu"))
        engine.executor.enable_compile()
    return engine


def _prompt_ids(n: int, length: int | None = None) -> list[list[int]]:
    """The first n held-out prompts as token ids; with `length`, each cut or cycled to that many."""
    from dflash_trt.models.sources import load_tokenizer
    from dflash_trt.tiny import ensure_tiny, heldout_prompts

    tok = load_tokenizer(ensure_tiny().target)
    prompts = heldout_prompts()
    out = []
    for i in range(n):
        ids = tok(prompts[i % len(prompts)], add_special_tokens=False)["input_ids"]
        if length is not None:
            ids = (ids * (length // len(ids) + 1))[:length]
        out.append(ids)
    return out


def _prefilled(engine: Any, prompts: list[list[int]], temperature: float) -> list[Any]:
    """Requests admitted and prefilled (each holds its first token), ready for a round."""
    from dflash_trt.engine.request import RequestParams, Status

    reqs = [engine.add_request(ids, RequestParams(max_tokens=2 * G + 2, ignore_eos=True, temperature=temperature,
                                                  seed=i)) for i, ids in enumerate(prompts)]  # fmt: skip
    while not all(r.status is Status.RUNNING for r in reqs):
        engine.step()
    assert all(len(r.output_ids) == 1 for r in reqs), "a round ran before every request was prefilled"
    return reqs


def _shape(batch: list[Any]) -> Any:
    """The round every timed call runs: G drafts per request, linear, the batch's sampling flags."""
    from dflash_trt.engine.round import RoundShape, round_flags

    return RoundShape(G, 0, round_flags(batch))


def time_rounds(drafters: dict[str, Path], *, bs: int, context: int, rounds: int, temperature: float,
                compile: bool) -> dict[str, Any]:  # fmt: skip
    """Median ms per round of each drafter on the same batch at the same state, alternating."""
    prompts = _prompt_ids(bs, context)
    engines = {name: _engine(d, max_batch_size=bs, max_seq_len=context + 4 * G, compile=compile)
               for name, d in drafters.items()}  # fmt: skip
    batches = {name: _prefilled(e, prompts, temperature) for name, e in engines.items()}
    for name, e in engines.items():  # warm-up (and compilation): not timed
        for _ in range(3):
            e.runner.decode_round(batches[name], _shape(batches[name]))
        if compile:
            e.executor.freeze()
    names = list(drafters)
    times: dict[str, list[float]] = {n: [] for n in names}
    before = {n: dict(vars(engines[n].runner.times)) for n in names}
    overturned = {n: 0 for n in names}
    for trial in range(rounds):
        for name in names if trial % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            out = engines[name].runner.decode_round(batches[name], _shape(batches[name]))
            times[name].append(1e3 * (time.perf_counter() - t0))
            overturned[name] += sum(out.overturned)
    result: dict[str, Any] = {
        "batch_size": bs,
        "temperature": temperature,
        "context": context,
        "rounds": rounds,
    }
    for name in names:
        after = vars(engines[name].runner.times)
        n = after["rounds"] - before[name]["rounds"]
        phases = {f"{k[:-2]}_ms": 1e3 * (after[k] - before[name][k]) / n if not compile else None
                  for k in ("draft_s", "verify_s", "accept_s")}  # fmt: skip
        result[name] = {
            "round_ms_median": statistics.median(times[name]),
            "round_ms_min": min(times[name]),
            **phases,
            "overturn_rate": overturned[name] / (rounds * bs * G),
        }
    result["ratio"] = statistics.median(b / a for a, b in zip(times[names[0]], times[names[1]]))
    result["ratio_of_medians"] = result[names[1]]["round_ms_median"] / result[names[0]]["round_ms_median"]
    result["ratio_min"] = result[names[1]]["round_ms_min"] / result[names[0]]["round_ms_min"]
    return result


def serve_batch(
    drafter: Path, prompts: list[list[int]], *, c: int, max_tokens: int, compile: bool
) -> dict[str, Any]:
    """All prompts through one engine with c batch rows (continuous batching), greedy, to completion."""
    from dflash_trt.engine.request import RequestParams

    engine = _engine(
        drafter, max_batch_size=c, max_seq_len=max(map(len, prompts)) + max_tokens + 1, compile=compile
    )
    if compile:  # compile the shape classes this run meets (batch 1 and more) before timing
        for bs in sorted({1, c}):
            for _ in range(bs):
                engine.add_request(prompts[0], RequestParams(max_tokens=2 * G + 2, ignore_eos=True))
            while engine.has_work():
                engine.step()
        engine.executor.freeze()
    t0 = time.perf_counter()
    reqs = [engine.add_request(ids, RequestParams(max_tokens=max_tokens, ignore_eos=True)) for ids in prompts]
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs)
    lengths = [a for r in reqs for a in r.acceptance_lengths]
    drafted = sum(r.num_draft_tokens for r in reqs)
    return {
        "output_tokens_per_s": tokens / wall,
        "tau_pooled": sum(lengths) / len(lengths),
        "overturn_rate": sum(r.num_overturned_draft_tokens for r in reqs) / drafted if drafted else 0.0,
        "wall_s": wall,
        "output_tokens": tokens,
    }


def _phases(r: dict[str, Any]) -> str:
    if r["draft_ms"] is None:
        return "-"
    return f"{r['draft_ms']:.2f}/{r['verify_ms']:.2f}/{r['accept_ms']:.2f}"


def _environment(threads: int) -> dict[str, Any]:
    import torch

    from dflash_trt import __version__

    return {
        "dflash_trt": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "threads": threads,
        "load_average": os.getloadavg(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    from dflash_trt.tiny import ensure_tiny

    torch.set_num_threads(args.threads)
    paths = ensure_tiny()
    drafters = {"v1": paths.drafter, "dflash2": paths.drafter_dflash2}
    config = {k: v for k, v in vars(args).items() if k != "json"}
    print(
        "# dflash2_round_cost: " + json.dumps({**config, "environment": _environment(args.threads)}),
        flush=True,
    )
    results: dict[str, Any] = {
        "config": config,
        "environment": _environment(args.threads),
        "rounds": [],
        "serving": [],
    }
    temps = (0.0, 0.7) if args.sampled else (0.0,)
    print(f"{'batch':>5} {'T':>4} {'v1 ms':>8} {'DFlash 2 ms':>11} {'ratio':>6} {'ratio(min)':>10}   "
          f"draft/verify/accept ms v1 | DFlash 2   overturn", flush=True)  # fmt: skip
    for temperature in temps:
        for bs in args.round_batches:
            r = time_rounds(drafters, bs=bs, context=args.context, rounds=args.rounds, temperature=temperature,
                            compile=args.compile)  # fmt: skip
            results["rounds"].append(r)
            v1, d2 = r["v1"], r["dflash2"]
            print(f"{bs:>5} {temperature:>4} {v1['round_ms_median']:>8.2f} {d2['round_ms_median']:>11.2f} "
                  f"{r['ratio']:>6.3f} {r['ratio_min']:>10.3f}   {_phases(v1)} | {_phases(d2)}   "
                  f"{d2['overturn_rate']:.2f}", flush=True)  # fmt: skip
    if not args.skip_serving:
        prompts = _prompt_ids(args.prompts)
        print(f"{'c':>3} {'v1 tok/s':>9} {'v1 tau':>7} {'D2 tok/s':>9} {'D2 tau':>7} {'tok/s ratio':>11} "
              f"{'tau ratio':>9} {'D2 overturn':>11}", flush=True)  # fmt: skip
        for c in args.batches:
            runs: dict[str, list[dict[str, Any]]] = {"v1": [], "dflash2": []}
            for trial in range(args.trials):
                for name in ["v1", "dflash2"] if trial % 2 == 0 else ["dflash2", "v1"]:
                    runs[name].append(serve_batch(drafters[name], prompts, c=c, max_tokens=args.max_tokens,
                                                  compile=args.compile))  # fmt: skip
            point: dict[str, Any] = {"concurrency": c, "v1": runs["v1"], "dflash2": runs["dflash2"]}
            tps = {n: statistics.median(r["output_tokens_per_s"] for r in runs[n]) for n in runs}
            point["tok_s_ratio"] = statistics.median(
                b["output_tokens_per_s"] / a["output_tokens_per_s"]
                for a, b in zip(runs["v1"], runs["dflash2"])
            )
            v1, d2 = runs["v1"][0], runs["dflash2"][0]  # tau and overturns are the same in every trial
            point["tau_ratio"] = d2["tau_pooled"] / v1["tau_pooled"]
            results["serving"].append(point)
            print(f"{c:>3} {tps['v1']:>9.1f} {v1['tau_pooled']:>7.2f} {tps['dflash2']:>9.1f} {d2['tau_pooled']:>7.2f} "
                  f"{point['tok_s_ratio']:>11.3f} {point['tau_ratio']:>9.3f} {d2['overturn_rate']:>11.2f}",
                  flush=True)  # fmt: skip
    if args.json:
        from dflash_trt.utils.io import atomic_write_text

        atomic_write_text(Path(args.json), json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
