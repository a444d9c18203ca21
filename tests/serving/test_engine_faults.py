# SPDX-License-Identifier: Apache-2.0
"""A dead or wedged engine under `dflash-trt serve`, driven by the fault-injection switch
(DFLASH_TRT_FAULT_INJECT with DFLASH_TRT_TESTING=1; docs/serving.md, "Failure modes").

Per fault, one server with the OpenAI front and C streams in flight over each of HTTP (SSE), gRPC
and the OpenAI front, plus non-streaming OpenAI requests (more than the engine's 16 batch rows, set
here, so some run and some wait in its queue). The engine raises, or hangs, in its STEP-th step, by which
time every client has sent its request. Then every client gets an explicit error naming the cause
(none hangs, none is cut) within 10 s of the fault, the wedge timeout included; readiness fails
within 10 s; serve exits 1 naming the cause. Deadlines are for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from tests.serving.conftest import launch_serve
from tests.serving.test_reliability import GEN, stream_body

pytestmark = pytest.mark.triton_server

C = 16  # concurrent streams per protocol
BATCH_ROWS = 16  # the engine's batch rows here (the bundle's 64 would hold every client)
N_PLAIN = 4  # non-streaming OpenAI requests
STEP = 80  # the engine step the fault fires in: late enough that, on a loaded 2-core machine, every client
# has sent its request and at least half the batch rows stream (at 40, a loaded run saw only 5 of 16)
WEDGE_TIMEOUT_S = 4.0
WITHIN_S = 10.0
MAX_TOKENS = 1900
FAULTS = {
    "raise": (
        f"engine-raise:{STEP}",
        rf"engine failure: InjectedFault: injected engine-raise at step {STEP}",
    ),
    "hang": (
        f"engine-hang:{STEP}",
        r"engine wedged for \d+ s: no step finished while \d+ requests were pending",
    ),
}


@dataclass
class Client:
    """One request: when it last received output, when and how it ended."""

    kind: str
    last_data: float | None = None
    ended: float | None = None
    status: int | None = None
    error: Any = None  # the error it received (text, or OpenAI's error object)
    cut: str | None = None  # a broken connection instead of an error


def _post(rec: Client, url: str, body: dict) -> None:
    """POST; record the status, the time of each SSE data event, and the error received: an SSE
    `error` event, or the `error` of a plain JSON answer."""
    plain = []
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            rec.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    plain.append(line)
                elif line[5:].strip() != "[DONE]":
                    event = json.loads(line[5:])
                    if "error" in event:
                        rec.error = event["error"]
                    else:
                        rec.last_data = time.monotonic()
    except httpx.HTTPError as exc:
        rec.cut = repr(exc)
    if rec.error is None and "".join(plain).strip():
        rec.error = json.loads("".join(plain)).get("error")
    rec.ended = time.monotonic()


def _http_sse(rec: Client, go: threading.Barrier, url: str, i: int) -> None:
    go.wait()
    _post(rec, url + GEN + "_stream", stream_body(f"h{i} = ", MAX_TOKENS))


def _grpc(rec: Client, go: threading.Barrier, addr: str, i: int) -> None:
    import tritonclient.grpc as grpcclient

    done = threading.Event()

    def callback(result, error) -> None:
        if error is not None:
            rec.error = str(error)
            done.set()
            return
        rec.last_data = time.monotonic()
        if result.get_response().parameters.get("triton_final_response").bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(addr)
    client.start_stream(callback=callback)
    inputs = []
    for name, value, dtype in (("text_input", np.array([f"g{i} = ".encode()], dtype=np.object_), "BYTES"),
                               ("sampling_param_max_tokens", np.array([MAX_TOKENS], dtype=np.int32), "INT32"),
                               ("sampling_param_ignore_eos", np.array([True]), "BOOL"),
                               ("streaming", np.array([True]), "BOOL")):  # fmt: skip
        inputs.append(grpcclient.InferInput(name, [1], dtype))
        inputs[-1].set_data_from_numpy(value)
    go.wait()
    client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
    if done.wait(120):
        rec.ended = time.monotonic()
    client.stop_stream()
    client.close()


def _openai(rec: Client, go: threading.Barrier, base: str, model: str, i: int, *, stream: bool) -> None:
    body = {
        "model": model,
        "prompt": f"o{i} = ",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    go.wait()
    _post(rec, base + "/v1/completions", body)


def _first_not_ready(urls: list[str], out: dict[str, float], stop: threading.Event) -> None:
    """Poll each readiness URL; record when it first answers anything but 200 (or nothing)."""
    while not stop.is_set() and len(out) < len(urls):
        for url in urls:
            if url in out:
                continue
            try:
                ok = httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                out[url] = time.monotonic()
        time.sleep(0.1)


def _bundle_with_wedge_timeout(tiny_bundle: Path, dest: Path) -> Path:
    """The bundle with a short wedge timeout and BATCH_ROWS rows (fewer than the clients: some wait in
    the engine's queue when the fault comes, which a bundle's 64 rows would not make them do)."""
    shutil.copytree(tiny_bundle, dest)
    model_yaml = dest / "model_repository/tensorrt_llm/1/model.yaml"
    cfg = yaml.safe_load(model_yaml.read_text())
    cfg["wedge_timeout_s"] = WEDGE_TIMEOUT_S
    cfg["max_batch_size"] = BATCH_ROWS
    model_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


def _explicit_error(rec: Client) -> str:
    """The error text the client received, or an assertion naming what it got instead."""
    assert rec.ended is not None, f"{rec.kind}: never ended (hangs)"
    assert rec.cut is None, f"{rec.kind}: the connection was cut instead of an error: {rec.cut}"
    if rec.kind.startswith("openai"):
        assert isinstance(rec.error, dict) and set(rec.error) == {"message", "type", "param", "code"}, rec
        if rec.kind == "openai-plain" or rec.status != 200:  # refused before any output: a 503
            assert rec.status == 503, rec
        return str(rec.error["message"])
    assert isinstance(rec.error, str), rec
    return rec.error


def _start_clients(ports: dict[str, int], model: str) -> tuple[list[Client], list[threading.Thread]]:
    """C streams over each protocol and N_PLAIN non-streaming OpenAI requests, released together."""
    http, base = f"http://127.0.0.1:{ports['http']}", f"http://127.0.0.1:{ports['openai']}"
    go = threading.Barrier(3 * C + N_PLAIN, timeout=60)  # every client is set up before any request is sent
    jobs: list[tuple[str, Any, tuple, dict]] = []
    for i in range(C):
        jobs += [("http", _http_sse, (http, i), {}), ("grpc", _grpc, (f"127.0.0.1:{ports['grpc']}", i), {}),
                 ("openai-stream", _openai, (base, model, i), {"stream": True})]  # fmt: skip
    jobs += [("openai-plain", _openai, (base, model, C + i), {"stream": False}) for i in range(N_PLAIN)]
    clients = [Client(kind) for kind, *_ in jobs]
    threads = [
        threading.Thread(target=target, args=(rec, go, *args), kwargs=kwargs)
        for rec, (_, target, args, kwargs) in zip(clients, jobs)
    ]
    for t in threads:
        t.start()
    return clients, threads


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_engine_fault_under_load_errors_every_client_fails_readiness_and_serve_exits_1(
    tiny_bundle, tmp_path, fault
):
    spec, cause = FAULTS[fault]
    bundle = _bundle_with_wedge_timeout(tiny_bundle, tmp_path / "bundle")
    env = {"DFLASH_TRT_TESTING": "1", "DFLASH_TRT_FAULT_INJECT": spec}
    proc, ports = launch_serve(bundle, openai=True, env=env)
    http, base = f"http://127.0.0.1:{ports['http']}", f"http://127.0.0.1:{ports['openai']}"
    try:
        model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        not_ready: dict[str, float] = {}
        stop = threading.Event()
        poller = threading.Thread(target=_first_not_ready, args=([http + "/v2/health/ready", base + "/health"],
                                                                  not_ready, stop))  # fmt: skip
        poller.start()
        clients, threads = _start_clients(ports, model)
        deadline = time.monotonic() + 180  # the fault fires within seconds; a hung client fails here
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        _, err = proc.communicate(timeout=120)
        exited = time.monotonic()
        stop.set()
        poller.join(10)

        errors = [_explicit_error(rec) for rec in clients]
        for rec, text in zip(clients, errors):
            assert re.search(cause, text), (rec.kind, text)
            # UNAVAILABLE: Triton's clients read the trailer, OpenAI's the 503 message
            assert "(error: UNAVAILABLE)" in text or "the model is unavailable: " in text, (rec.kind, text)
            # a stream that was generating failed in flight; one that a loaded machine delivered only
            # after the fault was refused on arrival, naming the same cause (both are explicit errors)
            if rec.last_data is not None:
                assert "request failed after" in text, (rec.kind, text)
        running = [rec.last_data for rec in clients if rec.last_data is not None]
        assert len(running) >= C // 2  # streams were generating when the fault came
        fault_at = max(running)  # the engine's last output anywhere: the fault came right after it
        errors_s = max(rec.ended for rec in clients if rec.ended is not None) - fault_at
        print(f"{fault}: every client's error {errors_s:.2f} s, readiness failed "
              f"{max(not_ready.values(), default=float('nan')) - fault_at:.2f} s, serve exited "
              f"{exited - fault_at:.2f} s after the engine's last output")  # fmt: skip
        assert errors_s <= WITHIN_S, errors_s
        assert len(not_ready) == 2 and max(not_ready.values()) - fault_at <= WITHIN_S, not_ready
        assert proc.returncode == 1, err
        assert "the engine died (" in err and re.search(cause, err), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
