# SPDX-License-Identifier: Apache-2.0
"""What `LLM.generate_async` returns: a request's outputs as they arrive, for sync and async callers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

from dflash_trt.api.outputs import CompletionOutput, Logprob, RequestOutput, best_of, merged
from dflash_trt.api.params import SamplingParams
from dflash_trt.errors import EngineDeadError


class Wakes:
    """One step's outputs for async consumers, grouped by event loop: `send` wakes each loop once to
    queue all of its outputs. At 64 requests a step, one wake-up (a write to the loop's self-pipe and a
    callback) per output was 64 of them per step."""

    def __init__(self) -> None:
        self._by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]
        ] = {}

    def add(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[RequestOutput], item: RequestOutput
    ) -> None:
        self._by_loop.setdefault(loop, []).append((queue, item))

    def send(self) -> None:
        for loop, items in self._by_loop.items():
            with contextlib.suppress(RuntimeError):  # that consumer's loop is closed
                loop.call_soon_threadsafe(_put_all, items)
        self._by_loop = {}


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class GenerationHandle:
    """What `generate_async` returns: await it, iterate it (sync or async), or abort it.

    Async iteration binds the handle to an event loop: the loop running where the handle was created
    (TensorRT-LLM's rule), or else the loop that first iterates it, so a server may create handles on
    a worker thread and consume them on its loop. A streaming consumer that falls behind the engine
    gets the outputs that arrived meanwhile as one (`outputs.merged`: the latest snapshot, their diffs
    concatenated): under load a server then sends one response per request per wake-up instead of
    one per engine step, and does not fall further behind. Sync iteration yields every output.
    A request that ends because the engine stopped (it raised, wedged, or was shut down) raises
    EngineDeadError from `result()` and from iteration.
    With n > 1 (or best_of) the request is several engine sequences (`request_ids`); each output
    carries every sequence's latest state (`record`), and the request finishes when all have.
    """

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
        self.leader: Any = None  # the engine request that holds the prompt (llm.py; its cached tokens)
        self.request_ids: list[int] = []  # the engine sequences (n > 1: several)
        count = sampling_params.num_sequences
        # per sequence: its converted log-probabilities so far (llm.py), and its latest output
        self.logprob_rows: list[list[dict[int, Logprob]]] = [[] for _ in range(count)]
        self._sequences: list[CompletionOutput | None] = [None] * count
        self.prompt_rows: list[dict[int, Logprob] | None] | None = None  # prompt_logprobs, converted once
        self._cond = threading.Condition()
        # what iteration yields: every output when streaming, else only the final one
        self._items: list[RequestOutput] = []
        self._last: RequestOutput | None = None  # the newest output, streamed or not (what fail() extends)
        self._done = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue[RequestOutput] | None = None
        with contextlib.suppress(RuntimeError):  # no loop running here: bind on first async iteration
            self._bind(asyncio.get_running_loop())

    def _bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[RequestOutput]:
        """Bind to `loop` (on that loop's thread): outputs already delivered are queued first."""
        with self._cond:
            if self._aqueue is None:
                self._aqueue = asyncio.Queue()
                for item in self._items:
                    self._aqueue.put_nowait(item)
                self._loop = loop
            return self._aqueue

    def push(self, item: RequestOutput, wakes: Wakes | None = None) -> None:
        """Deliver one output (the LLM's engine thread, or its watchdog). Ignored once finished. With
        `wakes`, an async consumer's loop is woken by `wakes.send()`, once for all of a step's outputs,
        instead of once for this one."""
        with self._cond:
            if self._done:
                return
            self._last = item
            keep = self.streaming or item.finished
            if item.finished:
                self._done = True
            if keep:
                self._items.append(item)
            self._cond.notify_all()
            loop, queue = self._loop, self._aqueue
        if keep and loop is not None and queue is not None:
            if wakes is not None:
                wakes.add(loop, queue, item)
                return
            with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
                loop.call_soon_threadsafe(queue.put_nowait, item)

    def record(self, comp: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """Keep sequence comp.index's newest output (the engine thread). Returns every sequence's
        output (the others without news: empty diffs) and whether all have finished; then, with
        best_of > n, the n best (`outputs.best_of`)."""
        self._sequences[comp.index] = comp
        empty: list[dict[int, Logprob]] | None = [] if self.sampling_params.logprobs is not None else None
        outputs = [  # a sequence with no output yet: empty (with logprobs asked for, an empty list of them)
            CompletionOutput(index=i, text="", token_ids=[], logprobs=empty) if c is None
            else c if c is comp else replace(c, text_diff="", token_ids_diff=[])
            for i, c in enumerate(self._sequences)
        ]  # fmt: skip
        done = all(c.finish_reason is not None for c in outputs)
        n = self.sampling_params.n
        if done and len(outputs) > n:
            outputs = best_of(outputs, n)
            if self.sampling_params.logprobs is None:  # ranked by it, not asked for it
                outputs = [replace(c, cumulative_logprob=None) for c in outputs]
        return outputs, done

    def fail(self, cause: str) -> None:
        """End the request with finish_reason 'error' and `cause`, keeping what it produced so far."""
        with self._cond:
            last = self._last
        outputs = [
            CompletionOutput(index=c.index, text=c.text, token_ids=list(c.token_ids), finish_reason="error")
            for c in (last.outputs if last is not None else [])
        ] or [CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")]
        self.push(
            RequestOutput(
                request_id=self.request_id,
                prompt=self.prompt,
                prompt_token_ids=self.prompt_token_ids,
                outputs=outputs,
                finished=True,
                error=cause,
            )
        )

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Cancel the request: it finishes with finish_reason 'cancelled' and frees its slot."""
        self._on_abort(self)

    @staticmethod
    def _checked(item: RequestOutput) -> RequestOutput:
        if item.error is not None:
            raise EngineDeadError(item.error, hint="retry the request on a running engine", output=item)
        return item

    def result(self, timeout: float | None = None) -> RequestOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
                self._cond.wait(left)
            return self._checked(self._items[-1])

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
                while i >= len(self._items) and not self._done:
                    self._cond.wait()
                if i >= len(self._items):
                    return
                item = self._items[i]
            i += 1
            yield self._checked(item)
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        queue = self._aqueue if self._aqueue is not None else self._bind(asyncio.get_running_loop())
        if self._loop is not asyncio.get_running_loop():
            raise RuntimeError("this request is bound to another event loop; iterate it there")
        while True:
            item = await queue.get()
            while not item.finished and not queue.empty():  # behind: what arrived meanwhile, as one
                item = merged(item, queue.get_nowait())
            yield self._checked(item)
            if item.finished:
                return
