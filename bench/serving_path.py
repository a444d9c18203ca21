# SPDX-License-Identifier: Apache-2.0
"""What the serving path in front of the engine costs: CPU per output token of every process on it.

A `tiny` bundle served by `dflash-trt serve --eager --openai-port` with the stand-in engine
(`DFLASH_TRT_TESTING=1 DFLASH_TRT_STAND_IN=K:MS:MODE`, engine/stand_in.py): every round emits K tokens
per request and takes MS ms on a simulated device, with no model cost (`--rounds overlap`, the default:
the engine launches each round before it commits the last, as TensorRT-LLM's overlap scheduler does;
`--rounds serial`: the host's work after each round adds to its MS ms), so what the processes spend is the path's own work: the
engine's scheduler, stop rules and detokenizer, the engine process's pipe, the Triton Python stub,
tritonserver, the OpenAI front (a thread of the serve process) and the client (this process, the
asyncio clients of `dflash-trt bench`). For each K, each protocol (Triton HTTP generate_stream, Triton
gRPC streaming, OpenAI /v1/completions SSE) and each concurrency C: C closed-loop streams of --osl
tokens each run for --warmup s, then for --duration s the script counts the tokens the client received
and reads every process's utime + stime from /proc/<pid>/stat before and after; then the streams are
cut off and the server drained before the next phase.

    .venv/bin/python bench/serving_path.py                    # C = 16,64,256; K = 1,8; three protocols
    .venv/bin/python bench/serving_path.py --concurrency 16,64 --out result.json

The stub and the engine process import the dflash_trt installed in this interpreter (the Python
backend ignores PYTHONPATH): the script checks that the served engine is the stand-in before it
measures anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from proc_tools import cpu_seconds, free_ports
from script_args import positive_ints

REPO = Path(__file__).resolve().parents[1]
PROTOCOLS = ("triton-http", "triton-grpc", "openai-completions")
ROLES = ("tritonserver", "stub", "engine", "serve", "client")  # serve: the serve process, the OpenAI front's
PROMPT = "import os\nimport sys\n\ndef main(argv):\n    "  # byte-level tiny: one token per character


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="16,64,256", help="streams in flight, comma-separated")
    p.add_argument(
        "--tokens-per-round", default="1,8", help="K: tokens per request per round, comma-separated"
    )
    p.add_argument("--round-ms", type=float, default=10.0, help="how long a stand-in round takes")
    p.add_argument("--rounds", choices=("overlap", "serial"), default="overlap",
                   help="overlap: each round launched before the last is committed (TensorRT-LLM's default); "
                        "serial: one after the other")  # fmt: skip
    p.add_argument(
        "--protocols", default=",".join(PROTOCOLS), help="comma-separated, of " + ", ".join(PROTOCOLS)
    )
    p.add_argument("--osl", type=int, default=256, help="output tokens per request")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each measured phase")
    p.add_argument("--duration", type=float, default=10.0, help="seconds each measured phase lasts")
    p.add_argument(
        "--bundle", type=Path, help="a tiny bundle to serve (default: built in a temporary directory)"
    )
    p.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = p.parse_args(argv)
    args.concurrency = positive_ints(p, "--concurrency", args.concurrency)
    args.tokens_per_round = positive_ints(p, "--tokens-per-round", args.tokens_per_round)
    args.protocols = [x.strip() for x in args.protocols.split(",") if x.strip()]
    bad = [x for x in args.protocols if x not in PROTOCOLS]
    if bad or not args.protocols:
        p.error(f"--protocols {','.join(bad) or repr('')}: pick from {', '.join(PROTOCOLS)}")
    if args.osl < 2 or args.duration <= 0 or args.warmup < 0 or args.round_ms < 0:
        p.error("--osl must be >= 2, --duration > 0, --warmup and --round-ms >= 0")
    return args


# --- processes --------------------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_roles(serve_pid: int) -> dict[str, int]:
    """The serving processes under `serve_pid` by role, and this process as the client."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = {serve_pid}, [serve_pid]
    while frontier:
        kids = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in tree]
        tree.update(kids)
        frontier = kids
    roles = {"serve": serve_pid, "client": os.getpid()}
    for pid in tree - {serve_pid}:
        cmd = _cmdline(pid)
        if "triton_python_backend_stub" in cmd:
            roles["stub"] = pid
        elif "dflash_trt.api.process" in cmd:
            roles["engine"] = pid
        elif cmd.split(" ", 1)[0].endswith("tritonserver"):
            roles["tritonserver"] = pid
    missing = [r for r in ROLES if r not in roles]
    if missing:
        raise SystemExit(
            f"serve (pid {serve_pid}) has no {', '.join(missing)} process: is it a torch bundle?"
        )
    return roles


@dataclass
class Server:
    proc: subprocess.Popen[str]
    http: str
    grpc: str
    openai: str
    metrics: str

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def serve(bundle: Path, k: int, round_ms: float, rounds: str) -> Server:
    """`dflash-trt serve --eager --openai-port` on free ports with the stand-in, once ready."""
    http, grpc, metrics, oai = free_ports(4)
    env = {**os.environ, "DFLASH_TRT_TESTING": "1", "DFLASH_TRT_STAND_IN": f"{k}:{round_ms:g}:{rounds}"}
    cmd = [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(bundle), "--eager", "--quiet",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--openai-port", str(oai)]  # fmt: skip
    srv = Server(subprocess.Popen(cmd, env=env, text=True), f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                 f"http://127.0.0.1:{oai}", f"http://127.0.0.1:{metrics}/metrics")  # fmt: skip
    deadline = time.monotonic() + 300
    while _get(srv.http + "/v2/health/ready")[0] != 200 or _get(srv.openai + "/health")[0] != 200:
        if srv.proc.poll() is not None or time.monotonic() > deadline:
            srv.proc.kill()
            raise SystemExit(f"serve --bundle {bundle} did not become ready (exit {srv.proc.poll()})")
        time.sleep(0.5)
    return srv


def metric(srv: Server, name: str, text: str | None = None) -> float:
    """A counter or gauge of the model's metrics (from `text`, a metrics page, or fetched), summed over
    its label sets."""
    text = _get(srv.metrics)[1] if text is None else text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip


def wait_idle(srv: Server, timeout: float = 120) -> None:
    """Until the engine holds no request (the cut-off streams are aborted)."""
    deadline = time.monotonic() + timeout
    while metric(srv, "dflash_requests_active") + metric(srv, "dflash_requests_queued") > 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"the engine still holds requests {timeout:g} s after a phase ended")
        time.sleep(0.2)


def check_stand_in(srv: Server, k: int) -> None:
    """One streamed request: the served engine must be the stand-in (K tokens per round, all accepted)."""
    n = 1 + 3 * k
    body = {"text_input": PROMPT, "sampling_param_max_tokens": n, "sampling_param_ignore_eos": True,
            "streaming": True, "sampling_param_return_perf_metrics": True}  # fmt: skip
    req = urllib.request.Request(
        srv.http + "/v2/models/tensorrt_llm/generate_stream", json.dumps(body).encode()
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
    counts = [e["num_output_tokens"] for e in events]
    tau = events[-1]["mean_acceptance_length"]
    if counts[-1] != n or any(c % k != 1 % k for c in counts) or abs(tau - k) > 1e-6:
        raise SystemExit(
            f"the served engine is not the stand-in (token counts {counts}, mean acceptance length {tau:g}, "
            f"want {k}): the Triton stub imports the dflash_trt installed in {sys.executable}'s environment; "
            "run this with a Python whose dflash_trt is this checkout (pip install -e .)"
        )


def engine_root(pid: int) -> str:
    """The package root the engine process runs from (utils/child.py puts it first on its path)."""
    cmd = _cmdline(pid)
    start = cmd.find("sys.path[0] = ")
    return cmd[start + len("sys.path[0] = ") :].split(";", 1)[0].strip("'\"") if start >= 0 else "?"


# --- the load -----------------------------------------------------------------------------------------
def _count_at(raw: Any, t: float) -> int:
    """The output tokens a request had received at time t (the server's cumulative counts)."""
    got = 0
    for at, count in zip(raw.times, raw.counts):
        if at > t:
            break
        if count is not None:
            got = count
    return got


def _snapshot(roles: dict[str, int], srv: Server) -> dict[str, Any]:
    page = _get(srv.metrics)[1]
    return {"t": time.perf_counter(), "cpu": {r: cpu_seconds(pid) for r, pid in roles.items()},
            "engine_tokens": metric(srv, "dflash_output_tokens_total", page),
            "request_rounds": metric(srv, "dflash_rounds_total", page),
            "engine_rounds": metric(srv, "dflash_round_duration_seconds_count", page)}  # fmt: skip


def _latencies(raws: list[Any], t0: float, t1: float) -> dict[str, float | None]:
    """Medians over the requests sent and finished inside the window: time to the first response,
    and from sending to the final one."""
    done = [r for r in raws if r.error is None and r.times and t0 <= r.send_t and r.done_t is not None
            and r.done_t <= t1]  # fmt: skip
    ttft = sorted(r.times[0] - r.send_t for r in done)
    whole = sorted(r.done_t - r.send_t for r in done)
    return {"ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
            "request_p50_s": whole[len(whole) // 2] if whole else None}  # fmt: skip


async def _phase_load(client: Any, payload: Any, c: int, args: argparse.Namespace, roles: dict[str, int],
                      srv: Server) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """C closed-loop streams: --warmup s, then a measured --duration s; then every stream is cut off."""
    from dflash_trt.bench.metrics import RawResult

    raws: list[Any] = []
    running = True

    async def stream() -> None:
        while running:  # not only the cancel: asyncio.wait_for (3.11) can swallow one as a reply lands
            raw = RawResult(index=len(raws))
            raws.append(raw)
            await client.send(payload, raw)
            if raw.error is not None:
                await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(stream()) for _ in range(c)]
    await asyncio.sleep(args.warmup)
    before = _snapshot(roles, srv)
    await asyncio.sleep(args.duration)
    after = _snapshot(roles, srv)
    running = False
    for task in tasks:
        task.cancel()
    _, stuck = await asyncio.wait(tasks, timeout=60)
    if stuck:
        raise SystemExit(f"{len(stuck)} of {c} streams did not stop within 60 s of the phase's end")
    return raws, before, after


def _client(protocol: str, srv: Server, c: int) -> Any:
    from dflash_trt.bench.clients import Sampling, make_client

    url = {"triton-http": srv.http, "triton-grpc": srv.grpc, "openai-completions": srv.openai}[protocol]
    model = "tensorrt_llm" if protocol.startswith("triton") else "tiny"
    return make_client(protocol, url, model, Sampling(ignore_eos=True), request_timeout_s=600, max_streams=c)


def summarize(raws: list[Any], before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Tokens and responses the client received in the measured window, and what each process spent."""
    t0, t1 = before["t"], after["t"]
    wall = t1 - t0
    tokens = sum(_count_at(r, t1) - _count_at(r, t0) for r in raws)
    responses = sum(1 for r in raws for t in r.times if t0 < t <= t1)
    cpu = {role: after["cpu"][role] - before["cpu"][role] for role in ROLES}
    rounds = after["engine_rounds"] - before["engine_rounds"]
    return {
        **_latencies(raws, t0, t1),
        # requests in an engine round, on average (each adds one to dflash_rounds_total)
        "requests_per_round": (after["request_rounds"] - before["request_rounds"]) / rounds
        if rounds
        else None,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "engine_tokens_per_s": (after["engine_tokens"] - before["engine_tokens"]) / wall,
        "responses_per_s": responses / wall,
        "tokens_per_response": tokens / responses if responses else None,
        "errors": sorted({r.error for r in raws if r.error is not None and "Cancelled" not in r.error})[:5],
        "cpu_s": cpu,
        "cpu_cores": {role: s / wall for role, s in cpu.items()},
        "cpu_us_per_token": {role: s * 1e6 / tokens if tokens else None for role, s in cpu.items()},
        "total_cpu_us_per_token": sum(cpu.values()) * 1e6 / tokens if tokens else None,
        "total_cpu_us_per_response": sum(cpu.values()) * 1e6 / responses if responses else None,
    }


async def run_phase(protocol: str, c: int, args: argparse.Namespace, srv: Server,
                    roles: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    from dflash_trt.bench.workload import Prompt

    async with _client(protocol, srv, c) as client:
        await client.probe()
        payload = client.prepare(Prompt(0, PROMPT, None, len(PROMPT), args.osl))
        raws, before, after = await _phase_load(client, payload, c, args, roles, srv)
    return summarize(raws, before, after)


# --- the run -------------------------------------------------------------------------------------------
def environment(srv: Server, roles: dict[str, int]) -> dict[str, Any]:
    """What the numbers were measured on."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?"
    )
    versions = {}
    for dist in ("dflash-trt", "torch", "nvidia-pytriton", "tritonclient", "aiohttp", "grpcio"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    status, body = _get(srv.http + "/v2")
    versions["tritonserver"] = json.loads(body).get("version") if status == 200 else None
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    )
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "git_commit": commit + ("+dirty" if dirty else ""),
        "engine_package_root": engine_root(roles["engine"]),
    }


def build_bundle(out: Path, max_batch_size: int) -> Path:
    cmd = [sys.executable, "-m", "dflash_trt", "build", "--target", "tiny", "--output", str(out),
           "--max-batch-size", str(max_batch_size), "--max-seq-len", "1024", "--force"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def measure_k(bundle: Path, k: int, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Serve with K tokens per round; one phase per protocol and concurrency."""
    srv = serve(bundle, k, args.round_ms, args.rounds)
    try:
        check_stand_in(srv, k)
        roles = process_roles(srv.proc.pid)
        result.setdefault("environment", environment(srv, roles))
        for protocol in args.protocols:
            for c in args.concurrency:
                row = {"protocol": protocol, "concurrency": c, "tokens_per_round": k,
                       **asyncio.run(run_phase(protocol, c, args, srv, roles))}  # fmt: skip
                result["phases"].append(row)
                print(_line(row), flush=True)
                wait_idle(srv)
    finally:
        srv.stop()


def _line(row: dict[str, Any]) -> str:
    us = row["cpu_us_per_token"]
    cells = [row["protocol"], str(row["concurrency"]), str(row["tokens_per_round"]),
             f"{row['output_tokens_per_s']:.0f}", f"{row['engine_tokens_per_s']:.0f}",
             f"{row['tokens_per_response'] or 0:.2f}", f"{row['requests_per_round'] or 0:.1f}",
             f"{1000 * (row['ttft_p50_s'] or 0):.0f}",
             *(f"{us[r]:.0f}" if us[r] is not None else "-" for r in ROLES),
             f"{row['total_cpu_us_per_token'] or 0:.0f}", f"{row['total_cpu_us_per_response'] or 0:.0f}",
             str(len(row["errors"]))]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def table(result: dict[str, Any]) -> str:
    env = result["environment"]
    cfg = result["config"]
    head = (f"{env['date']}, {env['cpu_model']} ({env['cpus_usable']} usable of {env['cpu_count']} CPUs), "
            f"commit {env['git_commit']}, Python {env['python']}, tritonserver {env['versions']['tritonserver']}; "
            f"stand-in rounds of {cfg['round_ms']:g} ms ({cfg.get('rounds', 'serial')}), {cfg['osl']} tokens per request, "
            f"{cfg['warmup']:g} s warm-up + {cfg['duration']:g} s measured per row")  # fmt: skip
    cols = ["protocol", "C", "K", "tok/s", "engine tok/s", "tok/resp", "req/round", "TTFT p50 ms",
            *(f"µs/tok {r}" for r in ROLES), "µs/tok total", "µs/resp total", "errors"]  # fmt: skip
    rule = "|" + "|".join("---" for _ in cols) + "|"
    return "\n".join([head, "", "| " + " | ".join(cols) + " |", rule, *(_line(r) for r in result["phases"])])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    config = {k: v for k, v in vars(args).items() if k not in ("bundle", "out")}
    result: dict[str, Any] = {"config": config, "phases": []}
    with tempfile.TemporaryDirectory(prefix="serving-path-") as tmp:
        bundle = args.bundle or build_bundle(Path(tmp) / "tiny", max(args.concurrency))
        for k in args.tokens_per_round:
            measure_k(bundle, k, args, result)
    print(table(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
