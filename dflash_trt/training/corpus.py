# SPDX-License-Identifier: Apache-2.0
"""The `tiny` pair's corpus: the Python standard library's own source, on every machine.

Files are split deterministically by the SHA-256 of their path relative to the stdlib root, so
the held-out set does not depend on the directory order or on which other files exist. Tests,
vendored third-party code and data-heavy packages are left out (they are either huge or not
representative of everyday Python).
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_PARTS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "turtledemo",
        "ensurepip",
        "encodings",  # generated codec tables
        "pydoc_data",  # one 700 kB generated file
    }
)
HELDOUT_MODULUS = 10  # one file in ten (by path hash) is held out


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: str) -> bool:
    digest = hashlib.sha256(relative.replace("\\", "/").encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_MODULUS == 0


def split_stdlib(root: Path | None = None) -> CorpusSplit:
    """All `.py` files under the stdlib root (exclusions above), split into train / held-out."""
    root = root or stdlib_root()
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_PARTS for part in rel.parts[:-1]) or not path.is_file():
            continue
        (heldout if is_heldout(rel.as_posix()) else train).append(path)
    return CorpusSplit(root=root, train=tuple(train), heldout=tuple(heldout))


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def code_prompts(files: tuple[Path, ...] | list[Path], *, count: int, seed: int = 0) -> list[str]:
    """Prompts cut from `files`: a `def`/`class` line and up to three following lines that
    stay inside the block (at most 160 characters), the shape of a user asking to complete code."""
    rng = random.Random(seed)
    candidates: list[str] = []
    for path in files:
        text = read_text(path)
        if not text:
            continue
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            stripped = line.lstrip(" ")
            if not stripped.startswith(("def ", "class ")) or len(line) > 100:
                continue
            indent = len(line) - len(stripped)
            block = [stripped]
            for nxt in lines[i + 1 : i + rng.randint(1, 4)]:
                body = nxt[indent:] if nxt[:indent].strip() == "" else None
                if body is None or not body.startswith(" ") or not body.strip():
                    break  # left the block (or a blank line): stop the prompt here
                block.append(body)
            prompt = "".join(block)
            if 12 <= len(prompt) <= 160 and prompt.endswith("\n") and '"""' not in prompt:
                candidates.append(prompt)
    rng.shuffle(candidates)
    seen: set[str] = set()
    out: list[str] = []
    for p in candidates:
        if p not in seen:
            seen.add(p)
            out.append(p)
        if len(out) == count:
            break
    return out
