# SPDX-License-Identifier: Apache-2.0
"""Serving soak: a real `dflash-trt serve` on a bundle (default: `tiny`, built into a temp dir),
loopback only. Prints its configuration and, per phase, requests, errors, mismatches and the
Python stub's RSS before/after; ends with a JSON summary (also written with --out).

    .venv/bin/python bench/soak_serving.py --requests 400 --concurrency 64 --rounds 3 \\
        --sigterm-streams 48 --sigterm-tokens 2000 --out bench/results/soak/tiny-cpu.json

Phases:
  load       `rounds` x `requests` greedy requests at `concurrency`, alternating HTTP SSE and gRPC
             streams over `prompts` distinct prompts; every final text is compared with that
             prompt's single-request reference (mismatch = any difference)
  abandon    25 HTTP streams closed mid-way and 25 gRPC streams cancelled, mixed with 50 normal
             requests; then the seconds until active/queued/KV are back to 0
  huge       a 20 MB prompt: seconds to its refusal, and the latency of a normal request sent
             meanwhile against an idle one
  sigterm    `sigterm_streams` HTTP streams of `sigterm_tokens` tokens; SIGTERM 1 s after all of them
             have reached the model (generating or queued); how every
             stream ended (complete / explicit abort error / refused with an error status before it
             reached the model / cut without a final event), serve's exit code and seconds to
             exit, with --drain-timeout
  keepalive  a fresh serve, one request on a keep-alive HTTP connection left open, SIGTERM: exit code
             and seconds to exit
  kill       a fresh serve, one HTTP and one gRPC stream in flight, `kill -9` of the Python stub:
             seconds until each client has its error, and until serve exits (and its code)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from proc_tools import free_ports

GEN = "/v2/models/tensorrt_llm/generate"


class Serve:
    def __init__(self, bundle: Path, drain: float) -> None:
        self.http, self.grpc, self.metrics = free_ports(3)
        cmd = [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(bundle), "--quiet",
               "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
               "--drain-timeout", str(drain)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.http}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("serve was not ready after 300 s")
            time.sleep(0.3)

    def stub_pid(self) -> int:
        for p in os.listdir("/proc"):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes()
                ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
                parent_of_parent = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if b"triton_python_backend_stub" in cmd and parent_of_parent == self.proc.pid:
                return int(p)
        raise SystemExit("no Python stub found under serve")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.stub_pid()}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
        return 0.0

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10).text
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def http_stream(url: str, prompt: str, n: int, *, stop_after: int | None = None) -> tuple[str, dict | str]:
    """('ok'|'error'|'refused'|'cut'|'closed', last event or exception text)."""
    body = {"text_input": prompt, "sampling_param_max_tokens": n, "sampling_param_ignore_eos": True,
            "streaming": True, "return_finish_reason": True}  # fmt: skip
    last: dict | None = None
    count = 0
    try:
        with httpx.stream("POST", url + GEN + "_stream", json=body, timeout=600) as r:
            # An SSE stream whose first response is an error comes with HTTP 400 (Triton's choice)
            # and that error as its one event; a refusal before the model has a plain JSON body.
            other: list[str] = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    last = json.loads(line[5:])
                    count += 1
                    if stop_after is not None and count >= stop_after:
                        return "closed", last
                elif line.strip():
                    other.append(line)
            if last is None and r.status_code != 200:
                return "refused", f"HTTP {r.status_code} " + " ".join(other)[:160]
    except httpx.HTTPError as exc:
        return "cut", repr(exc)
    if last is None:
        return "cut", "no event"
    if "error" in last:
        return "error", last
    return ("ok" if last.get("finish_reason") not in (None, "None") else "cut"), last


def grpc_stream(addr: str, prompt: str, n: int, *, cancel_after: int | None = None) -> tuple[str, str]:
    import tritonclient.grpc as grpcclient

    items: list = []
    done = threading.Event()

    def callback(result, error):
        items.append((result, error))
        final = error is not None or result.get_response().parameters.get("triton_final_response").bool_param
        if final or (cancel_after is not None and len(items) >= cancel_after):
            done.set()

    client = grpcclient.InferenceServerClient(addr)
    client.start_stream(callback=callback)
    tensors = []
    for name, value, dtype, triton in (("text_input", prompt.encode(), np.object_, "BYTES"),
                                       ("sampling_param_max_tokens", n, np.int32, "INT32"),
                                       ("sampling_param_ignore_eos", True, np.bool_, "BOOL"),
                                       ("streaming", True, np.bool_, "BOOL")):  # fmt: skip
        t = grpcclient.InferInput(name, [1], triton)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        tensors.append(t)
    client.async_stream_infer("tensorrt_llm", tensors, enable_empty_final_response=True)
    ok = done.wait(600)
    client.stop_stream(cancel_requests=cancel_after is not None)
    client.close()
    if cancel_after is not None:
        return "closed", ""
    if not ok:
        return "cut", "timeout"
    err = next((str(e) for _, e in items if e is not None), None)
    if err:
        return "error", err
    texts = [
        r.as_numpy("text_output") for r, e in items if e is None and r.as_numpy("text_output") is not None
    ]
    return "ok", texts[-1][0].decode() if texts else ""


def phase_load(s: Serve, args) -> dict:
    prompts = [f"def task_{i}(values):\n    " for i in range(args.prompts)]
    refs = {}
    for p in prompts:
        r = httpx.post(s.url + GEN, json={"text_input": p, "sampling_param_max_tokens": args.max_tokens,
                                          "sampling_param_ignore_eos": True}, timeout=120)  # fmt: skip
        refs[p] = r.json()["text_output"]
    rounds = []
    for k in range(args.rounds):
        rss0 = s.rss_mb()
        errors, mismatches = 0, 0
        t0 = time.monotonic()

        def one(i: int) -> tuple[str, str]:
            p = prompts[i % len(prompts)]
            if i % 2:
                status, last = http_stream(s.url, p, args.max_tokens)
                text = last.get("text_output", "") if isinstance(last, dict) else ""
            else:
                status, text = grpc_stream(f"127.0.0.1:{s.grpc}", p, args.max_tokens)
            return status, p if status != "ok" else ("" if text == refs[p] else p)

        with ThreadPoolExecutor(args.concurrency) as pool:
            for status, bad in pool.map(one, range(args.requests)):
                errors += status != "ok"
                mismatches += status == "ok" and bool(bad)
        time.sleep(0.5)
        rounds.append({"round": k + 1, "requests": args.requests, "errors": errors, "mismatches": mismatches,
                       "seconds": round(time.monotonic() - t0, 1), "rss_mb_before": rss0, "rss_mb_after": s.rss_mb()})  # fmt: skip
        print(f"load round {k + 1}: {rounds[-1]}", flush=True)
    return {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
        "rounds": rounds,
    }


def phase_abandon(s: Serve) -> dict:
    jobs = ([("http-reset", i) for i in range(25)] + [("grpc-cancel", i) for i in range(25)]
            + [("normal", i) for i in range(50)])  # fmt: skip
    errors = 0

    def one(job) -> bool:
        kind, i = job
        if kind == "http-reset":
            return http_stream(s.url, f"a{i} = ", 1500, stop_after=2)[0] == "closed"
        if kind == "grpc-cancel":
            return grpc_stream(f"127.0.0.1:{s.grpc}", f"b{i} = ", 1500, cancel_after=2)[0] == "closed"
        return http_stream(s.url, f"c{i} = ", 16)[0] == "ok"

    with ThreadPoolExecutor(32) as pool:
        errors = sum(not ok for ok in pool.map(one, jobs))
    t0 = time.monotonic()
    names = ("dflash_requests_active", "dflash_requests_queued", "dflash_kv_cache_utilization")
    while any(s.metric(m) for m in names) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    out = {"requests": len(jobs), "errors": errors, "idle_after_s": round(time.monotonic() - t0, 2),
           "idle": not any(s.metric(m) for m in names)}  # fmt: skip
    print(f"abandon: {out}", flush=True)
    return out


def phase_huge(s: Serve) -> dict:
    small = {"text_input": "def g():", "sampling_param_max_tokens": 4}
    idle = []
    for _ in range(3):
        t0 = time.monotonic()
        httpx.post(s.url + GEN, json=small, timeout=60)
        idle.append(time.monotonic() - t0)
    rss0 = s.rss_mb()
    res: dict = {}

    # encoded up front: building 20 MB of JSON in this process would hold the GIL and delay our own
    # "normal" client, not the server
    payload = json.dumps({"text_input": "x" * (20 * 1024 * 1024), "sampling_param_max_tokens": 4}).encode()

    def big():
        t0 = time.monotonic()
        r = httpx.post(
            s.url + GEN, content=payload, headers={"content-type": "application/json"}, timeout=300
        )
        res.update(status=r.status_code, seconds=time.monotonic() - t0, error=r.json().get("error", "")[:120])

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    normal = httpx.post(s.url + GEN, json=small, timeout=60)
    normal_s = time.monotonic() - t0
    t.join()
    time.sleep(0.5)
    out = {"refused_status": res["status"], "refused_s": round(res["seconds"], 3), "error": res["error"],
           "normal_status": normal.status_code, "normal_s": round(normal_s, 3), "idle_normal_s": round(min(idle), 3),
           "rss_mb_before": rss0, "rss_mb_after": s.rss_mb()}  # fmt: skip
    print(f"huge: {out}", flush=True)
    return out


def phase_sigterm(s: Serve, args) -> dict:
    results: list = [None] * args.sigterm_streams

    def one(i: int) -> None:
        results[i] = http_stream(s.url, f"s{i} = ", args.sigterm_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sigterm_streams)]
    for t in threads:
        t.start()
    # every stream in the model first (generating or queued): starting this many client threads can
    # take over a second on a busy machine, and a request sent after SIGTERM is refused, not drained
    deadline = time.monotonic() + 60
    while s.metric("dflash_requests_active") + s.metric("dflash_requests_queued") < args.sigterm_streams:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(1.0)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(args.drain_timeout + 120)
    _, err = s.proc.communicate(timeout=args.drain_timeout + 120)
    exit_s = time.monotonic() - t0
    kinds = {"complete": 0, "aborted": 0, "refused": 0, "other_error": 0, "cut": 0}
    refusals: set[str] = set()
    for status, last in results:
        if status == "ok":
            kinds["complete"] += 1
        elif status == "refused":
            kinds["refused"] += 1
            refusals.add(str(last)[:120])
        elif status == "error" and "aborted: the server shut down" in str(last):
            kinds["aborted"] += 1
        elif status == "error":
            kinds["other_error"] += 1
        else:
            kinds["cut"] += 1
    out = {"streams": args.sigterm_streams, "tokens": args.sigterm_tokens, "drain_timeout": args.drain_timeout,
           **kinds, "refusals": sorted(refusals), "serve_exit_code": s.proc.returncode, "exit_s": round(exit_s, 1),
           "serve_said": [ln for ln in err.splitlines() if ln.startswith("stopped")]}  # fmt: skip
    print(f"sigterm: {out}", flush=True)
    return out


def phase_keepalive(bundle: Path, args) -> dict:
    s = Serve(bundle, args.drain_timeout)
    with httpx.Client() as client:
        ok = (
            client.post(s.url + GEN, json={"text_input": "a", "sampling_param_max_tokens": 2}).status_code
            == 200
        )
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        _, err = s.proc.communicate(timeout=60)
        exit_s = time.monotonic() - t0
    out = {"request_ok": ok, "serve_exit_code": s.proc.returncode, "exit_s": round(exit_s, 2),
           "serve_said": [ln for ln in err.splitlines() if ln.startswith("stopped")]}  # fmt: skip
    print(f"keepalive: {out}", flush=True)
    return out


def phase_kill(bundle: Path, args) -> dict:
    s = Serve(bundle, args.drain_timeout)
    ended: dict[str, float] = {}
    status: dict[str, str] = {}
    started = {"http": threading.Event(), "grpc": threading.Event()}

    def http_client() -> None:
        body = {"text_input": "def f():", "sampling_param_max_tokens": 2000, "sampling_param_ignore_eos": True,
                "streaming": True}  # fmt: skip
        try:
            with httpx.stream("POST", s.url + GEN + "_stream", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        started["http"].set()
            status["http"] = "completed (the stream ended normally)"
        except httpx.HTTPError as exc:
            status["http"] = repr(exc)[:120]
        ended["http"] = time.monotonic()

    def grpc_client() -> None:
        import tritonclient.grpc as grpcclient

        done = threading.Event()

        def callback(result, error):
            started["grpc"].set()
            if error is not None:
                status["grpc"] = str(error)[:120]
                done.set()
            elif result.get_response().parameters.get("triton_final_response").bool_param:
                status["grpc"] = "completed"
                done.set()

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc}")
        client.start_stream(callback=callback)
        tensors = []
        for name, value, dtype, triton in (("text_input", b"def g():", np.object_, "BYTES"),
                                           ("sampling_param_max_tokens", 2000, np.int32, "INT32"),
                                           ("sampling_param_ignore_eos", True, np.bool_, "BOOL"),
                                           ("streaming", True, np.bool_, "BOOL")):  # fmt: skip
            t = grpcclient.InferInput(name, [1], triton)
            t.set_data_from_numpy(np.array([value], dtype=dtype))
            tensors.append(t)
        client.async_stream_infer("tensorrt_llm", tensors, enable_empty_final_response=True)
        done.wait(120)
        ended["grpc"] = time.monotonic()
        client.close()

    threads = [threading.Thread(target=grpc_client), threading.Thread(target=http_client)]
    threads[0].start()
    started["grpc"].wait(60)
    threads[1].start()
    started["http"].wait(60)
    stub = s.stub_pid()
    t0 = time.monotonic()
    os.kill(stub, signal.SIGKILL)
    for t in threads:
        t.join(120)
    _, err = s.proc.communicate(timeout=60)
    exit_s = time.monotonic() - t0
    out = {"http_error_s": round(ended["http"] - t0, 3), "http": status.get("http"),
           "grpc_error_s": round(ended["grpc"] - t0, 3), "grpc": status.get("grpc"),
           "serve_exit_code": s.proc.returncode, "serve_exit_s": round(exit_s, 2),
           "serve_said": [ln for ln in err.splitlines() if ln.startswith(("Error", "warning"))]}  # fmt: skip
    print(f"kill: {out}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, help="a built bundle (default: build `tiny` into a temp dir)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--drain-timeout", type=float, default=30)
    ap.add_argument("--sigterm-streams", type=int, default=48)
    ap.add_argument("--sigterm-tokens", type=int, default=2000)
    ap.add_argument(
        "--skip", default="", help="comma-separated phases to skip: load,abandon,huge,sigterm,keepalive,kill"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tmp = tempfile.TemporaryDirectory(prefix="dflash-soak-")
    bundle = args.bundle
    if bundle is None:
        bundle = Path(tmp.name) / "tiny"
        subprocess.run([sys.executable, "-m", "dflash_trt", "build", "--target", "tiny", "--output", str(bundle)],
                       check=True, capture_output=True)  # fmt: skip
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config.update(bundle=str(bundle), python=platform.python_version(), cpus=os.cpu_count(),
                  machine=platform.machine(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
    print(f"config: {json.dumps(config)}", flush=True)
    summary: dict = {"config": config}
    s = Serve(bundle, args.drain_timeout)
    try:
        if "load" not in skip:
            summary["load"] = phase_load(s, args)
        if "abandon" not in skip:
            summary["abandon"] = phase_abandon(s)
        if "huge" not in skip:
            summary["huge"] = phase_huge(s)
        if "sigterm" not in skip:
            summary["sigterm"] = phase_sigterm(s, args)
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            s.proc.communicate(timeout=args.drain_timeout + 60)
    try:
        if "keepalive" not in skip:
            summary["keepalive"] = phase_keepalive(bundle, args)
        if "kill" not in skip:
            summary["kill"] = phase_kill(bundle, args)
    finally:
        tmp.cleanup()
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
