# SPDX-License-Identifier: Apache-2.0
"""config.json and weight size of a Hugging Face repository, from the first copy that is available:

1. `$DFLASH_TRT_CONFIG_DIR/<org>--<name>/` (config.json, model.safetensors.index.json), an explicit seed;
2. the local Hugging Face cache (no network);
3. the Hub or the mirror at HF_ENDPOINT, unless offline (--offline or HF_HUB_OFFLINE=1); when it cannot
   be reached the shipped copy is used instead, with a notice naming the network failure;
4. the copy shipped in this package (data/configs: config.json, plus the weight index's total size
   and dtype and the upstream revision in sources.json).

Whatever copy is used is compared with the shipped one and a difference is reported. The copy used is
recorded as provenance and ends up in the manifest's `config_sources`.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_trt.builder import hub
from dflash_trt.builder.source import ModelSource
from dflash_trt.errors import DFlashTrtError, UsageError
from dflash_trt.utils.io import read_json_object

INDEX = "model.safetensors.index.json"


@lru_cache(maxsize=1)
def shipped_index() -> dict[str, dict[str, Any]]:
    """repo id -> {"revision", "origin", "weights": {"total_size", "dtype"}} of the shipped configs."""
    root = resources.files("dflash_trt.builder").joinpath("data", "configs")
    return dict(json.loads(root.joinpath("sources.json").read_text())["repos"])


def shipped(repo_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(config.json, metadata) shipped for `repo_id`, or None."""
    meta = shipped_index().get(repo_id)
    if meta is None:
        return None
    root = resources.files("dflash_trt.builder").joinpath("data", "configs", repo_id.replace("/", "--"))
    return json.loads(root.joinpath("config.json").read_text()), meta


def _total_size(index: Any) -> int | None:
    if isinstance(index, dict) and isinstance(index.get("metadata"), dict):
        size = index["metadata"].get("total_size")
        if size:
            return int(size)
    return None


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


class ConfigReader:
    """Reads configs for one build; remembers an unreachable Hub so that it is tried once."""

    def __init__(self, *, offline: bool) -> None:
        self.offline_flag = offline
        self.offline = offline or hub.env_offline()
        self.hub_down: hub.HubUnreachable | None = None
        self.notices: list[str] = []

    def _why_offline(self) -> str:
        return "--offline" if self.offline_flag else "HF_HUB_OFFLINE=1"

    def fetch(self, repo_id: str, *, what: str) -> ModelSource:
        ship = shipped(repo_id)
        found = self._config_dir(repo_id) or self._hf_cache(repo_id)
        if found is None and not self.offline and self.hub_down is None:
            try:
                found = self._hub(repo_id)
            except hub.HubUnreachable as exc:
                self.hub_down = exc
                if ship is None:
                    raise
        if found is None:
            if ship is None:
                raise self._missing(repo_id, what)
            config, meta = ship
            if self.offline:
                reason = self._why_offline()
            else:
                assert self.hub_down is not None  # online, nothing local: the Hub failed
                reason = self.hub_down.message
                lead = reason if not any(n.startswith(reason) for n in self.notices) else "still no Hub"
                self.notices.append(
                    f"{lead}: {what} {repo_id} is planned from the config shipped with dflash-trt "
                    f"(upstream revision {meta['revision']})"
                )
            provenance = {"source": "shipped", "revision": meta["revision"], "origin": meta["origin"],
                          "reason": reason}  # fmt: skip
            size = meta.get("weights", {}).get("total_size")
            extra = {"weights_bytes": int(size)} if size else {}
            return ModelSource(kind="hf", ref=repo_id, config=config, hf_id=repo_id, extra=extra,
                               provenance=provenance)  # fmt: skip
        config, size, provenance = found
        if ship is not None:
            differs = _diff(config, ship[0])
            shipped_size = ship[1].get("weights", {}).get("total_size")
            if size is not None and shipped_size and int(shipped_size) != size:
                differs.append(f"weights total_size ({size} vs {shipped_size})")
            provenance["matches_shipped"] = not differs
            if differs:
                provenance["differs_from_shipped"] = differs
                self.notices.append(
                    f"{what} {repo_id}: the {provenance['source']} config differs from the copy shipped with "
                    f"dflash-trt in {', '.join(differs)}; the plan uses the {provenance['source']} copy"
                )
        extra = {"weights_bytes": size} if size else {}
        return ModelSource(kind="hf", ref=repo_id, config=config, hf_id=repo_id, extra=extra,
                           provenance=provenance)  # fmt: skip

    def _missing(self, repo_id: str, what: str) -> DFlashTrtError:
        seed = f"${hub.CONFIG_DIR_ENV}/{repo_id.replace('/', '--')}/config.json"
        if self.offline:
            undo = "drop --offline" if self.offline_flag else "unset HF_HUB_OFFLINE"
            return UsageError(
                f"{what} {repo_id}: config.json is not in the local cache ({hub.CONFIG_DIR_ENV}, the Hugging "
                f"Face cache) nor shipped with dflash-trt, and {self._why_offline()} forbids downloading",
                hint=f"{undo} to download it, put it in {seed}, or pass a local checkpoint directory",
            )
        assert self.hub_down is not None
        return hub.HubUnreachable(self.hub_down.cause, repo_id=repo_id)

    def _config_dir(self, repo_id: str) -> tuple[dict[str, Any], int | None, dict[str, Any]] | None:
        root = os.environ.get(hub.CONFIG_DIR_ENV)
        if not root:
            return None
        folder = Path(root) / repo_id.replace("/", "--")
        cfg = folder / "config.json"
        if not cfg.is_file():
            return None
        config = _read(cfg, hub.CONFIG_DIR_ENV)
        index = folder / INDEX
        size = _total_size(_read(index, hub.CONFIG_DIR_ENV)) if index.is_file() else None
        return config, size, {"source": "config-dir", "path": str(folder)}

    def _hf_cache(self, repo_id: str) -> tuple[dict[str, Any], int | None, dict[str, Any]] | None:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
            return None
        cached = try_to_load_from_cache(repo_id, "config.json")
        if not isinstance(cached, str):
            return None
        path = Path(cached)
        config = _read(path, "the Hugging Face cache")
        revision = path.parent.name if path.parent.parent.name == "snapshots" else "unknown"
        cached_index = try_to_load_from_cache(repo_id, INDEX, revision=revision)
        size = None
        if isinstance(cached_index, str):
            size = _total_size(_read(Path(cached_index), "the Hugging Face cache"))
        elif not self.offline and self.hub_down is None:
            size = self._hub_size(repo_id, revision)
        return config, size, {"source": "hf-cache", "revision": revision}

    def _hub(self, repo_id: str) -> tuple[dict[str, Any], int | None, dict[str, Any]]:
        config, commit = hub.get_json(repo_id, "config.json")
        if not isinstance(config, dict):
            raise UsageError(f"{repo_id}/config.json on {hub.endpoint()} is not a JSON object")
        size = self._hub_size(repo_id, commit or "main")
        return config, size, {"source": "hub", "endpoint": hub.endpoint(), "revision": commit or "unknown"}

    def _hub_size(self, repo_id: str, revision: str) -> int | None:
        try:
            index, _ = hub.get_json(repo_id, INDEX, revision=revision, optional=True)
        except hub.HubUnreachable as exc:
            self.hub_down = exc
            return None
        return _total_size(index)


def _read(path: Path, where: str) -> dict[str, Any]:
    return read_json_object(
        path, lambda problem: UsageError(f"{path} (from {where}) {problem}", hint="replace the file")
    )
