# SPDX-License-Identifier: Apache-2.0
"""dflash-trt's CPU paged attention (`dflash_cpu::paged_attention`, layers/paged_attention_op.cpp)
against the path the engine takes without it (gather the context's K/V out of the pool, then
`attention.attend`: torch's SDPA in float32, two GEMMs in bfloat16), one decoder layer's attention
of a decode round: T query rows per sequence (1: plain decoding, 16: a DFlash block) over a context
of L keys in a shuffled paged pool, causal, for batches of sequences.

For each point: the best of --repeats timed loops of each path, the ratio, and the bytes of K/V the
operator reads per second (each visible key and value once) against the machine's read bandwidth
(torch `x.sum()` over --bandwidth-gib GiB, the same threads): the physical limit of a kernel that
streams the cache.

    python bench/paged_attention.py                                   # tiny's and qwen3-8b's heads, 1 thread
    python bench/paged_attention.py --heads 32,8,128 --contexts 4096 --dtype bfloat16 --json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

from script_args import positive_ints
from timing import best_loop

from dflash_trt.utils.device import cpu_model_name

PAGE = 16
# (name, query heads, KV heads, head dim): `tiny`'s attention and Qwen3-8B's
HEADS = {"tiny": (4, 2, 32), "qwen3-8b": (32, 8, 128)}


def _case(torch: Any, bs: int, t: int, heads: tuple[int, int, int], ctx: int, dtype: Any, seed: int):
    """q, pools, ctx_index and the causal mask of `bs` sequences whose last T of `ctx` tokens are new."""
    from dflash_trt.layers.kv_cache import context_index
    from dflash_trt.layers.masks import visibility_mask

    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    pages = -(-ctx // PAGE) + 1  # one spare page per sequence, as the engine's tables have
    pool = (bs * pages + 1) * PAGE
    k = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v = torch.randn(pool, hkv, d, generator=g).to(dtype)
    tables = (torch.randperm(bs * pages, generator=g) + 1).reshape(bs, pages)
    idx = context_index(tables, PAGE)
    lc = idx.shape[1]
    seq_lens = torch.full((bs,), ctx)
    positions = seq_lens[:, None] - t + torch.arange(t)
    k_pos = torch.arange(lc).expand(bs, lc)
    mask = visibility_mask(positions, k_pos, k_pos < seq_lens[:, None], causal=True, window=None)
    q = torch.randn(bs, t, h, d, generator=g).to(dtype)
    return q, k, v, idx, mask


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="tiny,qwen3-8b",
                   help=f"comma-separated: {', '.join(HEADS)}, or H,Hkv,d for one custom shape")  # fmt: skip
    p.add_argument("--batch-sizes", default="1,4,16", help="sequences per round")
    p.add_argument("--rows", default="1,16", help="query rows per sequence (1: plain step, 16: DFlash block)")
    p.add_argument("--contexts", default="256,2048", help="keys per sequence")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, the engine's)")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per point; the best counts")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the summed tensor (GiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    batches = positive_ints(p, "--batch-sizes", args.batch_sizes)
    rows = positive_ints(p, "--rows", args.rows)
    contexts = positive_ints(p, "--contexts", args.contexts)
    parts = args.heads.split(",")
    if all(x.strip().isdigit() for x in parts) and len(parts) == 3:
        shapes = {"custom": tuple(int(x) for x in parts)}
    elif all(x in HEADS for x in parts):
        shapes = {x: HEADS[x] for x in parts}
    else:
        p.error(f"--heads {args.heads!r}: give names from {', '.join(HEADS)} or three integers H,Hkv,d")
    if not args.bandwidth_gib > 0:
        p.error(f"--bandwidth-gib {args.bandwidth_gib!r}: must be > 0")
    if any(h % hkv for h, hkv, _ in shapes.values()):
        p.error(f"--heads {args.heads!r}: the query heads must be a multiple of the KV heads")

    import torch

    from dflash_trt.layers import cpu_attention
    from dflash_trt.layers.attention import attend_paged

    if not cpu_attention.available():
        print(f"error: dflash_cpu::paged_attention does not run here (x86-64 with AVX2 and FMA and a C++ "
              f"compiler; {cpu_attention.SWITCH_ENV}=0 turns it off)", file=sys.stderr)  # fmt: skip
        return 1
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    big = torch.ones(max(1, int(args.bandwidth_gib * 2**30) // 2), dtype=torch.bfloat16)
    bandwidth = big.numel() * 2 / best_loop(big.sum, 3, 1) / 1e9
    del big
    config = {
        "heads": {k: list(v) for k, v in shapes.items()}, "batch_sizes": batches, "rows": rows,
        "contexts": contexts, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
        "baseline": "gather + attention.attend (SDPA in float32, GEMMs in bfloat16)",
        "torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_model_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "read_bandwidth_gb_s": round(bandwidth, 1),
    }  # fmt: skip
    points = []
    for name, heads in shapes.items():
        for ctx in contexts:
            for bs in batches:
                for t in rows:
                    q, k, v, idx, mask = _case(torch, bs, t, heads, ctx, dtype, seed=bs * 100 + t)
                    scale = heads[2] ** -0.5

                    def run(kernel: bool, q=q, k=k, v=v, idx=idx, mask=mask, scale=scale) -> Any:
                        return attend_paged(q, k, v, idx, mask, scale=scale, kernel=kernel)

                    with torch.inference_mode():
                        ref = run(False).float()
                        err = float((run(True).float() - ref).abs().max())
                        kv_bytes = 2 * bs * ctx * heads[1] * heads[2] * k.element_size()
                        reps = max(3, int(2e8 / max(kv_bytes, 1)))
                        ours = best_loop(lambda: run(True), reps, args.repeats)
                        base = best_loop(lambda: run(False), reps, args.repeats)
                    points.append({
                        "heads": name, "context": ctx, "batch": bs, "rows": t, "ours_us": ours * 1e6,
                        "gather_sdpa_us": base * 1e6, "speedup": base / ours,
                        "ours_gb_s": kv_bytes / ours / 1e9, "max_abs_diff": err,
                    })  # fmt: skip
    if args.json:
        print(json.dumps({"config": config, "points": points}))
        return 0
    print("# paged_attention configuration: " + json.dumps(config))
    print(
        f"# read bandwidth (x.sum over {args.bandwidth_gib:g} GiB bf16, {args.threads} threads): {bandwidth:.1f} GB/s"
    )
    print(f"{'heads':<9} {'L':>5} {'bs':>3} {'T':>3} {'ours us':>9} {'gather+sdpa us':>15} {'speedup':>8} "
          f"{'K/V GB/s':>9} {'max diff':>9}")  # fmt: skip
    for r in points:
        print(f"{r['heads']:<9} {r['context']:>5} {r['batch']:>3} {r['rows']:>3} {r['ours_us']:>9.1f} "
              f"{r['gather_sdpa_us']:>15.1f} {r['speedup']:>7.2f}x {r['ours_gb_s']:>9.1f} {r['max_abs_diff']:>9.2g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
