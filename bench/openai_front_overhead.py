# SPDX-License-Identifier: Apache-2.0
"""What the OpenAI-compatible front costs: the same workload against one `dflash-trt serve
--openai-port` over Triton gRPC direct, OpenAI completions and OpenAI chat, at fixed concurrencies.

    .venv/bin/python bench/openai_front_overhead.py --concurrency 1,8 --requests 32 --osl 64 --reps 3

Every protocol gets the same chat-templated prompts (bench/datasets/tiny-python-heldout.jsonl), so
the same tokens reach the engine; protocols are interleaved within each repetition so that drift of
a shared machine hits all of them alike. Reported per protocol and concurrency: medians over the
repetitions of TTFT p50, TPOT p50, output tokens/s and tau, the spread (min-max) of TPOT p50, and
the front's own CPU time per request (CPU seconds of the serve process over the point, warm-up
included; it holds only the front and an idle main thread: tritonserver is a child process, so the
gRPC rows show that idle baseline). Prints its configuration next to its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proc_tools import cpu_seconds, free_ports

REPO = Path(__file__).resolve().parents[1]
PROTOCOLS = ("triton-grpc", "openai-completions", "openai-chat")


def _one(protocol, c, rep, args, serve_pid, grpc, oai, name, bundle, tmp) -> dict:
    """One point; the serve process's CPU time over it is the front's (tritonserver is a child)."""
    from dflash_trt.bench.sweep import SweepConfig, run_sweep

    grpc_side = protocol == "triton-grpc"
    before = cpu_seconds(serve_pid)
    summary = run_sweep(
        SweepConfig(
            url=f"127.0.0.1:{grpc}" if grpc_side else f"http://127.0.0.1:{oai}",
            out=str(tmp / f"{protocol}-c{c}-{rep}"),
            protocol=protocol,
            model="tensorrt_llm" if grpc_side else name,
            concurrency=(c,),
            num_requests=args.requests,
            warmup=args.warmup,
            dataset=str(REPO / "bench" / "datasets" / "tiny-python-heldout.jsonl"),
            tokenizer=str(bundle / "engine" / "checkpoints" / "target"),
            chat=True,
            osl=args.osl,
            request_timeout_s=300,
        )
    )
    front_cpu = cpu_seconds(serve_pid) - before
    (p,) = summary["points"]
    return {
        "rep": rep, "protocol": protocol, "concurrency": c,
        "ttft_p50_ms": p["ttft_p50_s"] * 1e3, "tpot_p50_ms": p["tpot_p50_s"] * 1e3,
        "output_tok_s": p["output_tokens_per_s"], "tau": p["mean_acceptance_length"],
        "errors": p["num_errors"], "front_cpu_ms_per_request": front_cpu / (args.requests + args.warmup) * 1e3,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, help="bundle directory [default: build tiny into a temp dir]")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the raw per-run numbers here")
    args = ap.parse_args()
    concurrency = tuple(int(c) for c in args.concurrency.split(","))

    import httpx

    from dflash_trt import __version__

    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            bundle = Path(tmp) / "tiny"
            subprocess.run([sys.executable, "-m", "dflash_trt", "build", "--target", "tiny", "--output", str(bundle)],
                           check=True, capture_output=True)  # fmt: skip
        name = json.loads((bundle / "manifest.json").read_text())["name"]
        http, grpc, metrics, oai = free_ports(4)
        serve = subprocess.Popen(
            [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(bundle), "--http-port", str(http),
             "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(oai), "--quiet"],
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{oai}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or serve.poll() is not None:
                    raise SystemExit("the server did not become ready")
                time.sleep(0.5)
            runs = []
            for rep in range(args.reps):
                order = PROTOCOLS[rep % 3 :] + PROTOCOLS[: rep % 3]  # rotate: no protocol always goes first
                for protocol in order:
                    for c in concurrency:
                        runs.append(
                            _one(protocol, c, rep, args, serve.pid, grpc, oai, name, bundle, Path(tmp))
                        )
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(120)

    print(f"dflash-trt {__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs; bundle {name}; {args.reps} reps x {args.requests} requests (+{args.warmup} warm-up)"
          f" of {args.osl} tokens (ignore_eos, greedy), chat-templated held-out prompts")  # fmt: skip
    print(
        "| c | protocol | TTFT p50 ms | TPOT p50 ms (min-max) | output tok/s | tau | front CPU ms/req | errors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in concurrency:
        for protocol in PROTOCOLS:
            rs = [r for r in runs if r["protocol"] == protocol and r["concurrency"] == c]

            def med(k: str, rs: list[dict] = rs) -> float:
                return statistics.median(r[k] for r in rs)

            tpots = [r["tpot_p50_ms"] for r in rs]
            cpu = f"{med('front_cpu_ms_per_request'):.2f}"
            print(f"| {c} | {protocol} | {med('ttft_p50_ms'):.1f} | {med('tpot_p50_ms'):.2f} ({min(tpots):.2f}-"
                  f"{max(tpots):.2f}) | {med('output_tok_s'):.0f} | {med('tau'):.3f} | {cpu} | "
                  f"{sum(r['errors'] for r in rs)} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
