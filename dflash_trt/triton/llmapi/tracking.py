# SPDX-License-Identifier: Apache-2.0
# Copied verbatim into model repositories as dflash_trt_llmapi/; edit dflash_trt/triton/llmapi/, never a copy.
"""The requests in flight in the model, and how each one ends.

Every request the engine accepted is tracked from submission to its last response, under its
Triton request id (several requests may share one). A request ends exactly once, explicitly:
- its final output: the final response (`finish`);
- the client cancelled (or disconnected): CANCELLED, seen by `watch_cancel` within check_period;
- another request with `stop: true` and the same id: CANCELLED (`stop`);
- the drain budget ran out before it finished: UNAVAILABLE naming the budget (`abort_all`);
- the engine failed it, died or shut down: UNAVAILABLE when the engine is dead or the model
  drains (retry elsewhere), else INTERNAL naming the exception (`fail`).
Never a silent end: a stream that stops without a final output is a failure.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .wire import RequestInputError

if TYPE_CHECKING:
    from dflash_trt.api.serving import OutputView, RequestStream

    from .wire import ParsedRequest, WireCodec


class RequestTracker:
    """In-flight requests by request id, the drain deadline they run under, and their endings.

    `engine_error` returns the dead engine's cause (or None); `on_count` receives the number of
    requests in flight whenever it changes (under the tracker's lock)."""

    def __init__(
        self,
        pb: Any,
        codec: WireCodec,
        *,
        check_period: float,
        engine_error: Callable[[], str | None],
        on_count: Callable[[int], None],
    ) -> None:
        self._pb = pb
        self._codec = codec
        self._check_period = check_period
        self._engine_error = engine_error
        self._on_count = on_count
        self._lock = threading.Lock()
        self._by_id: dict[str, list[RequestStream]] = {}
        self._handles: set[RequestStream] = set()
        self._drain_aborted: set[int] = set()  # id() of handles ended by the drain deadline
        self._active = 0
        self.drain_deadline: float | None = None  # time.monotonic() at which the drain budget ends
        self.drain_budget = 0.0

    # --- admission ------------------------------------------------------------------------------
    def begin_drain(self, budget: float) -> None:
        """From now on no request is admitted; those in flight run on for `budget` seconds."""
        self.drain_budget = max(0.0, budget)
        self.drain_deadline = time.monotonic() + self.drain_budget

    def unavailable_reason(self) -> str | None:
        """Why no request can be served now (a dead engine, draining), or None."""
        cause = self._engine_error()
        if cause is not None:
            return f"the engine is dead ({cause}); this server is restarting, retry on another replica"
        if self.drain_deadline is not None:
            return (
                "the server is shutting down (draining) and takes no new requests; retry on another replica"
            )
        return None

    # --- the requests in flight -----------------------------------------------------------------
    def track(self, rid: str, handle: RequestStream) -> None:
        with self._lock:
            self._active += 1
            self._by_id.setdefault(rid, []).append(handle)
            self._handles.add(handle)
            self._on_count(self._active)
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            self._abort_for_drain(handle)

    def untrack(self, rid: str, handle: RequestStream) -> None:
        with self._lock:
            self._active -= 1
            handles = self._by_id.get(rid, [])
            if handle in handles:
                handles.remove(handle)
            if not handles:
                self._by_id.pop(rid, None)
            self._handles.discard(handle)
            self._drain_aborted.discard(id(handle))
            self._on_count(self._active)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def abort_all(self) -> int:
        """The drain budget is spent: abort every request left (each ends UNAVAILABLE). Returns how many."""
        with self._lock:
            left = list(self._handles)
        for handle in left:
            self._abort_for_drain(handle)
        return len(left)

    def _abort_for_drain(self, handle: RequestStream) -> None:
        with self._lock:
            self._drain_aborted.add(id(handle))
        handle.abort()

    def stop(self, rid: str) -> None:
        """A `stop: true` request: abort the requests in flight under its id."""
        if not rid:
            raise RequestInputError("stop=true needs a request id naming the requests to stop")
        with self._lock:
            handles = list(self._by_id.get(rid, []))
        for h in handles:
            h.abort()

    async def watch_cancel(self, request: Any, handle: RequestStream, cancelled: set[int]) -> None:
        """The one place a client's cancellation is seen: a client that disconnects (or cancels its
        gRPC stream) frees its engine slot within check_period, streaming or not, and the request
        ends with CANCELLED. Cancel this task before the final response is sent: the response
        factory is gone after it (Triton 2.51 crashes in TRITONBACKEND_ResponseFactoryIsCancelled)."""
        while True:
            await asyncio.sleep(self._check_period)
            if request.is_cancelled():
                cancelled.add(id(handle))
                handle.abort()
                return

    # --- endings --------------------------------------------------------------------------------
    def finish(
        self, sender: Any, handle: RequestStream, output: OutputView, parsed: ParsedRequest, *,
        cancelled: bool, tokens: int,
    ) -> None:  # fmt: skip
        """The request's final output arrived: the final response, or the error that says why the
        engine ended it early (the drain budget, a cancellation)."""
        if id(handle) in self._drain_aborted:
            self._codec.send_unavailable(
                sender,
                f"request aborted: the server shut down before it finished (drain budget "
                f"{self.drain_budget:g} s spent) after {tokens} generated tokens; retry it",
            )
        elif cancelled or output.outputs[0].finish_reason == "cancelled":
            self._codec.send_error(sender, "request cancelled", "CANCELLED")
        else:
            self._codec.send_final(sender, self._codec.response(output, parsed))

    def fail(self, sender: Any, rid: str, exc: Exception, *, tokens: int) -> None:
        """A request the engine could not serve: UNAVAILABLE when the engine is dead or the server
        drains (retry elsewhere), else INTERNAL naming the exception."""
        reason = self.unavailable_reason()
        if reason is not None:
            self._codec.send_unavailable(sender, f"request failed after {tokens} generated tokens: {reason}")
            return
        self._pb.Logger.log_error(f"request {rid!r} failed: {type(exc).__name__}: {exc}")
        self._codec.send_error(sender, f"{type(exc).__name__}: {exc}", "INTERNAL")
