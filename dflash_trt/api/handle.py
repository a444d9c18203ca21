# SPDX-License-Identifier: Apache-2.0
"""What `LLM.generate_async` returns: a request's outputs as they arrive, for sync and async callers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from dflash_trt.api.outputs import RequestOutput
from dflash_trt.api.params import SamplingParams


class GenerationHandle:
    """What `generate_async` returns: await it, iterate it (sync or async), or abort it."""

    def __init__(
        self,
        *,
        prompt: str | None,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        streaming: bool,
        on_abort: Callable[[GenerationHandle], None],
    ) -> None:
        self._on_abort = on_abort
        self.sampling_params = sampling_params
        self.prompt = prompt
        self.prompt_token_ids = prompt_ids
        self.streaming = streaming
        self.request_id: int = -1
        self._cond = threading.Condition()
        self._items: list[RequestOutput] = []
        self._done = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue[RequestOutput] | None = None
        try:
            self._loop = asyncio.get_running_loop()
            self._aqueue = asyncio.Queue()
        except RuntimeError:
            pass

    def push(self, item: RequestOutput) -> None:
        """Deliver one output (called by the LLM's engine thread)."""
        with self._cond:
            if item.finished:
                self._done = True
            if self.streaming or item.finished:
                self._items.append(item)
            self._cond.notify_all()
        if self._loop is not None and self._aqueue is not None and (self.streaming or item.finished):
            with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Cancel the request: it finishes with finish_reason 'cancelled' and frees its slot."""
        self._on_abort(self)

    def result(self, timeout: float | None = None) -> RequestOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
                self._cond.wait(left)
            return self._items[-1]

    async def aresult(self) -> RequestOutput:
        last = None
        async for item in self:
            last = item
        assert last is not None
        return last

    def __await__(self):
        return self.aresult().__await__()

    def __iter__(self) -> Iterator[RequestOutput]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._items) and not (self._done and i >= len(self._items)):
                    self._cond.wait()
                if i >= len(self._items):
                    return
                item = self._items[i]
            i += 1
            yield item
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._aqueue is None:
            raise RuntimeError("generate_async() must be called inside a running event loop to iterate it")
        while True:
            item = await self._aqueue.get()
            yield item
            if item.finished:
                return
