# SPDX-License-Identifier: Apache-2.0
"""A scripted inference server (a test double, not part of the package): real protocols, an exact
and known token schedule.

Run it from the repository root with `python -m tests.bench.scripted_server --help`; the benchmark
tests start it in process (`tests/bench/conftest.py`, fixture `scripted`).

It speaks the Triton HTTP `generate`/`generate_stream` contract of our `tensorrt_llm` model,
the KServe v2 gRPC `ModelStreamInfer` service (Triton's protos from `tritonclient.grpc`), and the
OpenAI `/v1/completions` and `/v1/chat/completions` streaming protocol. Every request is
answered on the same schedule, measured from the moment its handler starts:

    response 0 (first chunk, `first_chunk_tokens` tokens)  at  ttft_s
    response i (i >= 1, tokens_per_chunk[(i-1) % len])     at  ttft_s + i * chunk_gap_s

so the harness's metrics can be checked against closed forms. Chunks after the first are
speculative rounds: a chunk of k tokens is one round with k - 1 accepted drafts out of
`draft_len` drafted. Token j of every answer is the character chr(ord('a') + j % 26), so a
byte-level tokenizer re-tokenises the text to exactly the generated count.

`flavor="trtllm"` imitates NVIDIA's llmapi model instead of ours: no `num_output_tokens`,
`num_input_tokens`, `mean_acceptance_length`, `num_rounds`, no `streaming_delta`,
`sampling_param_ignore_eos` or `sampling_param_min_tokens` inputs, and an error for any input
the model does not declare (as Triton's gRPC endpoint does; Triton's HTTP `generate` passes
unknown keys on as parameters, the scripted server is stricter on purpose).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from dflash_trt.triton.kserve import decode_first_raw, decode_first_typed, encode_raw

log = logging.getLogger(__name__)

FLAVORS = ("dflash", "trtllm")

# Inputs NVIDIA's llmapi `tensorrt_llm` model declares (the subset a benchmark touches) and ours adds.
_NVIDIA_INPUTS: dict[str, str] = {
    "text_input": "BYTES",
    "streaming": "BOOL",
    "sampling_param_temperature": "FP32",
    "sampling_param_top_k": "INT32",
    "sampling_param_top_p": "FP32",
    "sampling_param_max_tokens": "INT32",
    "sampling_param_seed": "UINT64",
    "sampling_param_return_perf_metrics": "BOOL",
    "sampling_param_exclude_input_from_output": "BOOL",
    "return_finish_reason": "BOOL",
}
_OUR_INPUTS: dict[str, str] = {
    "sampling_param_ignore_eos": "BOOL",
    "sampling_param_min_tokens": "INT32",
    "streaming_delta": "BOOL",
}
_NVIDIA_OUTPUTS: dict[str, str] = {
    "text_output": "BYTES",
    "finish_reason": "BYTES",
    "acceptance_rate": "FP32",
    "total_accepted_draft_tokens": "INT32",
    "total_draft_tokens": "INT32",
    "arrival_time_ns": "INT64",
    "first_token_time_ns": "INT64",
    "last_token_time_ns": "INT64",
}
_OUR_OUTPUTS: dict[str, str] = {
    "num_output_tokens": "INT32",
    "num_input_tokens": "INT32",
    "mean_acceptance_length": "FP32",
    "num_rounds": "INT32",
}


@dataclass(frozen=True, slots=True)
class Script:
    """The schedule and behaviour of the scripted server (times in seconds)."""

    ttft_s: float = 0.05
    chunk_gap_s: float = 0.02
    first_chunk_tokens: int = 1
    tokens_per_chunk: tuple[int, ...] = (4,)  # cycled over the chunks after the first
    draft_len: int = 7  # drafted tokens per round (block_size - 1)
    natural_output_tokens: int | None = None  # "EOS" after this many tokens unless ignore_eos / min_tokens
    flavor: str = "dflash"
    json_lists: bool = False  # HTTP JSON: one-element outputs as [x] instead of x
    openai_usage: bool = True  # honour stream_options.include_usage / continuous_usage_stats
    fail_every: int = 0  # every N-th request (1-based) fails; 0 = never
    fail_midstream: bool = False  # fail after the first chunk instead of before streaming
    grpc_separate_final: bool = False  # gRPC: the final flag on a separate empty response
    max_tokens_datatype: str = "INT32"  # the declared dtype of sampling_param_max_tokens
    metrics_as_strings: bool = False  # NVIDIA's quirk: numeric outputs sent as BYTES strings
    # Hold every schedule until this many requests have arrived (0 = off): a wave of N requests is
    # then all in flight at once, whatever the load on the machine.
    start_together: int = 0
    # Hold the N-th request (1-based) and every later one until release_held() (0 = off): a test
    # can interrupt a client while it certainly waits on the server.
    hold_from: int = 0

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor={self.flavor!r}: expected one of {FLAVORS}")
        if self.first_chunk_tokens < 1 or not self.tokens_per_chunk or min(self.tokens_per_chunk) < 1:
            raise ValueError("first_chunk_tokens and every tokens_per_chunk entry must be >= 1")
        if self.ttft_s < 0 or self.chunk_gap_s < 0:
            raise ValueError("ttft_s and chunk_gap_s must be >= 0")
        if min(self.fail_every, self.start_together, self.hold_from, self.draft_len) < 0:
            raise ValueError("fail_every, start_together, hold_from and draft_len must be >= 0")

    def declared_inputs(self) -> dict[str, str]:
        inputs = dict(_NVIDIA_INPUTS)
        inputs["sampling_param_max_tokens"] = self.max_tokens_datatype
        if self.flavor == "dflash":
            inputs.update(_OUR_INPUTS)
        return inputs

    def declared_outputs(self) -> dict[str, str]:
        outputs = dict(_NVIDIA_OUTPUTS)
        if self.flavor == "dflash":
            outputs.update(_OUR_OUTPUTS)
        return outputs


@dataclass(frozen=True, slots=True)
class Plan:
    """What one request gets: tokens per streamed response and the response times."""

    chunks: tuple[int, ...]  # tokens carried by each response, the first chunk included
    offsets_s: tuple[float, ...]  # send time of each response, from the request's arrival
    draft_len: int

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunks)

    def stats_after(self, i: int) -> dict[str, Any]:
        """Cumulative speculative counters after response i (rounds = chunks after the first)."""
        rounds = i
        accepted = sum(k - 1 for k in self.chunks[1 : i + 1])
        drafted = rounds * self.draft_len
        out: dict[str, Any] = {
            "num_rounds": rounds,
            "total_accepted_draft_tokens": accepted,
            "total_draft_tokens": drafted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
        }
        if rounds:
            out["mean_acceptance_length"] = 1.0 + accepted / rounds
        return out


def plan_request(script: Script, *, max_tokens: int, ignore_eos: bool = False, min_tokens: int = 0) -> Plan:
    """The schedule of one request: how many tokens, in which chunks, at which times."""
    if ignore_eos or script.natural_output_tokens is None:
        n = max_tokens
    else:
        n = min(max_tokens, max(script.natural_output_tokens, min_tokens))
    chunks: list[int] = []
    if n > 0:
        chunks.append(min(script.first_chunk_tokens, n))
        left = n - chunks[0]
        for k in itertools.cycle(script.tokens_per_chunk):
            if left <= 0:
                break
            chunks.append(min(k, left))
            left -= chunks[-1]
    offsets = tuple(script.ttft_s + i * script.chunk_gap_s for i in range(len(chunks)))
    return Plan(chunks=tuple(chunks), offsets_s=offsets, draft_len=script.draft_len)


def token_text(start: int, count: int) -> str:
    """Text of tokens start..start+count-1 (one ASCII character per token)."""
    return "".join(chr(97 + j % 26) for j in range(start, start + count))


class _RequestFailed(Exception):
    pass


@dataclass
class ServerLog:
    """What the server saw: one entry per request, plus the peak number of requests in flight."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    peak_active: int = 0
    count: int = 0


class ScriptedServer:
    """The server, started inside the running event loop (`await start()`)."""

    def __init__(
        self,
        script: Script | None = None,
        *,
        model: str = "tensorrt_llm",
        host: str = "127.0.0.1",
        http_port: int = 0,
        grpc_port: int | None = 0,
    ) -> None:
        self.script = script or Script()
        self.model = model
        self.host = host
        self._http_port = http_port
        self._grpc_port = grpc_port
        self.log = ServerLog()
        self._runner: web.AppRunner | None = None
        self._grpc_server: Any = None
        self.http_url = ""
        self.grpc_url: str | None = None
        self._gate: asyncio.Event | None = None  # set once start_together requests have arrived
        self._held: asyncio.Event | None = None  # set by release_held()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._held = asyncio.Event()
        self._gate = asyncio.Event()
        if self.script.start_together <= 1:
            self._gate.set()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v2", self._server_metadata)
        app.router.add_get("/v2/health/live", self._ok)
        app.router.add_get("/v2/health/ready", self._ok)
        app.router.add_get("/v2/models/{model}", self._model_metadata)
        app.router.add_get("/v2/models/{model}/ready", self._model_ready)
        app.router.add_post("/v2/models/{model}/generate", self._triton_generate)
        app.router.add_post("/v2/models/{model}/generate_stream", self._triton_generate_stream)
        app.router.add_get("/scripted/stats", self._stats)
        app.router.add_get("/v1/models", self._openai_models)
        app.router.add_post("/v1/completions", self._openai_completions)
        app.router.add_post("/v1/chat/completions", self._openai_chat)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        # A large backlog: 256+ clients connect at once, and a full backlog costs a 1 s SYN retry.
        site = web.TCPSite(self._runner, self.host, self._http_port, backlog=4096)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.http_url = f"http://{self.host}:{port}"
        if self._grpc_port is not None:
            await self._start_grpc()

    async def stop(self) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace=0.5)
            self._grpc_server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _start_grpc(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000)])
        # the generated base class answers UNIMPLEMENTED for the methods we do not script
        servicer_cls = type(
            "ScriptedGrpcService", (_GrpcService, service_pb2_grpc.GRPCInferenceServiceServicer), {}
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer_cls(self), server)
        port = server.add_insecure_port(f"{self.host}:{self._grpc_port}")
        await server.start()
        self._grpc_server = server
        self.grpc_url = f"{self.host}:{port}"

    # ---------------------------------------------------------------- bookkeeping
    def _admit(self, protocol: str, params: dict[str, Any]) -> int:
        self.log.count += 1
        self.log.active += 1
        self.log.peak_active = max(self.log.peak_active, self.log.active)
        self.log.requests.append({"protocol": protocol, **params})
        if self._gate is not None and self.log.count >= self.script.start_together:
            self._gate.set()
        return self.log.count

    def _release(self) -> None:
        self.log.active -= 1

    def _fails(self, n: int) -> bool:
        return self.script.fail_every > 0 and n % self.script.fail_every == 0

    def release_held(self) -> None:
        """Let held requests (Script.hold_from) go on, and stop holding. Thread-safe."""
        assert self._loop is not None and self._held is not None
        self._loop.call_soon_threadsafe(self._held.set)

    async def _schedule(self, plan: Plan, t0: float, *, fail: bool, n: int) -> AsyncIterator[int]:
        """Yield response indices at their scheduled times (absolute deadlines: no drift) for the
        n-th request."""
        loop = asyncio.get_running_loop()
        for wait, event in (
            (self.script.hold_from and n >= self.script.hold_from, self._held),
            (True, self._gate),
        ):
            if wait and event is not None and not event.is_set():
                await event.wait()
                t0 = loop.time()  # the schedule starts when the request is let go
        for i, offset in enumerate(plan.offsets_s):
            delay = t0 + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if fail and i == 1:  # mid-stream failure: after the first chunk
                raise _RequestFailed("scripted failure")
            yield i
        if fail and len(plan.chunks) <= 1:
            raise _RequestFailed("scripted failure")

    # ---------------------------------------------------------------- Triton (shared by HTTP and gRPC)
    def _triton_check(self, inputs: dict[str, Any]) -> str | None:
        declared = self.script.declared_inputs()
        for name in inputs:
            if name not in declared:
                return f"unexpected inference input '{name}' for model '{self.model}'"
        if "text_input" not in inputs:
            return f"expected 1 inputs but got 0 inputs for model '{self.model}': missing 'text_input'"
        if int(inputs.get("sampling_param_max_tokens", 16)) < 1:
            return "sampling_param_max_tokens must be >= 1"
        return None

    def _triton_plan(self, inputs: dict[str, Any]) -> Plan:
        return plan_request(
            self.script,
            max_tokens=int(inputs.get("sampling_param_max_tokens", 16)),
            ignore_eos=bool(inputs.get("sampling_param_ignore_eos", False)),
            min_tokens=int(inputs.get("sampling_param_min_tokens", 0) or 0),
        )

    def _triton_outputs(
        self, inputs: dict[str, Any], plan: Plan, i: int, *, arrival_ns: int, first_ns: int, now_ns: int
    ) -> dict[str, Any]:
        """Output name -> value of response i (cumulative counters, text per streaming_delta)."""
        done = sum(plan.chunks[: i + 1])
        final = i == len(plan.chunks) - 1
        delta = bool(inputs.get("streaming_delta", False)) and bool(inputs.get("streaming", False))
        start = done - plan.chunks[i] if delta else 0
        out: dict[str, Any] = {"text_output": token_text(start, done - start)}
        ours = self.script.flavor == "dflash"
        if ours:
            out["num_output_tokens"] = done
            out["num_input_tokens"] = len(_text(inputs["text_input"]).encode())
        if final and inputs.get("return_finish_reason"):
            out["finish_reason"] = (
                "length" if done >= int(inputs.get("sampling_param_max_tokens", 16)) else "stop"
            )
        if inputs.get("sampling_param_return_perf_metrics"):
            stats = plan.stats_after(i)
            for key in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"):
                out[key] = stats[key]
            if ours:
                out["num_rounds"] = stats["num_rounds"]
                if "mean_acceptance_length" in stats:
                    out["mean_acceptance_length"] = stats["mean_acceptance_length"]
            out["arrival_time_ns"] = arrival_ns
            out["first_token_time_ns"] = first_ns
            out["last_token_time_ns"] = now_ns
        if self.script.metrics_as_strings:
            out = {k: v if k in ("text_output", "finish_reason") else str(v) for k, v in out.items()}
        return out

    def _json_event(self, outputs: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model_name": self.model, "model_version": "1"}
        for k, v in outputs.items():
            body[k] = [v] if self.script.json_lists else v
        return body

    async def _stats(self, request: web.Request) -> web.Response:
        """Counters for out-of-process callers: requests seen, in flight now, peak in flight."""
        return web.json_response(
            {"count": self.log.count, "active": self.log.active, "peak_active": self.log.peak_active}
        )

    # ---------------------------------------------------------------- Triton HTTP
    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": "scripted-triton", "version": "0", "extensions": ["generate"]})

    def _unknown_model(self, name: str) -> web.Response:
        return web.json_response({"error": f"Request for unknown model: '{name}' is not found"}, status=400)

    async def _model_metadata(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model:
            return self._unknown_model(name)
        return web.json_response(
            {
                "name": self.model,
                "versions": ["1"],
                "platform": "python",
                "inputs": [
                    {"name": k, "datatype": v, "shape": [-1] if v == "BYTES" else [1]}
                    for k, v in self.script.declared_inputs().items()
                ],
                "outputs": [
                    {"name": k, "datatype": v, "shape": [-1] if v == "BYTES" else [1]}
                    for k, v in self.script.declared_outputs().items()
                ],
            }
        )

    async def _model_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if request.match_info["model"] == self.model else 400)

    async def _triton_http(self, request: web.Request, *, stream: bool) -> web.StreamResponse:
        arrival_ns = time.monotonic_ns()  # before t0: first_ns - arrival_ns is never below ttft_s
        t0 = asyncio.get_running_loop().time()
        name = request.match_info["model"]
        if name != self.model:
            return self._unknown_model(name)
        try:
            inputs = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": "failed to parse the request JSON buffer"}, status=400)
        problem = self._triton_check(inputs)
        if problem:
            return web.json_response({"error": problem}, status=400)
        n = self._admit("triton-http", inputs)
        try:
            fail = self._fails(n)
            if fail and not self.script.fail_midstream:
                return web.json_response({"error": "scripted failure"}, status=500)
            plan = self._triton_plan(inputs)
            streaming = stream and bool(inputs.get("streaming", False))
            first_ns = 0
            if not streaming:
                try:
                    async for _ in self._schedule(plan, t0, fail=fail, n=n):
                        first_ns = first_ns or time.monotonic_ns()
                except _RequestFailed as exc:
                    return web.json_response({"error": str(exc)}, status=500)
                outputs = self._triton_outputs(
                    {**inputs, "streaming": False},
                    plan,
                    len(plan.chunks) - 1,
                    arrival_ns=arrival_ns,
                    first_ns=first_ns,
                    now_ns=time.monotonic_ns(),
                )
                body = json.dumps(self._json_event(outputs))
                if stream:
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await resp.prepare(request)
                    await resp.write(f"data: {body}\n\n".encode())
                    await resp.write_eof()
                    return resp
                return web.Response(body=body, content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                async for i in self._schedule(plan, t0, fail=fail, n=n):
                    now_ns = time.monotonic_ns()
                    first_ns = first_ns or now_ns
                    outputs = self._triton_outputs(
                        inputs, plan, i, arrival_ns=arrival_ns, first_ns=first_ns, now_ns=now_ns
                    )
                    await resp.write(b"data: " + json.dumps(self._json_event(outputs)).encode() + b"\n\n")
            except _RequestFailed as exc:
                await resp.write(b"data: " + json.dumps({"error": str(exc)}).encode() + b"\n\n")
            await resp.write_eof()
            return resp
        finally:
            self._release()

    async def _triton_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._triton_http(request, stream=False)

    async def _triton_generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._triton_http(request, stream=True)

    # ---------------------------------------------------------------- OpenAI
    async def _openai_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _openai_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _openai_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        body = await request.json()
        if body.get("model") != self.model:
            return web.json_response(
                {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}},
                status=404,
            )
        n = self._admit("openai-chat" if chat else "openai-completions", body)
        try:
            fail = self._fails(n)
            if fail and not self.script.fail_midstream:
                return web.json_response({"error": {"message": "scripted failure", "code": 500}}, status=500)
            reply = _OpenAIReply(self, body, chat=chat, n=n)
            plan = plan_request(
                self.script,
                max_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 16),
                ignore_eos=bool(body.get("ignore_eos", False)),
                min_tokens=int(body.get("min_tokens", 0) or 0),
            )
            if not body.get("stream"):
                return await self._openai_whole(reply, plan, t0, fail=fail)
            return await self._openai_stream(request, reply, plan, t0, fail=fail)
        finally:
            self._release()

    async def _openai_whole(self, reply: _OpenAIReply, plan: Plan, t0: float, *, fail: bool) -> web.Response:
        """A non-streamed answer: everything at the time of the last chunk."""
        try:
            async for _ in self._schedule(plan, t0, fail=fail, n=reply.n):
                pass
        except _RequestFailed as exc:
            return web.json_response({"error": {"message": str(exc), "code": 500}}, status=500)
        return web.json_response(reply.whole(plan.num_output_tokens))

    async def _openai_stream(
        self, request: web.Request, reply: _OpenAIReply, plan: Plan, t0: float, *, fail: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        if reply.chat:  # the role-only first chunk carries no token
            await send(reply.role_chunk())
        try:
            done = 0
            async for i in self._schedule(plan, t0, fail=fail, n=reply.n):
                done += plan.chunks[i]
                await send(reply.chunk(done - plan.chunks[i], done, last=i == len(plan.chunks) - 1))
            if reply.usage_on:
                await send(reply.usage_chunk(done))
            await resp.write(b"data: [DONE]\n\n")
        except _RequestFailed as exc:
            await send({"error": {"message": str(exc), "code": 500}})
        await resp.write_eof()
        return resp


class _OpenAIReply:
    """The OpenAI bodies of one request: ids, usage (as stream_options asks) and finish reasons."""

    def __init__(self, server: ScriptedServer, body: dict[str, Any], *, chat: bool, n: int) -> None:
        self.model = server.model
        self.n = n  # the request's number at the server (1-based)
        self.chat = chat
        self.max_tokens = int(body.get("max_tokens") or 16)
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-{n}"
        opts = body.get("stream_options") or {}
        self.usage_on = server.script.openai_usage and bool(opts.get("include_usage"))
        self.continuous = self.usage_on and bool(opts.get("continuous_usage_stats"))
        if chat:
            self.prompt_tokens = sum(
                len(str(m.get("content", "")).encode()) for m in body.get("messages") or []
            )
        else:
            self.prompt_tokens = len(str(body.get("prompt", "")).encode())

    def usage(self, done: int) -> dict[str, int]:
        p = self.prompt_tokens
        return {"prompt_tokens": p, "completion_tokens": done, "total_tokens": p + done}

    def finish(self, done: int) -> str:
        return "length" if done >= self.max_tokens else "stop"

    def whole(self, done: int) -> dict[str, Any]:
        text = token_text(0, done)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish(done)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        obj = self.obj.replace(".chunk", "")
        return {"id": self.rid, "object": obj, "choices": [choice], "usage": self.usage(done)}

    def _payload(self, choices: list[dict[str, Any]], done: int | None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": self.rid,
            "object": self.obj,
            "model": self.model,
            "choices": choices,
        }
        if done is not None:
            payload["usage"] = self.usage(done)
        return payload

    def role_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self._payload([choice], 0 if self.continuous else None)

    def chunk(self, start: int, done: int, *, last: bool) -> dict[str, Any]:
        """Tokens start..done-1 as one streamed chunk."""
        piece = token_text(start, done - start)
        c: dict[str, Any] = {"index": 0, "finish_reason": self.finish(done) if last else None}
        if self.chat:
            c["delta"] = {"content": piece}
        else:
            c["text"] = piece
        return self._payload([c], done if self.continuous else None)

    def usage_chunk(self, done: int) -> dict[str, Any]:
        return self._payload([], done)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _GrpcService:
    """KServe v2 `GRPCInferenceService` (the methods a benchmark client calls)."""

    def __init__(self, server: ScriptedServer) -> None:
        from tritonclient.grpc import service_pb2

        self.pb = service_pb2
        self.server = server

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return self.pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return self.pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return self.pb.ModelReadyResponse(ready=request.name == self.server.model)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return self.pb.ServerMetadataResponse(name="scripted-triton", version="0", extensions=["generate"])

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        import grpc

        if request.name != self.server.model:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{request.name}' is not found"
            )
        tm = self.pb.ModelMetadataResponse.TensorMetadata
        script = self.server.script
        return self.pb.ModelMetadataResponse(
            name=self.server.model,
            versions=["1"],
            platform="python",
            inputs=[
                tm(name=k, datatype=v, shape=[-1 if v == "BYTES" else 1])
                for k, v in script.declared_inputs().items()
            ],
            outputs=[
                tm(name=k, datatype=v, shape=[-1 if v == "BYTES" else 1])
                for k, v in script.declared_outputs().items()
            ],
        )

    def _decode_inputs(self, request: Any) -> tuple[dict[str, Any], str | None]:
        declared = self.server.script.declared_inputs()
        inputs: dict[str, Any] = {}
        for idx, tensor in enumerate(request.inputs):
            if tensor.name in declared and tensor.datatype != declared[tensor.name]:
                return {}, (
                    f"unexpected datatype {tensor.datatype} for inference input '{tensor.name}', "
                    f"expecting {declared[tensor.name]}"
                )
            if idx < len(request.raw_input_contents):
                value = decode_first_raw(tensor.datatype, request.raw_input_contents[idx])
            else:
                value = decode_first_typed(tensor.datatype, tensor.contents)
            inputs[tensor.name] = value.decode() if isinstance(value, bytes) else value
        return inputs, None

    def _response(self, request: Any, outputs: dict[str, Any], *, final: bool) -> Any:
        declared = self.server.script.declared_outputs()
        resp = self.pb.ModelInferResponse(model_name=self.server.model, model_version="1", id=request.id)
        for name, value in outputs.items():
            dtype = "BYTES" if isinstance(value, str) else declared[name]
            resp.outputs.add(name=name, datatype=dtype, shape=[1])
            resp.raw_output_contents.append(encode_raw(dtype, value))
        resp.parameters["triton_final_response"].bool_param = final
        return self.pb.ModelStreamInferResponse(infer_response=resp)

    async def _one(self, request: Any, queue: asyncio.Queue[Any]) -> None:
        server = self.server
        arrival_ns = time.monotonic_ns()  # before t0: first_ns - arrival_ns is never below ttft_s
        t0 = asyncio.get_running_loop().time()
        empty_final = request.parameters["triton_enable_empty_final_response"].bool_param
        if request.model_name != server.model:
            await queue.put(
                self.pb.ModelStreamInferResponse(
                    error_message=f"Request for unknown model: '{request.model_name}' is not found"
                )
            )
            return
        inputs, problem = self._decode_inputs(request)
        problem = problem or server._triton_check(inputs)
        if problem:
            await queue.put(self.pb.ModelStreamInferResponse(error_message=problem))
            return
        n = server._admit("triton-grpc", inputs)
        try:
            fail = server._fails(n)
            if fail and not server.script.fail_midstream:
                await queue.put(self.pb.ModelStreamInferResponse(error_message="scripted failure"))
                return
            plan = server._triton_plan(inputs)
            streaming = bool(inputs.get("streaming", False))
            separate = server.script.grpc_separate_final and empty_final
            first_ns = 0
            try:
                last = len(plan.chunks) - 1
                async for i in server._schedule(plan, t0, fail=fail, n=n):
                    now_ns = time.monotonic_ns()
                    first_ns = first_ns or now_ns
                    if not streaming and i < last:
                        continue
                    outputs = server._triton_outputs(
                        inputs, plan, i, arrival_ns=arrival_ns, first_ns=first_ns, now_ns=now_ns
                    )
                    await queue.put(self._response(request, outputs, final=(i == last and not separate)))
                if separate:
                    await queue.put(self._response(request, {}, final=True))
            except _RequestFailed as exc:
                await queue.put(self.pb.ModelStreamInferResponse(error_message=str(exc)))
        finally:
            server._release()

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()
        tasks: set[asyncio.Task[None]] = set()

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(self._one(request, queue))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await queue.put(done)

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


class ScriptedServerThread:
    """Run a ScriptedServer on its own event loop in a daemon thread (for synchronous callers).

    >>> with ScriptedServerThread(Script(ttft_s=0.01)) as srv:
    ...     srv.http_url  # doctest: +SKIP
    """

    def __init__(self, script: Script | None = None, **kwargs: Any) -> None:
        self.server = ScriptedServer(script, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scripted-server", daemon=True)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)
        return self.server

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()


async def run_until_cancelled(server: ScriptedServer, *, announce: bool = True) -> None:
    """Start, print one JSON line with the URLs on stdout, serve until cancelled (Ctrl-C)."""
    await server.start()
    if announce:
        print(json.dumps({"http_url": server.http_url, "grpc_url": server.grpc_url}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.bench.scripted_server` (from the repository root): serve until Ctrl-C and
    print {"http_url", "grpc_url"} on stdout."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.bench.scripted_server", description=main.__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0 = any free port)")
    ap.add_argument("--grpc-port", type=int, default=0, help="gRPC port (0 = any free port, -1 = no gRPC)")
    ap.add_argument("--model", default="tensorrt_llm")
    ap.add_argument("--ttft", type=float, default=0.05, help="seconds to the first chunk")
    ap.add_argument("--chunk-gap", type=float, default=0.02, help="seconds between chunks")
    ap.add_argument("--first-chunk-tokens", type=int, default=1)
    ap.add_argument("--tokens-per-chunk", default="4", help="tokens per later chunk (a comma list is cycled)")
    ap.add_argument("--draft-len", type=int, default=7, help="drafted tokens per round (block_size - 1)")
    ap.add_argument(
        "--natural-output-tokens", type=int, help="stop after this many unless ignore_eos/min_tokens"
    )
    ap.add_argument(
        "--flavor", choices=FLAVORS, default="dflash", help="our model's I/O, or NVIDIA's llmapi model's"
    )
    ap.add_argument("--fail-every", type=int, default=0, help="every N-th request fails (0 = never)")
    ap.add_argument(
        "--start-together", type=int, default=0, help="hold first chunks until this many requests are in"
    )
    args = ap.parse_args(argv)
    try:
        script = Script(
            ttft_s=args.ttft,
            chunk_gap_s=args.chunk_gap,
            first_chunk_tokens=args.first_chunk_tokens,
            tokens_per_chunk=tuple(int(k) for k in args.tokens_per_chunk.split(",")),
            draft_len=args.draft_len,
            natural_output_tokens=args.natural_output_tokens,
            flavor=args.flavor,
            fail_every=args.fail_every,
            start_together=args.start_together,
        )
    except ValueError as exc:
        ap.error(str(exc))
    grpc_port = None if args.grpc_port < 0 else args.grpc_port
    server = ScriptedServer(
        script, model=args.model, host=args.host, http_port=args.port, grpc_port=grpc_port
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_until_cancelled(server))


if __name__ == "__main__":
    main()
