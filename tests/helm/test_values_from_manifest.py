# SPDX-License-Identifier: Apache-2.0
"""The build -> chart seam: helm-values.yaml derived from a bundle manifest drives the chart."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_support import CHART_DIR, GOLDEN_DIR, KUBE_VERSIONS, MANIFESTS, load_manifest

from dflash_trt.deploy import chart as deploy
from dflash_trt.errors import ConfigError, UsageError
from dflash_trt.utils.io import dump_yaml


def _docs_by_kind(values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    rendered = deploy.render_chart(values, chart_dir=CHART_DIR, release="demo", namespace="llm")
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in rendered.documents:
        out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.mark.parametrize("name", MANIFESTS)
def test_values_golden(name: str, golden) -> None:
    values = deploy.helm_values_from_manifest(load_manifest(name))
    golden(GOLDEN_DIR / "values" / f"{name}.helm-values.yaml", dump_yaml(values))


def test_single_node_b200() -> None:
    v = deploy.helm_values_from_manifest(load_manifest("gpt-oss-120b-b200"))
    assert v["backend"] == "trtllm"
    assert v["gpu"] == {"count": 8, "perNode": 8, "product": ["NVIDIA-B200"]}
    assert v["image"] == {"repository": "nvcr.io/nvidia/tritonserver", "tag": "26.10-trtllm-python-py3"}
    assert v["probes"]["startup"]["budgetSeconds"] == 1800
    assert v["shm"]["sizeLimit"] == "32Gi"
    assert v["storage"] == {"type": "newClaim", "size": "150Gi"}  # 2 x 65 GB + 20, in 10 GiB steps
    assert v["modelInit"]["download"]["repos"] == [
        {"repo": "openai/gpt-oss-120b"},
        {"repo": "z-lab/gpt-oss-120b-DFlash"},
    ]
    assert "multiNode" not in v
    assert "limits" not in v["resources"], "GPU pods get no memory limit (weights staging peaks)"


def test_multi_node_when_gpus_exceed_a_node() -> None:
    v = deploy.helm_values_from_manifest(load_manifest("gpt-oss-120b-h100-tp16"))
    assert v["gpu"]["count"] == 16 and v["gpu"]["perNode"] == 8
    assert v["multiNode"] == {"enabled": True, "sshSecretName": deploy.DEFAULT_SSH_SECRET}
    assert v["storage"]["accessModes"] == ["ReadWriteMany"], "a group's pods share the volume across nodes"
    assert v["image"] == {"repository": "nvcr.io/nvidia/tritonserver", "tag": "26.09-trtllm-python-py3"}


def test_gb200_trays_have_four_gpus() -> None:
    m = load_manifest("gpt-oss-120b-b200")
    m["gpu"].update(profile="gb200", product_label="NVIDIA-GB200")
    v = deploy.helm_values_from_manifest(m)
    assert v["gpu"]["perNode"] == 4 and v["multiNode"]["enabled"] is True
    m["gpu"]["per_node"] = 8  # the manifest wins over the profile default
    assert "multiNode" not in deploy.helm_values_from_manifest(m)


def test_torch_cpu() -> None:
    v = deploy.helm_values_from_manifest(load_manifest("tiny-cpu"))
    assert v["backend"] == "torch" and v["gpu"]["count"] == 0 and v["gpu"]["product"] == []
    assert v["image"]["repository"] == deploy.DEFAULT_TORCH_IMAGE[0]
    assert v["shm"]["sizeLimit"] == "1Gi"
    assert v["probes"]["startup"]["budgetSeconds"] == 300
    assert "modelInit" not in v, "no Hugging Face ids: nothing to download"
    assert v["resources"]["limits"]["memory"]


def test_build_args_run_the_build_in_the_init_container() -> None:
    v = deploy.helm_values_from_manifest(load_manifest("gpt-oss-120b-b200"), build_args=["-c", "r.yaml"])
    assert v["modelInit"] == {
        "enabled": True,
        "mode": "build",
        "build": {"args": ["-c", "r.yaml"]},
        "useGpus": True,
    }


@pytest.mark.parametrize(
    ("budget", "weights"),
    [(1800, 65.0), (1805, 65.0), (None, 65.0), (None, 240.0), (7, 1.0)],
)
@pytest.mark.helm
def test_startup_probe_covers_the_budget(budget: int | None, weights: float) -> None:
    m = load_manifest("gpt-oss-120b-b200")
    m["serving"].update(startup_budget_s=budget, weights_gb=weights)
    v = deploy.helm_values_from_manifest(m)
    want = budget if budget is not None else deploy.startup_budget_seconds(weights_gb=weights, gpu=True)
    probe = _docs_by_kind(v)["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= want
    # ... and no more than one period over it.
    assert (probe["failureThreshold"] - 1) * probe["periodSeconds"] < max(want, 10)
    if budget is None:
        assert want >= 600 + 20 * weights


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"backend": "vllm"}, "manifest backend"),
        ({"gpu": {"count": 0}}, "manifest gpu.count"),
        ({"gpu": {"count": 12, "per_node": 8}}, "manifest gpu.count"),
        ({"gpu": {"count": "eight"}}, "manifest gpu.count"),
        ({"gpu": {"count": 8, "per_node": 0}}, "manifest gpu.per_node"),
        ({"serving": {"image": "nvcr.io/nvidia/tritonserver"}}, "manifest serving.image"),
        ({"serving": {"startup_budget_s": -5}}, "manifest serving.startup_budget_s"),
        ({"serving": {"weights_gb": "65 GB"}}, "manifest serving.weights_gb"),
        ({"gpu": ["count", 8]}, "manifest gpu"),
    ],
)
def test_bad_manifest_names_the_field(patch: dict[str, Any], field: str) -> None:
    m = load_manifest("gpt-oss-120b-b200")
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(m.get(key), dict):
            m[key] = {**m[key], **value}
        else:
            m[key] = value
    with pytest.raises(ConfigError) as info:
        deploy.helm_values_from_manifest(m)
    assert info.value.field == field
    assert "fix:" in info.value.one_line()


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        (
            "nvcr.io/nvidia/tritonserver:26.10-trtllm-python-py3",
            ("nvcr.io/nvidia/tritonserver", "26.10-trtllm-python-py3"),
        ),
        ("registry.local:5000/team/dflash:1.2", ("registry.local:5000/team/dflash", "1.2")),
        ("dflash-trt:0.1.0-cpu", ("dflash-trt", "0.1.0-cpu")),
    ],
)
def test_serving_image_is_split(ref: str, expected: tuple[str, str]) -> None:
    m = load_manifest("gpt-oss-120b-b200")
    m["serving"]["image"] = ref
    image = deploy.helm_values_from_manifest(m)["image"]
    assert (image["repository"], image["tag"]) == expected and "digest" not in image


def test_serving_image_digest() -> None:
    m = load_manifest("gpt-oss-120b-b200")
    m["serving"]["image"] = "nvcr.io/nvidia/tritonserver@sha256:" + "a" * 64
    assert deploy.helm_values_from_manifest(m)["image"] == {
        "repository": "nvcr.io/nvidia/tritonserver",
        "tag": "",
        "digest": "sha256:" + "a" * 64,
    }


def test_manifest_is_not_mutated() -> None:
    m = load_manifest("gpt-oss-120b-h100-tp16")
    before = copy.deepcopy(m)
    deploy.helm_values_from_manifest(m)
    assert m == before


def test_write_and_load_bundle_values(tmp_path: Path) -> None:
    m = load_manifest("gpt-oss-120b-b200")
    path = deploy.write_helm_values(tmp_path, m)
    assert path == tmp_path / "helm-values.yaml"
    assert path.read_text().startswith("# Helm values for bundle gpt-oss-120b")
    assert deploy.load_bundle_values(tmp_path) == deploy.helm_values_from_manifest(m)


def test_missing_values_file_names_file_and_fix(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        deploy.load_bundle_values(tmp_path)
    line = info.value.one_line()
    assert str(tmp_path / "helm-values.yaml") in line and "dflash-trt build" in line
    assert "\n" not in line


def test_merge_values_is_helm_coalescing() -> None:
    base = {"gpu": {"count": 8, "product": ["A"]}, "tests": {"enabled": True}}
    over = {"gpu": {"product": ["B", "C"]}, "tests": None}
    assert deploy.merge_values(base, over) == {"gpu": {"count": 8, "product": ["B", "C"]}, "tests": None}


@pytest.mark.helm
@pytest.mark.parametrize("name", MANIFESTS)
def test_build_values_drive_the_chart(name: str, helm_binary: Path) -> None:
    """The values a build writes lint (strict, both Helm builds), render and validate as they are."""
    values = deploy.helm_values_from_manifest(load_manifest(name))
    for binary in (None, helm_binary):
        report = deploy.lint_chart(values, chart_dir=CHART_DIR, helm_binary=binary)
        assert report.ok, report.problems
    rendered = deploy.render_chart(
        values, chart_dir=CHART_DIR, helm_binary=helm_binary, kube_version="1.29.0"
    )
    assert deploy.validate_manifests(rendered.text, kube_versions=KUBE_VERSIONS) == []

    docs = {(d["kind"], d["metadata"]["name"]) for d in rendered.documents}
    m = load_manifest(name)
    gpus, per_node = m["gpu"]["count"], 8
    workload = "LeaderWorkerSet" if gpus > per_node else "Deployment"
    assert any(kind == workload for kind, _ in docs)
    pod_specs = _pod_specs(rendered.documents)
    for spec in pod_specs:
        limits = spec["containers"][0].get("resources", {}).get("limits", {})
        assert limits.get("nvidia.com/gpu", 0) == (min(gpus, per_node) if gpus else 0)
        if m["gpu"]["product_label"]:
            terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [
                m["gpu"]["product_label"]
            ]
    if workload == "LeaderWorkerSet":
        lws = next(d for d in rendered.documents if d["kind"] == "LeaderWorkerSet")
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == math.ceil(gpus / per_node)


def _pod_specs(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    specs = []
    for doc in documents:
        if doc["kind"] == "Deployment":
            specs.append(doc["spec"]["template"]["spec"])
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            specs += [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    return specs


def test_values_file_is_plain_yaml(tmp_path: Path) -> None:
    path = deploy.write_helm_values(tmp_path, load_manifest("tiny-cpu"))
    assert isinstance(yaml.safe_load(path.read_text()), dict)
