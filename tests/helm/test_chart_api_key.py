# SPDX-License-Identifier: Apache-2.0
"""The chart's API key (apiKey.secretName) and NetworkPolicy (networkPolicy.enabled).

Rendered by real Helm, then run for real: a tritonserver started with the rendered restricted-API
arguments (with $(DFLASH_TRT_API_KEY) expanded as the kubelet does) and the OpenAI sidecar's
rendered `dflash-trt serve --triton-url` command, against which the rendered `helm test` scripts
and the probes' paths run with curl. Without a key they get 403/401, with it 200; the probes need
none. The render checks: the key reaches only the containers that serve (never init containers or
the build Job), by Secret reference; the NetworkPolicy opens each port to whom it should.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from helm_support import CHART_DIR, NAMESPACE, RELEASE, load_value_set

from dflash_trt.deploy import chart as deploy
from dflash_trt.errors import UsageError
from tests.serving.conftest import build_bundle, free_ports

pytestmark = pytest.mark.helm

KEY = "chart-" + "5eb2a1c0" * 4
SECRET = "dflash-trt-api-key"


def _values(name: str = "tiny-cpu", **extra: Any) -> dict[str, Any]:
    values = copy.deepcopy(load_value_set(name))
    values["apiKey"] = {"secretName": SECRET, "secretKey": "key"}
    return deploy.merge_values(values, extra)


def _docs(values: dict[str, Any]) -> list[dict[str, Any]]:
    return deploy.render_chart(values, chart_dir=CHART_DIR, release=RELEASE, namespace=NAMESPACE).documents


def _kind(docs: list[dict[str, Any]], kind: str, name_part: str = "") -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]
    return doc


def _env_names(container: dict[str, Any]) -> list[str]:
    return [e["name"] for e in container.get("env", [])]


def test_the_key_reaches_only_the_serving_containers_by_secret_reference() -> None:
    from dflash_trt.triton.server import PROTECTED_APIS

    docs = _docs(_values(openai={"enabled": True}))
    spec = _kind(docs, "Deployment")["spec"]["template"]["spec"]
    triton, sidecar = spec["containers"]
    restricted = [a for a in triton["args"] if "restricted" in a]
    groups = ",".join((*PROTECTED_APIS, "model-repository"))  # the chart's Triton has no admin key
    assert restricted == [f"--http-restricted-api={groups}:authorization=Bearer $(DFLASH_TRT_API_KEY)",
                          f"--grpc-restricted-protocol={groups}:authorization=Bearer $(DFLASH_TRT_API_KEY)"]  # fmt: skip
    ref = {"name": "DFLASH_TRT_API_KEY", "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "key"}}}
    assert ref in triton["env"] and ref in sidecar["env"]
    assert all("DFLASH_TRT_API_KEY" not in _env_names(c) for c in spec["initContainers"])
    for pod in ("test-generate", "test-openai"):
        assert ref in _kind(docs, "Pod", pod)["spec"]["containers"][0]["env"]
    assert "DFLASH_TRT_API_KEY" not in str(_kind(docs, "Pod", "test-health"))  # probes need no key
    assert triton["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    ready = triton["readinessProbe"]["exec"]["command"][2]  # also asks for no engine-dead report
    assert (
        "GET /v2/health/ready " in ready and "DFLASH_TRT_API_KEY" not in ready and "uthorization" not in ready
    )
    assert KEY not in str(docs)


def test_multi_node_leader_gets_the_key_workers_do_not() -> None:
    docs = _docs(_values("gpt-oss-120b-multinode"))
    lwt = _kind(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    assert sum("restricted" in a for a in leader["args"]) == 2 and "DFLASH_TRT_API_KEY" in _env_names(leader)
    assert "DFLASH_TRT_API_KEY" not in _env_names(worker)


def test_a_replaced_server_command_cannot_carry_the_key() -> None:
    with pytest.raises(UsageError) as info:
        _docs(_values(server={"command": ["my-server"]}))
    assert "apiKey.secretName with server.command set" in str(info.value) and "fix:" in str(info.value)


def test_network_policy_opens_each_port_to_whom_it_should() -> None:
    docs = _docs(_values("gpt-oss-120b-multinode", networkPolicy={"enabled": True}))
    policy = _kind(docs, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    clients, monitoring, group = policy["ingress"]
    assert clients["from"] == [{"podSelector": {"matchLabels": {"dflash-trt-client": "true"}}}]
    assert [p["port"] for p in clients["ports"]] == ["http", "grpc"]
    assert monitoring == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                          "ports": [{"port": "metrics", "protocol": "TCP"}]}  # fmt: skip
    assert (
        group["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    )  # MPI, NCCL
    for pod in ("test-health", "test-generate"):  # helm test pods are clients
        assert _kind(docs, "Pod", pod)["metadata"]["labels"]["dflash-trt-client"] == "true"

    docs = _docs(_values(openai={"enabled": True}, networkPolicy={
        "enabled": True, "clientNamespaceSelector": {"matchLabels": {"team": "apps"}}}))  # fmt: skip
    clients, monitoring = _kind(docs, "NetworkPolicy")["spec"]["ingress"]
    assert [p["port"] for p in clients["ports"]] == ["http", "grpc", "openai"]
    assert clients["from"][0]["namespaceSelector"] == {"matchLabels": {"team": "apps"}}
    default = [d for d in _docs(load_value_set("gpt-oss-120b-8gpu")) if d["kind"] == "NetworkPolicy"]
    assert default == []  # off by default


# ------------------------------------------------------------------ the rendered pieces, run for real
@pytest.fixture(scope="module")
def keyed_chart(tmp_path_factory):
    """tritonserver with the chart's rendered restricted-API arguments, and the OpenAI sidecar's
    rendered command, both with the key as the kubelet would expand it from the Secret."""
    from dflash_trt.triton.server import TritonServer

    docs = _docs(_values(openai={"enabled": True}))
    spec = _kind(docs, "Deployment")["spec"]["template"]["spec"]
    triton, sidecar = spec["containers"]
    chart_args = [a.replace("$(DFLASH_TRT_API_KEY)", KEY) for a in triton["args"] if "restricted" in a]

    class ChartTriton(TritonServer):
        def command(self) -> list[str]:
            return [*super().command(), *chart_args]

    bundle = build_bundle(tmp_path_factory.mktemp("chart-key") / "tiny")
    http, grpc, metrics, oai = free_ports(4)
    server = ChartTriton(model_repository=bundle / "model_repository", http_port=http, grpc_port=grpc,
                         metrics_port=metrics, forward_logs=False, extra_env={"DFLASH_TRT_BUNDLE_ROOT": str(bundle)})  # fmt: skip
    server.start()
    front = None
    try:
        server.wait_ready(120)
        args = sidecar["args"]
        args[args.index("--bundle") + 1] = str(bundle)
        args[args.index("--triton-url") + 1] = f"127.0.0.1:{grpc}"
        args[args.index("--host") + 1] = "127.0.0.1"
        args[args.index("--openai-port") + 1] = str(oai)
        assert sidecar["command"] == ["dflash-trt", "serve"]
        front = subprocess.Popen([sys.executable, "-m", "dflash_trt", "serve", *args], stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, "DFLASH_TRT_API_KEY": KEY})  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            assert front.poll() is None, front.stderr.read() if front.stderr else ""
            try:
                if (
                    httpx.get(
                        f"http://127.0.0.1:{oai}{sidecar['readinessProbe']['httpGet']['path']}"
                    ).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the sidecar never became ready"
            time.sleep(0.3)
        yield {"docs": docs, "triton": triton, "http": http, "oai": oai, "server": server}
    finally:
        if front is not None and front.poll() is None:
            front.terminate()
            front.wait(60)
        server.stop()


def _pod_script(docs: list[dict[str, Any]], name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    pod = _kind(docs, "Pod", name)["spec"]["containers"][0]
    script = pod["command"][2]
    return subprocess.run(["/bin/sh", "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.triton_server
def test_rendered_helm_tests_and_probes_against_real_servers(keyed_chart) -> None:
    docs, triton = keyed_chart["docs"], keyed_chart["triton"]
    base, oai = f"http://127.0.0.1:{keyed_chart['http']}", f"http://127.0.0.1:{keyed_chart['oai']}"
    # the kubelet sends no key: the startup probe's GET and the readiness script's (on port 8000)
    assert httpx.get(base + triton["startupProbe"]["httpGet"]["path"]).status_code == 200
    ready = triton["readinessProbe"]["exec"]["command"][2].replace(
        "/dev/tcp/127.0.0.1/8000", f"/dev/tcp/127.0.0.1/{keyed_chart['http']}"
    )
    probe = subprocess.run(["/bin/bash", "-c", ready], capture_output=True, text=True, timeout=10)
    assert probe.returncode == 0, probe.stderr
    assert httpx.get(f"{oai}/health/live").status_code == 200
    health = _pod_script(docs, "test-health", {"BASE_URL": base})
    assert health.returncode == 0, health.stdout + health.stderr

    generate_url = f"{base}/v2/models/tensorrt_llm/generate"
    body = _kind(docs, "Pod", "test-generate")["spec"]["containers"][0]["env"][1]["value"]
    for key, ok in ((KEY, True), ("wrong-" + KEY, False), ("", False)):
        env = {"GENERATE_URL": generate_url, "BODY": body, "DFLASH_TRT_API_KEY": key}
        out = _pod_script(docs, "test-generate", env)
        assert (out.returncode == 0) == ok, out.stdout + out.stderr
        if ok:
            assert '"text_output"' in out.stdout
    prompt_env = {
        e["name"]: e.get("value", "")
        for e in _kind(docs, "Pod", "test-openai")["spec"]["containers"][0]["env"]
    }
    for key, ok in ((KEY, True), ("wrong-" + KEY, False)):
        env = {"OPENAI_URL": f"{oai}/v1", "PROMPT_JSON": prompt_env["PROMPT_JSON"],
               "MAX_TOKENS": prompt_env["MAX_TOKENS"], "DFLASH_TRT_API_KEY": key}  # fmt: skip
        out = _pod_script(docs, "test-openai", env)
        assert (out.returncode == 0) == ok, out.stdout + out.stderr
        if ok:
            assert re.search(r'"completion_tokens": *\d', out.stdout), out.stdout
