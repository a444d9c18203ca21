# SPDX-License-Identifier: Apache-2.0
"""The chart with real Helm: strict lint and render (helm-python-sdk and the helm v4 binary),
golden renders, and manifests validated for Kubernetes 1.29 and 1.33."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_support import (
    CHART_DIR,
    GOLDEN_DIR,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    load_value_set,
)

from dflash_trt.deploy import chart as deploy

pytestmark = pytest.mark.helm


def _render(values: dict[str, Any], **kw: Any) -> deploy.RenderedChart:
    return deploy.render_chart(values, chart_dir=CHART_DIR, release=RELEASE, namespace=NAMESPACE, **kw)


def _by_key(documents: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    assert len(out) == len(documents), "two objects share a kind and name"
    return out


def _kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in documents if d["kind"] == kind]


# ------------------------------------------------------------------------------------ lint


@pytest.mark.parametrize("name", [*VALUE_SETS, "defaults"])
def test_lint_strict_sdk(name: str) -> None:
    values = {} if name == "defaults" else load_value_set(name)
    for kube in KUBE_VERSIONS:
        report = deploy.lint_chart(values, chart_dir=CHART_DIR, kube_version=kube)
        assert report.ok, report.problems
        assert report.tool.startswith("helm-python-sdk (Helm v4")


@pytest.mark.parametrize("name", [*VALUE_SETS, "defaults"])
def test_lint_strict_binary(name: str, helm_binary: Path) -> None:
    args = [str(helm_binary), "lint", "--strict", str(CHART_DIR)]
    if name != "defaults":
        args += ["-f", str(CHART_DIR / "ci" / f"{name}.values.yaml")]
    for kube in KUBE_VERSIONS:
        proc = subprocess.run([*args, "--kube-version", kube], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
        assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


def test_binary_is_helm_v4(helm_binary: Path) -> None:
    out = subprocess.run([str(helm_binary), "version", "--short"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("v4."), out.stdout


def test_binary_lint_catches_a_broken_chart(tmp_path: Path, helm_binary: Path) -> None:
    """The strict lint is not a rubber stamp: a removed API version fails it."""
    import shutil

    chart = tmp_path / "dflash-trt"
    shutil.copytree(CHART_DIR, chart)
    hpa = chart / "templates" / "hpa.yaml"
    hpa.write_text(hpa.read_text().replace("autoscaling/v2\n", "autoscaling/v2beta2\n"))
    values = CHART_DIR / "ci" / "gpt-oss-120b-8gpu.values.yaml"
    proc = subprocess.run(
        [str(helm_binary), "lint", "--strict", str(chart), "-f", str(values), "--kube-version", "1.29.0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0 and "autoscaling/v2beta2" in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------- render


@pytest.mark.parametrize("name", VALUE_SETS)
def test_golden_render(name: str, golden) -> None:
    rendered = _render(load_value_set(name))
    golden(GOLDEN_DIR / f"{name}.yaml", rendered.text)
    assert rendered.notes is not None
    golden(GOLDEN_DIR / f"{name}.NOTES.txt", rendered.notes)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_binary_template_equals_sdk_render(name: str, helm_binary: Path) -> None:
    """helm v4.1.4 (npm) and the Helm v4.2.3 Go SDK render the same objects, for both k8s versions."""
    values = load_value_set(name)
    sdk = _by_key(_render(values).documents)
    for kube in KUBE_VERSIONS:
        binary = _by_key(_render(values, helm_binary=helm_binary, kube_version=kube).documents)
        assert binary == sdk


@pytest.mark.parametrize("name", VALUE_SETS)
def test_manifests_validate(name: str, helm_binary: Path) -> None:
    """kubernetes-validate --strict (1.29, 1.33), WARN = failure; custom resources by our schemas."""
    text = _render(load_value_set(name), helm_binary=helm_binary, kube_version="1.29.0").text
    assert deploy.validate_manifests(text, kube_versions=KUBE_VERSIONS) == []


def test_default_values_render_and_validate() -> None:
    text = _render({}).text
    assert deploy.validate_manifests(text, kube_versions=KUBE_VERSIONS) == []


# ---------------------------------------------------------------- validation is not blind


def _mutated(name: str, kind: str, mutate) -> str:
    docs = _render(load_value_set(name)).documents
    target = next(d for d in docs if d["kind"] == kind)
    mutate(target)
    return yaml.safe_dump_all(docs)


@pytest.mark.parametrize(
    ("name", "kind", "mutation", "expect"),
    [
        ("tiny-cpu", "Deployment", lambda d: d["spec"].update(replicas="two"), "is not of type"),
        ("tiny-cpu", "Deployment", lambda d: d["spec"].update(bogusField=1), "bogusField"),
        (
            "gpt-oss-120b-8gpu",
            "HorizontalPodAutoscaler",
            lambda d: d.update(apiVersion="autoscaling/v2beta2"),
            "autoscaling/v2beta2",
        ),
        (
            "gpt-oss-120b-8gpu",
            "ServiceMonitor",
            lambda d: d["spec"]["endpoints"][0].update(intervall="5s"),
            "intervall",
        ),
        (
            "gpt-oss-120b-8gpu",
            "ServiceMonitor",
            lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds"),
            "interval",
        ),
        (
            "gpt-oss-120b-multinode",
            "LeaderWorkerSet",
            lambda d: d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0].update(
                imagee="x"
            ),
            "imagee",
        ),
        (
            "gpt-oss-120b-multinode",
            "LeaderWorkerSet",
            lambda d: d["spec"]["leaderWorkerTemplate"].update(size="2"),
            "size",
        ),
        (
            "gpt-oss-120b-multinode",
            "PodMonitor",
            lambda d: d["spec"].update(podMetricsEndpoints=[]),
            "podMetricsEndpoints",
        ),
        ("tiny-cpu", "Service", lambda d: d.update(kind="Servicee"), "Servicee"),
    ],
)
def test_validation_catches(name: str, kind: str, mutation, expect: str) -> None:
    problems = deploy.validate_manifests(_mutated(name, kind, mutation), kube_versions=KUBE_VERSIONS)
    assert problems, "the broken manifest passed validation"
    assert any(expect in p for p in problems), problems


def test_crd_schemas_check_pod_templates_per_kubernetes_version() -> None:
    """A PodSpec field that 1.33 knows and 1.29 does not is caught for 1.29 only."""
    docs = _render(load_value_set("gpt-oss-120b-multinode")).documents
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["hostUsers"] = True  # exists in both
    text = yaml.safe_dump_all(docs)
    assert deploy.validate_manifests(text, kube_versions=KUBE_VERSIONS) == []
    new_field = _field_only_in("io.k8s.api.core.v1.PodSpec", "1.33.0", "1.29.0")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"][new_field] = None
    problems = deploy.validate_manifests(yaml.safe_dump_all(docs), kube_versions=KUBE_VERSIONS)
    assert problems and all("1.29.0" in p for p in problems), problems


def _field_only_in(definition: str, newer: str, older: str) -> str:
    def props(version: str) -> set[str]:
        defs = deploy._k8s_definitions(version)["$defs"]
        return set(defs[definition]["properties"])

    extra = sorted(props(newer) - props(older))
    assert extra, f"{definition} gained no field between {older} and {newer}"
    return extra[0]


# ------------------------------------------------------------------- what the chart encodes


def _server(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def test_tiny_cpu_has_no_gpu_anything() -> None:
    docs = _render(load_value_set("tiny-cpu")).documents
    spec = _server(_kind(docs, "Deployment")[0])
    container = spec["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(spec)
    assert "tolerations" not in spec and "affinity" not in spec
    assert container["resources"]["limits"] == {"memory": "4Gi"}
    init = spec["initContainers"][0]
    assert init["args"] == ["--target", "tiny", "--output", "/models/bundle", "--force"]
    assert 'dflash-trt build "$@"' in init["command"][2]
    assert next(v for v in spec["volumes"] if v["name"] == "bundle") == {
        "name": "bundle",
        "emptyDir": {"sizeLimit": "2Gi"},
    }
    assert not _kind(docs, "PersistentVolumeClaim")


def test_single_node_gpu_pod() -> None:
    values = load_value_set("gpt-oss-120b-8gpu")
    docs = _render(values).documents
    spec = _server(_kind(docs, "Deployment")[0])
    c = spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 == c["resources"]["requests"]["nvidia.com/gpu"]
    assert c["command"] == ["tritonserver"]
    assert "--model-repository=/models/model_repository" in c["args"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "http": 8000,
        "grpc": 8001,
        "metrics": 8002,
    }
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800
    ready = c["readinessProbe"]["exec"]["command"]
    assert ready[:2] == ["/bin/bash", "-c"] and "GET /v2/health/ready" in ready[2]
    assert "/var/run/dflash-trt/engine-dead" in ready[2]
    live = c["livenessProbe"]["exec"]["command"]
    assert live[:2] == ["/bin/bash", "-c"] and "triton_python_backend_stu[b]" in live[2]
    assert "GET /v2/health/live" in live[2] and "/var/run/dflash-trt/heartbeat" in live[2]
    assert "/var/run/dflash-trt/engine-dead" in live[2]
    # shutdown timing derives from server.drainSeconds (30) and the preStop sleep (5)
    assert spec["terminationGracePeriodSeconds"] == 5 + 30 + 15 + 10 + 5
    assert "--exit-timeout-secs=10" in c["args"]
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[:2] == ["/bin/sh", "-c"] and pre[2].startswith("sleep 5\n") and "printf '%s\\n' 30" in pre[2]
    assert {"name": "DFLASH_TRT_CONTROL_DIR", "value": "/var/run/dflash-trt"} in c["env"]
    assert {"name": "control", "mountPath": "/var/run/dflash-trt"} in c["volumeMounts"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    expr = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert expr == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-B200"]}]}
    ]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in c[
        "env"
    ]
    init = spec["initContainers"][0]
    assert "hf download 'openai/gpt-oss-120b'" in init["command"][2]
    assert "--local-dir '/models'" in init["command"][2]

    (service,) = _kind(docs, "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": 8000,
        "grpc": 8001,
        "metrics": 8002,
    }
    (hpa,) = _kind(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "demo-dflash-trt",
    }
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "triton_queue_time_per_request_us"
    assert "replicas" not in _kind(docs, "Deployment")[0]["spec"], "the HPA owns replicas"
    (sm,) = _kind(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    (pvc,) = _kind(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (pdb,) = _kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_multi_node_lws() -> None:
    docs = _render(load_value_set("gpt-oss-120b-multinode")).documents
    assert not _kind(docs, "Deployment")
    (lws,) = _kind(docs, "LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
    assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == "leader"
    assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    for tmpl in (leader, worker):
        c = tmpl["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert {"name": "ssh", "mountPath": "/etc/dflash-trt/ssh", "readOnly": True} in c["volumeMounts"]
    lc = leader["spec"]["containers"][0]
    script = lc["command"][2]
    assert "mpirun" in script and "trtllm-llmapi-launch tritonserver" in script
    assert "$((LWS_GROUP_SIZE * 4))" in script
    assert lc["args"][: lc["args"].index("--")] == ["-x", "NCCL_DEBUG"]
    assert "--model-repository=/models/model_repository" in lc["args"]
    assert lc["startupProbe"]["failureThreshold"] * lc["startupProbe"]["periodSeconds"] >= 2400
    assert "-x DFLASH_TRT_CONTROL_DIR" in script and "preStop" in lc["lifecycle"]
    wc = worker["spec"]["containers"][0]
    assert "/usr/sbin/sshd" in wc["command"][2] and "startupProbe" not in wc and "lifecycle" not in wc
    (service,) = _kind(docs, "Service")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "leader"
    (pm,) = _kind(docs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "leader"
    (hpa,) = _kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert hpa["spec"]["scaleTargetRef"]["name"] == lws["metadata"]["name"]
    (pdb,) = _kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchExpressions"][0]["values"] == ["server", "leader", "worker"]


def test_helm_test_pods() -> None:
    docs = _render(load_value_set("gpt-oss-120b-8gpu")).documents
    pods = {d["metadata"]["name"]: d for d in _kind(docs, "Pod")}
    assert set(pods) == {"demo-dflash-trt-test-health", "demo-dflash-trt-test-generate"}
    for pod in pods.values():
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
    env = {
        e["name"]: e["value"] for e in pods["demo-dflash-trt-test-generate"]["spec"]["containers"][0]["env"]
    }
    assert env["GENERATE_URL"] == "http://demo-dflash-trt:8000/v2/models/tensorrt_llm/generate"
    assert json.loads(env["BODY"]) == {"text_input": "def fibonacci(n):", "sampling_param_max_tokens": 8}
    health = pods["demo-dflash-trt-test-health"]["spec"]["containers"][0]["command"][2]
    assert "/v2/health/ready" in health and "/v2/models/tensorrt_llm/ready" in health


def test_prompt_with_quotes_stays_valid_json() -> None:
    values = copy.deepcopy(load_value_set("tiny-cpu"))
    values["tests"]["prompt"] = 'it\'s "quoted" $(rm -rf /)'
    docs = _render(values).documents
    pod = next(d for d in _kind(docs, "Pod") if d["metadata"]["name"].endswith("test-generate"))
    body = next(e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == "BODY")
    assert json.loads(body)["text_input"] == values["tests"]["prompt"]


def test_user_affinity_is_merged_with_gpu_product() -> None:
    values = copy.deepcopy(load_value_set("gpt-oss-120b-8gpu"))
    values["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    spec = _server(_kind(_render(values).documents, "Deployment")[0])
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert len(terms) == 2
    for term in terms:
        assert {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-B200"]} in term[
            "matchExpressions"
        ]
    assert "podAntiAffinity" in spec["affinity"]


def test_init_marker_changes_with_the_init_spec() -> None:
    values = copy.deepcopy(load_value_set("gpt-oss-120b-8gpu"))

    def marker(v: dict[str, Any]) -> str:
        script = _server(_kind(_render(v).documents, "Deployment")[0])["initContainers"][0]["command"][2]
        return next(line for line in script.splitlines() if line.strip().startswith("marker="))

    first = marker(values)
    values["modelInit"]["download"]["repos"][1]["revision"] = "v2"
    assert marker(values) != first


def test_kube_version_floor(helm_binary: Path) -> None:
    """Chart.yaml's kubeVersion (>= 1.29) is enforced: autoscaling/v2, policy/v1 and the probes need it."""
    values = CHART_DIR / "ci" / "tiny-cpu.values.yaml"
    args = [str(helm_binary), "template", RELEASE, str(CHART_DIR), "-f", str(values), "--kube-version"]
    old = subprocess.run([*args, "1.28.0"], capture_output=True, text=True, check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr
    assert subprocess.run([*args, "1.29.0"], capture_output=True, text=True, check=False).returncode == 0


def test_app_version_is_the_package_version() -> None:
    from dflash_trt import __version__

    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert deploy.DEFAULT_TORCH_IMAGE[1].startswith(__version__)
