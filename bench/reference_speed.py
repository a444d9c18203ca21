# SPDX-License-Identifier: Apache-2.0
"""In-process batch-1 speed: `dflash_trt.LLM` (embedded engine, DFlash) vs the authors' `dflash_generate`.

Both run the SAME weights on the same prompts, one request at a time, greedy, with a fixed number
of new tokens (ours with ignore_eos, theirs with no stop ids), and must produce identical token
ids for every prompt (exit 1 otherwise, unless --allow-mismatch).

  pair       --shape tiny: the packaged trained pair (dflash_trt/assets/tiny), loaded by our engine
             and, for the reference, by transformers (target) and dflash.DFlashDraftModel (drafter,
             our checkpoint's state dict loaded strictly, as tests/test_oracle_parity.py does).
             --shape qwen3-0.3b: a random-weight Qwen3 pair written to a temporary directory
             (dflash_trt/bench/shapes.py).
  prompts    the first N held-out prompts of the tiny pair (dflash_trt.tiny.heldout_prompts),
             tokenized once with the target's tokenizer; both sides get the same ids.
  timing     wall time of each generate call (prefill included), after one warm-up call per side;
             the two sides alternate per prompt (ours first on even prompts, theirs first on odd
             ones) so that drift in machine load hits both. On CUDA every call ends synchronised.
             tok/s = new tokens / summed wall time; ratio = ours / reference.
  threads    torch intra-op threads set explicitly (--threads, default 1) for both sides.

    .venv/bin/python bench/reference_speed.py                          # tiny, 8 prompts x 128, fp32, CPU
    .venv/bin/python bench/reference_speed.py --device cuda --json out.json
    .venv/bin/python bench/reference_speed.py --shape qwen3-0.3b --dtype bfloat16 --prompts 2
    .venv/bin/python bench/reference_speed.py --engine-kwargs '{"enforce_eager": true}'

Needs the oracle extra (PyPI dflash==0.1.0). Exit status: 0 identical, 1 outputs differ or a
runtime error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXIT_MISMATCH = 1
EXIT_USAGE = 2


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="tiny", help="tiny (the packaged trained pair) or qwen3-0.3b (random)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--prompts", type=int, default=8, help="the first N held-out prompts (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the warm-up call per side")
    p.add_argument(
        "--engine-kwargs", default="{}", help="JSON object of extra keyword arguments for dflash_trt.LLM"
    )
    p.add_argument("--seed", type=int, default=0, help="weights seed of random shapes")
    p.add_argument("--allow-mismatch", action="store_true", help="report differing outputs, exit 0")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    try:
        kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as exc:
        p.error(f"--engine-kwargs {args.engine_kwargs!r} is not JSON ({exc}); pass an object, e.g. '{{}}'")
    if not isinstance(kwargs, dict):
        p.error(
            f"--engine-kwargs {args.engine_kwargs!r} is not a JSON object; pass e.g. '{{\"compile\": true}}'"
        )
    args.engine_kwargs = kwargs
    for name in ("prompts", "max_new_tokens", "threads", "warmup_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.shape != "tiny":
        from dflash_trt.bench.shapes import SHAPES

        if args.shape not in SHAPES:
            p.error(f"--shape {args.shape!r} is unknown; use tiny or one of {', '.join(SHAPES)}")
    return args


def _versions() -> dict[str, Any]:
    from importlib import metadata

    import torch
    import transformers

    import dflash_trt

    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dflash": dist("dflash"),
        "dflash_trt": dflash_trt.__version__,
    }


def _loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _machine(device: str, load_at_start: list[float] | None) -> dict[str, Any]:
    import torch

    from dflash_trt.utils.device import cpu_model_name

    out: dict[str, Any] = {
        "hostname": platform.node(),
        "machine": platform.machine(),
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": load_at_start,
        "loadavg_at_end": _loadavg(),
    }
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    return out


def _pair(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path, dict[str, Any]]:
    if args.shape == "tiny":
        from dflash_trt.tiny import ensure_tiny

        paths = ensure_tiny()
        return paths.target, paths.drafter, {"weights": "trained (packaged tiny pair)"}
    from dflash_trt.bench.shapes import get_shape, parameter_count, write_pair

    shape = get_shape(args.shape)
    tdir, ddir = write_pair(shape, workdir, weights="files", dtype=args.dtype, seed=args.seed)
    info = {
        "weights": f"random (seed {args.seed}, std 0.02, written in {args.dtype})",
        "description": shape.description,
        "parameters": parameter_count(shape),
    }
    return tdir, ddir, info


def _reference_models(tdir: Path, ddir: Path, device: str, dtype: Any):
    """The authors' classes on our weights: transformers' target and dflash.DFlashDraftModel."""
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_trt.models.checkpoint import load_drafter

    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=dtype).to(device).eval()
    ours = load_drafter(ddir, dtype=torch.float32)
    drafter = DFlashDraftModel(Qwen3Config(**ours.config.to_hf_config())).eval()
    result = drafter.load_state_dict(ours.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # pragma: no cover - strict raises first
        raise RuntimeError(f"drafter state does not fit dflash.DFlashDraftModel: {result}")
    return target, drafter.to(device=device, dtype=dtype).eval()


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = _loadavg()
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch.cuda.is_available() is False (torch {torch.__version__})")

    import dflash.model as dflash_model

    from dflash_trt import LLM, SamplingParams
    from dflash_trt.models.checkpoint import load_drafter_config
    from dflash_trt.models.dflash_config import max_draft_len_for
    from dflash_trt.models.sources import load_tokenizer
    from dflash_trt.tiny import heldout_prompts

    if args.device == "cpu":
        # dflash times its phases with a CUDA-only clock; on CPU it has nothing to synchronise.
        dflash_model._cuda_time = time.perf_counter

    texts = heldout_prompts()
    if args.prompts > len(texts):
        raise SystemExit(f"--prompts {args.prompts}: only {len(texts)} held-out prompts exist")
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory(prefix="dflash-refspeed-") as tmp:
        tdir, ddir, weights = _pair(args, Path(tmp))
        tokenizer = load_tokenizer(tdir)
        prompts = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts[: args.prompts]]
        block = load_drafter_config(ddir).block_size
        llm = LLM(
            str(tdir),
            speculative_config={
                "decoding_type": "DFlash",
                "max_draft_len": max_draft_len_for(block),
                "speculative_model": str(ddir),
                "max_concurrency": 1,  # the full block every round, as the reference drafts it
            },
            max_batch_size=1,
            max_seq_len=max(map(len, prompts)) + args.max_new_tokens + 2 * block,
            device=args.device,
            dtype=args.dtype,
            cpu_threads=args.threads if args.device == "cpu" else None,
            **args.engine_kwargs,
        )
        try:
            ref_target, ref_drafter = _reference_models(tdir, ddir, args.device, dtype)

            def ours(ids: list[int], n: int) -> tuple[list[int], list[int], float]:
                sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, return_perf_metrics=True)
                sync()
                t0 = time.perf_counter()
                out: Any = llm.generate(ids, sp)
                sync()
                dt = time.perf_counter() - t0
                c = out.outputs[0]
                acc = list(c.request_perf_metrics.speculative_decoding.acceptance_lengths or [])
                return list(c.token_ids), acc, dt

            def theirs(ids: list[int], n: int) -> tuple[list[int], list[int], float]:
                x = torch.tensor([ids], device=dev)
                sync()
                t0 = time.perf_counter()
                r = dflash_model.dflash_generate(ref_drafter, ref_target, x, n, None, return_stats=True)
                sync()
                dt = time.perf_counter() - t0
                return r.output_ids[0, len(ids) :].tolist(), list(r.acceptance_lengths), dt

            ours(prompts[0], args.warmup_tokens)
            theirs(prompts[0], args.warmup_tokens)
            rows = []
            for i, ids in enumerate(prompts):
                order = (("ours", ours), ("reference", theirs))
                res = {}
                for name, fn in order if i % 2 == 0 else order[::-1]:
                    res[name] = fn(ids, args.max_new_tokens)
                (o_ids, o_acc, o_s), (r_ids, r_acc, r_s) = res["ours"], res["reference"]
                first_diff = next((k for k, (a, b) in enumerate(zip(o_ids, r_ids)) if a != b), None)
                if first_diff is None and len(o_ids) != len(r_ids):
                    first_diff = min(len(o_ids), len(r_ids))
                rows.append(
                    {
                        "prompt": i,
                        "prompt_tokens": len(ids),
                        "ours_tokens": len(o_ids),
                        "reference_tokens": len(r_ids),
                        "ours_s": o_s,
                        "reference_s": r_s,
                        "ours_tau": sum(o_acc) / len(o_acc) if o_acc else None,
                        "reference_tau": sum(r_acc) / len(r_acc) if r_acc else None,
                        "identical": first_diff is None,
                        "first_difference_at": first_diff,
                    }
                )
                print(f"prompt {i}: {json.dumps(rows[-1])}", flush=True)
            engine_threads = llm.cpu_threads
        finally:
            llm.shutdown()

    def side(key: str) -> dict[str, Any]:
        tokens = sum(r[f"{key}_tokens"] for r in rows)
        secs = sum(r[f"{key}_s"] for r in rows)
        taus = [r[f"{key}_tau"] for r in rows if r[f"{key}_tau"] is not None]
        return {
            "tokens": tokens,
            "seconds": secs,
            "tokens_per_s": tokens / secs,
            "mean_tau": sum(taus) / len(taus) if taus else None,
        }

    machine = _machine(args.device, load_at_start)
    config = {
        "shape": args.shape,
        **weights,
        "target_dir": str(tdir) if args.shape == "tiny" else "(temporary)",
        "drafter_dir": str(ddir) if args.shape == "tiny" else "(temporary)",
        "block_size": block,
        "device": args.device,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "prompt_source": "dflash_trt.tiny.heldout_prompts()",
        "max_new_tokens": args.max_new_tokens,
        "greedy": True,
        "warmup_tokens": args.warmup_tokens,
        "torch_threads": torch.get_num_threads(),
        "engine_threads": engine_threads,
        "engine_kwargs": args.engine_kwargs,
        "machine": machine,
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    o, r = side("ours"), side("reference")
    return {
        "config": config,
        "ours": o,
        "reference": r,
        "ratio": o["tokens_per_s"] / r["tokens_per_s"],
        "identical": all(row["identical"] for row in rows),
        "mismatched_prompts": [row["prompt"] for row in rows if not row["identical"]],
        "per_prompt": rows,
    }


def format_summary(result: dict[str, Any]) -> str:
    cfg = result["config"]
    o, r = result["ours"], result["reference"]

    def tau(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        "# reference_speed configuration: " + json.dumps(cfg),
        f"# threads: torch {cfg['torch_threads']}, engine {cfg['engine_threads']}; device {cfg['device']}, "
        f"dtype {cfg['dtype']}; {cfg['prompts']} prompts x {cfg['max_new_tokens']} new tokens, batch 1",
        f"{'side':<28} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'tau':>5}",
        f"{'dflash_trt.LLM (ours)':<28} {o['tokens']:>7} {o['seconds']:>8.2f} {o['tokens_per_s']:>8.1f} "
        f"{tau(o['mean_tau']):>5}",
        f"{'dflash.dflash_generate':<28} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.1f} "
        f"{tau(r['mean_tau']):>5}",
        f"ratio ours / reference: {result['ratio']:.2f}x; outputs identical: "
        + ("yes" if result["identical"] else f"NO (prompts {result['mismatched_prompts']})"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only; never reach the Hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import dflash.model  # noqa: F401
    except ImportError:
        print(
            "bench/reference_speed.py needs the authors' package: pip install dflash==0.1.0 "
            "(the oracle extra)",
            file=sys.stderr,
        )
        return EXIT_MISMATCH
    from dflash_trt.errors import DFlashTrtError

    try:
        result = run(args)
    except (DFlashTrtError, TypeError) as exc:  # the engine's one-line errors (TypeError: LLM(**kwargs))
        print(f"bench/reference_speed.py: {exc}", file=sys.stderr)
        return EXIT_MISMATCH
    print(format_summary(result), flush=True)
    if args.json:
        tmp = Path(args.json).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.json)
    return 0 if result["identical"] or args.allow_mismatch else EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
