# SPDX-License-Identifier: Apache-2.0
"""Real tritonserver fixtures (binary from the nvidia-pytriton wheel), on 127.0.0.1 and free ports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton_server

HERE = Path(__file__).parent


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


# Long requests that must still be in flight when a test stops or kills the server: a step emits at
# most 16 tokens of tiny's block, so with 100 ms more per engine step a 2000-token request takes at
# least 12.5 s however fast the engine is (engine/faults.py). Unslowed, eager tiny emits 200 tokens of
# a repetitive prompt in ~0.15 s.
SLOW_ENGINE = {"DFLASH_TRT_TESTING": "1", "DFLASH_TRT_FAULT_INJECT": "engine-slow:100"}
# 250 ms more per step: a 1500-token request needs at least 94 rounds, 23 s, to run to its end, so the
# abort tests tell an aborted request from a finished one by its tokens, not by a race with the clock.
SLOWER_ENGINE = {"DFLASH_TRT_TESTING": "1", "DFLASH_TRT_FAULT_INJECT": "engine-slow:250"}


def build_bundle(out: Path, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "dflash_trt", "build", "--target", "tiny", "--output", str(out), *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def pin_full_block(bundle: Path) -> Path:
    """Make the bundle's engine draft the full block at every batch size (`max_concurrency` = its
    max_batch_size in model.yaml: TensorRT-LLM's schedule), as `generate` does. For tests that compare a
    served request's rounds or tau with generate's or with another served run's: by default the draft
    length follows measured costs, so it depends on what the engine served before."""
    import yaml

    model_yaml = bundle / "model_repository" / "tensorrt_llm" / "1" / "model.yaml"
    config = yaml.safe_load(model_yaml.read_text())
    config["speculative_config"]["max_concurrency"] = config["max_batch_size"]
    model_yaml.write_text(yaml.safe_dump(config))
    return bundle


def start_server(repo: Path, *, bundle: Path | None = None, env: dict[str, str] | None = None):
    from dflash_trt.triton.server import TritonServer

    http, grpc, metrics = free_ports(3)
    extra = {"DFLASH_TRT_BUNDLE_ROOT": str(bundle)} if bundle else {}
    extra.update(env or {})
    server = TritonServer(model_repository=repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                          extra_env=extra, forward_logs=False)  # fmt: skip
    server.start()
    try:
        server.wait_ready(120)
    except Exception:
        print("\n".join(server.logs))
        raise
    return server


def launch_serve(
    bundle: Path, *extra: str, timeout: float = 120, openai: bool = False, env: dict[str, str] | None = None
):
    """`dflash-trt serve` as users run it, on free ports; returns (process, {"http", "grpc", "metrics"
    [, "openai"]} ports) once /v2/health/ready (and the OpenAI front's /health) answer 200. stderr is
    piped (read it with communicate()). `env` is added to this process's environment."""
    import time

    import httpx

    http, grpc, metrics, oai = free_ports(4)
    ports = {"http": http, "grpc": grpc, "metrics": metrics, **({"openai": oai} if openai else {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(bundle), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--quiet", *extra,
         *(["--openai-port", str(oai)] if openai else [])],
        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{http}/v2/health/ready"] + (
        [f"http://127.0.0.1:{oai}/health"] if openai else []
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if all(httpx.get(url, timeout=2).status_code == 200 for url in urls):
                return proc, ports
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("serve never became ready")


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    return build_bundle(tmp_path_factory.mktemp("bundles") / "tiny")


@pytest.fixture(scope="session")
def pinned_tiny_bundle(tmp_path_factory) -> Path:
    """`tiny`'s bundle drafting the full block at every batch size (`pin_full_block`)."""
    return pin_full_block(build_bundle(tmp_path_factory.mktemp("bundles") / "tiny-pinned"))


@pytest.fixture(scope="session")
def server(pinned_tiny_bundle):
    """Triton serving `tiny` with the full block pinned: its tests compare rounds with `generate`."""
    srv = start_server(pinned_tiny_bundle / "model_repository", bundle=pinned_tiny_bundle)
    yield srv
    srv.stop()


def http_generate(srv, body: dict, *, stream: bool = False, timeout: float = 60):
    import httpx

    url = f"{srv.http_url}/v2/models/tensorrt_llm/{'generate_stream' if stream else 'generate'}"
    if not stream:
        return httpx.post(url, json=body, timeout=timeout)
    events = []
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


HANG_S = 120.0  # how long `eventually` waits: a bound on a hang, never a timing under test


def eventually(condition: Callable[[], object], what: str, *, timeout: float = HANG_S, every: float = 0.05):
    """Poll until `condition()` is true and return its value; fail naming `what` only after `timeout`
    (which a loaded machine never needs: the tests wait for states, they do not time them)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        time.sleep(every)


def metric_value(srv, name: str) -> float:
    import httpx

    text = httpx.get(srv.metrics_url, timeout=10).text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise AssertionError(f"metric {name} not exposed")
    return total


@pytest.fixture
def stub_processes():
    """PIDs of Python-backend stub processes (to prove that shutdown leaves none)."""

    def list_stubs(repo: Path) -> list[int]:
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "triton_python_backend_stub" in cmd and str(repo) in cmd:
                out.append(int(pid))
        return out

    return list_stubs


def grpc_stream_request(
    url: str, prompt: str, max_tokens: int, *, request_id: str = "r1", ignore_eos: bool = False
) -> list:
    """One streamed greedy request through tritonclient's gRPC stream, with perf metrics: the responses
    that carry text (the last one is final). Fails on any stream error."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    results: list = []
    done = threading.Event()

    def callback(result, error):
        results.append((result, error))
        if error is not None or result.get_response().parameters.get("triton_final_response").bool_param:
            done.set()

    def tensor(name, value, dtype, kind):
        t = grpcclient.InferInput(name, [1], kind)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    inputs = [tensor("text_input", prompt.encode(), np.object_, "BYTES"), tensor("streaming", True, np.bool_, "BOOL"),
              tensor("sampling_param_max_tokens", max_tokens, np.int32, "INT32"),
              tensor("sampling_param_return_perf_metrics", True, np.bool_, "BOOL")]  # fmt: skip
    if ignore_eos:
        inputs.append(tensor("sampling_param_ignore_eos", True, np.bool_, "BOOL"))
    client.async_stream_infer("tensorrt_llm", inputs, request_id=request_id, enable_empty_final_response=True)
    assert done.wait(120)
    client.stop_stream()
    client.close()
    assert all(err is None for _, err in results), results
    return [r for r, _ in results if r.as_numpy("text_output") is not None]


def fold_chat_stream(chunks) -> tuple[str, list[dict], str | None]:
    """Streamed chat chunks (the openai client's) -> (content, tool calls as {id, name, arguments} with
    their argument fragments joined, the last finish_reason), as a client assembles them."""
    content, calls, finish = "", [], None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.id is not None:
                calls.append({"id": t.id, "name": t.function.name, "arguments": t.function.arguments})
            else:
                calls[t.index]["arguments"] += t.function.arguments
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish
