# SPDX-License-Identifier: Apache-2.0
"""JSON Lines input: one JSON value per line, blank lines skipped, a bad line named by number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trt.errors import UsageError


def iter_jsonl(path: Path, *, name: str, hint: str) -> Iterator[tuple[int, Any]]:
    """Yield (line number, parsed value) for each non-blank line of `path`.

    A line that is not JSON raises UsageError "`name`: line N is not JSON (reason)" with `hint`;
    `name` is how the caller's flag names the file (e.g. "--data='x.jsonl'"). The shape of each
    value (an object with the caller's keys) is the caller's to check.
    """
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{name}: line {lineno} is not JSON ({exc.msg})", hint=hint) from None
            yield lineno, value
