# SPDX-License-Identifier: Apache-2.0
# Copied verbatim into model repositories as dflash_trt_llmapi/; edit dflash_trt/triton/llmapi/, never a copy.
"""What the model tells its supervisor (serve, the chart's probes) through $DFLASH_TRT_CONTROL_DIR.

Engine liveness: with $DFLASH_TRT_CONTROL_DIR set, the model's event loop touches `heartbeat` there
every second while the engine serves. Once the engine is dead (its thread raised, or it wedged:
`ServingLLM.engine_error`), the heartbeat stops, every request in flight has already ended with an
UNAVAILABLE error naming the cause, new requests get UNAVAILABLE at once, and the model writes the
cause to `engine-dead` there: a supervisor restarts the server. A stale heartbeat alone means a
wedged stub process.

Drain: with $DFLASH_TRT_CONTROL_DIR set, the file `drain` appearing there (its content: the drain
budget in seconds; empty or unreadable: DEFAULT_DRAIN_S) puts the model into draining: new requests
get UNAVAILABLE (HTTP 503), in-flight requests run on until the budget is spent, and whatever is left
then ends with an explicit UNAVAILABLE error. Once nothing is in flight the model shuts its engine
down and writes `drained` there; finalize() writes `finalized`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .metrics import POLL_S

if TYPE_CHECKING:
    from dflash_trt.api.serving import ServingLLM

    from .tracking import RequestTracker

CONTROL_DIR_ENV = "DFLASH_TRT_CONTROL_DIR"
DEFAULT_DRAIN_S = 30.0
HEARTBEAT_S = 1.0
DEAD_MARKER = "engine-dead"
REPORT_DEAD_WITHIN_S = 2.0  # error responses go out before the marker asks for a restart


def write_marker(path: Path, text: str) -> None:
    """Write a marker file whole (a reader never sees it half written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def drain_budget(text: str) -> float:
    """The budget in seconds a `drain` file holds: DEFAULT_DRAIN_S when it is empty or not a number."""
    text = text.strip()
    try:
        budget = float(text) if text else DEFAULT_DRAIN_S
    except ValueError:
        budget = DEFAULT_DRAIN_S
    return max(0.0, budget)


class Liveness:
    """The control directory's files, as the model's event loop keeps them. Without a control dir
    (None) the engine is still watched and its death still logged; only the files are skipped."""

    def __init__(self, pb: Any, *, control_dir: Path | None, model_name: str) -> None:
        self._pb = pb
        self.control_dir = control_dir
        self._model_name = model_name
        self._last_beat = -1e9
        self._dead_report: asyncio.Future[None] | None = None
        if control_dir is not None:  # a restarted container keeps its control dir (an emptyDir)
            (control_dir / DEAD_MARKER).unlink(missing_ok=True)

    @classmethod
    def from_env(cls, pb: Any, *, model_name: str) -> Liveness:
        env_dir = os.environ.get(CONTROL_DIR_ENV)
        return cls(pb, control_dir=Path(env_dir) if env_dir else None, model_name=model_name)

    # --- engine liveness ------------------------------------------------------------------------
    async def watch_engine(
        self, llm: ServingLLM, tracker: RequestTracker, publish: Callable[[ServingLLM], None]
    ) -> None:
        """Every POLL_S: `publish` the engine's counters, then its liveness into the heartbeat
        (alive) or the engine-dead report (dead). Runs until cancelled."""
        while True:
            try:
                publish(llm)
            except Exception as exc:  # metrics must never take the model down
                self._pb.Logger.log_warn(f"engine stats poll failed: {exc}")
            cause = llm.engine_error
            if cause is None:
                self._heartbeat()
            elif self._dead_report is None:
                self._dead_report = asyncio.ensure_future(self._report_dead(cause, tracker))
            await asyncio.sleep(POLL_S)

    def _heartbeat(self) -> None:
        """Touch `heartbeat` (at most once a second) while the engine serves: a supervisor that sees
        it go stale knows the stub or its engine is wedged, though Triton still reports the model ready."""
        now = time.monotonic()
        if self.control_dir is None or now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        with contextlib.suppress(OSError):
            (self.control_dir / "heartbeat").touch()

    async def _report_dead(self, cause: str, tracker: RequestTracker) -> None:
        """The engine died: its requests have ended with errors; once those are sent (or after
        REPORT_DEAD_WITHIN_S), write the cause to `engine-dead` for the supervisor."""
        self._pb.Logger.log_error(
            f"{self._model_name}: the engine is dead ({cause}); new requests get UNAVAILABLE. "
            "Restart the server (serve exits 1; the chart's probes fail)."
        )
        give_up = time.monotonic() + REPORT_DEAD_WITHIN_S
        while tracker.in_flight() and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        if self.control_dir is not None:
            with contextlib.suppress(OSError):
                write_marker(self.control_dir / DEAD_MARKER, cause + "\n")

    # --- drain ----------------------------------------------------------------------------------
    async def watch_drain(self, llm: ServingLLM, tracker: RequestTracker) -> None:
        """Wait for the `drain` file, then drain within its budget: in-flight requests run on, what
        is left then is aborted with an UNAVAILABLE error, and the engine is shut down once nothing
        is in flight. Needs a control dir."""
        assert self.control_dir is not None
        tracker.begin_drain(await self._wait_for_drain())
        assert tracker.drain_deadline is not None
        log = self._pb.Logger
        log.log_info(
            f"{self._model_name}: draining: {tracker.in_flight()} requests in flight, budget "
            f"{tracker.drain_budget:g} s; new requests get UNAVAILABLE"
        )
        while time.monotonic() < tracker.drain_deadline and tracker.in_flight():
            await asyncio.sleep(0.05)
        aborted = tracker.abort_all()
        if aborted:
            log.log_warn(
                f"{self._model_name}: drain budget spent: aborted {aborted} requests with an UNAVAILABLE error"
            )
        give_up = time.monotonic() + 10.0  # aborted requests end within a step; never wait forever
        while tracker.in_flight() and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        # Nothing is in flight and nothing new is admitted: shut the engine down now rather than in
        # finalize(), which Triton calls only once every client stream holding the model has closed
        # (an idle gRPC stream can hold it until the process is killed).
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        (self.control_dir / "drained").write_text(f"aborted={aborted} in_flight={tracker.in_flight()}\n")
        log.log_info(f"{self._model_name}: drained ({aborted} aborted); engine shut down")

    async def _wait_for_drain(self) -> float:
        """Poll for the `drain` file until it exists; returns the budget it holds."""
        assert self.control_dir is not None
        marker = self.control_dir / "drain"
        while True:
            await asyncio.sleep(0.1)
            with contextlib.suppress(OSError):
                if marker.exists():
                    return drain_budget(marker.read_text())

    def mark_finalized(self) -> None:
        if self.control_dir is not None:
            with contextlib.suppress(OSError):
                (self.control_dir / "finalized").write_text(f"{time.time():.3f}\n")
