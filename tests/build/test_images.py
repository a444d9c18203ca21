# SPDX-License-Identifier: Apache-2.0
"""The container recipes in build/docker/, linted: pinned bases, a non-root user, no build tools but inductor's g++ in
the serving image's final stage, files and extras that exist, and image names that the chart and
`dflash-trt chart --bundle` point at. `make image-test` builds and runs the serving image for real
(build/docker/README.md); the image's smoke test is checked here with the installed package.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from dflash_trt import __version__

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "build" / "docker"
RECIPES = ("Dockerfile.serve-torch", "Dockerfile.build-trtllm", "Dockerfile.debian-base")
BUILD_TOOLS = re.compile(r"\b(clang|build-essential|make|cmake)\b")  # g++ stays: inductor needs it


def _stages(text: str) -> list[list[str]]:
    """Instructions per stage, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    stages: list[list[str]] = []
    for ln in lines:
        if ln.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(ln)
    return stages


def _arg_defaults(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))


@pytest.mark.parametrize("name", RECIPES)
def test_bases_are_pinned_and_files_exist(name: str) -> None:
    text = (DOCKER / name).read_text()
    defaults = _arg_defaults(text)
    for stage in _stages(text):
        base = stage[0].split()[1]
        base = defaults.get(base.strip("${}"), base) if base.startswith("$") else base
        if base == "scratch" or base in ("build",):
            continue
        assert ":" in base and not base.endswith(":latest"), f"{name}: unpinned base {base}"
    for src in re.findall(r"^(?:COPY|ADD) (?!--from)(?:--\S+ )*(\S+) ", text, flags=re.M):
        produced = {"wheelhouse/", "rootfs.tar"}  # made by images.sh in the build context
        assert src in produced or (DOCKER / src).exists(), (
            f"{name}: {src} is neither in build/docker nor made"
        )


def test_serving_image_is_non_root_with_inductors_compiler_only() -> None:
    text = (DOCKER / "Dockerfile.serve-torch").read_text()
    build, final = _stages(text)
    assert "USER 1000:1000" in final  # the chart's runAsUser/runAsGroup
    chart = yaml.safe_load((ROOT / "helm" / "dflash-trt" / "values.yaml").read_text())
    assert (
        chart["podSecurityContext"]["runAsUser"] == 1000 and chart["podSecurityContext"]["runAsGroup"] == 1000
    )
    installs = [ln for ln in final if "apt-get install" in ln or "pip install" in ln]
    assert installs and not any(BUILD_TOOLS.search(ln) for ln in installs), installs
    # compiled rounds (the engine's default) need g++ and Python's headers at run time, to compile and to load
    runtime = " ".join(ln for ln in installs if "apt-get install" in ln)
    assert "g++" in runtime.split() and "libpython3.11-dev" in runtime.split(), runtime
    assert any("/opt/tritonserver/bin" in ln for ln in final if ln.startswith("ENV"))  # tritonserver on PATH
    exposed = next(ln for ln in final if ln.startswith("EXPOSE")).split()[1:]
    assert exposed == ["8000", "8001", "8002", "9000"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for spec in re.findall(r'"dflash-trt\[([\w,]+)\]"', " ".join(build)):
        assert set(spec.split(",")) <= set(extras), spec
    assert "USER 1000:1000" in (DOCKER / "Dockerfile.build-trtllm").read_text()


def test_image_names_are_what_the_chart_points_at() -> None:
    from dflash_trt.deploy.chart import DEFAULT_TORCH_IMAGE

    assert ("ghcr.io/dflash-trt/dflash-trt", f"{__version__}-cpu") == DEFAULT_TORCH_IMAGE
    script = (DOCKER / "images.sh").read_text()
    assert "IMAGE=${IMAGE:-ghcr.io/dflash-trt/dflash-trt:${VERSION}-cpu}" in script
    helpers = (ROOT / "helm" / "dflash-trt" / "templates" / "_helpers.tpl").read_text()
    assert 'printf "ghcr.io/dflash-trt/dflash-trt-build:%s-trtllm" .Chart.AppVersion' in helpers
    chart = yaml.safe_load((ROOT / "helm" / "dflash-trt" / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    for name in ("Dockerfile.serve-torch", "Dockerfile.build-trtllm"):
        assert f"dflash-trt{'-build' if 'build' in name else ''}:0.1.0-" in (DOCKER / name).read_text()


def test_scripts_parse() -> None:
    for script in ("images.sh", "tritonserver.sh"):
        shell = "bash" if script.endswith("images.sh") else "sh"
        out = subprocess.run([shell, "-n", str(DOCKER / script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    out = subprocess.run(["bash", str(DOCKER / "images.sh"), "nonsense"], capture_output=True, text=True)
    assert out.returncode == 2 and "fix: one of all" in out.stderr
