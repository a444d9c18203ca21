# SPDX-License-Identifier: Apache-2.0
"""CONTRACT TEST of the TensorRT-LLM branch of our Triton model.

TensorRT-LLM cannot be installed on CPU machines, so `tensorrt_llm` here is a stand-in
(tests/serving/fake_trtllm) that implements the mirrored LLM-API subset, rejects any argument that
is not a field of TensorRT-LLM's published LLM-API classes, and runs the embedded engine
underneath. What this proves: model.py takes the trtllm branch when triton_config.engine is
tensorrt_llm, passes model.yaml's LLM arguments through TensorRT-LLM's merge helper unchanged
(paths resolved against the bundle), and serves real Triton traffic through that object. It does
not prove anything about TensorRT-LLM's own runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_trt.triton.repository import render_model_yaml
from tests.serving.conftest import HERE, http_generate, start_server

pytestmark = [pytest.mark.triton_server, pytest.mark.trtllm]


def test_trtllm_branch_serves_through_the_llm_api_contract(tiny_bundle, tmp_path):
    import shutil

    bundle = tmp_path / "trtllm-like"
    shutil.copytree(tiny_bundle, bundle)
    model_yaml = bundle / "model_repository/tensorrt_llm/1/model.yaml"
    cfg = yaml.safe_load(model_yaml.read_text())
    triton = {**cfg.pop("triton_config"), "engine": "tensorrt_llm"}
    manifest = json.loads((bundle / "manifest.json").read_text())
    llm_args = {
        "model": cfg["model"],
        "tokenizer": cfg["tokenizer"],
        "backend": "pytorch",
        "tensor_parallel_size": 1,
        "max_batch_size": 4,
        "max_num_tokens": 512,
        "max_seq_len": 512,
        "kv_cache_config": {"dtype": "auto", "free_gpu_memory_fraction": 0.85, "enable_block_reuse": False},
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": 4},
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": 7,
            "speculative_model": cfg["speculative_config"]["speculative_model"],
            "mask_token_id": manifest["drafter"]["mask_token_id"],
            "target_layer_ids": manifest["drafter"]["target_layer_ids"],
        },
        "trust_remote_code": True,
    }
    model_yaml.write_text(render_model_yaml(llm_args, triton))
    # The Python backend puts the model's directory on sys.path (it ignores PYTHONPATH), so the
    # stand-in package goes next to model.py in this test's private copy of the repository.
    shutil.copytree(HERE / "fake_trtllm" / "tensorrt_llm", model_yaml.parent / "tensorrt_llm")
    record = tmp_path / "received.json"
    srv = start_server(bundle / "model_repository", bundle=bundle, env={"FAKE_TRTLLM_RECORD": str(record)})
    try:
        body = {"text_input": "def f(x):", "sampling_param_max_tokens": 12, "sampling_param_ignore_eos": True,
                "sampling_param_return_perf_metrics": True}  # fmt: skip
        r = http_generate(srv, body)
        assert r.status_code == 200, r.text
        assert r.json()["num_output_tokens"] == 12 and r.json()["total_draft_tokens"] > 0
        events = http_generate(srv, {**body, "streaming": True}, stream=True)
        assert events[-1]["text_output"] == r.json()["text_output"]
    finally:
        srv.stop()
    received = json.loads(record.read_text())
    # the branch passed every argument through (relative paths resolved against the bundle root)
    assert set(received) == set(llm_args)
    assert Path(received["model"]) == bundle.resolve() / llm_args["model"]
    assert Path(received["speculative_config"]["speculative_model"]).is_dir()
    for key in ("kv_cache_config", "cuda_graph_config", "max_batch_size", "backend", "trust_remote_code"):
        assert received[key] == llm_args[key]


def test_stand_in_rejects_keys_tensorrt_llm_would_reject(tmp_path):
    import sys

    sys.path.insert(0, str(HERE / "fake_trtllm"))
    try:
        import tensorrt_llm

        from dflash_trt.errors import ConfigError

        with pytest.raises(ConfigError, match=r"llm_api.kv_cache_free_gpu_memory_fraction"):
            tensorrt_llm.LLM("x", kv_cache_free_gpu_memory_fraction=0.9)  # a trtllm-serve flag, not a field
    finally:
        sys.path.remove(str(HERE / "fake_trtllm"))
        for name in [m for m in sys.modules if m.startswith("tensorrt_llm")]:
            del sys.modules[name]
