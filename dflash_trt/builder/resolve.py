# SPDX-License-Identifier: Apache-2.0
"""Resolve a target name (`tiny`, a local directory, a registered short name or a Hugging Face id)
and its drafter into configs (no weights are read or downloaded here)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt import pairs
from dflash_trt.builder import registry
from dflash_trt.builder.configs import ConfigReader
from dflash_trt.builder.source import ModelSource, ResolvedPair
from dflash_trt.errors import UsageError


def _local(path: Path, what: str) -> ModelSource:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UsageError(
            f"{what} directory {path} has no config.json", hint=f"pass a {what} checkpoint directory"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{cfg_path} is not valid JSON ({exc})", hint="re-download the checkpoint") from exc
    return ModelSource(
        kind="local",
        ref=str(path.resolve()),
        config=cfg,
        path=path.resolve(),
        provenance={"source": "local", "path": str(cfg_path.resolve())},
    )


def _packaged(target: str, drafter: str | None) -> ResolvedPair:
    """A pair this package carries (pairs.py): its target, and its default or named drafter."""
    pair = pairs.packaged_pair(target)
    t = _local(pair.target, "target")
    t.kind = "embedded"
    t.provenance["source"] = "embedded"
    if drafter and not pairs.is_packaged_drafter(drafter):
        return ResolvedPair(name=target, target=t, drafter=_local(Path(drafter).expanduser(), "drafter"))
    path = pairs.packaged_drafter(drafter) if drafter else pairs.default_drafter(pair)
    if path is None:
        raise UsageError(
            f"--target={target!r}: this build of dflash-trt ships no drafter for it",
            hint="pass --drafter DIR, or train one with the recipe in build/recipes/",
        )
    packaged = _local(path, "drafter")
    packaged.kind = "embedded"
    packaged.provenance["source"] = "embedded"
    return ResolvedPair(name=target, target=t, drafter=packaged)


def resolve_pair(target: str, drafter: str | None, *, offline: bool = False) -> ResolvedPair:
    """Configs of the pair; Hub ids are read through a ConfigReader (see builder/configs.py)."""
    if pairs.is_packaged(target):
        return _packaged(target, drafter)
    tpath = Path(target).expanduser()
    if tpath.is_dir():
        t = _local(tpath, "target")
        d = _local(Path(drafter).expanduser(), "drafter") if drafter else None
        return ResolvedPair(name=tpath.name, target=t, drafter=d)
    entry = registry.lookup(target)
    if entry is None:
        raise UsageError(
            f"--target={target!r} is not `tiny`, a directory, a registered name or a Hugging Face id",
            hint="see `dflash-trt models` for the registered targets",
        )
    reader = ConfigReader(offline=offline)
    t = reader.fetch(entry.target_id, what="target")
    if drafter:
        dpath = Path(drafter).expanduser()
        d = _local(dpath, "drafter") if dpath.is_dir() else reader.fetch(drafter, what="drafter")
    elif entry.drafter_id:
        d = reader.fetch(entry.drafter_id, what="drafter")
    else:
        d = None
    return ResolvedPair(
        name=entry.name, target=t, drafter=d, registry_entry=entry.to_dict(), notices=reader.notices
    )
