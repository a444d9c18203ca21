# SPDX-License-Identifier: Apache-2.0
"""Atomic file and directory writes: readers see the old output or the new one, never a mix."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json_object(path: Path, fail: Callable[[str], Exception]) -> dict[str, Any]:
    """The JSON object stored in `path`. When the file is unreadable, not JSON or not an object,
    raises `fail(problem)`, where problem reads "is not valid JSON (...)" or "does not hold a JSON
    object": the caller's error names the file's role and the fix."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(f"is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise fail("does not hold a JSON object")
    return data


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 4 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def atomic_dir(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` in one rename.

    On any exception (including KeyboardInterrupt) the temporary directory is removed and
    `final` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            if not overwrite:
                raise FileExistsError(final)
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            old.rmdir()
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
