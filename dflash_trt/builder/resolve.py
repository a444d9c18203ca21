# SPDX-License-Identifier: Apache-2.0
"""Resolve a target name (`tiny`, a local directory, a registered short name or a Hugging Face id)
and its drafter into configs (no weights are read or downloaded here)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_trt.errors import UsageError


@dataclass
class ModelSource:
    """One checkpoint: where it comes from and its config.json."""

    kind: str  # embedded | local | hf
    ref: str  # what TensorRT-LLM / transformers would load: a path or an HF id
    config: dict[str, Any]
    path: Path | None = None  # local directory when there is one
    hf_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ref": self.ref,
            "hf_id": self.hf_id,
            "path": str(self.path) if self.path else None,
        }


@dataclass
class ResolvedPair:
    name: str
    target: ModelSource
    drafter: ModelSource | None
    registry_entry: dict[str, Any] | None = None


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
    return ModelSource(kind="local", ref=str(path.resolve()), config=cfg, path=path.resolve())


def resolve_pair(target: str, drafter: str | None, *, offline: bool = False) -> ResolvedPair:
    from dflash_trt.builder import registry
    from dflash_trt.tiny import TINY_NAME, ensure_tiny

    if target == TINY_NAME:
        paths = ensure_tiny()
        t = _local(paths.target, "target")
        t.kind = "embedded"
        d: ModelSource | None = (
            _local(Path(drafter), "drafter") if drafter else _local(paths.drafter, "drafter")
        )
        if not drafter and d is not None:
            d.kind = "embedded"
        return ResolvedPair(name=TINY_NAME, target=t, drafter=d)
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
    t = registry.fetch_config(entry.target_id, offline=offline, what="target")
    if drafter:
        dpath = Path(drafter).expanduser()
        d = (
            _local(dpath, "drafter")
            if dpath.is_dir()
            else registry.fetch_config(drafter, offline=offline, what="drafter")
        )
    elif entry.drafter_id:
        d = registry.fetch_config(entry.drafter_id, offline=offline, what="drafter")
    else:
        d = None
    return ResolvedPair(name=entry.name, target=t, drafter=d, registry_entry=entry.to_dict())
