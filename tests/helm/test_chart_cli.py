# SPDX-License-Identifier: Apache-2.0
"""`dflash-trt chart --bundle DIR [--lint] [--render OUT] [-f extra.yaml] [--helm-binary PATH]`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helm_support import KUBE_VERSIONS, load_manifest

from dflash_trt.deploy import chart as deploy


@pytest.fixture(autouse=True)
def _no_ambient_helm_binary(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    # DFLASH_TRT_HELM_BINARY is also --helm-binary's envvar: keep the SDK the default here
    # (after the session's helm_binary fixture has read it).
    if "helm_binary" in request.fixturenames:
        request.getfixturevalue("helm_binary")
    monkeypatch.delenv("DFLASH_TRT_HELM_BINARY", raising=False)
    monkeypatch.delenv("DFLASH_TRT_CHART_DIR", raising=False)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A bundle directory as `dflash-trt build` leaves it, as far as the chart cares."""
    bundle = tmp_path / "gpt-oss-120b"
    (bundle / "model_repository" / "tensorrt_llm" / "1").mkdir(parents=True)
    (bundle / "engine").mkdir()
    manifest = load_manifest("gpt-oss-120b-b200")
    (bundle / "manifest.json").write_text("{}")
    deploy.write_helm_values(bundle, manifest)
    return bundle


def test_missing_values_file(cli, tmp_path: Path) -> None:
    code, out, err = cli(["chart", "--bundle", str(tmp_path)])
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert str(tmp_path / "helm-values.yaml") in lines[0] and "fix: re-run `dflash-trt build`" in lines[0]


@pytest.mark.helm
def test_lint_is_the_default(cli, bundle: Path) -> None:
    code, out, err = cli(["chart", "--bundle", str(bundle)])
    assert code == 0, err
    assert out == "" and "lint: ok:" in err and "helm-python-sdk" in err


@pytest.mark.helm
def test_render_to_stdout_with_extra_values(cli, bundle: Path, tmp_path: Path) -> None:
    extra = tmp_path / "prod.yaml"
    extra.write_text("replicaCount: 3\nstorage:\n  storageClassName: fast\n")
    code, out, err = cli(["chart", "--bundle", str(bundle), "--lint", "--render", "-", "-f", str(extra)])
    assert code == 0, err
    docs = {d["kind"]: d for d in yaml.safe_load_all(out) if d}
    assert docs["Deployment"]["spec"]["replicas"] == 3
    assert docs["PersistentVolumeClaim"]["spec"]["storageClassName"] == "fast"
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8, "the bundle's values survive the layering"


@pytest.mark.helm
def test_binary_render_and_validate(cli, bundle: Path, helm_binary: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "out" / "manifests.yaml"
    args = ["--bundle", str(bundle), "--lint", "--render", str(out_file), "--helm-binary", str(helm_binary)]
    for version in KUBE_VERSIONS:
        args += ["--kube-version", version]
    code, _, err = cli(["chart", *args])
    assert code == 0, err
    assert "helm binary" in err and "validate: ok" in err and f"render: wrote 7 objects to {out_file}" in err
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out_file.read_text()) if d)
    assert kinds == [
        "Deployment",
        "PersistentVolumeClaim",
        "Pod",
        "Pod",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    ]


@pytest.mark.helm
@pytest.mark.parametrize("use_binary", [False, True])
def test_bad_extra_values_fail_with_the_key(
    cli, bundle: Path, tmp_path: Path, helm_binary: Path, use_binary: bool
) -> None:
    extra = tmp_path / "bad.yaml"
    extra.write_text("gpu:\n  count: 12\n")
    args = ["--bundle", str(bundle), "-f", str(extra)] + (
        ["--helm-binary", str(helm_binary)] if use_binary else []
    )
    code, _, err = cli(["chart", *args])
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith("error: helm lint --strict failed") and "gpu.count=12 exceeds gpu.perNode=8" in last
    )

    extra.write_text("replicaCount: many\n")
    code, out, err = cli(["chart", *args, "--render", "-"])
    assert code == 2 and out == "", "values rejected on render are a usage error"
    assert "/replicaCount" in err


def test_wrong_chart_dir(cli, bundle: Path, tmp_path: Path) -> None:
    code, _, err = cli(["chart", "--bundle", str(bundle), "--chart", str(tmp_path)])
    assert code == 2 and "no Chart.yaml" in err and "fix:" in err


def test_help_does_not_import_heavy_modules() -> None:
    code = (
        "import sys; from dflash_trt.cli import main\n"
        "try:\n    main(['chart', '--help'])\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('torch', 'helm_python', 'jsonschema', 'kubernetes_validate') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "--bundle" in proc.stdout and "--helm-binary" in proc.stdout
