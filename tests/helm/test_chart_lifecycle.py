# SPDX-License-Identifier: Apache-2.0
"""The chart's shutdown and liveness scripts, rendered by Helm and run against a real tritonserver
serving the tiny bundle: the preStop hook drains (in-flight requests finish or end with an explicit
error, then Triton exits 0 on SIGTERM), the liveness probe fails once the Python stub is wedged
(stale heartbeat) or killed, and both the liveness and the readiness probes fail once the model's
engine dies (an injected engine fault).

Two substitutions adapt the rendered scripts to this shared machine: the control directory and the
HTTP port (the pod's are fixed), and, for the liveness probe, the processes it scans (a pod's /proc
holds only its own; this machine's holds other tritonservers too)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import httpx
import pytest
from helm_support import CHART_DIR, load_value_set

from dflash_trt import deploy
from tests.serving.conftest import HANG_S, SLOW_ENGINE, build_bundle, eventually, free_ports

pytestmark = [pytest.mark.helm, pytest.mark.triton_server]

CONTROL = "/var/run/dflash-trt"


def _server_container(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = deploy.render_chart(values, chart_dir=CHART_DIR, release="demo", namespace="default").documents
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


@pytest.fixture(scope="module")
def chart_server(tmp_path_factory):
    """A tritonserver started with the chart's arguments that matter here (exit timeout, control dir).
    Its engine raises in its 3rd step (DFLASH_TRT_FAULT_INJECT): the first request kills it."""
    from dflash_trt.triton.server import TritonServer

    values = load_value_set("tiny-cpu")
    values.setdefault("server", {}).update({"drainSeconds": 2, "preStopSleepSeconds": 0})
    spec, container = _server_container(values)
    exit_timeout = next(
        int(a.split("=")[1]) for a in container["args"] if a.startswith("--exit-timeout-secs=")
    )
    tmp = tmp_path_factory.mktemp("chart")
    bundle = build_bundle(tmp / "tiny")
    control = tmp / "control"
    control.mkdir()
    http, grpc, metrics = free_ports(3)
    server = TritonServer(model_repository=bundle / "model_repository", http_port=http, grpc_port=grpc,
                          metrics_port=metrics, exit_timeout=exit_timeout, forward_logs=False,
                          extra_env={"DFLASH_TRT_BUNDLE_ROOT": str(bundle), "DFLASH_TRT_CONTROL_DIR": str(control),
                                     "DFLASH_TRT_TESTING": "1", "DFLASH_TRT_FAULT_INJECT": "engine-raise:3"})  # fmt: skip
    server.start()
    server.wait_ready(120)
    yield server, spec, container, control
    server.stop()


def _sse(url: str, body: dict, into: list) -> None:
    try:
        with httpx.stream(
            "POST", url + "/v2/models/tensorrt_llm/generate_stream", json=body, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    into.append(json.loads(line[5:]))
    except httpx.HTTPError as exc:
        into.append(repr(exc))


def _probe_script(container: dict[str, Any], kind: str, server: Any, control: Any) -> str:
    script = container[kind]["exec"]["command"][2].replace(CONTROL, str(control))
    script = script.replace("/dev/tcp/127.0.0.1/8000", f"/dev/tcp/127.0.0.1/{server.http_port}")
    own = " ".join(f"/proc/{pid}/cmdline" for pid in [server.proc.pid, *server.watch_stubs()])
    return script.replace("/proc/[0-9]*/cmdline", own)


@pytest.mark.timing
def test_liveness_and_readiness_probes_fail_once_the_stub_or_its_engine_is_wedged_or_dead(chart_server):
    server, _, container, control = chart_server
    live = _probe_script(container, "livenessProbe", server, control)
    ready = _probe_script(container, "readinessProbe", server, control)

    def probe(script: str = live) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, timeout=10)

    assert probe().returncode == 0, probe().stderr
    assert probe(ready).returncode == 0, probe(ready).stderr
    stub = next(iter(server.stub_pids))
    # wedged: the stub stops beating (stopped here; its heartbeat is aged instead of waiting 10 s)
    os.kill(stub, signal.SIGSTOP)
    try:
        old = time.time() - 30
        os.utime(control / "heartbeat", (old, old))
        out = probe()
        assert out.returncode == 1 and "heartbeat is stale" in out.stderr, out.stderr
    finally:
        os.kill(stub, signal.SIGCONT)
    eventually(lambda: probe().returncode == 0, "the heartbeat beating again", every=0.2)
    # the engine dies (the injected fault, in its 3rd step): the client gets an explicit error, Triton
    # still answers ready, and both probes fail naming the cause
    events: list = []
    _sse(server.http_url, {"text_input": "x = ", "sampling_param_max_tokens": 200, "sampling_param_ignore_eos": True,
                           "streaming": True}, events)  # fmt: skip
    assert isinstance(events[-1], dict) and "injected engine-raise at step 3" in events[-1].get(
        "error", ""
    ), events
    eventually(lambda: (control / "engine-dead").exists(), "the model reporting its dead engine", timeout=15)
    assert httpx.get(f"{server.http_url}/v2/health/ready", timeout=5).status_code == 200
    for script in (live, ready):
        out = probe(script)
        assert (
            out.returncode == 1 and "the model's engine is dead: engine failure: InjectedFault" in out.stderr
        ), out.stderr
    os.kill(stub, signal.SIGKILL)
    # Triton itself still answers live (the defect the probe works around)
    assert httpx.get(f"{server.http_url}/v2/health/live", timeout=5).status_code == 200
    out = eventually(lambda: (o := probe()).returncode == 1 and o, "the probe failing on the dead stub")
    assert "no live triton_python_backend_stub" in out.stderr


@pytest.mark.timing
def test_prestop_drains_then_sigterm_exits_0(tmp_path):
    from dflash_trt.triton.server import TritonServer

    values = load_value_set("tiny-cpu")
    values.setdefault("server", {}).update({"drainSeconds": 0, "preStopSleepSeconds": 0})
    spec, container = _server_container(values)
    assert spec["terminationGracePeriodSeconds"] == 0 + 0 + 15 + 10 + 5
    exit_timeout = next(
        int(a.split("=")[1]) for a in container["args"] if a.startswith("--exit-timeout-secs=")
    )
    bundle = build_bundle(tmp_path / "tiny")
    control = tmp_path / "control"
    control.mkdir()
    http, grpc, metrics = free_ports(3)
    server = TritonServer(model_repository=bundle / "model_repository", http_port=http, grpc_port=grpc,
                          metrics_port=metrics, exit_timeout=exit_timeout, forward_logs=False,
                          extra_env={"DFLASH_TRT_BUNDLE_ROOT": str(bundle), "DFLASH_TRT_CONTROL_DIR": str(control),
                                     **SLOW_ENGINE})  # fmt: skip
    server.start()
    try:
        server.wait_ready(120)
        # drainSeconds=0: the short stream ends before the hook runs, the long ones are cut by it
        # (serve's SIGTERM test covers in-flight requests finishing within a budget)
        streams: dict[int, list] = {i: [] for i in range(5)}
        bodies = {i: {"text_input": f"s{i} = ", "sampling_param_max_tokens": 6 if i == 0 else 2000,
                      "sampling_param_ignore_eos": True, "return_finish_reason": True, "streaming": True} for i in streams}  # fmt: skip
        threads = [
            threading.Thread(target=_sse, args=(server.http_url, bodies[i], streams[i])) for i in streams
        ]
        for t in threads:
            t.start()
        eventually(lambda: all(streams.values()) and streams[0][-1].get("finish_reason") == "length",
                   "every stream started and the short one finished", every=0.01)  # fmt: skip
        script = container["lifecycle"]["preStop"]["exec"]["command"][2].replace(CONTROL, str(control))
        hook = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=HANG_S)
        assert hook.returncode == 0, hook.stderr
        assert (control / "drained").exists()  # the hook returned once the model had drained
        refused = httpx.post(f"{server.http_url}/v2/models/tensorrt_llm/generate",
                             json={"text_input": "late", "sampling_param_max_tokens": 2}, timeout=10)  # fmt: skip
        # the model answers UNAVAILABLE; Triton 2.51's generate endpoints turn every model error into 400
        assert refused.status_code != 200 and "draining" in refused.json()["error"]
        for t in threads:
            t.join(30)
        assert streams[0][-1].get("finish_reason") == "length"
        for i in (1, 2, 3, 4):
            assert "aborted: the server shut down" in streams[i][-1].get("error", ""), streams[i][-1]
        t1 = time.monotonic()
        code = server.stop()  # what the kubelet does after the hook: SIGTERM
        assert code == 0 and (control / "finalized").exists()
        assert time.monotonic() - t1 < exit_timeout
    finally:
        server.stop()
