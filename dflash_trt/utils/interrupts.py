# SPDX-License-Identifier: Apache-2.0
"""Ctrl-C that no library can lose.

Python turns SIGINT into a KeyboardInterrupt at whatever line runs next. Inside third-party code
(a bare `except:`, a callback called from C whose exception is only printed) that exception can be
caught and dropped, and a build would then run on to completion after the user asked it to stop.
`noted_interrupts()` records every SIGINT as well as raising it, and `check_interrupted()` raises
again at the caller's own step boundaries, so an interrupted long job stops before it commits
anything.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_received = threading.Event()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _received.set()
    raise KeyboardInterrupt


@contextmanager
def noted_interrupts() -> Iterator[None]:
    """Inside the block SIGINT raises KeyboardInterrupt as usual and is also remembered for
    `check_interrupted`. The previous handler comes back afterwards. Signal handlers belong to the
    main thread: elsewhere (or where SIGINT is ignored, as for a background job) this changes
    nothing and `check_interrupted` never raises."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        yield
        return
    _received.clear()
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _received.clear()


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if SIGINT came inside `noted_interrupts`, even where the first
    KeyboardInterrupt was caught and dropped by the code it interrupted."""
    if _received.is_set():
        raise KeyboardInterrupt
