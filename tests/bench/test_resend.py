# SPDX-License-Identifier: Apache-2.0
"""A POST that fails before the server answered, on a connection the server had already closed
(llama-server closes its kept-alive connections after each streamed response), is sent again; any
other failure is the request's error, never retried."""

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

    def post(self, *args: object, **kwargs: object) -> _Response:
        self.posts += 1
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
    raw, _, posts = _run([aiohttp.ServerDisconnectedError()])  # the server may have seen it
    assert posts == 1 and raw.resends == 0 and "ServerDisconnectedError" in (raw.error or "")


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
