# SPDX-License-Identifier: Apache-2.0
"""The drafting plugin on a GPU: each dflash:: kernel against its bandwidth floor, and the engine's
DFlash round with and without the plugin.

1. Copy bandwidth: `dst.copy_(src)` over two 512 MiB buffers; bandwidth = 2 * bytes / time.
2. Per kernel and shape: median time (CUDA events, after warm-up) of the Triton op and of its
   PyTorch reference, and the floor = bytes the op must move / measured bandwidth. "x floor" is
   time / floor (1.0 = at bandwidth). Bytes counted:
     block_attention   q, block K/V, visible context K/V (window-limited), context slot ids, output
     inject_context    features, fc weight, stacked K/V weight (+ bias), norm weights, the K/V
                       written for every layer (the fc/norm/projection intermediates are not counted)
     greedy_accept     the target logits [N, g + 1, V] once
     rejection_accept  target and draft probability rows of the emitting position once (the kernel
                       makes two passes over them by design: expect >= 2x floor)
3. Engine: b requests at once (greedy, ignore_eos, fixed output length) on the embedded engine with
   CUDA graphs; the round time is the wall time of `ModelRunner.decode_round` (copy-in, replay and
   the one host read-back) over rounds that ran the whole batch; median and mean are reported for
   use_plugins False (before) and True (after) at batch 1, 8 and 32.

    .venv/bin/python bench/plugin_kernels.py                        # kernels + the tiny engine
    .venv/bin/python bench/plugin_kernels.py --drafter DRAFTER_DIR --target TARGET_DIR \
        --engine-drafter DRAFTER_DIR --dtype bfloat16 --json plugin.json

Without CUDA it exits with status 3 and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

EXIT_NO_DEVICE = 3


@dataclass(frozen=True)
class DrafterShape:
    """Kernel shapes. The default is Qwen3-8B-sized (hidden 4096, 32 heads over 8 KV heads of 128,
    vocabulary 151936) with 5 draft layers fed by 5 target layers; pass --drafter to use a real
    checkpoint's config instead."""

    hidden: int = 4096
    num_target_features: int = 5
    layers: int = 5
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    block: int = 16
    sliding_window: int | None = None
    rope_theta: float = 1_000_000.0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--contexts", default="1024,8192", help="context lengths for block_attention")
    p.add_argument("--drafter", default=None, help="drafter directory: kernel shapes from its config")
    p.add_argument("--target", default="tiny", help="engine target: `tiny` or a transformers directory")
    p.add_argument("--engine-drafter", default=None, help="engine drafter directory (default: the target's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


# --- timing -----------------------------------------------------------------------------------------
def _time_ms(fn, reps: int) -> float:
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(reps: int) -> float:
    import torch

    n = 512 * 2**20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps)
    return 2 * n / (ms * 1e-3) / 1e9


# --- per-kernel cases -------------------------------------------------------------------------------
def _kernel_rows(
    shape: DrafterShape, dtype, batch_sizes: list[int], contexts: list[int], reps: int, bw: float
):
    import torch

    from dflash_trt.plugins import accept, block_attention, context_kv, load_ops
    from dflash_trt.plugins.context_kv import stack_kv_weights

    load_ops()
    dev = torch.device("cuda")
    elt = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, Any]] = []

    def randn(*s, dt=dtype):
        return torch.randn(*s, generator=gen, device=dev, dtype=torch.float32).to(dt)

    def record(op: str, cfg: dict, bytes_moved: int, triton_fn, ref_fn) -> None:
        t_triton = _time_ms(triton_fn, reps)
        t_ref = _time_ms(ref_fn, reps)
        floor = bytes_moved / (bw * 1e9) * 1e3
        rows.append({
            "op": op, **cfg, "bytes": bytes_moved, "floor_ms": floor, "triton_ms": t_triton,
            "reference_ms": t_ref, "x_floor": t_triton / floor, "speedup_vs_reference": t_ref / t_triton,
        })  # fmt: skip
        print(
            f"{op:<17} {json.dumps(cfg):<62} floor {floor:8.4f} ms  triton {t_triton:8.4f} ms "
            f"({t_triton / floor:5.2f}x floor)  reference {t_ref:8.4f} ms ({t_ref / t_triton:5.2f}x)",
            flush=True,
        )

    h, hkv, d, blk, page = shape.heads, shape.kv_heads, shape.head_dim, shape.block, 16
    windows = [0] + ([shape.sliding_window] if shape.sliding_window else [])
    for bs in batch_sizes:
        for ctx in contexts:
            pages = -(-(ctx + blk) // page)
            num_pages = 1 + bs * pages
            kc, vc = randn(num_pages * page, hkv, d), randn(num_pages * page, hkv, d)
            tables = 1 + torch.arange(bs * pages, device=dev).view(bs, pages)
            ctx_index = (tables[:, :, None] * page + torch.arange(page, device=dev)).reshape(bs, -1)
            ctx_lens = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
            block_lens = torch.full((bs,), blk, dtype=torch.int64, device=dev)
            q, kb, vb = randn(bs, blk, h, d), randn(bs, blk, hkv, d), randn(bs, blk, hkv, d)
            for window in windows:
                causal = window > 0
                args = (q, kb, vb, kc, vc, ctx_index, ctx_lens, block_lens, causal, window, d**-0.5)
                keys = min(ctx, window) if window else ctx
                moved = (
                    2 * bs * blk * h * d + 2 * bs * blk * hkv * d + 2 * bs * keys * hkv * d
                ) * elt + bs * keys * 8
                record(
                    "block_attention",
                    {"batch": bs, "context": ctx, "block": blk, "window": window},
                    moved,
                    lambda a=args: torch.ops.dflash.block_attention(*a),
                    lambda a=args: block_attention.block_attention_reference(*a),
                )
    dim, k_feat, layers = shape.hidden, shape.num_target_features, shape.layers
    fc = randn(dim, k_feat * dim) * (k_feat * dim) ** -0.5
    hn = torch.ones(dim, device=dev, dtype=dtype)
    kw = [randn(hkv * d, dim) * dim**-0.5 for _ in range(layers)]
    vw = [randn(hkv * d, dim) * dim**-0.5 for _ in range(layers)]
    kv_weight, kv_bias = stack_kv_weights(kw, vw, [None] * layers, [None] * layers)
    kn = torch.ones(layers, d, device=dev, dtype=dtype)
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    for bs in batch_sizes:
        n = bs * blk  # a round commits up to B tokens per sequence
        feats = randn(n, k_feat * dim)
        pos = torch.arange(n, device=dev) + 1000
        slots = torch.randperm(n * 4, device=dev)[:n] + 16
        k_pools = [torch.zeros(n * 4 + 16, hkv, d, device=dev, dtype=dtype) for _ in range(layers)]
        v_pools = [torch.zeros_like(t) for t in k_pools]
        args = (feats, pos, slots, fc, hn, kv_weight, kv_bias, kn, inv_freq, 1.0, 1e-6, k_pools, v_pools)
        moved = (n * k_feat * dim + fc.numel() + kv_weight.numel() + 2 * dim + layers * d) * elt
        moved += n * layers * 2 * hkv * d * elt + n * 16
        record(
            "inject_context",
            {"batch": bs, "rows": n, "layers": layers},
            moved,
            lambda a=args: torch.ops.dflash.inject_context(*a),
            lambda a=args: context_kv.inject_context_reference(*a),
        )
    vocab, g = shape.vocab, blk - 1
    for bs in batch_sizes:
        logits = randn(bs, g + 1, vocab)
        drafts = logits[:, :g].float().argmax(-1)
        valid = torch.ones(bs, g, dtype=torch.bool, device=dev)
        gargs = (drafts, logits, valid)
        record(
            "greedy_accept",
            {"batch": bs, "g": g, "vocab": vocab},
            logits.numel() * elt,
            lambda a=gargs: torch.ops.dflash.greedy_accept(*a),
            lambda a=gargs: accept.greedy_accept_reference(*a),
        )
        p = torch.softmax(randn(bs, g + 1, vocab, dt=torch.float32), -1)
        qd = torch.softmax(randn(bs, g, vocab, dt=torch.float32), -1)
        ua = torch.rand(bs, g, device=dev, generator=gen)
        ue = torch.rand(bs, g + 1, device=dev, generator=gen)
        rargs = (drafts, qd, p, ua, ue, valid)
        record(
            "rejection_accept",
            {"batch": bs, "g": g, "vocab": vocab},
            bs * vocab * 4 * 2,
            lambda a=rargs: torch.ops.dflash.rejection_accept(*a),
            lambda a=rargs: accept.rejection_accept_reference(*a),
        )
    return rows


# --- the engine round -------------------------------------------------------------------------------
PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
)


def _engine_rows(args: argparse.Namespace, batch_sizes: list[int]) -> list[dict[str, Any]]:
    import torch

    from dflash_trt.api.llm import LLM, SamplingParams
    from dflash_trt.models.checkpoint import load_drafter_config
    from dflash_trt.models.dflash_config import max_draft_len_for
    from dflash_trt.models.sources import resolve_models

    models = resolve_models(args.target, args.engine_drafter)
    if models.drafter_dir is None:
        raise SystemExit("the engine benchmark needs a drafter (--engine-drafter DIR)")
    block = load_drafter_config(models.drafter_dir).block_size
    spec = {
        "decoding_type": "DFlash",
        "max_draft_len": max_draft_len_for(block),
        "speculative_model": str(models.drafter_dir),
    }
    rows: list[dict[str, Any]] = []
    for use_plugins in (False, True):
        llm = LLM(
            str(models.target_dir),
            speculative_config=spec,
            max_batch_size=max(batch_sizes),
            max_num_tokens=max(2048, max(batch_sizes) * 64),
            max_seq_len=args.max_tokens + 256,
            device="cuda",
            dtype=args.dtype,
            use_plugins=use_plugins,
        )
        runner = llm.engine.runner
        if use_plugins and not llm.engine.parts.backend.plugins:
            llm.shutdown()
            raise SystemExit("the plugin was disabled by its device self-check (see the warning above)")
        per_round: list[tuple[int, float]] = []
        real = runner.decode_round

        def timed(seqs, shape, _real=real, _log=per_round):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _real(seqs, shape)  # ends in the host read-back: the round is complete
            _log.append((len(seqs), time.perf_counter() - t0))
            return out

        runner.decode_round = timed
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
        try:
            llm.generate(
                list(PROMPTS[:2]), SamplingParams(max_tokens=16, ignore_eos=True)
            )  # warm-up, capture
            for bs in batch_sizes:
                llm.generate(
                    [PROMPTS[i % len(PROMPTS)] for i in range(bs)],
                    SamplingParams(max_tokens=8, ignore_eos=True),
                )
                per_round.clear()
                outs: Any = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(bs)], sp)
                full = [t * 1e3 for n, t in per_round if n == bs]
                row = {
                    "use_plugins": use_plugins,
                    "batch": bs,
                    "rounds_at_full_batch": len(full),
                    "round_ms_median": statistics.median(full) if full else float("nan"),
                    "round_ms_mean": statistics.fmean(full) if full else float("nan"),
                    "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                }
                rows.append(row)
                print(f"engine round      {json.dumps(row)}", flush=True)
        finally:
            llm.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench/plugin_kernels.py needs torch (pip install 'dflash-trt[torch,triton]')", file=sys.stderr)
        return EXIT_NO_DEVICE
    if not torch.cuda.is_available():
        print(
            "bench/plugin_kernels.py needs a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). Nothing was measured.",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    from dflash_trt.plugins import triton_installed

    if not triton_installed():
        print(
            "bench/plugin_kernels.py needs OpenAI Triton (pip install 'dflash-trt[triton]')", file=sys.stderr
        )
        return EXIT_NO_DEVICE
    import triton

    dtype = getattr(torch, args.dtype)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    shape = DrafterShape()
    if args.drafter:
        from dflash_trt.models.checkpoint import load_drafter_config

        c = load_drafter_config(args.drafter)
        shape = DrafterShape(
            hidden=c.hidden_size,
            num_target_features=c.num_target_features,
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            vocab=c.vocab_size,
            block=c.block_size,
            sliding_window=c.sliding_window,
            rope_theta=c.rope.theta,
        )
    config = {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "batch_sizes": batch_sizes,
        "contexts": contexts,
        "kernel_shape": asdict(shape),
        "kernel_shape_from": args.drafter or "default (Qwen3-8B-sized)",
        "engine_target": args.target,
        "engine_drafter": args.engine_drafter or f"{args.target}'s default",
        "engine_max_tokens": args.max_tokens,
        "reps": args.reps,
        "date": time.strftime("%Y-%m-%d"),
    }
    print("# dflash plugin benchmark: " + json.dumps(config), flush=True)
    result: dict[str, Any] = {"config": config}
    if not args.skip_kernels:
        bw = copy_bandwidth_gbs(args.reps)
        config["copy_bandwidth_gbs"] = bw
        print(f"# measured copy bandwidth: {bw:.0f} GB/s (2 x 512 MiB per copy)", flush=True)
        result["kernels"] = _kernel_rows(shape, dtype, batch_sizes, contexts, args.reps, bw)
    if not args.skip_engine:
        result["engine"] = _engine_rows(args, batch_sizes)
        before = {r["batch"]: r for r in result["engine"] if not r["use_plugins"]}
        for r in result["engine"]:
            if r["use_plugins"] and r["batch"] in before:
                b = before[r["batch"]]
                print(
                    f"# batch {r['batch']}: round {b['round_ms_median']:.3f} -> {r['round_ms_median']:.3f} ms "
                    f"(median, {b['round_ms_median'] / r['round_ms_median']:.2f}x)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
