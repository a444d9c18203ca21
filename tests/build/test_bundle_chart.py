# SPDX-License-Identifier: Apache-2.0
"""A written TensorRT-LLM bundle (gpt-oss-120b on B200 TP8, offline config fixtures: the build
references the Hub checkpoints, so nothing large is downloaded) and its Helm values driving the
real chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

FIXTURES = Path(__file__).parent / "fixtures" / "configs"

pytestmark = pytest.mark.helm


@pytest.fixture(scope="module")
def gpt_oss_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gb") / "gpt-oss-120b"
    env = {**__import__("os").environ, "DFLASH_TRT_CONFIG_DIR": str(FIXTURES)}
    subprocess.run([sys.executable, "-m", "dflash_trt", "build", "--target", "gpt-oss-120b", "--gpu", "b200", "--tp",
                    "8", "--output", str(out)], check=True, capture_output=True, text=True, env=env)  # fmt: skip
    return out


def test_trtllm_bundle_contents(gpt_oss_bundle):
    b = gpt_oss_bundle
    manifest = json.loads((b / "manifest.json").read_text())
    assert manifest["backend"] == "trtllm" and manifest["gpu"]["count"] == 8
    llm_api = yaml.safe_load((b / "engine/llm_api.yaml").read_text())
    model_yaml = yaml.safe_load((b / "model_repository/tensorrt_llm/1/model.yaml").read_text())
    triton = model_yaml.pop("triton_config")
    assert model_yaml == llm_api and triton["engine"] == "tensorrt_llm" and triton["decoupled"] is True
    script = (b / "engine/serve-trtllm.sh").read_text()
    assert "trtllm-serve openai/gpt-oss-120b --backend pytorch --tp_size 8" in script
    assert "--config engine/llm_api.yaml" in script and (b / "engine/serve-trtllm.sh").stat().st_mode & 0o111
    assert not (b / "engine/checkpoints").exists()  # native MXFP4: the Hub checkpoint is referenced


def test_bundle_values_drive_the_chart(gpt_oss_bundle, tmp_path):
    out = tmp_path / "rendered.yaml"
    lint = subprocess.run([sys.executable, "-m", "dflash_trt", "chart", "--bundle", str(gpt_oss_bundle), "--lint",
                           "--render", str(out)], capture_output=True, text=True)  # fmt: skip
    assert lint.returncode == 0, lint.stderr
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    deploy = next(d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet"))
    pod = (
        deploy["spec"]["template"]["spec"]
        if deploy["kind"] == "Deployment"
        else deploy["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    )
    server = next(c for c in pod["containers"] if c["name"] in ("triton", "server", "tritonserver"))
    assert server["resources"]["limits"]["nvidia.com/gpu"] in (8, "8")
    assert "trtllm-python-py3" in server["image"]
    startup = server["startupProbe"]
    assert (
        startup["failureThreshold"] * startup["periodSeconds"]
        >= json.loads((gpt_oss_bundle / "manifest.json").read_text())["serving"]["startup_budget_s"]
    )
