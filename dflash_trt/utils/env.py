# SPDX-License-Identifier: Apache-2.0
"""Process environment changes that undo themselves."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """`name` = `value` in this process's environment (and its children's) while inside; then back to
    what it was, unset included."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
