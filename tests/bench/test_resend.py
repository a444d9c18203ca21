# SPDX-License-Identifier: Apache-2.0
"""A POST that fails before the server answered, on a connection the server had already closed
(llama-server closes its kept-alive connections after each streamed response), is sent again: a failed
write, or a read that finds a kept-alive connection closed. Any other failure (an answer, or a fresh
connection closed unanswered) is the request's error, never retried."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from dflash_trt.bench.clients import RESEND_ATTEMPTS, Sampling, make_client
from dflash_trt.bench.metrics import RawResult


class _Response:
    status = 200

    def __init__(self, events: list[bytes]) -> None:
        self.content = _Content(events)

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Content:
    def __init__(self, events: list[bytes]) -> None:
        self._chunks = [b"data: " + e + b"\n\n" for e in events]

    async def iter_any(self):
        for c in self._chunks:
            yield c

    def __aiter__(self):
        return self.iter_any()

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


class _Session:
    """post() fails with `failures` (exceptions raised before any response), then streams."""

    def __init__(self, failures: list[BaseException], events: list[bytes]) -> None:
        self.failures, self.events, self.posts = list(failures), events, 0

    reused = False  # every POST goes out on a kept-alive connection (what aiohttp's trace signal reports)

    def post(self, *args: object, **kwargs: object) -> _Response:
        self.posts += 1
        ctx = kwargs.get("trace_request_ctx")
        if self.reused and isinstance(ctx, dict):
            ctx["reused"] = True
        if self.failures:
            raise self.failures.pop(0)
        return _Response(self.events)


def _run(failures: list[BaseException], session: _Session | None = None) -> tuple[RawResult, list, int]:
    """One request through the OpenAI client's stream, on `session` (default: one that fails with
    `failures` before answering, then streams one event)."""
    client = make_client("openai-completions", "http://127.0.0.1:9", "m", Sampling(), request_timeout_s=5,
                         max_streams=1)  # fmt: skip
    client._aiohttp = aiohttp  # type: ignore[attr-defined]
    event = {"choices": [{"text": "hi", "index": 0, "finish_reason": None}]}
    client._session = session or _Session(failures, [json.dumps(event).encode(), b"[DONE]"])  # type: ignore[attr-defined]
    raw = RawResult(index=0)

    async def go() -> list:
        return [e async for e in client._stream("/v1/completions", b"{}", raw)]  # type: ignore[attr-defined]

    got = asyncio.run(go())
    return raw, got, client._session.posts  # type: ignore[attr-defined]


def _closed() -> BaseException:
    return aiohttp.ClientOSError(32, "Can not write request body for http://127.0.0.1:9/v1/completions")


def test_a_post_the_server_never_saw_is_sent_again() -> None:
    raw, events, posts = _run([_closed()])
    assert raw.error is None and raw.resends == 1 and posts == 2 and len(events) == 1
    assert raw.done_t is not None and raw.done_t >= raw.send_t > 0  # one clock from the first send


def test_resends_are_bounded_and_other_failures_are_errors() -> None:
    raw, events, posts = _run([_closed()] * (RESEND_ATTEMPTS + 1))
    assert posts == RESEND_ATTEMPTS + 1 and raw.resends == RESEND_ATTEMPTS and events == []
    assert raw.error is not None and "Can not write request body" in raw.error
    # a fresh connection closed unanswered: the server may have seen the request
    raw, _, posts = _run([aiohttp.ServerDisconnectedError()])
    assert posts == 1 and raw.resends == 0 and "ServerDisconnectedError" in (raw.error or "")


def test_a_kept_alive_connection_closed_before_the_answer_is_sent_again() -> None:
    event = {"choices": [{"text": "hi", "index": 0, "finish_reason": None}]}
    session = _Session([aiohttp.ServerDisconnectedError()], [json.dumps(event).encode(), b"[DONE]"])
    session.reused = True
    raw, events, posts = _run([], session)
    assert raw.error is None and raw.resends == 1 and posts == 2 and len(events) == 1


def test_against_a_server_that_closes_its_kept_alive_connections() -> None:
    """A real socket: the server answers a request with keep-alive, then closes that connection
    without answering the next one sent on it (what llama-server's closes look like to a client). The
    second request is sent again on a fresh connection; a request whose fresh connection is closed
    unanswered stays an error."""
    body = b'data: {"choices": [{"text": "hi", "index": 0, "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    seen: list[int] = []  # requests read per connection, in connection order

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(0)
        me = len(seen) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                seen[me] += 1
                # the kept-alive connection's next request, or any request once closing_fresh: unanswered
                if seen[me] > 1 or closing_fresh:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def go() -> list[RawResult]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = make_client("openai-completions", f"http://127.0.0.1:{port}", "m", Sampling(), request_timeout_s=5,
                             max_streams=1)  # fmt: skip
        await client.open()
        raws = [RawResult(index=i) for i in range(3)]
        try:
            for raw in raws[:2]:
                _ = [e async for e in client._stream("/v1/completions", b"{}", raw)]  # type: ignore[attr-defined]
            nonlocal closing_fresh
            closing_fresh = True
            await client.close()
            await client.open()  # a fresh pool: the next POST opens a new connection, closed unanswered
            _ = [e async for e in client._stream("/v1/completions", b"{}", raws[2])]  # type: ignore[attr-defined]
        finally:
            await client.close()
            server.close()
            await server.wait_closed()
        return raws

    closing_fresh = False
    first, second, third = asyncio.run(go())
    assert first.error is None and first.resends == 0
    assert second.error is None and second.resends == 1  # closed on the kept-alive connection, sent again
    assert seen == [2, 1, 1]  # requests read per connection: answered + closed, answered, closed
    assert third.resends == 0 and (third.error or "").startswith("ServerDisconnectedError")


def test_a_server_answer_is_never_resent() -> None:
    class _Busy(_Response):
        status = 503

        async def text(self) -> str:
            return "busy"

    class _BusySession(_Session):
        def post(self, *args: object, **kwargs: object) -> _Response:
            self.posts += 1
            return _Busy([])

    raw, events, posts = _run([], _BusySession([], []))
    assert events == [] and posts == 1 and raw.resends == 0 and (raw.error or "").startswith("HTTP 503")
