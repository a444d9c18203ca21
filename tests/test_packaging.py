# SPDX-License-Identifier: Apache-2.0
"""The wheel carries what an installed dflash-trt needs at run time (not just the Python files),
and nothing that only tests use: test doubles and test helpers live under tests/."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What marks test code: a test-double or test-helper module, or an import of a test framework.
TEST_PATH = re.compile(
    r"(^|/)(tests?|testing|conftest\.py|test_[^/]*\.py|[^/]*(scripted|fake|mock|double)[^/]*)(/|$)"
)
TEST_IMPORT = re.compile(r"^\s*(import|from)\s+(pytest|unittest|tests)\b", re.M)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (path,) = out.glob("dflash_trt-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_contents(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for required in (
        "dflash_trt/triton/templates/model.py",
        "dflash_trt/builder/data/trtllm_llmapi_fields.json",
        "dflash_trt/builder/data/configs/sources.json",
        "dflash_trt/builder/data/configs/openai--gpt-oss-120b/config.json",
        "dflash_trt/_chart/dflash-trt/dashboards/dflash-trt.json",
        "dflash_trt/_chart/dflash-trt/templates/build-job.yaml",
        "dflash_trt/_chart/schemas/prometheusrule-monitoring-v1.json",
        "dflash_trt/_chart/dflash-trt/Chart.yaml",
        "dflash_trt/_chart/dflash-trt/values.schema.json",
        "dflash_trt/_chart/dflash-trt/templates/deployment.yaml",
        "dflash_trt/_chart/schemas/leaderworkerset-leaderworkerset-v1.json",
        "dflash_trt/assets/tiny/target/model.safetensors",
        "dflash_trt/assets/tiny/target/tokenizer.json",
        "dflash_trt/assets/tiny/drafter/model.safetensors",
        "dflash_trt/assets/tiny/heldout_prompts.json",
    ):
        assert required in names, required
    assert not any(n.startswith(("tests/", "build/", "bench/", "helm/")) for n in names)
    entry = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "dflash-trt = dflash_trt.cli:main" in entry


def test_wheel_carries_no_test_code(wheel: zipfile.ZipFile) -> None:
    """No test double, test helper or test-framework import ships: they belong under tests/. (The
    chart's `helm test` pods under _chart/ are for users: `helm test` runs them in a cluster.)"""
    package = [
        n for n in wheel.namelist() if n.startswith("dflash_trt/") and not n.startswith("dflash_trt/_chart/")
    ]
    assert not [n for n in package if TEST_PATH.search(n.removeprefix("dflash_trt/"))]
    importing = [n for n in package if n.endswith(".py") and TEST_IMPORT.search(wheel.read(n).decode())]
    assert not importing, f"modules importing a test framework or tests/: {importing}"


def test_the_cli_offers_no_test_server() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dflash_trt", "bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    commands = re.findall(r"^  (\S+)", out.split("Commands:")[1], re.M)
    assert commands == ["compare", "engine", "plot", "sweep"]
