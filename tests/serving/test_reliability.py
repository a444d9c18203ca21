# SPDX-License-Identifier: Apache-2.0
"""Serving reliability against a real tritonserver / `dflash-trt serve` (loopback, small max_tokens):
load correctness over HTTP SSE and gRPC together, abandoned streams, the bad-input matrix on both
protocols, a huge prompt, a killed Python stub, and SIGTERM under load and with an idle keep-alive
connection. Bounded: each case takes seconds on 2 CPU cores. The tests wait for states (a stream
started, a slot freed, a process gone) and bound only hangs, so they pass on a loaded machine."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from dflash_trt.cli.serve import HEARTBEAT_TIMEOUT_S
from tests.serving.conftest import HANG_S, SLOW_ENGINE, eventually, http_generate, launch_serve, metric_value

pytestmark = pytest.mark.triton_server

GEN = "/v2/models/tensorrt_llm/generate"


# --- clients ------------------------------------------------------------------------------------
def sse(
    url: str, body: dict, *, timeout: float = 60, stop_after: int | None = None, into: list | None = None
) -> list:
    """POST generate_stream; the parsed events (appended to `into` as they come), then an exception's
    repr if the stream broke."""
    events: list = [] if into is None else into
    try:
        with httpx.stream("POST", url + GEN + "_stream", json=body, timeout=timeout) as r:
            plain = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if stop_after is not None and len(events) >= stop_after:
                        return events  # leaving the block closes the connection mid-stream
                elif line.strip():
                    plain.append(line)
            if not events and r.status_code != 200:  # refused before the model: a plain JSON error
                events.append({"error": " ".join(plain), "status": r.status_code})
    except httpx.HTTPError as exc:
        events.append(repr(exc))
    return events


class GrpcStream:
    """One request on a tritonclient gRPC stream; `done` is set on the final response or an error."""

    def __init__(self, addr: str, inputs: dict[str, object], request_id: str = "") -> None:
        import tritonclient.grpc as grpcclient

        self.items: list = []  # (result, error)
        self.done = threading.Event()
        self.client = grpcclient.InferenceServerClient(addr)
        self.client.start_stream(callback=self._callback)
        tensors = []
        for name, value in inputs.items():
            arr = np.array(value if isinstance(value, list) else [value])
            if arr.dtype.kind in "SUO":
                arr = np.array(
                    [v.encode() if isinstance(v, str) else v for v in arr.tolist()], dtype=np.object_
                )
                triton = "BYTES"
            elif arr.dtype.kind == "b":
                triton = "BOOL"
            else:
                arr = arr.astype(np.int32)
                triton = "INT32"
            t = grpcclient.InferInput(name, list(arr.shape), triton)
            t.set_data_from_numpy(arr)
            tensors.append(t)
        self.client.async_stream_infer("tensorrt_llm", tensors, request_id=request_id,
                                       enable_empty_final_response=True)  # fmt: skip

    def _callback(self, result, error) -> None:
        self.items.append((result, error))
        if error is not None or result.get_response().parameters.get("triton_final_response").bool_param:
            self.done.set()

    def error(self) -> str | None:
        return next((str(e) for _, e in self.items if e is not None), None)

    def text(self) -> str:
        texts = [r.as_numpy("text_output") for r, e in self.items if e is None]
        texts = [t for t in texts if t is not None]
        return texts[-1][0].decode() if texts else ""

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_body(prompt: str, n: int, **extra) -> dict:
    return {"text_input": prompt, "sampling_param_max_tokens": n, "sampling_param_ignore_eos": True,
            "streaming": True, "return_finish_reason": True, **extra}  # fmt: skip


def grpc_inputs(prompt: str, n: int) -> dict:
    return {"text_input": prompt, "sampling_param_max_tokens": n, "sampling_param_ignore_eos": True,
            "streaming": True}  # fmt: skip


def stub_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def stubs_of(server_pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"triton_python_backend_stub" in cmd and int(stat.rsplit(")", 1)[1].split()[1]) == server_pid:
            out.append(int(p))
    return out


def children(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p))
        except OSError:
            pass
    return out


# --- the session server -------------------------------------------------------------------------
def test_load_mixing_http_sse_and_grpc_matches_single_requests(server):
    prompts = [f"def f{i}(x):\n" for i in range(6)]
    want = {p: http_generate(server, {"text_input": p, "sampling_param_max_tokens": 12,
                                      "sampling_param_ignore_eos": True}).json()["text_output"] for p in prompts}  # fmt: skip
    got: dict[tuple[str, int], str] = {}
    errors: list = []

    def http_worker(p, k):
        events = sse(server.http_url, stream_body(p, 12))
        if not events or not isinstance(events[-1], dict) or "error" in events[-1]:
            errors.append(events[-1:])
        else:
            got[(p, k)] = events[-1]["text_output"]

    def grpc_worker(p, k):
        s = GrpcStream(server.grpc_url, grpc_inputs(p, 12))
        ok = s.done.wait(120)
        s.close()
        if not ok or s.error():
            errors.append(s.error() or "timeout")
        else:
            got[(p, k)] = s.text()

    threads = [threading.Thread(target=(http_worker if k % 2 else grpc_worker), args=(p, k))
               for k in range(4) for p in prompts]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors
    assert len(got) == 24
    mismatches = [(p, k) for (p, k), text in got.items() if text != want[p]]
    assert not mismatches  # greedy output does not depend on batching or protocol


@pytest.fixture(scope="module")
def slow_server(tiny_bundle):
    """A server whose engine steps take 250 ms more (SLOWER_ENGINE): a 1500-token request needs at least
    23 s however fast the machine; an aborted one stops within a step or two."""
    from tests.serving.conftest import SLOWER_ENGINE, start_server

    srv = start_server(tiny_bundle / "model_repository", bundle=tiny_bundle, env=SLOWER_ENGINE)
    yield srv
    srv.stop()


@pytest.mark.timing
def test_abandoned_streams_free_their_slots(slow_server):
    """8 streams of 1500 tokens whose clients leave (4 SSE after 2 events, 4 gRPC cancelled): the engine
    goes idle with far fewer tokens emitted than asked for, so they were aborted, not run to their end."""
    server = slow_server
    before = metric_value(server, "dflash_output_tokens_total")
    kept = []
    threads = [threading.Thread(target=lambda: kept.append(sse(server.http_url, stream_body("a = ", 1500), stop_after=2)))
               for _ in range(4)]  # fmt: skip
    grpcs = [GrpcStream(server.grpc_url, grpc_inputs("b = ", 1500)) for _ in range(4)]
    for t in threads:
        t.start()
    normal = http_generate(server, {"text_input": "c = ", "sampling_param_max_tokens": 4})
    for t in threads:
        t.join(60)
    eventually(lambda: all(len(s.items) >= 2 for s in grpcs), "every gRPC stream started")
    for s in grpcs:
        s.close(cancel=True)  # the client goes away mid-stream
    assert normal.status_code == 200 and len(kept) == 4
    gauges = ("dflash_requests_active", "dflash_requests_queued", "dflash_kv_cache_utilization")
    eventually(lambda: not any(metric_value(server, m) for m in gauges), "the abandoned streams' slots freed",
               every=0.1)  # fmt: skip
    emitted = metric_value(server, "dflash_output_tokens_total") - before
    # Unaborted they emit 8 x 1500 (+ 4): any 4 of them left running would pass 6000, which aborted streams
    # at most 16 x 8 tokens a 250 ms step could only reach after 11 s of full blocks.
    assert 4 <= emitted < 4 * 1500, f"{emitted} tokens: abandoned streams ran on"


@pytest.mark.parametrize(
    ("inputs", "pattern"),
    [
        ({"text_input": ["one", "two"], "sampling_param_max_tokens": 3}, "text_input must hold exactly one string, got 2"),
        ({"text_input": "x", "sampling_param_stop": [b"\xff\xfe"]}, "sampling_param_stop is not valid UTF-8"),
        ({"text_input": "x", "sampling_param_stop_token_ids": [1000000, -3]}, "stop_token_ids[0]=1000000: out of range for vocab_size="),
        ({"text_input": "x", "sampling_param_stop_token_ids": [-3]}, "stop_token_ids[0]=-3: out of range"),
        ({"text_input": "x", "sampling_param_max_tokens": 99999}, "exceeds max_seq_len=2048"),
    ],
)  # fmt: skip
def test_bad_input_over_grpc_names_the_field(server, inputs, pattern):
    s = GrpcStream(server.grpc_url, inputs)
    assert s.done.wait(30)
    s.close()
    err = s.error()
    assert err is not None and pattern in err, err  # stream errors carry a message, not a status code


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ({"text_input": "x", "sampling_param_stop_token_ids": [1000000, -3]}, "stop_token_ids[0]=1000000: out of range for vocab_size="),
        ({"text_input": "x", "sampling_param_max_tokens": 2147483648}, "outside the INT32 range"),
        ({"text_input": "x", "image_url": "http://a/b.png"}, "image_url is not supported"),
    ],
)  # fmt: skip
def test_bad_input_over_http_gets_400_naming_the_field(server, body, pattern):
    r = http_generate(server, body)
    assert r.status_code == 400 and pattern in r.json()["error"], r.text


@pytest.mark.timing
def test_huge_prompt_is_refused_before_tokenizing_and_others_are_unaffected(server):
    stub = stubs_of(server.proc.pid)[0]
    small = {"text_input": "def g():", "sampling_param_max_tokens": 4}
    assert http_generate(server, small).status_code == 200
    rss_before = stub_rss_mb(stub)
    # encoded up front: building 20 MB of JSON here would hold the GIL and delay our own normal client
    big = json.dumps({"text_input": "x" * (20 * 1024 * 1024), "sampling_param_max_tokens": 4}).encode()

    def post_big():
        return httpx.post(
            server.http_url + GEN, content=big, headers={"content-type": "application/json"}, timeout=60
        )

    result: dict = {}
    t = threading.Thread(target=lambda: result.update(big=post_big()))
    t.start()
    normal = http_generate(server, small)  # served while the huge one is in flight
    t.join(60)
    r = result["big"]
    # refused by the byte check, which runs before the text is decoded or tokenized (a 20 MB prompt
    # tokenized would cost its own size several times over in the stub)
    assert (
        r.status_code == 400 and "text_input is 20971520 bytes, over the limit of 65536" in r.json()["error"]
    )
    assert normal.status_code == 200
    assert stub_rss_mb(stub) - rss_before < 200, "the stub kept the huge prompt's memory"


# --- serve: killed stub, SIGTERM ------------------------------------------------------------------
@pytest.mark.timing
def test_killed_stub_fails_inflight_clients_and_serve_exits_nonzero(tiny_bundle):
    proc, ports = launch_serve(tiny_bundle, env=SLOW_ENGINE)
    url = f"http://127.0.0.1:{ports['http']}"
    try:
        g = GrpcStream(f"127.0.0.1:{ports['grpc']}", grpc_inputs("def g():", 2000))
        eventually(lambda: len(g.items) >= 1, "the gRPC stream started", every=0.01)
        out: list = []
        t = threading.Thread(target=lambda: sse(url, stream_body("def f():", 2000), timeout=HANG_S, into=out))
        t.start()
        eventually(lambda: len(out) >= 1, "the HTTP stream started", every=0.01)
        triton = children(proc.pid)
        (stub,) = [s for pid in triton for s in stubs_of(pid)]
        os.kill(stub, signal.SIGKILL)
        # both clients end (2000 slowed tokens each take 12.5 s or more) and serve exits on its own
        t.join(HANG_S)
        assert g.done.wait(HANG_S) and not t.is_alive()
        _, err = proc.communicate(timeout=HANG_S)
        g.close()
        assert isinstance(out[-1], str) and "RemoteProtocolError" in out[-1]  # the stream breaks, no hang
        assert "UNAVAILABLE" in (g.error() or "")
        assert proc.returncode == 1 and "Python-backend stub" in err and "died" in err, err
        with pytest.raises(httpx.HTTPError):  # nothing answers as ready any more
            httpx.get(f"{url}/v2/health/ready", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.timing
def test_sigterm_under_load_ends_every_stream_explicitly_and_exits_0(tiny_bundle):
    drain = 3.0
    proc, ports = launch_serve(tiny_bundle, "--drain-timeout", str(drain), env=SLOW_ENGINE)
    url = f"http://127.0.0.1:{ports['http']}"
    try:
        bodies = {i: stream_body(f"v{i} = ", 8 if i < 2 else 2000) for i in range(6)}  # 2 short, 4 long
        results: dict = {i: [] for i in bodies}  # the events of each stream, as they come
        threads = [threading.Thread(target=lambda i=i: sse(url, bodies[i], timeout=HANG_S, into=results[i]))
                   for i in bodies]  # fmt: skip
        grpcs = [GrpcStream(f"127.0.0.1:{ports['grpc']}", grpc_inputs(f"w{i} = ", 2000)) for i in range(2)]
        for t in threads:
            t.start()
        eventually(lambda: all(results.values()) and all(g.items for g in grpcs), "every stream started")
        proc.send_signal(signal.SIGTERM)
        eventually(lambda: not _ready(url), "readiness off")  # readiness turns false first
        try:
            refused = httpx.post(
                url + GEN, json={"text_input": "new", "sampling_param_max_tokens": 2}, timeout=5
            )
            assert refused.status_code != 200  # no new work while draining
        except httpx.TransportError:
            pass  # already gone: no new work either
        for t in threads:
            t.join(HANG_S)
        for g in grpcs:
            assert g.done.wait(HANG_S)
        # the long ones (2000 slowed tokens: 12.5 s or more) end at the drain deadline, and serve exits on its own
        _, err = proc.communicate(timeout=HANG_S)
        for i, events in results.items():
            last = events[-1]
            assert isinstance(last, dict), f"stream {i} was cut: {last}"  # never a silent cut
            if i < 2:
                assert last.get("finish_reason") == "length", last  # short ones finished in the budget
            else:
                assert "aborted: the server shut down" in last["error"], last
        for g in grpcs:
            assert "aborted: the server shut down" in (g.error() or ""), g.error()
            g.close()
        assert proc.returncode == 0, err
        # every request ended explicitly and the engine shut down; the gRPC clients' open streams may
        # keep Triton from finalizing the model (it is then killed, after the drain)
        assert re.search(r"model (finalized|drained)", err) and "exit code -11" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


TRITON_DEFAULT_EXIT_TIMEOUT_S = 30.0


@pytest.mark.timing
def test_sigterm_with_an_idle_keepalive_connection_exits_0_quickly(tiny_bundle):
    proc, ports = launch_serve(tiny_bundle)
    try:
        with httpx.Client() as client:  # its connection stays open (keep-alive) across the shutdown
            url = f"http://127.0.0.1:{ports['http']}"
            assert (
                client.post(url + GEN, json={"text_input": "a", "sampling_param_max_tokens": 2}).status_code
                == 200
            )
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=HANG_S)
            took = time.monotonic() - t0
        assert proc.returncode == 0 and "model finalized" in err, err
        # the idle connection was not waited for: Triton's own exit timeout (30 s by default) is
        # serve's EXIT_TIMEOUT_S; an order of magnitude below 30 s, whatever the load
        assert took < TRITON_DEFAULT_EXIT_TIMEOUT_S - 5, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.timing
def test_wedged_stub_is_noticed_by_its_stale_heartbeat(tiny_bundle):
    proc, ports = launch_serve(tiny_bundle)
    url = f"http://127.0.0.1:{ports['http']}"
    try:
        (stub,) = [s for pid in children(proc.pid) for s in stubs_of(pid)]
        os.kill(stub, signal.SIGSTOP)  # alive but wedged: Triton keeps reporting ready
        t0 = time.monotonic()
        assert httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
        _, err = proc.communicate(timeout=HANG_S)
        took = time.monotonic() - t0
        assert proc.returncode == 1 and "heartbeat" in err and "wedged" in err, err
        # serve waited for the heartbeat to go stale (it beats every second), not for anything less
        assert took >= HEARTBEAT_TIMEOUT_S - 1.0, took
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/v2/health/ready", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
