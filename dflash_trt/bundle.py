# SPDX-License-Identifier: Apache-2.0
"""The deployment bundle: what `dflash-trt build` writes and everything downstream reads.

  <bundle>/manifest.json              the seam: inputs, resolved models, backend, versions, checks
  <bundle>/engine/llm_api.yaml        LLM-API arguments (TensorRT-LLM field names for trtllm)
  <bundle>/engine/checkpoints/...     copied or quantized checkpoints (when the bundle holds them)
  <bundle>/engine/serve-trtllm.sh     trtllm backend: launch `trtllm-serve` with llm_api.yaml
  <bundle>/model_repository/          the Triton repository (llmapi layout)
  <bundle>/helm-values.yaml           values for helm/dflash-trt
  <bundle>/bench-plan.yaml            a `dflash-trt bench sweep --spec` for this deployment
Relative paths inside a bundle are relative to the bundle root.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_trt.errors import UsageError

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
BACKENDS = ("torch", "trtllm")
REQUIRED_KEYS = ("schema_version", "name", "backend", "target", "drafter", "speculative", "gpu", "limits",
                 "serving", "files")  # fmt: skip


def load_manifest(bundle: str | Path) -> dict[str, Any]:
    """Read and check `<bundle>/manifest.json`; errors name the file, the problem and the fix."""
    path = Path(bundle) / MANIFEST
    if not Path(bundle).is_dir():
        raise UsageError(
            f"--bundle={str(bundle)!r} is not a directory", hint="run `dflash-trt build --output DIR`"
        )
    if not path.is_file():
        raise UsageError(
            f"{path} not found: not a dflash-trt bundle", hint="run `dflash-trt build --output DIR`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path} is not valid JSON ({exc})", hint="rebuild the bundle with --force") from exc
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise UsageError(f"{path} lacks {missing}", hint="rebuild the bundle with this dflash-trt version")
    if manifest["schema_version"] != SCHEMA_VERSION:
        raise UsageError(
            f"{path}: schema_version={manifest['schema_version']!r}, this dflash-trt reads {SCHEMA_VERSION}",
            hint="rebuild the bundle with this dflash-trt version",
        )
    if manifest["backend"] not in BACKENDS:
        raise UsageError(f"{path}: backend={manifest['backend']!r}", hint=f"one of {', '.join(BACKENDS)}")
    return manifest


def bundle_path(bundle: str | Path, manifest: dict[str, Any], key: str) -> Path:
    rel = manifest["files"].get(key)
    if rel is None:
        raise UsageError(f"bundle manifest has no files.{key}", hint="rebuild the bundle")
    return Path(bundle) / rel
