# SPDX-License-Identifier: Apache-2.0
"""The aiohttp application: routes, SSE streaming, errors in OpenAI's shape, disconnects.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /health` (200 when Triton and the model are ready, else 503:
the readiness probe), `GET /health/live` (the front's event loop answers: the liveness probe).

With an API key (FrontConfig.api_key) every route but the two health probes needs
`Authorization: Bearer <key>`; anything else is a 401 in OpenAI's error shape (`_auth`), and the
front sends the same key to Triton's gRPC endpoint.

A client that disconnects cancels its handler (`handler_cancellation=True`), which closes the
upstream generator, which cancels the Triton stream: the model aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from dflash_trt.errors import UsageError
from dflash_trt.openai_front import protocol as P
from dflash_trt.openai_front.chat import ChatTemplate
from dflash_trt.openai_front.parsers import OutputFormat
from dflash_trt.openai_front.parsers.guides import tool_call_guide
from dflash_trt.openai_front.parsers.think import opens_thinking
from dflash_trt.openai_front.upstream import Piece, Upstream
from dflash_trt.utils.api_key import HTTP_HEADER, ApiKey

log = logging.getLogger(__name__)

KEY_CFG: web.AppKey[FrontConfig] = web.AppKey("cfg")
KEY_UP: web.AppKey[Upstream] = web.AppKey("upstream")
KEY_CHAT: web.AppKey[ChatTemplate | None] = web.AppKey("chat")
SHUTDOWN_GRACE_S = 30.0  # in-flight requests get this long to finish on shutdown, then are cancelled
OPEN_PATHS = frozenset({"/health", "/health/live"})  # probes answer without the API key


@dataclass
class FrontConfig:
    triton_url: str  # host:port of Triton's gRPC endpoint
    triton_model: str  # the Triton model name
    served_names: list[str]  # OpenAI model ids (the first is listed by /v1/models)
    host: str = "127.0.0.1"
    port: int = 9000
    max_seq_len: int | None = None  # the chat default (what the context leaves) and /v1/models
    created: int = field(default_factory=P.now)
    api_key: ApiKey | None = None  # required from clients, and sent to Triton


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(obj), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except P.OpenAIError as exc:
        return _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        msg = f"{request.method} {request.path}: {exc.reason}"
        if exc.status == 404:
            msg += "; fix: use /v1/models, /v1/completions or /v1/chat/completions"
        return _json({"error": {"message": msg, "type": kind, "param": None, "code": None}}, exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("request %s %s failed", request.method, request.path)
        err = P.OpenAIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")
        return _json(err.body(), 500)


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    """401 (OpenAI's shape, `WWW-Authenticate: Bearer`) unless the request carries the key."""
    key = request.app[KEY_CFG].api_key
    if key is None or request.path in OPEN_PATHS:
        return await handler(request)
    presented = request.headers.get(HTTP_HEADER)
    if key.accepts(presented):
        return await handler(request)
    if presented:
        message = "Incorrect API key provided; fix: send the server's key as `Authorization: Bearer <key>`"
    else:
        message = (
            "No API key provided; fix: send `Authorization: Bearer <key>` (the key serve was started with)"
        )
    err = P.OpenAIError(message, status=401, code="invalid_api_key")
    resp = _json(err.body(), 401)
    resp.headers["WWW-Authenticate"] = 'Bearer realm="dflash-trt"'
    return resp


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise P.OpenAIError(
            f"the request body is not valid JSON ({exc}); fix: send a JSON object", param=None
        ) from None


# ---------------------------------------------------------------------------------------- routes
async def models(request: web.Request) -> web.Response:
    cfg = request.app[KEY_CFG]
    return _json({"object": "list", "data": [_model_card(cfg, n) for n in cfg.served_names]})


async def model(request: web.Request) -> web.Response:
    cfg = request.app[KEY_CFG]
    name = request.match_info["model"]
    if name not in cfg.served_names:
        raise P.OpenAIError(
            f"model={name!r}: not served here; fix: use one of {', '.join(cfg.served_names)}",
            param="model", status=404, type="not_found_error", code="model_not_found",
        )  # fmt: skip
    return _json(_model_card(cfg, name))


def _model_card(cfg: FrontConfig, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": cfg.created, "owned_by": "dflash-trt"}
    if cfg.max_seq_len:
        card["max_model_len"] = cfg.max_seq_len
    return card


async def health(request: web.Request) -> web.Response:
    ok = await request.app[KEY_UP].ready()
    return _json({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)


async def live(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[KEY_CFG]
    gen = P.parse_completions(await _body(request), cfg.served_names)
    return await _run(request, gen)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[KEY_CFG]
    gen = P.parse_chat(await _body(request), cfg.served_names)
    chat = request.app[KEY_CHAT]
    if chat is None:
        raise P.OpenAIError(
            "messages: this front was started without a tokenizer, so it has no chat template; "
            "fix: use /v1/completions, or start it with the bundle", param="messages", code="chat_template_missing",
        )  # fmt: skip
    assert gen.messages is not None
    gen.prompt = chat.render(
        gen.messages, gen.chat_template_kwargs, gen.tools if gen.tool_choice != "none" else None
    )
    _answer_format(gen, chat.format)
    if gen.max_tokens is None and cfg.max_seq_len is not None:
        # OpenAI's chat default: what the context leaves. A prompt that leaves nothing goes as it is
        # (with the model's default max_tokens): the engine refuses it, naming the prompt.
        left = cfg.max_seq_len - chat.count(gen.prompt)
        gen.max_tokens = left if left >= 1 else None
    return await _run(request, gen)


def _answer_format(gen: P.Generation, fmt: OutputFormat) -> None:
    """How the answer is read (a parser per choice, reasoning_content or not), and with a required
    or named tool choice the guide that forces the call (parsers.guides)."""
    prompt, tools = gen.prompt or "", bool(gen.tools) and gen.tool_choice != "none"
    gen.reasons = fmt.reasons
    gen.parser = lambda: fmt.parser(prompt, tools=tools)
    gen.keep_special_tokens = fmt.harmony  # its markers are special tokens: the model must send them
    if gen.tool_choice in ("required", "function"):
        functions = [f for f in gen.tools if gen.tool_choice == "required" or f["name"] == gen.tool_name]
        one = gen.tool_choice == "function" or not gen.parallel_tool_calls
        gen.guide_type, gen.guide = tool_call_guide(functions, harmony=fmt.harmony, one=one,
                                                    thinking=fmt.think and opens_thinking(prompt))  # fmt: skip


# ---------------------------------------------------------------------------------------- generation
async def _run(request: web.Request, gen: P.Generation) -> web.StreamResponse:
    rid = P.new_id(gen.kind)
    created = P.now()
    pieces = request.app[KEY_UP].generate(gen, rid)
    async with contextlib.aclosing(pieces):
        if not gen.stream:
            out = P.Outcome()
            async for piece in pieces:
                _fold(out, piece, delta=False)
            return _json(P.full_response(gen, rid, created, out, _token_text(request.app[KEY_CHAT])))
        # The first response decides the status: a request the model refuses is a 400, not an SSE error.
        first = await anext(pieces)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        try:
            await _stream(resp, gen, rid, created, first, pieces, _token_text(request.app[KEY_CHAT]))
        except P.OpenAIError as exc:  # a failure after the headers went out: an SSE error event
            await _event(resp, exc.body())
        except ConnectionResetError:  # the client left mid-stream: leaving `aclosing` cancels its request
            log.debug("%s: the client closed the stream; request cancelled", rid)
            return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _fold(out: P.Outcome, piece: Piece, *, delta: bool) -> None:
    """Keep a response's news in `out`: counts and finish reasons always; text and log-probabilities
    only for a full response (a stream sends them straight out)."""
    if piece.prompt_tokens is not None:
        out.prompt_tokens = int(piece.prompt_tokens)
    if piece.cached_tokens is not None:
        out.cached_tokens = int(piece.cached_tokens)
    if piece.final:
        out.stats = piece.stats
    if piece.prompt_logprobs is not None:
        out.prompt_ids, out.prompt_logprobs = piece.prompt_ids, piece.prompt_logprobs
    for i, seq in enumerate(piece.seqs):
        choice = out.choice(i)
        if seq.completion_tokens is not None:
            choice.completion_tokens = int(seq.completion_tokens)
        if piece.final:
            choice.finish_reason = seq.finish_reason
        if not delta:
            choice.text = seq.text
            if seq.logprobs is not None:
                choice.logprobs = seq.logprobs


def _token_text(chat: ChatTemplate | None) -> Any:
    """A token id's text (its own decoding, special tokens included), or "token_id:N" without a tokenizer."""
    if chat is None or chat.tokenizer is None:
        return lambda t: f"token_id:{t}"
    return lambda t: chat.tokenizer.decode([t], skip_special_tokens=False)


async def _event(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


class _ChoiceStream:
    """What one streamed choice has sent: its role (chat's first chunk), the text a stop string may
    still claim (`StopHoldback`), and how many tokens' log-probabilities and characters went out."""

    def __init__(self, gen: P.Generation) -> None:
        self.role = gen.kind == "chat"
        self.echo = gen.prompt if gen.echo else None  # completions' echo: the prompt goes out first
        self.holdback = P.StopHoldback(gen.stop) if gen.stop else None  # Triton then sends accumulated text
        self.rows = 0
        self.chars = 0
        self.parser = gen.parser() if gen.parser is not None else None  # reasoning and tool calls apart
        self.called = False  # a tool call went out

    def news(self, gen: P.Generation, seq: Any, final: bool, token_text: Any) -> tuple[str, Any]:
        """This response's new text and the logprobs object of its new tokens (None without)."""
        text = seq.text if self.holdback is None else self.holdback.delta(seq.text, final=final)
        if self.echo is not None:
            text, self.echo = self.echo + text, None
        logprobs = None
        if seq.logprobs is not None:  # every token so far when the text is accumulated
            rows = seq.logprobs if self.holdback is None else seq.logprobs[self.rows :]
            self.rows += len(rows)
            logprobs = P.logprobs_body(gen, rows, token_text, offset=self.chars) if rows else None
        self.chars += len(text)
        return text, logprobs


async def _stream(
    resp: web.StreamResponse,
    gen: P.Generation,
    rid: str,
    created: int,
    first: Piece,
    rest: AsyncIterator[Piece],
    token_text: Any,
) -> None:
    """SSE chunks: each choice's news per response (its index on every chunk), each choice's finish
    reason with the final response, then the usage chunk if asked."""
    out = P.Outcome()
    streams: list[_ChoiceStream] = []

    async def pieces() -> AsyncIterator[Piece]:
        yield first
        async for p in rest:
            yield p

    async for piece in pieces():
        _fold(out, piece, delta=True)
        running = P.usage(out) if gen.continuous_usage else None
        for i, seq in enumerate(piece.seqs):
            if i == len(streams):
                streams.append(_ChoiceStream(gen))
            cs = streams[i]
            text, logprobs = cs.news(gen, seq, piece.final, token_text)
            if cs.parser is not None:
                await _parsed(resp, gen, rid, created, cs, text, piece.final, seq.finish_reason, running,
                              logprobs, P.dflash_stats(out) if piece.final else None, index=i)  # fmt: skip
            elif piece.final:
                fr = P.finish_reason(seq.finish_reason) or "stop"
                await _event(resp, P.chunk(gen, rid, created, text=text, finish=fr, role=cs.role, usage_obj=running,
                                           stats=P.dflash_stats(out), index=i, logprobs=logprobs))  # fmt: skip
            elif text or cs.role or logprobs is not None:
                await _event(resp, P.chunk(gen, rid, created, text=text, role=cs.role, usage_obj=running, index=i,
                                           logprobs=logprobs))  # fmt: skip
                cs.role = False
        if piece.final:
            break
    if gen.include_usage:
        await _event(resp, P.chunk(gen, rid, created, text=None, usage_obj=P.usage(out), no_choice=True))


async def _parsed(
    resp: web.StreamResponse, gen: P.Generation, rid: str, created: int, cs: _ChoiceStream, text: str,
    final: bool, finish: str | None, running: Any, logprobs: Any, stats: Any, *, index: int,
) -> None:  # fmt: skip
    """A parsed choice's chunks: its reasoning and content, then each tool-call piece in its own chunk
    (the call's id and name first, then argument fragments), then with the final response a chunk
    with the finish reason ("tool_calls" when it called tools)."""
    assert cs.parser is not None
    delta = cs.parser.feed(text)
    if final:
        delta.add(cs.parser.finish())
    if delta.reasoning or delta.content or cs.role or logprobs is not None:
        await _event(resp, P.chunk(gen, rid, created, text=delta.content or None, reasoning=delta.reasoning,
                                   role=cs.role, usage_obj=running, index=index, logprobs=logprobs))  # fmt: skip
        cs.role = False
    for call in delta.tool_calls:
        cs.called = True
        await _event(resp, P.chunk(gen, rid, created, text=None, tool_calls=[call.body()], usage_obj=running,
                                   index=index))  # fmt: skip
    if final:
        fr = P.finish_reason(finish) or "stop"
        fr = "tool_calls" if cs.called and fr == "stop" else fr
        await _event(resp, P.chunk(gen, rid, created, text=None, finish=fr, usage_obj=running, stats=stats,
                                   index=index))  # fmt: skip


# ---------------------------------------------------------------------------------------- app
def build_app(cfg: FrontConfig, upstream: Upstream, chat: ChatTemplate | None) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=64 * 1024**2)
    app[KEY_CFG] = cfg
    app[KEY_UP] = upstream
    app[KEY_CHAT] = chat
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)

    async def on_cleanup(_app: web.Application) -> None:
        await upstream.close()

    app.on_cleanup.append(on_cleanup)
    return app


class FrontThread:
    """The front on its own event loop in a daemon thread (what `dflash-trt serve` runs next to
    tritonserver). start() returns once the port is bound, or raises why it could not be."""

    def __init__(self, cfg: FrontConfig, chat: ChatTemplate | None) -> None:
        self.cfg = cfg
        self.chat = chat
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="openai-front", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def start(self, timeout: float = 30.0) -> FrontThread:
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"the OpenAI front did not start within {timeout:g} s")
        if isinstance(self._error, OSError):
            raise UsageError(
                f"--openai-port={self.cfg.port}: cannot listen on {self.cfg.host}:{self.cfg.port} ({self._error})",
                hint="pick a free port",
            ) from self._error
        if self._error is not None:
            raise self._error
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._started.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        upstream = Upstream(self.cfg.triton_url, self.cfg.triton_model, api_key=self.cfg.api_key)
        app = build_app(self.cfg, upstream, self.chat)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S,
                                     access_log=None)  # fmt: skip
        await self._runner.setup()
        await web.TCPSite(self._runner, self.cfg.host, self.cfg.port).start()

    def stop(self) -> None:
        """Stop listening, let in-flight requests finish (up to SHUTDOWN_GRACE_S), then cancel the rest."""
        if not self._thread.is_alive():
            return
        if self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            with contextlib.suppress(Exception):
                fut.result(SHUTDOWN_GRACE_S + 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
