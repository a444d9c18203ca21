# SPDX-License-Identifier: Apache-2.0
"""Timing shared by the kernel benchmark scripts in this folder (they import it by name: a script's
own folder is first on its path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def best_loop(fn: Callable[[], Any], reps: int, repeats: int) -> float:
    """Seconds per call of `fn`: one untimed call, then the best of `repeats` loops of `reps` calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best
