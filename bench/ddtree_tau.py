# SPDX-License-Identifier: Apache-2.0
"""DDTree vs linear DFlash in the batch-1 reference loop: acceptance length tau, and the cost of
building the tree.

  tau        the packaged `tiny` pair on its held-out prompts (dflash_trt.tiny.heldout_prompts,
             tokenized with the target's tokenizer), greedy, --max-new-tokens per prompt, stopping
             at eos, the drafter's trained block size. For linear DFlash (budget 0) and every
             --budgets value: tau = mean over prompts of each prompt's mean round length (bonus
             token included; the reference benchmark's convention), pooled tau = all rounds, nodes
             verified per round. Every DDTree output must equal the linear output token for token
             (greedy is lossless); exit 1 otherwise.
  tree cost  spec.tree.build_tree (batched, on device, no host sync) and build_tree_host (the
             paper's heap per request, packed into the same tensors) on random drafter logits
             [bs, g, V] of the tiny pair's shape, median of --repeats calls, per budget.
  verify     the tiny target's native verify pass (NativeTarget on the paged cache, layer taps on,
             a 256-token context) over the linear block (B tokens, causal) and over a tree of
             budget + 1 nodes (block_mask), interleaved, median of --repeats calls: what a tree
             costs the round before the engine has one.
  Timings alternate the variants call by call, so their ratios hold on a loaded machine; run
  `--only cost` / `--only verify` under cpu-quiet for absolute numbers.

    .venv/bin/python bench/ddtree_tau.py                                   # 32 prompts x 128 tokens
    .venv/bin/python bench/ddtree_tau.py --prompts 4 --max-new-tokens 32 --budgets 16 --json out.json

Exit status: 0 all outputs identical, 1 a DDTree output differs from linear DFlash, 2 bad arguments.
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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=32, help="the first N held-out prompts (default all 32)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="16,32,64", help="comma-separated DDTree node budgets")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--repeats", type=int, default=200, help="calls per tree-cost measurement")
    p.add_argument("--cost-batch-sizes", default="1,8", help="batch sizes of the tree-cost measurement")
    p.add_argument(
        "--only", choices=("all", "tau", "cost", "verify"), default="all",
        help="run one part (time the tree cost under cpu-quiet; tau does not depend on timing)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        args.cost_batch_sizes = [int(b) for b in args.cost_batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error("--budgets and --cost-batch-sizes take comma-separated integers, e.g. 16,32,64")
    if (
        not args.budgets
        or min(args.budgets) < 1
        or not args.cost_batch_sizes
        or min(args.cost_batch_sizes) < 1
    ):
        p.error("budgets and batch sizes must be >= 1")
    for name in ("prompts", "max_new_tokens", "threads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    return args


def _measure_tau(target, drafter, prompts: list[list[int]], stops: list[int], args, budget: int) -> dict:
    from dflash_trt.reference.generate import spec_generate

    per, rounds, outputs, nodes, t0 = [], [], [], 0, time.perf_counter()
    for ids in prompts:
        r = spec_generate(target, drafter, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                          tree_budget=budget)  # fmt: skip
        outputs.append(r.output_ids)
        if r.acceptance_lengths:
            per.append(r.mean_acceptance_length)
            rounds += r.acceptance_lengths
            nodes += r.num_draft_tokens
    return {
        "tree_budget": budget,
        "tau": sum(per) / len(per) if per else None,
        "tau_pooled": sum(rounds) / len(rounds) if rounds else None,
        "rounds": len(rounds),
        "drafted_nodes_per_round": nodes / len(rounds) if rounds else None,
        "wall_s": time.perf_counter() - t0,
        "outputs": outputs,
    }


def _tree_cost(*, batch_sizes: list[int], budgets: list[int], g: int, vocab: int, repeats: int) -> list[dict]:
    import torch

    from dflash_trt.spec.tree import build_tree, build_tree_host

    rows = []
    for bs in batch_sizes:
        logits = torch.randn(bs, g, vocab, generator=torch.Generator().manual_seed(0)) * 3
        anchors = torch.zeros(bs, dtype=torch.long)
        for budget in budgets:
            timings: dict[str, list[float]] = {"batched": [], "heap": []}
            for _ in range(repeats):
                t0 = time.perf_counter()
                build_tree(logits, anchors, budget=budget)
                t1 = time.perf_counter()
                build_tree_host(logits, anchors, budget=budget)
                t2 = time.perf_counter()
                timings["batched"].append(t1 - t0)
                timings["heap"].append(t2 - t1)
            rows.append({"batch_size": bs, "tree_budget": budget, "g": g, "vocab": vocab,
                         **{f"{k}_us": statistics.median(v) * 1e6 for k, v in timings.items()}})  # fmt: skip
    return rows


def _verify_cost(target_dir, drafter, args) -> list[dict]:
    import torch

    from dflash_trt.layers.kv_cache import context_index, slot_mapping
    from dflash_trt.models.loader import load_native_target
    from dflash_trt.spec.tree import build_tree, tree_positions

    native = load_native_target(target_dir, device="cpu", dtype=torch.float32)
    taps = list(drafter.config.target_layer_ids)
    page, ctx, block = 16, 256, drafter.block_size
    vocab = native.config.vocab_size
    rows = []
    for bs in args.cost_batch_sizes:
        width = (ctx + max(args.budgets) + 1) // page + 2
        cache = native.make_cache(num_pages=1 + bs * width, page_size=page)
        tables = (1 + torch.arange(bs * width)).view(bs, width)
        index = context_index(tables, page)
        starts = torch.full((bs,), ctx)
        pos = torch.arange(ctx).expand(bs, ctx)
        with torch.inference_mode():
            native(
                torch.randint(0, vocab, (bs, ctx)), pos, starts, cache, slot_mapping(tables, pos, page), index
            )
        # (tokens, tree): the linear block first, then one tree per budget
        variants: list[tuple[int, Any]] = [(block, None)]
        for budget in args.budgets:
            logits = torch.randn(bs, block - 1, vocab) * 3
            variants.append(
                (budget + 1, build_tree(logits, torch.zeros(bs, dtype=torch.long), budget=budget))
            )
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(args.repeats):
            for (t, tree), spent in zip(variants, times):
                cols = starts[:, None] + torch.arange(t)
                positions = cols if tree is None else tree_positions(starts, tree)
                ids = torch.randint(0, vocab, (bs, t)) if tree is None else tree.tokens
                mask = None if tree is None else tree.visibility
                t0 = time.perf_counter()
                with torch.inference_mode():
                    native(ids, positions, starts + t, cache, slot_mapping(tables, cols, page), index,
                           tap_layers=taps, block_mask=mask)  # fmt: skip
                spent.append(time.perf_counter() - t0)
        base = statistics.median(times[0])
        rows += [{"batch_size": bs, "tokens": t, "tree": tree is not None, "context": ctx,
                  "ms": statistics.median(v) * 1e3, "ratio_to_linear": statistics.median(v) / base}
                 for (t, tree), v in zip(variants, times)]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.tiny import ensure_tiny, heldout_prompts

    torch.set_num_threads(args.threads)
    paths = ensure_tiny()
    if args.only in ("cost", "verify"):
        args.prompts = 0
    target = HFTarget.from_pretrained(paths.target, device=torch.device("cpu"), dtype=torch.float32)
    drafter = load_drafter(paths.drafter)
    tok = AutoTokenizer.from_pretrained(paths.target)
    prompts = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in heldout_prompts()[: args.prompts]]
    stops = [tok.eos_token_id]
    runs = (
        [_measure_tau(target, drafter, prompts, stops, args, b) for b in [0, *args.budgets]]
        if prompts
        else []
    )
    mismatched: dict[int, list[int]] = {}
    base = runs[0]["outputs"] if runs else []
    for r in runs:
        mismatched[r["tree_budget"]] = [i for i, (a, b) in enumerate(zip(base, r.pop("outputs"))) if a != b]
        r["tau_ratio"] = r["tau"] / runs[0]["tau"] if r["tau"] and runs[0]["tau"] else None
    verify = _verify_cost(paths.target, drafter, args) if args.only in ("all", "verify") else []
    cost = []
    if args.only in ("all", "cost"):
        cost = _tree_cost(batch_sizes=args.cost_batch_sizes, budgets=args.budgets, g=drafter.block_size - 1,
                          vocab=target.info.vocab_size, repeats=args.repeats)  # fmt: skip
    result: dict[str, Any] = {
        "config": {
            "pair": "tiny",
            "parts": args.only,
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "block_size": drafter.block_size,
            "greedy": True,
            "stop": "eos",
            "loop": "reference (batch 1)",
            "torch_threads": args.threads,
            "date": datetime.date.today().isoformat(),
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(),
            },
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
        },
        "tau": runs,
        "tree_cost": cost,
        "verify_cost": verify,
        "identical": not any(mismatched.values()),
        "mismatched_prompts": {str(k): v for k, v in mismatched.items() if v},
    }
    print(json.dumps(result["config"]))
    print(f"{'budget':>7} {'tau':>6} {'ratio':>6} {'pooled':>7} {'nodes/round':>12} {'wall s':>7}")
    for r in runs:
        print(f"{r['tree_budget'] or 'linear':>7} {r['tau']:6.2f} {r['tau_ratio']:6.3f} {r['tau_pooled']:7.2f} "
              f"{r['drafted_nodes_per_round']:12.1f} {r['wall_s']:7.1f}")  # fmt: skip
    print(f"{'bs':>3} {'budget':>7} {'batched us':>11} {'heap us':>9}")
    for c in cost:
        print(f"{c['batch_size']:>3} {c['tree_budget']:>7} {c['batched_us']:11.0f} {c['heap_us']:9.0f}")
    if verify:
        print(f"{'bs':>3} {'nodes':>6} {'verify ms':>10} {'x linear':>9}")
    for v in verify:
        print(f"{v['batch_size']:>3} {v['tokens']:>6} {v['ms']:10.2f} {v['ratio_to_linear']:9.2f}")
    print(f"outputs identical to linear DFlash: {'yes' if result['identical'] else 'NO'}")
    if args.json:
        from dflash_trt.utils.io import atomic_write_text

        atomic_write_text(Path(args.json), json.dumps(result, indent=2) + "\n")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
