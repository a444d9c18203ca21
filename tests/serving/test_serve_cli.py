# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt serve` as users run it: readiness, traffic, clean shutdown on SIGINT/SIGTERM, and
the --no-draft baseline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import launch_serve

pytestmark = pytest.mark.triton_server


def launch(bundle, *extra):
    proc, ports = launch_serve(bundle, *extra)
    return proc, ports["http"]


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_starts_serves_and_stops_cleanly(tiny_bundle, sig):
    proc, http = launch(tiny_bundle)
    r = httpx.post(f"http://127.0.0.1:{http}/v2/models/tensorrt_llm/generate",
                   json={"text_input": "a", "sampling_param_max_tokens": 4, "sampling_param_return_perf_metrics": True},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["total_draft_tokens"] > 0
    triton_pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "ready in" in err and "draining" in err and "model finalized, tritonserver exit code 0" in err
    for pid in triton_pids:  # the server's process group (tritonserver + Python stub) is gone
        assert not group_alive(pid)


def test_serve_no_draft_runs_the_target_alone(tiny_bundle):
    proc, http = launch(tiny_bundle, "--no-draft")
    try:
        body = {"text_input": "def g():", "sampling_param_max_tokens": 8, "sampling_param_return_perf_metrics": True,
                "sampling_param_ignore_eos": True}  # fmt: skip
        r = httpx.post(f"http://127.0.0.1:{http}/v2/models/tensorrt_llm/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["total_draft_tokens"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_serve_errors(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tmp_path)],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "not a dflash-trt bundle" in out.stderr
    out = subprocess.run([sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tmp_path), "--http-port", "9000",
                          "--grpc-port", "9000"], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "ports must differ" in out.stderr


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])
