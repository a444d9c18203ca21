# SPDX-License-Identifier: Apache-2.0
"""The resolved models of a build: where each checkpoint comes from, its config.json, and which copy
of that config the plan read (provenance)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ModelSource:
    """One checkpoint: where it comes from and its config.json."""

    kind: str  # embedded | local | hf
    ref: str  # what TensorRT-LLM / transformers would load: a path or an HF id
    config: dict[str, Any]
    path: Path | None = None  # local directory when there is one
    hf_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # which copy of config.json the plan used: {"source": config-dir|hf-cache|hub|shipped|local|embedded, ...}
    provenance: dict[str, Any] = field(default_factory=dict)

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
    notices: list[str] = field(default_factory=list)  # provenance warnings (Hub fallback, mismatches)

    def config_sources(self) -> dict[str, Any]:
        out = {"target": self.target.provenance}
        if self.drafter is not None:
            out["drafter"] = self.drafter.provenance
        return out
