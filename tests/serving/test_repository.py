# SPDX-License-Identifier: Apache-2.0
"""The rendered model repository: strict rendering, NVIDIA-compatible I/O names, and the checked-in
copy at the top level (`model_repository/`) never drifting from the renderer's output."""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

import pytest

from dflash_trt.errors import ConfigError
from dflash_trt.triton.repository import (
    INPUTS,
    OUTPUTS,
    PARTS_PACKAGE,
    render_config_pbtxt,
    render_model_yaml,
)

ROOT = Path(__file__).resolve().parents[2]
NVIDIA_INPUTS = {"text_input", "streaming", "sampling_param_temperature", "sampling_param_top_k",
                 "sampling_param_top_p", "sampling_param_max_tokens", "sampling_param_stop", "sampling_param_seed",
                 "sampling_param_exclude_input_from_output", "sampling_param_return_perf_metrics",
                 "return_finish_reason", "return_stop_reason", "return_cumulative_logprob", "stop"}  # fmt: skip
NVIDIA_OUTPUTS = {"text_output", "finish_reason", "stop_reason", "cumulative_logprob", "acceptance_rate",
                  "total_accepted_draft_tokens", "total_draft_tokens", "arrival_time_ns", "first_token_time_ns",
                  "last_token_time_ns"}  # fmt: skip


def test_io_names_are_a_superset_of_nvidias():
    assert {p.name for p in INPUTS} >= NVIDIA_INPUTS
    assert {p.name for p in OUTPUTS} >= NVIDIA_OUTPUTS
    assert all(p.optional for p in INPUTS if p.name != "text_input")
    assert all(p.optional for p in INPUTS if p.ours)


def test_checked_in_model_repository_matches_the_renderer(tiny_bundle, update_goldens):
    rendered = tiny_bundle / "model_repository" / "tensorrt_llm"
    checked_in = ROOT / "model_repository" / "tensorrt_llm"
    if update_goldens:
        shutil.rmtree(checked_in, ignore_errors=True)
        shutil.copytree(rendered, checked_in)
    cmp = filecmp.dircmp(rendered, checked_in)
    files = ["config.pbtxt", "1/model.py", "1/model.yaml"]
    for f in files:
        assert (checked_in / f).read_text() == (rendered / f).read_text(), (
            f"model_repository/tensorrt_llm/{f} drifted from the renderer: run "
            "`.venv/bin/pytest tests/serving/test_repository.py --update-goldens` and review the diff"
        )
    assert not cmp.left_only and not cmp.right_only


def test_checked_in_model_repository_carries_the_models_parts(tiny_bundle):
    """model.py's parts (dflash_trt/triton/llmapi/, copied next to it) are held to the renderer too."""
    rendered = tiny_bundle / "model_repository/tensorrt_llm/1" / PARTS_PACKAGE
    checked_in = ROOT / "model_repository/tensorrt_llm/1" / PARTS_PACKAGE
    names = sorted(p.name for p in rendered.glob("*.py"))
    assert names and names == sorted(p.name for p in checked_in.glob("*.py"))
    for name in names:
        assert (checked_in / name).read_text() == (rendered / name).read_text(), (
            f"model_repository/tensorrt_llm/1/{PARTS_PACKAGE}/{name} drifted from the renderer: run "
            "`.venv/bin/pytest tests/serving/test_repository.py --update-goldens` and review the diff"
        )


def test_rendering_is_strict():
    triton = {"max_batch_size": 0, "decoupled": True, "engine": "dflash_trt"}
    with pytest.raises(ConfigError, match=r"triton_config=.*missing \['decoupled'\]"):
        render_model_yaml({"model": "m"}, {"max_batch_size": 0, "engine": "dflash_trt"})
    with pytest.raises(ConfigError, match=r"llm_api.model=None: is required"):
        render_model_yaml({"model": None}, triton)
    with pytest.raises(ConfigError, match=r"llm_api.speculative_config.speculative_model=None: has no value"):
        render_model_yaml({"model": "m", "speculative_config": {"speculative_model": None}}, triton)
    with pytest.raises(ConfigError, match=r"triton_config.engine='vllm'"):
        render_model_yaml({"model": "m"}, {**triton, "engine": "vllm"})
    with pytest.raises(ConfigError, match=r"unknown keys"):
        render_model_yaml({"model": "m"}, {**triton, "batching": True})
    with pytest.raises(ConfigError, match=r"model_name"):
        render_config_pbtxt(model_name='bad "name"')
    text = render_config_pbtxt()
    assert 'backend: "python"' in text and "max_batch_size" not in text.split("#", 3)[-1].split("\n", 2)[-1]
