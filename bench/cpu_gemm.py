# SPDX-License-Identifier: Apache-2.0
"""dflash-trt's CPU GEMMs (dflash_trt/layers/cpu_gemm.py) against what the engine would run without
them, and against the machine's read bandwidth, on the weight shapes of a model, for the row counts
decoding and verification use:
- `--dtype bfloat16` (AVX512-BF16): ours against oneDNN's prepacked bf16 GEMM;
- `--dtype float32` (AVX2): ours on weights kept as bf16 (fp32 compute) against torch's fp32 GEMM on
  the fp32 weights (MKL), which read twice the bytes.

For each weight [N, K] and rows M: the best of --repeats timed loops of each kernel, its time and the
weight bytes it streamed per second (its own weights' bytes), the ratio of the two kernels, and each
result's largest error against a float32 product. The read bandwidth (torch `x.sum()` over --bandwidth-gib GiB of bf16, the
same threads) is the physical limit of a kernel that streams its weight from memory: weights smaller
than the last-level cache are read from cache in these loops and may exceed it.

    python bench/cpu_gemm.py                    # qwen3-0.3b's projections and LM head, 2 threads
    python bench/cpu_gemm.py --dtype float32    # the AVX2 kernel against MKL's fp32 GEMM
    python bench/cpu_gemm.py --shape toy --rows 1,16 --threads 1 --json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from typing import Any

from script_args import positive_ints
from timing import best_loop

from dflash_trt.bench.shapes import SHAPES
from dflash_trt.utils.device import cpu_model_name


def _weights(shape_name: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one layer's fused projections and the LM head, as the engine packs them."""
    s = SHAPES[shape_name]
    head_dim = s.head_dim
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    return [
        ("qkv", q + 2 * kv, s.hidden),
        ("o_proj", s.hidden, q),
        ("gate_up", 2 * s.intermediate, s.hidden),
        ("down_proj", s.hidden, s.intermediate),
        ("lm_head", s.vocab, s.hidden),
    ]


def _baseline(w: Any, dtype: Any) -> tuple[Any, int]:
    """What the engine runs without our kernels, and the bytes per weight element it reads: oneDNN's
    prepacked bf16 GEMM, or torch's fp32 GEMM on the weight loaded in fp32."""
    import torch

    if dtype == torch.bfloat16:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        return functools.partial(_onednn, packed), 2
    return functools.partial(_linear, w.float()), 4


def _onednn(packed: Any, x: Any) -> Any:
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def _linear(w: Any, x: Any) -> Any:
    import torch

    return torch.nn.functional.linear(x, w)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.3b", help=f"one of {', '.join(SHAPES)}")
    p.add_argument("--rows", default="1,2,4,8,16,64", help="comma-separated row counts M")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed loops per point; the best counts")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the summed tensor (GiB)")
    p.add_argument("--stream-gb", type=float, default=2.0,
                   help="GB of weights each timed loop streams (sets its repetitions; at least 3)")  # fmt: skip
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activations' dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.shape not in SHAPES:
        p.error(f"--shape {args.shape!r}: unknown; use one of {', '.join(SHAPES)}")
    rows = positive_ints(p, "--rows", args.rows)
    if not args.stream_gb > 0:
        p.error(f"--stream-gb {args.stream_gb!r}: must be > 0 (GB of weights per timed loop)")

    import torch

    from dflash_trt.layers import cpu_gemm

    dtype = getattr(torch, args.dtype)
    if not cpu_gemm.available(dtype):
        need = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX2 and FMA"
        print(f"error: dflash-trt's {args.dtype} GEMM does not run here (it needs {need} and a C compiler; "
              f"{cpu_gemm.SWITCH_ENV}=0 turns it off)", file=sys.stderr)  # fmt: skip
        return 1
    baseline = "oneDNN prepacked bf16" if dtype == torch.bfloat16 else "torch fp32 (MKL) on fp32 weights"
    torch.set_num_threads(args.threads)
    big = torch.ones(int(args.bandwidth_gib * 2**30) // 2, dtype=torch.bfloat16)
    secs = best_loop(big.sum, 5, 1)
    bandwidth = big.numel() * 2 / secs / 1e9
    del big
    config = {
        "shape": args.shape, "dtype": args.dtype, "baseline": baseline, "rows": rows, "threads": args.threads,
        "repeats": args.repeats, "stream_gb": args.stream_gb,
        "torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_model_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "read_bandwidth_gb_s": round(bandwidth, 1),
    }  # fmt: skip
    points = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k in _weights(args.shape):
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        ours = cpu_gemm.pack(w)
        base, base_bytes = _baseline(w, dtype)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            want = x.float() @ w.float().t()
            reps = max(
                3, int(args.stream_gb * 1e9 / (n * k * 2))
            )  # --stream-gb of bf16 weights per timed loop
            row: dict[str, Any] = {"weight": name, "n": n, "k": k, "rows": m}
            runs = {
                "dflash": (functools.partial(cpu_gemm.gemm, x, ours, None), 2),
                "baseline": (functools.partial(base, x), base_bytes),
            }
            for kernel, (fn, itemsize) in runs.items():
                t = best_loop(fn, reps, args.repeats)
                row[f"{kernel}_us"] = t * 1e6
                row[f"{kernel}_gb_s"] = n * k * itemsize / t / 1e9
                row[f"{kernel}_max_err"] = float((fn().float() - want).abs().max())
            row["speedup"] = row["baseline_us"] / row["dflash_us"]
            points.append(row)
    if args.json:
        print(json.dumps({"config": config, "points": points}))
        return 0
    print("# cpu_gemm configuration: " + json.dumps(config))
    print(
        f"# read bandwidth (x.sum over {args.bandwidth_gib:g} GiB bf16, {args.threads} threads): {bandwidth:.1f} GB/s"
    )
    print(f"# baseline: {baseline}")
    print(f"{'weight':<10} {'N':>7} {'K':>5} {'M':>4} {'dflash us':>10} {'GB/s':>6} {'base us':>10} {'GB/s':>6} "
          f"{'speedup':>7} {'max err':>15}")  # fmt: skip
    for r in points:
        print(f"{r['weight']:<10} {r['n']:>7} {r['k']:>5} {r['rows']:>4} {r['dflash_us']:>10.1f} {r['dflash_gb_s']:>6.1f} "
              f"{r['baseline_us']:>10.1f} {r['baseline_gb_s']:>6.1f} {r['speedup']:>6.2f}x "
              f"{r['dflash_max_err']:>7.3g}/{r['baseline_max_err']:<7.3g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
