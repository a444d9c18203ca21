# SPDX-License-Identifier: Apache-2.0
"""The engine interface a server talks to: what the Triton model needs from an LLM-API object.

`dflash_trt.LLM` implements `ServingLLM` as it is. TensorRT-LLM's `LLM` has the request half
(`generate_async`, `shutdown`) with the same output shapes; the Triton model adapts the rest
(liveness, counters) and TensorRT-LLM's loop rule in one small class (`TensorRTLLM` in
triton/llmapi/startup.py), which the contract test drives through a stand-in.

Contract:
- `generate_async` may be called on any thread. It tokenizes and validates: a bad request raises
  ValueError (dflash-trt's RequestError is one). The stream binds to an event loop when it is first
  iterated asynchronously.
- A request that ends because the engine stopped raises from iteration (EngineDeadError here).
- `engine_error` is None while the engine serves, else the cause of its death (the exception type
  and message, or "wedged for N s"). A clean `shutdown()` is not a death.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol


class CompletionView(Protocol):
    """One sequence of an output (TensorRT-LLM's CompletionOutput fields that serving reads)."""

    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def text_diff(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> int | str | None: ...
    @property
    def request_perf_metrics(self) -> Any: ...


class OutputView(Protocol):
    """One snapshot of a request (TensorRT-LLM's RequestOutput fields that serving reads)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def outputs(self) -> Sequence[CompletionView]: ...
    @property
    def finished(self) -> bool: ...


class RequestStream(Protocol):
    """A request in flight: its outputs as they arrive, and a way to cancel it."""

    def abort(self) -> None: ...
    def __aiter__(self) -> AsyncIterator[OutputView]: ...


class ServingLLM(Protocol):
    """What a server needs from an engine (see the module docstring for the contract)."""

    def generate_async(
        self, inputs: str, sampling_params: Any = None, streaming: bool = False
    ) -> RequestStream:
        """Queue one request; raises ValueError for a bad one."""
        ...

    def shutdown(self) -> None: ...

    @property
    def engine_error(self) -> str | None:
        """None while the engine serves; else why it died."""
        ...

    def get_stats(self) -> dict[str, Any]:
        """Engine counters: waiting, active, kv_free_tokens, kv_capacity_tokens (any may be absent)."""
        ...

    def drain_round_times(self) -> list[float]:
        """Durations (s) of the rounds run since the last call."""
        ...
