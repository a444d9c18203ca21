# SPDX-License-Identifier: Apache-2.0
"""API keys end to end: one real `dflash-trt serve --openai-port` started with a key from
$DFLASH_TRT_API_KEY, driven by raw HTTP, tritonclient gRPC, the official `openai` client and
`bench sweep`. Each protected path is tried with no key, a wrong key and the right key; probes and
metrics answer without one; the key never reaches serve's log, its command line or tritonserver's
environment.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.serving.conftest import free_ports

pytestmark = pytest.mark.triton_server

KEY = "k3y-" + "0123456789abcdef" * 2  # 36 printable characters
WRONG = "k3y-" + "fedcba9876543210" * 2
MODEL = "tensorrt_llm"
GEN = {"text_input": "def f(x):", "sampling_param_max_tokens": 4}


class Keyed:
    def __init__(self, proc: subprocess.Popen, log: Path, ports: list[int]) -> None:
        self.proc, self.log = proc, log
        self.http, self.grpc, self.metrics, self.openai = ports
        self.base = f"http://127.0.0.1:{self.http}"
        self.oai = f"http://127.0.0.1:{self.openai}"


@pytest.fixture(scope="module")
def keyed(tiny_bundle, tmp_path_factory):
    ports = free_ports(4)
    log = tmp_path_factory.mktemp("keyed") / "serve.log"
    env = {**os.environ, "DFLASH_TRT_API_KEY": KEY}
    with log.open("w") as err:  # a file, not a pipe: the verbose Triton log must never block serve
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_trt", "serve", "--bundle", str(tiny_bundle), "--http-port", str(ports[0]),
             "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--openai-port", str(ports[3]),
             "--log-verbose", "1"],
            stderr=err, env=env, text=True,
        )  # fmt: skip
    served = Keyed(proc, log, ports)
    deadline = time.monotonic() + 150
    while True:  # the OpenAI front's readiness probe needs no key either
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{served.oai}/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "serve never became ready:\n" + log.read_text()
        time.sleep(0.3)
    yield served
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    assert proc.returncode == 0, log.read_text()
    assert KEY not in log.read_text()


def _auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("key", [None, WRONG])
def test_triton_http_refuses_inference_and_metadata_without_the_key(keyed, key) -> None:
    for method, path in [("POST", f"/v2/models/{MODEL}/generate"), ("POST", f"/v2/models/{MODEL}/infer"),
                         ("GET", "/v2"), ("GET", f"/v2/models/{MODEL}"), ("GET", f"/v2/models/{MODEL}/config"),
                         ("GET", "/v2/models/stats"), ("GET", "/v2/logging"), ("GET", "/v2/trace/setting"),
                         ("GET", "/v2/systemsharedmemory/status")]:  # fmt: skip
        r = httpx.request(
            method, keyed.base + path, json=GEN if method == "POST" else None, headers=_auth(key)
        )
        assert r.status_code == 403, (path, r.status_code, r.text)
        assert "restricted" in r.json()["error"]


def test_triton_http_serves_with_the_key_and_keeps_probes_open(keyed) -> None:
    r = httpx.post(f"{keyed.base}/v2/models/{MODEL}/generate", json=GEN, headers=_auth(KEY), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"]
    assert httpx.get(f"{keyed.base}/v2", headers=_auth(KEY)).json()["name"] == "triton"
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready"):
        assert httpx.get(keyed.base + path).status_code == 200, path
    metrics = httpx.get(f"http://127.0.0.1:{keyed.metrics}/metrics")
    assert metrics.status_code == 200 and "nv_inference_request_success" in metrics.text


def _grpc_stream(url: str, headers: dict[str, str] | None) -> tuple[list[str], Exception | None]:
    """One streamed generate over gRPC (the model is decoupled): (text pieces, error)."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inputs = []
    for name, dtype, value in [("text_input", "BYTES", np.array([b"def f(x):"], dtype=np.object_)),
                               ("sampling_param_max_tokens", "INT32", np.array([4], dtype=np.int32))]:  # fmt: skip
        inp = grpcclient.InferInput(name, [1], dtype)
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    got: queue.Queue = queue.Queue()
    texts: list[str] = []
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
        try:
            with contextlib.suppress(InferenceServerException):  # a refused stream: the callback says why
                client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
            while True:
                result, error = got.get(timeout=60)
                if error is not None:
                    return texts, error
                out = result.as_numpy("text_output")
                if out is not None:
                    texts.append(out.reshape(-1)[0].decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return texts, None
        finally:
            client.stop_stream()


def test_triton_grpc_needs_the_key_except_for_health(keyed) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from dflash_trt.utils.api_key import GRPC_HEADER

    url = f"127.0.0.1:{keyed.grpc}"
    with grpcclient.InferenceServerClient(url) as client:
        for key in (None, WRONG):
            headers = None if key is None else {GRPC_HEADER: f"Bearer {key}"}
            texts, error = _grpc_stream(url, headers)
            assert texts == [] and "restricted" in str(error), error
            for call in (lambda h: client.get_model_metadata(MODEL, headers=h),
                         lambda h: client.get_server_metadata(headers=h)):  # fmt: skip
                with pytest.raises(InferenceServerException, match="restricted"):
                    call(headers)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        good = {GRPC_HEADER: f"Bearer {KEY}"}
        texts, error = _grpc_stream(url, good)
        assert error is None and "".join(texts)
        assert client.get_model_metadata(MODEL, headers=good).name == MODEL


def test_openai_front_answers_401_in_openai_shape(keyed) -> None:
    for headers, word in (({}, "No API key"), (_auth(WRONG), "Incorrect API key"),
                          ({"Authorization": KEY}, "Incorrect API key")):  # fmt: skip
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nowhere")):
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2} if method == "POST" else None
            r = httpx.request(method, keyed.oai + path, json=body, headers=headers)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", err
            assert word in err["message"] and KEY not in err["message"] and WRONG not in err["message"]
    assert httpx.get(f"{keyed.oai}/health").status_code == 200
    assert httpx.get(f"{keyed.oai}/health/live").status_code == 200


def test_openai_client_with_the_wrong_and_the_right_key(keyed) -> None:
    with openai.OpenAI(base_url=f"{keyed.oai}/v1", api_key=WRONG, max_retries=0, timeout=60) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model="tiny", prompt="def f(x):", max_tokens=4)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=f"{keyed.oai}/v1", api_key=KEY, max_retries=0, timeout=60) as good:
        assert [m.id for m in good.models.list()] == ["tiny"]
        r = good.completions.create(model="tiny", prompt="def f(x):", max_tokens=4, temperature=0)
        assert r.choices[0].text and r.usage is not None and r.usage.completion_tokens >= 1
        chunks = list(good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, stream=True))  # fmt: skip
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def _sweep(
    keyed, tmp: Path, protocol: str, tokenizer: Path, *flags: str, env_key: str | None
) -> tuple[int, str]:
    """`dflash-trt bench sweep` in this process: (exit code, stdout + stderr)."""
    from dflash_trt.cli import main

    url = (
        f"127.0.0.1:{keyed.grpc}"
        if protocol == "triton-grpc"
        else keyed.oai
        if "openai" in protocol
        else keyed.base
    )
    model = "tiny" if "openai" in protocol else MODEL
    tmp.mkdir(parents=True, exist_ok=True)
    dataset = tmp / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):", "class A:")))
    args = ["bench", "sweep", "--url", url, "--protocol", protocol, "--model", model, "--dataset", str(dataset),
            "--tokenizer", str(tokenizer), "--osl", "4", "--concurrency", "1", "--num-requests", "2",
            "--warmup", "0", "--out", str(tmp / protocol), "--json", *flags]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    old = os.environ.pop("DFLASH_TRT_API_KEY", None)
    if env_key is not None:
        os.environ["DFLASH_TRT_API_KEY"] = env_key
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            pytest.raises(SystemExit) as ex,
        ):
            main(args)
    finally:
        os.environ.pop("DFLASH_TRT_API_KEY", None)
        if old is not None:
            os.environ["DFLASH_TRT_API_KEY"] = old
    return int(ex.value.code or 0), out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory) -> Path:
    from dflash_trt.tiny import build_byte_tokenizer

    path = tmp_path_factory.mktemp("tok")
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("protocol", ["triton-grpc", "triton-http", "openai-completions"])
def test_bench_sweep_sends_the_key(keyed, tmp_path, byte_tokenizer, protocol) -> None:
    code, text = _sweep(keyed, tmp_path / "none", protocol, byte_tokenizer, env_key=None)
    assert code == 2 and "requires an API key" in text and "fix: pass --api-key-file" in text, text
    code, text = _sweep(keyed, tmp_path / "wrong", protocol, byte_tokenizer, env_key=WRONG)
    assert code == 2 and "refused the API key from $DFLASH_TRT_API_KEY" in text and WRONG not in text, text

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    code, text = _sweep(keyed, tmp_path / "ok", protocol, byte_tokenizer, "--api-key-file", str(key_file),
                        env_key=None)  # fmt: skip
    assert code == 0, text
    point = json.loads(text[: text.rindex("}") + 1])["runs"][0]["points"][0]
    assert point["num_errors"] == 0 and point["output_tokens_total"] == 8
    for written in (tmp_path / "ok" / protocol).iterdir():  # the key is sent, never recorded
        assert KEY not in written.read_text(), written


def test_the_key_stays_out_of_serve_and_tritonservers_environment(keyed) -> None:
    serve_cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes().decode()
    assert KEY not in serve_cmdline
    children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == keyed.proc.pid]
    triton = [p for p in children if b"tritonserver" in (p / "cmdline").read_bytes()]
    assert len(triton) == 1
    assert b"DFLASH_TRT_API_KEY" not in (triton[0] / "environ").read_bytes()
    # tritonserver 2.51 takes restricted-API keys only as flags (documented in docs/serving.md)
    assert f"authorization=Bearer {KEY}".encode() in (triton[0] / "cmdline").read_bytes()
    log = keyed.log.read_text()
    assert "API key from $DFLASH_TRT_API_KEY: required on inference and metadata" in log
    assert KEY not in log


def _ppid(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
