# SPDX-License-Identifier: Apache-2.0
"""Kubernetes deployment: Helm values from a bundle manifest, and offline chart checks.

Importing this package is cheap; helm-python-sdk, jsonschema and kubernetes-validate are
imported only by the functions that use them.
"""

from __future__ import annotations

from dflash_trt.deploy.chart import (
    DEFAULT_KUBE_VERSIONS,
    LintReport,
    RenderedChart,
    default_chart_dir,
    helm_values_from_manifest,
    lint_chart,
    load_bundle_values,
    merge_values,
    render_chart,
    validate_manifests,
    write_helm_values,
)

__all__ = [
    "DEFAULT_KUBE_VERSIONS",
    "LintReport",
    "RenderedChart",
    "default_chart_dir",
    "helm_values_from_manifest",
    "lint_chart",
    "load_bundle_values",
    "merge_values",
    "render_chart",
    "validate_manifests",
    "write_helm_values",
]
