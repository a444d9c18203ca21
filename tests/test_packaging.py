# SPDX-License-Identifier: Apache-2.0
"""The wheel carries what an installed dflash-trt needs at run time (not just the Python files)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contents(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("dflash_trt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
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
        "dflash_trt/assets/tiny/drafter-dflash2/model.safetensors",
        "dflash_trt/builder/data/configs/z-lab--Qwen3.8-27B-DFlash2/config.json",
        "dflash_trt/assets/tiny/heldout_prompts.json",
    ):
        assert required in names, required
    assert not any(n.startswith(("tests/", "build/", "bench/", "helm/")) for n in names)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "dflash-trt = dflash_trt.cli:main" in entry
