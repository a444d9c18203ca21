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


def test_compile_flag_sets_the_llm_argument_and_needs_the_embedded_engine(tiny_bundle, tmp_path, monkeypatch):
    import json
    import shutil

    import yaml

    from dflash_trt.cli.serve import _with_overrides

    repo = _with_overrides(
        tiny_bundle / "model_repository", tmp_path / "a", no_draft=False, compile_rounds=True
    )
    args = yaml.safe_load((repo / "tensorrt_llm/1/model.yaml").read_text())
    assert args["compile"] is True and "speculative_config" in args
    both = _with_overrides(
        tiny_bundle / "model_repository", tmp_path / "b", no_draft=True, compile_rounds=True
    )
    text = (both / "tensorrt_llm/1/model.yaml").read_text()
    assert text.startswith("# --no-draft --compile copy") and "speculative_config" not in yaml.safe_load(text)
    eager = _with_overrides(
        tiny_bundle / "model_repository", tmp_path / "c", no_draft=False, compile_rounds=False
    )
    text = (eager / "tensorrt_llm/1/model.yaml").read_text()
    assert text.startswith("# --eager copy") and yaml.safe_load(text)["compile"] is False
    # no flag: the bundle's own repository (the engine compiles where it can), its cache in the bundle
    from dflash_trt.cli.serve import _compile_cache_env
    from dflash_trt.engine.compile import CACHE_ENV, bundle_cache_root

    monkeypatch.delenv(CACHE_ENV, raising=False)
    root = bundle_cache_root(tiny_bundle)
    assert root == tiny_bundle / "compile-cache"
    assert _compile_cache_env(root, CACHE_ENV) == {CACHE_ENV: str(root.resolve())}
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "shared-cache"))  # set by the user: the server inherits it
    assert bundle_cache_root(tiny_bundle) == tmp_path / "shared-cache"
    assert _compile_cache_env(bundle_cache_root(tiny_bundle), CACHE_ENV) == {}

    other = tmp_path / "trtllm-bundle"
    shutil.copytree(tiny_bundle, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["backend"] = "trtllm"
    (other / "manifest.json").write_text(json.dumps(manifest))
    out = subprocess.run([sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(other), "--compile"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "--compile needs a bundle for the embedded engine" in out.stderr


def test_the_openai_front_is_built_while_tritonserver_loads_the_model():
    """`serve --openai-port`: tritonserver starts first, the front (its chat template: transformers and
    the tokenizer, seconds) is built while the model loads, and starts once the model is ready."""
    from dflash_trt.cli import serve as serve_cli

    calls: list[str] = []

    class FakeServer:
        install = None
        http_url = grpc_url = metrics_url = "-"

        def start(self) -> None:
            calls.append("server.start")

        def wait_ready(self, timeout: float) -> float:
            calls.append("server.wait_ready")
            return 0.0

        def watch_stubs(self) -> bool:
            return True

    class FakeFront:
        url = "-"
        cfg = type("Cfg", (), {"served_names": ["m"]})

        def start(self) -> None:
            calls.append("front.start")

    def make_front() -> FakeFront:
        calls.append("front built")
        return FakeFront()

    manifest = {"name": "m", "backend": "torch", "serving": {"model_name": "tensorrt_llm"}}
    front = serve_cli._start(FakeServer(), make_front, manifest, ready_timeout=1.0, no_draft=False)
    assert isinstance(front, FakeFront)
    assert calls == ["server.start", "front built", "server.wait_ready", "front.start"]
    assert serve_cli._start(FakeServer(), None, manifest, ready_timeout=1.0, no_draft=False) is None
