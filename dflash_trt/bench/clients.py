# SPDX-License-Identifier: Apache-2.0
"""One asyncio streaming client per protocol. All share one event loop and one contract:

- `probe()` checks the server and the model before any timed work and returns a `ServerInfo`
  (which optional inputs the model declares, how output length is controlled);
- `prepare(prompt)` builds the request body up front (off the hot path);
- `send(payload, raw)` streams one request and fills `raw` (times, server token counts, text,
  speculative statistics). It never raises for a failed request: it sets `raw.error`.

Protocols: `triton-http` (`/v2/models/{m}/generate_stream`, SSE), `triton-grpc` (KServe v2
`ModelStreamInfer` through `tritonclient.grpc`'s protos on a `grpc.aio` channel: the aio client's
`stream_infer` refuses the reserved `triton_enable_empty_final_response` parameter, so requests
are built here), `openai-completions` and `openai-chat` (SSE with `stream_options`).

With an API key every client sends it on every request (`Authorization: Bearer` on HTTP, Triton's
`triton-grpc-protocol-authorization` metadata on gRPC); a server that refuses the key (or wants
one) fails the probe with a one-line error, before any timed work.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dflash_trt.bench.metrics import RawResult
from dflash_trt.bench.workload import Prompt
from dflash_trt.errors import DFlashTrtError, UsageError
from dflash_trt.openai_front.protocol import DFLASH_FIELD, DFLASH_STATS
from dflash_trt.triton.kserve import decode_first_raw, decode_first_typed, encode_raw
from dflash_trt.utils.api_key import ENV_VAR, ApiKey

PROTOCOLS = ("triton-grpc", "triton-http", "openai-completions", "openai-chat")
# How Triton refuses a call without the key of a restricted protocol (gRPC status UNAVAILABLE).
RESTRICTED = "This protocol is restricted"

# Speculative / timing outputs of the Triton model, copied per response into RawResult.spec.
SPEC_OUTPUTS = (
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
    "mean_acceptance_length",
    "num_rounds",
    "total_overturned_draft_tokens",
    "arrival_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
)

# The datatypes of the contract (used when the server's model metadata cannot be read).
CONTRACT_INPUTS: dict[str, str] = {
    "text_input": "BYTES",
    "streaming": "BOOL",
    "sampling_param_max_tokens": "INT32",
    "sampling_param_temperature": "FP32",
    "sampling_param_top_p": "FP32",
    "sampling_param_top_k": "INT32",
    "sampling_param_seed": "UINT64",
    "sampling_param_return_perf_metrics": "BOOL",
    "return_finish_reason": "BOOL",
}
OUR_INPUTS = {
    "sampling_param_ignore_eos": "BOOL",
    "sampling_param_min_tokens": "INT32",
    "streaming_delta": "BOOL",
}


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = True  # fixed output length where the server supports it
    thinking: bool = False  # openai-chat: chat_template_kwargs.enable_thinking
    extra: tuple[tuple[str, Any], ...] = ()  # --extra-inputs, merged into every request


@dataclass
class ServerInfo:
    protocol: str
    url: str
    model: str
    server: dict[str, Any] | None = None
    model_inputs: dict[str, str] | None = None
    model_outputs: list[str] | None = None
    output_length_control: str = "none"
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "url": self.url,
            "model": self.model,
            "server": self.server,
            "model_inputs": self.model_inputs,
            "model_outputs": self.model_outputs,
            "output_length_control": self.output_length_control,
            "notes": self.notes,
        }


def _one(v: Any) -> Any:
    """One-element outputs arrive as x or [x] in Triton's HTTP JSON."""
    if isinstance(v, list):
        return v[0] if v else None
    return v


def _number(v: Any) -> float | None:
    """A numeric output as float. NVIDIA's llmapi model sends its metric tensors with the text
    output's dtype (BYTES), so numbers may arrive as strings; unparsable values count as absent."""
    if v is None or isinstance(v, bool):
        return None if v is None else float(v)
    if isinstance(v, (bytes, bytearray)):
        v = v.decode("utf-8", errors="replace")
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _count(v: Any) -> int | None:
    f = _number(v)
    return None if f is None else round(f)


def _refused(url: str, what: str, api_key: ApiKey | None) -> UsageError:
    """The server wants a key we lack, or refused the one we sent."""
    if api_key is None:
        return UsageError(f"the server at --url={url} requires an API key ({what})",
                          hint=f"pass --api-key-file FILE or set ${ENV_VAR}")  # fmt: skip
    return UsageError(f"the server at --url={url} refused the API key from {api_key.source} ({what})",
                      hint="send the key the server was started with")  # fmt: skip


def _unreachable(url: str, exc: BaseException, default_port: str) -> DFlashTrtError:
    return DFlashTrtError(
        f"cannot reach the server at --url={url} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
        hint=f"start the server or fix --url ({default_port})",
    )


class Client:
    protocol = ""

    def __init__(
        self,
        url: str,
        model: str,
        sampling: Sampling,
        *,
        request_timeout_s: float,
        max_streams: int,
        api_key: ApiKey | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.sampling = sampling
        self.request_timeout_s = request_timeout_s
        self.max_streams = max(1, max_streams)
        self.info = ServerInfo(protocol=self.protocol, url=self.url, model=model)

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def probe(self) -> ServerInfo:
        raise NotImplementedError

    def prepare(self, prompt: Prompt) -> Any:
        raise NotImplementedError

    async def send(self, payload: Any, raw: RawResult) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---------------------------------------------------------------------------------------- HTTP
async def iter_sse(content: Any) -> AsyncIterator[tuple[float, bytes]]:
    """Server-sent events from an aiohttp stream: (arrival time, data) per event.

    Reads whatever bytes arrived (no line-length limit: accumulated text can be long); events
    that arrive in one read share its arrival time.
    """
    buf = bytearray()
    data: list[bytes] = []
    async for block in content.iter_any():
        t = time.perf_counter()
        buf += block
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = bytes(buf[start:nl]).rstrip(b"\r")
            start = nl + 1
            if not line:
                if data:
                    yield t, b"\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
        del buf[:start]
    tail = bytes(buf).strip()
    if tail.startswith(b"data:"):
        data.append(tail[5:].lstrip(b" "))
    if data:
        yield time.perf_counter(), b"\n".join(data)


class _HttpClient(Client):
    default_port = "Triton HTTP listens on 8000 by default"

    async def open(self) -> None:
        import aiohttp

        # limit=0: no connection cap (aiohttp's default of 100 queues requests above 100 streams)
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=30)
        headers = self.api_key.http_headers() if self.api_key is not None else None
        reuse = aiohttp.TraceConfig()  # which POSTs went out on a kept-alive connection (`_never_sent`)
        reuse.on_connection_reuseconn.append(_mark_reused)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers,
                                              trace_configs=[reuse])  # fmt: skip
        self._aiohttp = aiohttp

    async def close(self) -> None:
        session = getattr(self, "_session", None)
        if session is not None:
            await session.close()

    async def _get(self, path: str) -> tuple[int, Any]:
        try:
            async with self._session.get(self.url + path) as resp:
                text = await resp.text()
                if resp.status in (401, 403):
                    raise _refused(
                        self.url, f"GET {path}: HTTP {resp.status} {_error_body(text)}", self.api_key
                    )
                try:
                    body = json.loads(text) if text else None
                except json.JSONDecodeError:
                    body = text
                return resp.status, body
        except (self._aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _unreachable(self.url, exc, self.default_port) from exc

    async def _stream(self, path: str, payload: bytes, raw: RawResult) -> AsyncIterator[tuple[float, Any]]:
        """POST and yield (time, parsed event); errors land in raw.error. A POST that fails before
        the server answered, on a kept-alive connection the server had closed (llama-server closes
        one after each streamed response although it advertises keep-alive), is sent again on a
        fresh connection, up to RESEND_ATTEMPTS times: the server never saw it. The request's clock
        keeps its first send time."""
        raw.send_t = time.perf_counter()
        for attempt in range(RESEND_ATTEMPTS + 1):
            post: dict[str, bool] = {}  # what became of this POST: "answered", "reused"
            async for event in self._post_once(path, payload, raw, post):
                yield event
            if (post.get("answered") or raw.error is None or attempt == RESEND_ATTEMPTS
                    or not _never_sent(raw.error, reused=post.get("reused", False))):  # fmt: skip
                break
            raw.error = None
            raw.resends += 1
        raw.done_t = time.perf_counter()

    async def _post_once(
        self, path: str, payload: bytes, raw: RawResult, post: dict[str, bool]
    ) -> AsyncIterator[tuple[float, Any]]:
        """One POST; `post["answered"]` is set once the server's status line arrived, `post["reused"]`
        (by `_mark_reused`) when it went out on a kept-alive connection."""
        try:
            async with self._session.post(
                self.url + path,
                data=payload,
                headers={"Content-Type": "application/json"},
                trace_request_ctx=post,
            ) as resp:
                post["answered"] = True
                if resp.status != 200:
                    raw.error = f"HTTP {resp.status}: {_error_body(await resp.text())}"
                    return
                async for t, data in iter_sse(resp.content):
                    if data == b"[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        raw.error = f"bad SSE data: {data[:200]!r}"
                        break
                    if isinstance(obj, dict) and obj.get("error"):
                        err = obj["error"]
                        raw.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                        break
                    yield t, obj
        except (self._aiohttp.ClientError, OSError, TimeoutError) as exc:
            raw.error = f"{type(exc).__name__}: {exc}"[:300]


# A request that failed before the server answered, on a connection it had already closed, is sent
# again (the server never saw it). aiohttp says so in two ways: the write failed ("Can not write
# request body"), or the write went into the socket's buffer and the read then found the connection
# closed (ServerDisconnectedError). The second also happens when a server drops a request it had read,
# so it counts as never sent only on a kept-alive connection, the race llama-server's closes cause (a
# fresh connection that the server closes without an answer is the request's error).
RESEND_ATTEMPTS = 2
_NEVER_SENT = ("Can not write request body",)
_CLOSED_BEFORE_READ = "ServerDisconnectedError"


def _never_sent(error: str, *, reused: bool) -> bool:
    return any(s in error for s in _NEVER_SENT) or (reused and error.startswith(_CLOSED_BEFORE_READ))


async def _mark_reused(_session: Any, ctx: Any, _params: Any) -> None:
    """aiohttp's on_connection_reuseconn signal: the POST's trace context (its `post` dict) learns that
    it goes out on a kept-alive connection."""
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


class TritonHttpClient(_HttpClient):
    protocol = "triton-http"

    async def probe(self) -> ServerInfo:
        info = self.info
        status, body = await self._get("/v2/health/ready")
        if status != 200:
            info.notes.append(f"/v2/health/ready answered HTTP {status}")
        status, body = await self._get("/v2")
        info.server = body if status == 200 and isinstance(body, dict) else None
        status, body = await self._get(f"/v2/models/{self.model}")
        if status == 200 and isinstance(body, dict):
            info.model_inputs = {t["name"]: t.get("datatype", "") for t in body.get("inputs", [])}
            info.model_outputs = [t["name"] for t in body.get("outputs", [])]
        elif status in (400, 404):
            raise UsageError(
                f"--model={self.model!r}: the server at {self.url} does not serve it ({_err_text(body)})",
                hint="pass --model with a model the server loaded (Triton: GET /v2/repository/index lists them)",
            )
        else:
            info.notes.append(
                f"model metadata unavailable (HTTP {status}); sending the contract's NVIDIA inputs only"
            )
        self._inputs = _triton_inputs(info, self.sampling)
        return info

    def prepare(self, prompt: Prompt) -> bytes:
        body = {
            name: value for name, (_, value) in _triton_values(self._inputs, prompt, self.sampling).items()
        }
        return json.dumps(body).encode()

    async def send(self, payload: bytes, raw: RawResult) -> None:
        delta = self._inputs.get("streaming_delta") is not None
        async for t, obj in self._stream(f"/v2/models/{self.model}/generate_stream", payload, raw):
            text = _one(obj.get("text_output"))
            count = _one(obj.get("num_output_tokens"))
            if isinstance(text, list):  # defensive: nested lists
                text = text[0] if text else ""
            count = _count(count)
            if count is not None:
                raw.count_source = "num_output_tokens"
            if delta:
                raw.add_delta(t, count, text or "")
            else:
                raw.add_accumulated(t, count, text or "")
            nin = _count(_one(obj.get("num_input_tokens")))
            if nin is not None:
                raw.input_tokens_server = nin
            fr = _one(obj.get("finish_reason"))
            if fr:
                raw.finish_reason = str(fr)
            for key in SPEC_OUTPUTS:
                v = _number(_one(obj.get(key)))
                if v is not None:
                    raw.spec[key] = v


def _error_body(text: str) -> str:
    """The message of an error body: JSON, or an SSE event (Triton answers a failed first response so)."""
    body = text.strip()
    if body.startswith("data:"):
        body = body[5:].strip()
    try:
        return _err_text(json.loads(body))
    except json.JSONDecodeError:
        return body[:200]


def _err_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:200]
    return str(body)[:200]


def _triton_inputs(info: ServerInfo, sampling: Sampling) -> dict[str, str | None]:
    """Input name -> datatype for every optional input we will send (None = not sent).

    Only inputs the model declares are sent: Triton rejects undeclared inputs, and NVIDIA's
    model lacks our additions (ignore_eos, min_tokens, streaming_delta).
    """
    declared = info.model_inputs
    if declared is None:
        declared = dict(CONTRACT_INPUTS)
    chosen: dict[str, str | None] = {}
    for name in (*CONTRACT_INPUTS, *OUR_INPUTS):
        chosen[name] = declared.get(name)
    if sampling.ignore_eos:
        if chosen["sampling_param_ignore_eos"]:
            info.output_length_control = "sampling_param_ignore_eos"
            chosen["sampling_param_min_tokens"] = None
        elif chosen["sampling_param_min_tokens"]:
            info.output_length_control = "sampling_param_min_tokens = max_tokens"
        else:
            info.output_length_control = (
                "none: the model declares neither ignore_eos nor min_tokens; actual lengths are reported"
            )
    else:
        info.output_length_control = "natural EOS (--no-ignore-eos)"
        chosen["sampling_param_ignore_eos"] = chosen["sampling_param_min_tokens"] = None
    for key, _ in sampling.extra:
        if key not in declared:
            raise UsageError(
                f"--extra-inputs: the model does not declare an input named {key!r}",
                hint=f"declared inputs: {', '.join(sorted(declared))}",
            )
        chosen[key] = declared[key]
    if chosen["text_input"] is None or chosen["sampling_param_max_tokens"] is None:
        raise UsageError(
            f"--model={info.model!r} declares no text_input / sampling_param_max_tokens input: it is not an llmapi-style model",
            hint="point --model at the llmapi `tensorrt_llm` model (or use --protocol openai-completions)",
        )
    return chosen


def _triton_values(inputs: dict[str, str | None], prompt: Prompt, s: Sampling) -> dict[str, tuple[str, Any]]:
    """name -> (datatype, value) of one request's inputs."""
    if prompt.text is None:
        raise UsageError("Triton protocols need prompt text", hint="use --tokenizer with chat datasets")
    want: dict[str, Any] = {
        "text_input": prompt.text,
        "streaming": True,
        "sampling_param_max_tokens": prompt.output_tokens,
        "sampling_param_temperature": s.temperature,
        "sampling_param_top_p": s.top_p,
        "sampling_param_top_k": s.top_k,
        "sampling_param_seed": s.seed,
        "sampling_param_return_perf_metrics": True,
        "return_finish_reason": True,
        "sampling_param_ignore_eos": True,
        "sampling_param_min_tokens": prompt.output_tokens,
        "streaming_delta": True,
    }
    want.update(dict(s.extra))
    return {
        name: (dtype, want[name])
        for name, dtype in inputs.items()
        if dtype is not None and want.get(name) is not None
    }


# ---------------------------------------------------------------------------------------- gRPC
def _output_value(resp: Any, i: int, out: Any) -> Any:
    """First element of output i of a ModelInferResponse (raw contents, or typed contents)."""
    raws = resp.raw_output_contents
    if i < len(raws):
        v = decode_first_raw(out.datatype, raws[i])
    else:
        v = decode_first_typed(out.datatype, out.contents)
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v


class TritonGrpcClient(Client):
    protocol = "triton-grpc"
    streams_per_channel = 100  # HTTP/2 servers often cap concurrent streams per connection at 100

    def _target(self) -> str:
        url = self.url
        for prefix in ("grpc://", "http://"):
            if url.startswith(prefix):
                url = url[len(prefix) :]
        return url

    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self._grpc = grpc
        self._pb = service_pb2
        n = max(1, math.ceil(self.max_streams / self.streams_per_channel))
        opts = [
            ("grpc.max_send_message_length", 2**31 - 1),
            ("grpc.max_receive_message_length", 2**31 - 1),
            ("grpc.use_local_subchannel_pool", 1),  # one connection per channel
        ]
        self._channels = [grpc.aio.insecure_channel(self._target(), options=opts) for _ in range(n)]
        self._metadata = self.api_key.grpc_metadata() if self.api_key is not None else None
        self._stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in self._channels]
        self._next = 0
        self._idle: list[_GrpcStream] = []

    async def close(self) -> None:
        for stream in getattr(self, "_idle", []):
            stream.close()
        for c in getattr(self, "_channels", []):
            await c.close()

    async def probe(self) -> ServerInfo:
        info, pb, grpc, stub = self.info, self._pb, self._grpc, self._stubs[0]
        try:
            ready = await stub.ServerReady(pb.ServerReadyRequest(), timeout=15)
            if not ready.ready:
                info.notes.append("ServerReady answered ready=false")
            meta = await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=15, metadata=self._metadata)
            info.server = {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}
        except grpc.aio.AioRpcError as exc:
            if RESTRICTED in (exc.details() or ""):
                raise _refused(self.url, f"gRPC {exc.code().name}: {exc.details()}", self.api_key) from exc
            raise _unreachable(
                self.url, exc, "Triton gRPC listens on 8001 by default; pass host:port"
            ) from exc
        try:
            md = await stub.ModelMetadata(
                pb.ModelMetadataRequest(name=self.model), timeout=15, metadata=self._metadata
            )
            info.model_inputs = {t.name: t.datatype for t in md.inputs}
            info.model_outputs = [t.name for t in md.outputs]
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.UNAVAILABLE,
            ):
                raise UsageError(
                    f"--model={self.model!r}: the server at {self.url} does not serve it ({exc.details()})",
                    hint="pass --model with a model the server loaded",
                ) from exc
            info.notes.append(
                f"model metadata unavailable ({exc.code().name}); sending the contract's NVIDIA inputs only"
            )
        self._inputs = _triton_inputs(info, self.sampling)
        return info

    def prepare(self, prompt: Prompt) -> Any:
        req = self._pb.ModelInferRequest(model_name=self.model, id=str(prompt.index))
        for name, (dtype, value) in _triton_values(self._inputs, prompt, self.sampling).items():
            req.inputs.add(name=name, datatype=dtype, shape=[1])
            req.raw_input_contents.append(encode_raw(dtype, value))
        # one empty final response at worst; the last response carries triton_final_response=true
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        return req

    async def _acquire(self) -> _GrpcStream:
        if self._idle:
            return self._idle.pop()
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        return _GrpcStream(stub, self._metadata)

    async def send(self, payload: Any, raw: RawResult) -> None:
        stream = await self._acquire()
        reusable = False
        try:
            reusable = await asyncio.wait_for(self._exchange(stream, payload, raw), self.request_timeout_s)
        except asyncio.TimeoutError:
            raw.error = f"timed out after {self.request_timeout_s:g} s"
        except self._grpc.aio.AioRpcError as exc:
            raw.error = f"gRPC {exc.code().name}: {exc.details()}"[:300]
        except StopAsyncIteration:
            raw.error = "the server closed the stream before the final response"
        finally:
            if reusable:
                self._idle.append(stream)
            else:
                stream.close()
        if raw.done_t is None:
            raw.done_t = time.perf_counter()

    async def _exchange(self, stream: _GrpcStream, payload: Any, raw: RawResult) -> bool:
        """One request on a stream; True when it ended cleanly (final flag) so the stream is reusable."""
        delta = self._inputs.get("streaming_delta") is not None
        stats_resp = None  # the latest response carrying outputs beyond text and count
        raw.send_t = time.perf_counter()
        stream.write(payload)
        while True:
            sresp = await stream.read()
            t = time.perf_counter()
            if sresp.error_message:
                raw.error = sresp.error_message[:300]
                # a failed request: drop the stream rather than guess whether more responses follow
                return False
            r = sresp.infer_response
            outputs = r.outputs
            if outputs:
                # hot path: decode only the text and the token count; the rest once, at the end
                text, count = "", None
                for i, out in enumerate(outputs):
                    name = out.name
                    if name == "text_output":
                        text = _output_value(r, i, out) or ""
                    elif name == "num_output_tokens":
                        count = _output_value(r, i, out)
                count = _count(count)
                if count is not None:
                    raw.count_source = "num_output_tokens"
                if delta:
                    raw.add_delta(t, count, text)
                else:
                    raw.add_accumulated(t, count, text)
                if len(outputs) > 2:
                    stats_resp = r
            final = r.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                raw.done_t = t
                break
        if stats_resp is not None:
            values = {out.name: _output_value(stats_resp, i, out) for i, out in enumerate(stats_resp.outputs)}
            nin = _count(values.get("num_input_tokens"))
            if nin is not None:
                raw.input_tokens_server = nin
            if values.get("finish_reason"):
                raw.finish_reason = str(values["finish_reason"])
            for key in SPEC_OUTPUTS:
                v = _number(values.get(key))
                if v is not None:
                    raw.spec[key] = v
        return True


class _GrpcStream:
    """A long-lived `ModelStreamInfer` stream carrying one request at a time.

    A closed-loop slot keeps its stream, so a request costs one message, not one RPC set-up.
    Requests never overlap on a stream, so every response belongs to the request in flight.
    """

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._call = stub.ModelStreamInfer(self._requests(), metadata=metadata)
        self._responses = self._call.__aiter__()

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    def write(self, request: Any) -> None:
        self._queue.put_nowait(request)

    async def read(self) -> Any:
        return await self._responses.__anext__()

    def close(self) -> None:
        self._queue.put_nowait(None)
        self._call.cancel()


# ---------------------------------------------------------------------------------------- OpenAI
class OpenAIClient(_HttpClient):
    protocol = "openai-completions"
    path = "/v1/completions"
    default_port = "the OpenAI base URL, e.g. http://host:8000 or http://host:8000/v1"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]

    async def probe(self) -> ServerInfo:
        info = self.info
        status, body = await self._get("/v1/models")
        if status == 200 and isinstance(body, dict):
            ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
            info.server = {"models": ids}
            if ids and self.model not in ids:
                raise UsageError(
                    f"--model={self.model!r}: the server at {self.url} serves {', '.join(map(str, ids))}",
                    hint="pass --model with one of those names",
                )
        else:
            info.notes.append(f"GET /v1/models answered HTTP {status}")
        info.output_length_control = (
            "ignore_eos + min_tokens extra body keys"
            if self.sampling.ignore_eos
            else "natural EOS (--no-ignore-eos)"
        )
        return info

    def _body(self, prompt: Prompt) -> dict[str, Any]:
        s = self.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": prompt.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "temperature": s.temperature,
        }
        if s.top_p is not None:
            body["top_p"] = s.top_p
        if s.top_k is not None:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        if s.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = prompt.output_tokens
        return body

    def prepare(self, prompt: Prompt) -> bytes:
        body = self._body(prompt)
        if prompt.text is None:
            raise UsageError(
                "openai-completions needs prompt text", hint="use --protocol openai-chat for messages"
            )
        body["prompt"] = prompt.text
        body.update(dict(self.sampling.extra))
        return json.dumps(body).encode()

    def _piece(self, choice: dict[str, Any]) -> str:
        return str(choice.get("text") or "")

    async def send(self, payload: bytes, raw: RawResult) -> None:
        async for t, obj in self._stream(self.path, payload, raw):
            choices = obj.get("choices") or []
            piece = ""
            if choices:
                piece = self._piece(choices[0])
                fr = choices[0].get("finish_reason")
                if fr:
                    raw.finish_reason = str(fr)
            stats = obj.get(DFLASH_FIELD)  # dflash-trt's OpenAI front: per-request DFlash statistics
            if isinstance(stats, dict):
                for key, output in DFLASH_STATS.items():
                    v = _number(stats.get(key))
                    if v is not None:
                        raw.spec[output] = v
            usage = obj.get("usage")
            count = None
            if isinstance(usage, dict):
                count = _count(usage.get("completion_tokens"))
                if count is not None:
                    raw.count_source = "usage"
                prompt_tokens = _count(usage.get("prompt_tokens"))
                if prompt_tokens is not None:
                    raw.input_tokens_server = prompt_tokens
            raw.add_delta(t, count, piece)


class OpenAIChatClient(OpenAIClient):
    protocol = "openai-chat"
    path = "/v1/chat/completions"

    def prepare(self, prompt: Prompt) -> bytes:
        body = self._body(prompt)
        if prompt.messages is None:
            raise UsageError(
                "openai-chat needs messages", hint="this is a bug: the workload built no messages"
            )
        body["messages"] = list(prompt.messages)
        body["chat_template_kwargs"] = {"enable_thinking": self.sampling.thinking}
        body.update(dict(self.sampling.extra))
        return json.dumps(body).encode()

    def _piece(self, choice: dict[str, Any]) -> str:
        delta = choice.get("delta") or {}
        # reasoning text is output too (its tokens are in usage.completion_tokens)
        return str(delta.get("reasoning_content") or delta.get("reasoning") or "") + str(
            delta.get("content") or ""
        )


def make_client(
    protocol: str,
    url: str,
    model: str,
    sampling: Sampling,
    *,
    request_timeout_s: float,
    max_streams: int,
    api_key: ApiKey | None = None,
) -> Client:
    classes: dict[str, type[Client]] = {
        "triton-http": TritonHttpClient,
        "triton-grpc": TritonGrpcClient,
        "openai-completions": OpenAIClient,
        "openai-chat": OpenAIChatClient,
    }
    if protocol not in classes:
        raise UsageError(f"--protocol={protocol!r}: unknown", hint=f"pick one of {', '.join(PROTOCOLS)}")
    return classes[protocol](
        url, model, sampling, request_timeout_s=request_timeout_s, max_streams=max_streams, api_key=api_key
    )
