# SPDX-License-Identifier: Apache-2.0
"""values.schema.json and validate-values.yaml reject bad values with messages that name the key;
every value is typed, commented in values.yaml and documented in the chart README."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import values_docs as docs
import yaml
from helm_support import CHART_DIR, load_value_set

from dflash_trt.deploy import chart as deploy
from dflash_trt.errors import UsageError

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def _rejected(values: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(UsageError) as info:
        deploy.render_chart(values, chart_dir=CHART_DIR, **kw)
    line = info.value.one_line()
    assert "\n" not in line
    return line


# ------------------------------------------------------------------------ schema rejections


def _first_key(data: dict[str, Any]) -> str:
    key, value = next(iter(data.items()))
    return key + ("." + _first_key(value) if isinstance(value, dict) and value else "")


SCHEMA_CASES = [
    ({"replicaCount": "two"}, "at '/replicaCount': got string, want integer"),
    ({"backend": "jax"}, "at '/backend': value must be one of 'trtllm', 'torch'"),
    ({"replicacount": 2}, "additional properties 'replicacount' not allowed"),
    ({"gpu": {"count": -1}}, "at '/gpu/count'"),
    ({"gpu": {"cnt": 8}}, "additional properties 'cnt' not allowed"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    ({"image": {"digest": "sha256:abc"}}, "at '/image/digest'"),
    ({"shm": {"sizeLimit": 16}}, "at '/shm/sizeLimit': got number, want string"),
    ({"storage": {"size": "lots"}}, "at '/storage/size'"),
    ({"storage": {"type": "hostPath"}}, "at '/storage/type'"),
    ({"storage": {"accessModes": []}}, "at '/storage/accessModes'"),
    (
        {"modelInit": {"download": {"repos": [{"repo": "x'; rm -rf /; echo '"}]}}},
        "at '/modelInit/download/repos/0/repo'",
    ),
    ({"modelInit": {"download": {"repos": [{"repo": "a/b", "localDir": "relative/dir"}]}}}, "localDir"),
    ({"modelInit": {"mode": "copy"}}, "at '/modelInit/mode'"),
    ({"probes": {"startup": {"budgetSeconds": 0}}}, "at '/probes/startup/budgetSeconds'"),
    ({"server": {"drainSeconds": -1}}, "at '/server/drainSeconds'"),
    ({"terminationGracePeriodSeconds": 60}, "terminationGracePeriodSeconds"),
    ({"service": {"httpPort": 70000}}, "at '/service/httpPort'"),
    ({"metrics": {"serviceMonitor": {"interval": "15 seconds"}}}, "at '/metrics/serviceMonitor/interval'"),
    (
        {"autoscaling": {"metric": {"targetAverageValue": "fast"}}},
        "at '/autoscaling/metric/targetAverageValue'",
    ),
    ({"autoscaling": {"maxReplicas": 0}}, "at '/autoscaling/maxReplicas'"),
    ({"multiNode": {"restartPolicy": "Always"}}, "at '/multiNode/restartPolicy'"),
    ({"podDisruptionBudget": {"maxUnavailable": "half"}}, "at '/podDisruptionBudget/maxUnavailable'"),
    ({"server": {"extraArgs": ["log-verbose=1"]}}, "at '/server/extraArgs/0'"),
    ({"resources": {"limits": {"memory": ["4Gi"]}}}, "at '/resources/limits/memory'"),
    ({"bundle": {"mountPath": "models"}}, "at '/bundle/mountPath'"),
    ({"tests": {"maxTokens": 0}}, "at '/tests/maxTokens'"),
]


@pytest.mark.helm
@pytest.mark.parametrize(("bad", "message"), SCHEMA_CASES, ids=[_first_key(c[0]) for c in SCHEMA_CASES])
def test_schema_rejects(bad: dict[str, Any], message: str) -> None:
    line = _rejected(bad)
    assert message in line, line
    assert "fix:" in line


@pytest.mark.helm
def test_schema_rejection_with_the_binary(helm_binary: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("replicaCount: two\nstorage:\n  type: hostPath\n")
    proc = subprocess.run(
        [str(helm_binary), "lint", "--strict", str(CHART_DIR), "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "/replicaCount" in proc.stdout and "/storage/type" in proc.stdout
    assert "/replicaCount" in _rejected({"replicaCount": "two"}, helm_binary=helm_binary)


# ----------------------------------------------------------------- cross-field `fail` checks

FAIL_CASES = [
    ("tiny-cpu", {"backend": "trtllm"}, r"gpu.count=0 with backend=trtllm: .*fix: set gpu.count"),
    (
        "tiny-cpu",
        {"image": {"repository": "nvcr.io/nvidia/tritonserver", "tag": "26.10-trtllm-python-py3"}},
        r"image=nvcr.io/nvidia/tritonserver:26.10-trtllm-python-py3 with backend=torch: .*fix: set image.repository",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"gpu": {"count": 16}},
        r"gpu.count=16 exceeds gpu.perNode=8: .*fix: set multiNode.enabled=true",
    ),
    (
        "gpt-oss-120b-multinode",
        {"gpu": {"count": 4}},
        r"multiNode.enabled=true with gpu.count=4 <= gpu.perNode=4",
    ),
    ("gpt-oss-120b-multinode", {"gpu": {"count": 10}}, r"gpu.count=10 is not a multiple of gpu.perNode=4"),
    (
        "gpt-oss-120b-multinode",
        {"multiNode": {"sshSecretName": ""}},
        r"multiNode.sshSecretName is empty: .*fix: create a Secret",
    ),
    (
        "gpt-oss-120b-multinode",
        {"backend": "torch", "image": {"repository": "x/y"}},
        r"multiNode.enabled=true with backend=torch",
    ),
    (
        "gpt-oss-120b-multinode",
        {"storage": {"type": "newClaim", "accessModes": ["ReadWriteOnce"], "readOnly": False}},
        r"storage.accessModes=\[\"ReadWriteOnce\"\] with multiNode.enabled=true: .*fix: use ReadWriteMany",
    ),
    (
        "gpt-oss-120b-multinode",
        {
            "storage": {"readOnly": False},
            "modelInit": {"enabled": True, "mode": "build", "build": {"args": ["x"]}},
        },
        r"modelInit.mode=build with multiNode.enabled=true",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"resources": {"limits": {"nvidia.com/gpu": 8}}},
        r"resources.limits\[nvidia.com/gpu\] is set: .*fix: remove it and set gpu.count",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"storage": {"type": "existingClaim"}},
        r"storage.type=existingClaim with storage.existingClaim empty",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"storage": {"type": "emptyDir"}, "modelInit": {"enabled": False}},
        r"storage.type=emptyDir with modelInit.enabled=false",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"storage": {"readOnly": True}},
        r"storage.readOnly=true with modelInit.enabled=true",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"modelInit": {"download": {"repos": []}}},
        r"modelInit.mode=download with modelInit.download.repos empty",
    ),
    (
        "tiny-cpu",
        {"modelInit": {"build": {"args": []}}},
        r"modelInit.mode=build with modelInit.build.args empty",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        r"autoscaling.minReplicas=5 > autoscaling.maxReplicas=2",
    ),
    (
        "gpt-oss-120b-8gpu",
        {"metrics": {"podMonitor": {"enabled": True}}},
        r"both true: Prometheus would scrape every pod twice",
    ),
    (
        "tiny-cpu",
        {"podDisruptionBudget": {"minAvailable": 1}},
        r"maxUnavailable=1 and podDisruptionBudget.minAvailable=1 are both set",
    ),
    ("tiny-cpu", {"podDisruptionBudget": {"maxUnavailable": None}}, r"are both null; fix: set one of them"),
    ("tiny-cpu", {"image": {"tag": ""}}, r"image.tag and image.digest are both empty"),
]


@pytest.mark.helm
@pytest.mark.parametrize(
    ("base", "patch", "pattern"), FAIL_CASES, ids=[f"{c[0]}:{_first_key(c[1])}" for c in FAIL_CASES]
)
def test_validate_values_rejects(base: str, patch: dict[str, Any], pattern: str) -> None:
    values = deploy.merge_values(load_value_set(base), patch)
    line = _rejected(values)
    assert re.search(pattern, line), line


@pytest.mark.helm
def test_all_problems_are_reported_at_once(helm_binary: Path) -> None:
    values = deploy.merge_values(
        load_value_set("gpt-oss-120b-8gpu"), {"gpu": {"count": 16}, "autoscaling": {"minReplicas": 9}}
    )
    for binary in (None, helm_binary):
        line = _rejected(values, helm_binary=binary)
        assert "gpu.count=16" in line and "autoscaling.minReplicas=9" in line


@pytest.mark.helm
def test_valid_edge_cases_render() -> None:
    """Percentages, minAvailable instead of maxUnavailable (null drops the default), digests, MIG."""
    values = deploy.merge_values(
        load_value_set("gpt-oss-120b-8gpu"),
        {
            "podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"},
            "image": {"tag": "", "digest": "sha256:" + "0" * 64},
            "gpu": {"resourceName": "nvidia.com/mig-3g.40gb", "count": 2},
            "storage": {"storageClassName": "-"},
        },
    )
    rendered = deploy.render_chart(values, chart_dir=CHART_DIR)
    kinds = {d["kind"]: d for d in rendered.documents}
    assert kinds["PodDisruptionBudget"]["spec"] == {
        "minAvailable": "50%",
        "selector": kinds["PodDisruptionBudget"]["spec"]["selector"],
    }
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "nvcr.io/nvidia/tritonserver@sha256:" + "0" * 64
    assert container["resources"]["limits"] == {"nvidia.com/mig-3g.40gb": 2}
    assert kinds["PersistentVolumeClaim"]["spec"]["storageClassName"] == ""
    assert deploy.validate_manifests(rendered.text) == []


# ------------------------------------------------------------------ schema <-> values <-> docs


def test_values_yaml_satisfies_its_schema() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    errors = sorted(jsonschema.Draft7Validator(SCHEMA).iter_errors(VALUES), key=str)
    assert not errors, [e.message for e in errors]


def test_ci_value_sets_satisfy_the_schema_after_merging() -> None:
    validator = jsonschema.Draft7Validator(SCHEMA)
    for path in sorted((CHART_DIR / "ci").glob("*.values.yaml")):
        merged = deploy.merge_values(VALUES, yaml.safe_load(path.read_text()))
        assert not list(validator.iter_errors(merged)), path.name


def test_every_value_is_typed_and_described() -> None:
    documented = dict(docs.iter_documented(SCHEMA))
    assert len(documented) > 100
    for key, node in documented.items():
        assert node.get("description"), f"{key} has no description in values.schema.json"
        assert "type" in node or "oneOf" in node, f"{key} has no type in values.schema.json"
        docs.lookup(VALUES, key)  # every schema value has a default in values.yaml


def _leaves(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict) and data:
        return [leaf for k, v in data.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def test_every_values_yaml_key_is_documented() -> None:
    documented = [k for k, _ in docs.iter_documented(SCHEMA)]
    for leaf in _leaves(VALUES):
        assert any(leaf == k or leaf.startswith(k + ".") for k in documented), f"{leaf} is not documented"


def test_values_yaml_comments_repeat_the_schema() -> None:
    comments = docs.values_comments((CHART_DIR / "values.yaml").read_text())
    for key, node in docs.iter_documented(SCHEMA):
        assert comments.get(key) == node["description"], (
            f"values.yaml `# --` comment of {key} differs from the schema"
        )
    extra = set(comments) - {k for k, _ in docs.iter_documented(SCHEMA)}
    assert not extra, f"`# --` comments on keys the schema does not document: {sorted(extra)}"


def test_readme_values_table_in_sync(update_helm_goldens: bool) -> None:
    readme_path = CHART_DIR / "README.md"
    readme = readme_path.read_text()
    expected = docs.replace_table(readme, docs.values_table(SCHEMA, VALUES))
    if update_helm_goldens:
        readme_path.write_text(expected)
        return
    assert readme == expected, (
        "helm/dflash-trt/README.md values table is stale: `pytest tests/helm --update-helm-goldens`"
    )
    for key, _ in docs.iter_documented(SCHEMA):
        assert f"| `{key}` |" in readme


def test_schema_ships_with_the_chart() -> None:
    ignored = (CHART_DIR / ".helmignore").read_text().splitlines()
    assert not any(p.strip() and not p.startswith("#") and "schema" in p for p in ignored)
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["kubeVersion"] == ">=1.29.0-0"
    assert "dependencies" not in chart, "remote dependencies break offline helm template"


def test_schema_defaults_are_what_the_manifest_function_emits() -> None:
    """Every key helm_values_from_manifest writes exists in values.yaml (the schema would reject it)."""
    from helm_support import MANIFESTS, load_manifest

    validator = jsonschema.Draft7Validator(SCHEMA)
    for name in MANIFESTS:
        produced = deploy.helm_values_from_manifest(load_manifest(name))
        merged = deploy.merge_values(copy.deepcopy(VALUES), produced)
        assert not list(validator.iter_errors(merged)), name
