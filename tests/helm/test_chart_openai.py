# SPDX-License-Identifier: Apache-2.0
"""The chart's OpenAI-compatible front (openai.enabled): a sidecar running `dflash-trt serve
--triton-url`, exposed on the Service and probed; off by default (renders nothing)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from helm_support import CHART_DIR, KUBE_VERSIONS, NAMESPACE, RELEASE, load_value_set

from dflash_trt.deploy import chart as deploy
from dflash_trt.errors import UsageError

pytestmark = pytest.mark.helm


def _render(values: dict[str, Any], **kw: Any) -> deploy.RenderedChart:
    return deploy.render_chart(values, chart_dir=CHART_DIR, release=RELEASE, namespace=NAMESPACE, **kw)


def _with_openai(name: str, **openai: Any) -> dict[str, Any]:
    values = copy.deepcopy(load_value_set(name))
    values["openai"] = {"enabled": True, **openai}
    return values


def _pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for d in docs:
        if d["kind"] == "Deployment":
            out["server"] = d["spec"]["template"]["spec"]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out["leader"] = lwt["leaderTemplate"]["spec"]
            out["worker"] = lwt["workerTemplate"]["spec"]
    return out


def test_off_by_default() -> None:
    docs = _render(load_value_set("tiny-cpu")).documents
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert "openai" not in {p["name"] for p in service["spec"]["ports"]}
    assert [c["name"] for c in _pod_specs(docs)["server"]["containers"]] == ["triton"]


def test_sidecar_service_port_and_probes(helm_binary: Path) -> None:
    values = _with_openai("tiny-cpu", port=9100, servicePort=80, modelName="tiny")
    rendered = _render(values, helm_binary=helm_binary, kube_version="1.29.0")
    docs = rendered.documents
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert {"name": "openai", "port": 80, "targetPort": "openai", "protocol": "TCP"} in service["spec"][
        "ports"
    ]
    triton, front = _pod_specs(docs)["server"]["containers"]
    assert (triton["name"], front["name"]) == ("triton", "openai")
    assert front["image"] == triton["image"]  # openai.image empty: the server image
    assert front["command"] == ["dflash-trt", "serve"]
    assert front["args"] == ["--bundle", "/models", "--triton-url", "127.0.0.1:8001", "--host", "0.0.0.0",
                             "--openai-port", "9100", "--openai-model-name", "tiny"]  # fmt: skip
    assert front["ports"] == [{"name": "openai", "containerPort": 9100, "protocol": "TCP"}]
    assert front["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    assert front["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "openai"}
    assert {"name": "bundle", "mountPath": "/models", "readOnly": True} in front["volumeMounts"]
    assert deploy.validate_manifests(rendered.text, kube_versions=KUBE_VERSIONS) == []


def test_multi_node_only_the_leader_gets_the_front() -> None:
    values = _with_openai("gpt-oss-120b-multinode", image={"repository": "ghcr.io/x/dflash-trt", "tag": "1",
                                                           "pullPolicy": "Always"})  # fmt: skip
    specs = _pod_specs(_render(values).documents)
    leader = [c["name"] for c in specs["leader"]["containers"]]
    assert leader == ["triton", "openai"] and [c["name"] for c in specs["worker"]["containers"]] == ["worker"]
    assert specs["leader"]["containers"][1]["image"] == "ghcr.io/x/dflash-trt:1"


@pytest.mark.parametrize("port", [8000, 8001, 8002, 0])
def test_schema_refuses_a_port_that_collides_with_triton(port: int) -> None:
    with pytest.raises(UsageError, match="openai/port"):
        _render(_with_openai("tiny-cpu", port=port))


def test_helm_test_pod_for_the_front() -> None:
    docs = _render(_with_openai("tiny-cpu", servicePort=9100)).documents
    pods = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Pod"}
    pod = pods[f"{RELEASE}-dflash-trt-test-openai"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}  # the key: valueFrom
    assert env["OPENAI_URL"] == f"http://{RELEASE}-dflash-trt:9100/v1"
    assert not any(n.endswith("test-openai") for n in (d["metadata"]["name"] for d in
                   _render(load_value_set("tiny-cpu")).documents if d["kind"] == "Pod"))  # fmt: skip
