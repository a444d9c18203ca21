# SPDX-License-Identifier: Apache-2.0
"""Is the client the bottleneck? Drive N concurrent streams against the scripted server.

The scripted server runs in its own process with a known schedule (first chunk at --ttft, then
one chunk of --tokens-per-chunk tokens every --chunk-gap), so every latency the harness should
measure is known. The script reports the client's CPU cost per output token and per chunk, its
event-loop lag, the achieved vs intended concurrency (and the server's peak in-flight count),
and how far measured TTFT/TPOT drift from the schedule: a client that keeps up measures the
schedule; one that does not inflates TPOT and lowers the achieved concurrency. The scripted server
is the test double `tests/bench/scripted_server.py` (not in the wheel): run this from a checkout.

    .venv/bin/python bench/client_overhead.py --streams 256 --protocol triton-http
    .venv/bin/python bench/client_overhead.py --streams 512 --protocol triton-grpc --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """The scripted server (a test double in tests/bench/, not in the wheel) in its own process."""
    cmd = [
        sys.executable, "-m", "tests.bench.scripted_server",
        "--port", "0",
        "--grpc-port", "0" if args.protocol == "triton-grpc" else "-1",
        "--ttft", str(args.ttft),
        "--chunk-gap", str(args.chunk_gap),
        "--tokens-per-chunk", str(args.tokens_per_chunk),
        "--start-together", str(args.start_together),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise SystemExit("the scripted server did not start")
    return proc, json.loads(line)


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (Linux /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256, help="concurrent streams (closed loop)")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument(
        "--protocol",
        default="triton-http",
        choices=["triton-http", "triton-grpc", "openai-completions", "openai-chat"],
    )
    ap.add_argument("--isl", type=int, default=32)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--ttft", type=float, default=0.05)
    ap.add_argument("--chunk-gap", type=float, default=0.05)
    ap.add_argument("--tokens-per-chunk", type=int, default=4)
    ap.add_argument(
        "--start-together",
        type=int,
        default=0,
        help="the server holds every schedule until this many requests are in (tests: a full wave)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    from dflash_trt.bench.sweep import SweepConfig, run_sweep
    from dflash_trt.tiny import build_byte_tokenizer

    proc, urls = _start_server(args)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tok_dir = Path(tmp) / "tokenizer"
            tok = build_byte_tokenizer()
            if args.protocol == "openai-chat":
                tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            tok.save_pretrained(tok_dir)
            url = urls["grpc_url"] if args.protocol == "triton-grpc" else urls["http_url"]
            cfg = SweepConfig(
                url=url,
                out=str(Path(tmp) / "run"),
                protocol=args.protocol,
                concurrency=(args.streams,),
                num_requests=args.streams * args.requests_per_stream,
                warmup=args.streams,
                isl=args.isl,
                osl=args.osl,
                tokenizer=str(tok_dir),
                label="client-overhead",
            )
            t0, srv0 = time.perf_counter(), _cpu_seconds(proc.pid)
            summary = run_sweep(cfg, overwrite=True)
            wall, srv1 = time.perf_counter() - t0, _cpu_seconds(proc.pid)
        with urllib.request.urlopen(urls["http_url"] + "/scripted/stats", timeout=10) as resp:
            stats = json.loads(resp.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    p = summary["points"][0]
    n_later = -(-(args.osl - 1) // args.tokens_per_chunk)  # chunks after the first
    expected_tpot = n_later * args.chunk_gap / (args.osl - 1)
    result: dict[str, object] = {
        "config": {
            "streams": args.streams,
            "requests": args.streams * args.requests_per_stream,
            "warmup_requests": args.streams,
            "protocol": args.protocol,
            "isl": args.isl,
            "osl": args.osl,
            "ttft_s": args.ttft,
            "chunk_gap_s": args.chunk_gap,
            "tokens_per_chunk": args.tokens_per_chunk,
            "start_together": args.start_together,
        },
        "environment": {
            "date": datetime.now(timezone.utc).date().isoformat(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "aiohttp": metadata.version("aiohttp"),
            "grpcio": metadata.version("grpcio"),
            "note": "client and scripted server (one Python process) share this machine",
        },
        "num_errors": p["num_errors"],
        "intended_concurrency": args.streams,
        "achieved_concurrency": p["achieved_concurrency"],
        "server_peak_in_flight": stats["peak_active"],
        "output_tokens_per_s": p["output_tokens_per_s"],
        "chunks_per_s": p["num_chunks"] / p["duration_s"] if p["duration_s"] else None,
        "client_cpu_util": p["client_cpu_util"],
        "client_cpu_us_per_output_token": p["client_cpu_us_per_output_token"],
        "client_cpu_us_per_chunk": p["client_cpu_us_per_chunk"],
        "client_loop_lag_p99_ms": p["client_loop_lag_p99_ms"],
        "ttft_expected_s": args.ttft,
        "ttft_p50_s": p["ttft_p50_s"],
        "ttft_p99_s": p["ttft_p99_s"],
        "tokens_per_chunk_hist": p["tokens_per_chunk_hist"],
        "output_tokens_total": p["output_tokens_total"],
        "tpot_expected_s": expected_tpot,
        "tpot_p50_s": p["tpot_p50_s"],
        "tpot_p99_s": p["tpot_p99_s"],
        "tpot_p50_inflation_pct": 100.0 * (p["tpot_p50_s"] / expected_tpot - 1.0)
        if p["tpot_p50_s"]
        else None,
        "server_ttft_p50_s": p["server_ttft_p50_s"],
        "server_cpu_util": (srv1 - srv0) / wall if srv0 is not None and srv1 is not None else None,
        "wall_s": wall,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        c = result["config"]
        print(f"client overhead: {c}")
        for k, v in result.items():
            if k not in ("config",):
                print(f"  {k:34s} {v:.4g}" if isinstance(v, float) else f"  {k:34s} {v}")
    return result


if __name__ == "__main__":
    main()
