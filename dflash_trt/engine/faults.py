# SPDX-License-Identifier: Apache-2.0
"""The fault-injection switch for reliability tests (docs/serving.md, "Failure modes").

`DFLASH_TRT_FAULT_INJECT=engine-raise:N` makes the engine thread raise in its N-th step (one step
runs one round for the running batch), `engine-hang:N` makes it block there until the LLM is shut
down, `engine-slow:N` makes every step take N ms longer (a request that must still be in flight when
a test stops the server, however fast the engine has become). Honoured only when
`DFLASH_TRT_TESTING=1` is also set, and ignored (with a warning) otherwise. The LLM reads the switch
once when it starts; with no fault set the engine's step is not wrapped, so the switch costs nothing
per step.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from dflash_trt.errors import ConfigError

log = logging.getLogger(__name__)

FAULT_ENV = "DFLASH_TRT_FAULT_INJECT"
TESTING_ENV = "DFLASH_TRT_TESTING"
KINDS = ("engine-raise", "engine-hang", "engine-slow")

T = TypeVar("T")


class InjectedFault(RuntimeError):
    """Raised by the engine-raise fault (an exception the engine did not expect, like a kernel failure)."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: Literal["engine-raise", "engine-hang", "engine-slow"]
    n: int  # engine-raise/-hang: the 1-based engine step in which it fires; engine-slow: ms added to every step


def fault_from_env(environ: Mapping[str, str] | None = None) -> Fault | None:
    """The fault the environment asks for, or None. A malformed switch is a ConfigError when testing."""
    env = os.environ if environ is None else environ
    spec = env.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    if env.get(TESTING_ENV) != "1":
        log.warning("%s=%r ignored: fault injection needs %s=1", FAULT_ENV, spec, TESTING_ENV)
        return None
    kind, _, n = spec.partition(":")
    if kind not in KINDS or not n.isdigit() or int(n) < 1:
        raise ConfigError(FAULT_ENV, spec, f"is not one of {', '.join(k + ':N' for k in KINDS)} with N >= 1",
                          hint="e.g. engine-raise:20, or unset it")  # fmt: skip
    what = f"{n} ms added to every engine step" if kind == "engine-slow" else f"{kind} at engine step {n}"
    log.warning("fault injection armed: %s (%s=1)", what, TESTING_ENV)
    return Fault(kind=kind, n=int(n))  # type: ignore[arg-type]  # kind is checked against KINDS


def with_fault(step: Callable[[], T], fault: Fault, released: threading.Event) -> Callable[[], T]:
    """`step`, firing `fault` on its fault.n-th call. A hang blocks until `released` is set (the LLM
    sets it at shutdown, so a test process keeps no blocked thread), then raises. A slow engine waits
    fault.n ms (or until `released`) before every step."""
    if fault.kind == "engine-slow":

        def slow_step() -> T:
            released.wait(fault.n / 1000)
            return step()

        return slow_step
    calls = 0

    def faulty_step() -> T:
        nonlocal calls
        calls += 1
        if calls == fault.n:
            if fault.kind == "engine-hang":
                log.warning("injected fault: engine step %d hangs", calls)
                released.wait()
                raise InjectedFault(f"injected engine-hang at step {calls}, released by shutdown")
            raise InjectedFault(f"injected engine-raise at step {calls}")
        return step()

    return faulty_step
