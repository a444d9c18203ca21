# SPDX-License-Identifier: Apache-2.0
"""The chart's on-cluster build (buildJob) and its DFlash dashboard and alerts: rendered with real Helm,
off by default, rejected values named, and the Job's and the wait container's shell scripts run for
real against a directory standing in for the bundle volume, with the real `dflash-trt build`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helm_support import CHART_DIR, NAMESPACE, RELEASE, REPO, load_value_set

from dflash_trt.deploy import chart as deploy
from dflash_trt.errors import UsageError

pytestmark = pytest.mark.helm

BUILD = "qwen3-8b-fp8-build"
MONITORED = "llama-3.1-8b-nvfp4-build"


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    return deploy.render_chart(values, chart_dir=CHART_DIR, release=RELEASE, namespace=NAMESPACE).documents


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def _rejected(values: dict[str, Any]) -> str:
    with pytest.raises(UsageError) as info:
        _render(values)
    return info.value.one_line()


# ------------------------------------------------------------------------------ off by default


def test_everything_is_off_by_default() -> None:
    docs = _render({})
    kinds = {d["kind"] for d in docs}
    assert "Job" not in kinds and "PrometheusRule" not in kinds and "ConfigMap" not in kinds
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "initContainers" not in pod


# ---------------------------------------------------------------------------------- build Job


def test_build_job_and_the_serving_pods_wait_for_its_bundle() -> None:
    docs = _render(load_value_set(BUILD))
    job = _one(docs, "Job")
    deployment = _one(docs, "Deployment")
    spec = job["spec"]["template"]["spec"]
    build = spec["containers"][0]
    assert job["metadata"]["name"].startswith(f"{RELEASE}-dflash-trt-build-")
    assert build["args"] == ["--target", "qwen3-8b", "--gpu", "h100", "--quant", "fp8"]
    assert build["image"] == "registry.example.com/ml/dflash-trt-build:0.1.0"
    assert build["resources"]["limits"]["nvidia.com/gpu"] == 1 and spec["restartPolicy"] == "Never"
    # the HF token is a reference to the Secret, never a value
    token = next(e for e in build["env"] if e["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    # the Job writes the volume the server reads
    claim = spec["volumes"][0]["persistentVolumeClaim"]["claimName"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    assert "--model-repository=/models/bundle/model_repository" in pod["containers"][0]["args"]
    # the serving pod waits for the Job's markers (same fingerprint) and never writes the volume
    wait = pod["initContainers"][0]
    assert wait["name"] == "wait-for-bundle" and wait["volumeMounts"][0]["readOnly"] is True
    fingerprint = job["metadata"]["annotations"]["dflash-trt/build-fingerprint"]
    assert f".dflash-trt-build-{fingerprint}.done" in wait["command"][2]
    assert f".dflash-trt-build-{fingerprint}.done" in build["command"][2]
    assert job["metadata"]["name"] in wait["command"][2]
    # the build pod is not behind the Service, and no disruption budget counts it
    service = _one(docs, "Service")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "server"
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "build"


def test_other_build_args_make_another_job() -> None:
    base = load_value_set(BUILD)
    first = _one(_render(base), "Job")["metadata"]["name"]
    again = _one(_render(base), "Job")["metadata"]["name"]
    other = deploy.merge_values(base, {"buildJob": {"args": ["--target", "qwen3-8b", "--gpu", "h100"]}})
    assert first == again != _one(_render(other), "Job")["metadata"]["name"]


def test_multi_node_groups_wait_for_one_build() -> None:
    values = deploy.merge_values(
        load_value_set("gpt-oss-120b-multinode"),
        {"modelInit": {"enabled": False}, "buildJob": {"enabled": True, "args": ["--target", "gpt-oss-120b",
         "--gpu", "gb200", "--tp", "8"], "gpus": 0, "image": {"repository": "registry.example.com/b"}}},
    )  # fmt: skip
    docs = _render(values)
    job = _one(docs, "Job")
    assert "resources" not in job["spec"]["template"]["spec"]["containers"][0]  # gpus: 0
    lws = _one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    for template in (lws["leaderTemplate"], lws["workerTemplate"]):
        assert template["spec"]["initContainers"][0]["name"] == "wait-for-bundle"


BUILD_FAILS = [
    ({"buildJob": {"args": []}}, r"buildJob.enabled=true with buildJob.args empty; fix: pass the build"),
    (
        {"buildJob": {"args": ["--target", "x", "--output", "/m"]}},
        r"buildJob.args has --output: .*fix: remove",
    ),
    ({"buildJob": {"args": ["--target", "x", "-o", "/m"]}}, r"buildJob.args has -o:"),
    ({"buildJob": {"args": ["--target", "x", "--dry-run"]}}, r"buildJob.args has --dry-run: .*wait forever"),
    (
        {"modelInit": {"enabled": True, "mode": "download", "download": {"repos": [{"repo": "a/b"}]}}},
        r"buildJob.enabled=true with modelInit.enabled=true: two writers",
    ),
    (
        {"storage": {"type": "emptyDir"}},
        r"buildJob.enabled=true with storage.type=emptyDir: a Job cannot fill",
    ),
]


@pytest.mark.parametrize(("patch", "pattern"), BUILD_FAILS)
def test_bad_build_values_are_named(patch: dict[str, Any], pattern: str) -> None:
    line = _rejected(deploy.merge_values(load_value_set(BUILD), patch))
    assert re.search(pattern, line), line


def test_without_a_build_image_the_job_runs_one_with_dflash_trt() -> None:
    """The NGC server image has no dflash-trt: an unset buildJob.image means the dflash-trt build
    image (build/docker/Dockerfile.build-trtllm) for trtllm, the server image for torch."""
    values = deploy.merge_values(load_value_set(BUILD), {"buildJob": {"image": {"repository": ""}}})
    job = _one(_render(values), "Job")
    assert (
        job["spec"]["template"]["spec"]["containers"][0]["image"]
        == "ghcr.io/dflash-trt/dflash-trt-build:0.1.0-trtllm"
    )
    torch = deploy.merge_values(values, {"backend": "torch", "gpu": {"count": 0},
                                         "image": {"repository": "registry.example.com/cpu", "tag": "1"}})  # fmt: skip
    job = _one(_render(torch), "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/cpu:1"


def test_schema_rejects_a_bad_output_path() -> None:
    line = _rejected(deploy.merge_values(load_value_set(BUILD), {"buildJob": {"outputSubPath": "../x"}}))
    assert "buildJob" in line and "outputSubPath" in line, line


# --------------------------------------------------- the Job's and the wait container's scripts


def _scripts(tmp_path: Path, args: list[str], period: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rendered build and wait containers with the volume at tmp_path/volume."""
    values = deploy.merge_values(
        load_value_set(BUILD),
        {
            "bundle": {"mountPath": str(tmp_path / "volume")},
            "buildJob": {"args": args, "waitPeriodSeconds": period},
        },
    )
    docs = _render(values)
    build = _one(docs, "Job")["spec"]["template"]["spec"]["containers"][0]
    wait = _one(docs, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    return build, wait


def _run(container: dict[str, Any], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a container's `sh -c SCRIPT NAME ARGS...` here, with the real dflash-trt CLI on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    cli = bindir / "dflash-trt"
    cli.write_text(f'#!/bin/sh\nexec {sys.executable} -m dflash_trt "$@"\n')
    cli.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "TMPDIR": str(tmp_path),
    }
    cmd = [*container["command"], *container.get("args", [])]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out, "")


@pytest.mark.timing
def test_job_builds_a_bundle_and_the_wait_container_then_passes(tmp_path: Path) -> None:
    build, wait = _scripts(tmp_path, ["--target", "tiny"])
    volume = tmp_path / "volume"
    volume.mkdir()
    # nothing built yet: the serving pod keeps waiting
    early = _run(wait, tmp_path, timeout=2.5)
    assert early.returncode == 124 and "waiting for Job" in early.stdout
    done = _run(build, tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((volume / "bundle" / "manifest.json").read_text())
    assert manifest["name"] == "tiny" and (volume / "bundle" / "model_repository").is_dir()
    assert len(list(volume.glob(".dflash-trt-build-*.done"))) == 1
    ready = _run(
        wait, tmp_path, timeout=120
    )  # a bound on a hang: the wait container sees the marker and ends
    assert ready.returncode == 0 and "is complete" in ready.stdout, ready.stdout + ready.stderr
    # a rerun of the same spec keeps the bundle (no rebuild)
    again = _run(build, tmp_path, timeout=60)
    assert again.returncode == 0 and "already holds the bundle of this spec" in again.stdout


def test_a_bundle_of_another_spec_is_not_served(tmp_path: Path) -> None:
    """After `helm upgrade` with other args, the old bundle (and its manifest) is not enough."""
    build, _ = _scripts(tmp_path, ["--target", "tiny"])
    assert _run(build, tmp_path, timeout=120).returncode == 0
    _, wait_other = _scripts(tmp_path, ["--target", "tiny", "--max-seq-len", "256"])
    waited = _run(wait_other, tmp_path, timeout=2.5)
    assert waited.returncode == 124, waited.stdout + waited.stderr


def test_failed_build_is_visible_to_the_job_and_the_serving_pods(tmp_path: Path) -> None:
    build, wait = _scripts(tmp_path, ["--target", "no-such-model"])
    (tmp_path / "volume").mkdir()
    failed = _run(build, tmp_path, timeout=60)
    assert failed.returncode == 2  # the Job's pod fails: the Job retries, then reports Failed
    assert "is not `tiny`, a directory, a registered name or a Hugging Face id" in failed.stderr
    marker = next((tmp_path / "volume").glob(".dflash-trt-build-*.failed")).read_text()
    assert marker.startswith("error: --target='no-such-model'")
    assert not (tmp_path / "volume" / "bundle").exists()
    waited = _run(wait, tmp_path, timeout=10)
    assert waited.returncode == 1
    assert "the build Job" in waited.stderr and "failed: error: --target='no-such-model'" in waited.stderr
    assert "fix: see kubectl logs job/" in waited.stderr


# ------------------------------------------------------------------------ dashboard and rules


def test_dashboard_configmap_for_the_grafana_sidecar() -> None:
    docs = _render(load_value_set(MONITORED))
    cm = _one(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert cm["metadata"]["namespace"] == NAMESPACE
    dashboard = json.loads(cm["data"]["dflash-trt.json"])
    assert dashboard == json.loads((CHART_DIR / "dashboards" / "dflash-trt.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    for title in ("DFlash drafter", "τ over time", "Acceptance length histogram", "Output tokens/s",
                  "Queue and active requests", "KV cache utilization", "Round duration",
                  "Time to first token", "Inter-token latency", "Triton: time per request"):  # fmt: skip
        assert title in titles, title
    other_ns = deploy.merge_values(
        load_value_set(MONITORED), {"metrics": {"grafanaDashboard": {"namespace": "grafana"}}}
    )
    assert _one(_render(other_ns), "ConfigMap")["metadata"]["namespace"] == "grafana"


def test_prometheus_rule_alerts_use_the_values() -> None:
    values = deploy.merge_values(
        load_value_set(MONITORED),
        {
            "metrics": {
                "prometheusRule": {"severity": "page", "tauCollapse": {"threshold": 2.25, "for": "5m"}}
            }
        },
    )
    rule = _one(_render(values), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(rules) == {"DFlashTauCollapse", "DFlashQueueGrowth", "DFlashKvCacheSaturated"}
    tau = rules["DFlashTauCollapse"]
    assert ") < 2.25" in tau["expr"] and tau["for"] == "5m" and tau["labels"] == {"severity": "page"}
    assert f'namespace="{NAMESPACE}",model="tensorrt_llm"' in tau["expr"]
    assert "{{ $labels.pod }}" in tau["annotations"]["summary"]  # left for Prometheus to expand
    assert "> 8" in rules["DFlashQueueGrowth"]["expr"] and "> 0.95" in rules["DFlashKvCacheSaturated"]["expr"]


def test_rule_schema_catches_a_bad_rule() -> None:
    rule = _one(_render(load_value_set(MONITORED)), "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["for"] = "soon"
    text = "\n---\n".join(json.dumps(d) for d in [rule])
    problems = deploy.validate_manifests(text)
    assert problems and "PrometheusRule" in problems[0] and "for" in problems[0], problems


def test_precompile_in_the_job_is_opt_in_torch_only_and_never_fails_the_build(tmp_path: Path) -> None:
    """buildJob.precompile runs `dflash-trt precompile` after a torch build (its own Job name, so an
    existing release's Job is untouched until it is turned on); a failed precompile leaves a served
    bundle (the servers then compile in the background)."""
    values = deploy.merge_values(
        load_value_set(BUILD),
        {"backend": "torch", "image": {"repository": "ghcr.io/dflash-trt/dflash-trt", "tag": "0.1.0-cpu"},
         "bundle": {"mountPath": str(tmp_path / "volume")},
         "buildJob": {"args": ["--target", "tiny"], "precompile": True}},
    )  # fmt: skip
    job = _one(_render(values), "Job")
    off = _one(_render(deploy.merge_values(values, {"buildJob": {"precompile": False}})), "Job")
    trt = _one(_render(deploy.merge_values(values, {"backend": "trtllm"})), "Job")
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert 'dflash-trt precompile --bundle "$out"' in script
    for other in (off, trt):
        assert "dflash-trt precompile" not in other["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert job["metadata"]["name"] != off["metadata"]["name"]

    # the real build, then a precompile that fails (here: a CLI whose precompile exits 3)
    (tmp_path / "volume").mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "precompile-calls"
    fake = bindir / "dflash-trt"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = precompile ]; then echo "$@" >> {calls}; exit 3; fi\n'
        f'exec {sys.executable} -m dflash_trt "$@"\n'
    )
    fake.chmod(0o755)
    build = job["spec"]["template"]["spec"]["containers"][0]
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    cmd = [*build["command"], *build.get("args", [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls.read_text().split() == ["precompile", "--bundle", str(tmp_path / "volume" / "bundle")]
    assert "precompile failed (status 3)" in done.stderr
    assert len(list((tmp_path / "volume").glob(".dflash-trt-build-*.done"))) == 1
