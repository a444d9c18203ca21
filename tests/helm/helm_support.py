# SPDX-License-Identifier: Apache-2.0
"""Paths, value sets and fake manifests shared by the Helm chart tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "dflash-trt"
SCHEMA_DIR = REPO / "helm" / "schemas"
HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden"
MANIFEST_DIR = HERE / "fixtures" / "manifests"

# The value sets in helm/dflash-trt/ci/: the three serving layouts, and the two on-cluster builds
# (one with the Grafana dashboard and the PrometheusRule).
VALUE_SETS = (
    "tiny-cpu",
    "gpt-oss-120b-8gpu",
    "gpt-oss-120b-multinode",
    "qwen3-8b-fp8-build",
    "llama-3.1-8b-nvfp4-build",
)
MANIFESTS = tuple(sorted(p.stem for p in MANIFEST_DIR.glob("*.json")))
# Oldest and newest supported Kubernetes minors.
KUBE_VERSIONS = ("1.29.0", "1.33.0")
RELEASE, NAMESPACE = "demo", "llm"


def load_value_set(name: str) -> dict[str, Any]:
    data = yaml.safe_load((CHART_DIR / "ci" / f"{name}.values.yaml").read_text())
    assert isinstance(data, dict)
    return data


def load_manifest(name: str) -> dict[str, Any]:
    data = json.loads((MANIFEST_DIR / f"{name}.json").read_text())
    assert isinstance(data, dict)
    return data
