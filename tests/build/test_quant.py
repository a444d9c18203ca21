# SPDX-License-Identifier: Apache-2.0
"""Real ModelOpt 0.47 quantization of the `tiny` target (CPU), exported as a unified HF checkpoint,
loaded and served by the embedded engine.

What runs here, on CPU: FP8 — calibration (max), weight + activation + FP8 KV-cache recipe, export;
NVFP4 — the NVFP4_DEFAULT_CFG recipe, calibration (amax collection), NVFP4 weight packing and
export. The embedded engine then dequantizes the exported weights and generates with them.
What does NOT run here: NVFP4/FP8 GEMMs and activation/KV quantization at inference (TensorRT-LLM
on Hopper/Blackwell); no GPU is available to this suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import modelopt.torch.quantization  # noqa: F401  (the modelopt extra, part of the dev install)
import pytest

from dflash_trt import LLM, SamplingParams
from dflash_trt.cli import main

pytestmark = pytest.mark.modelopt

GOLDEN = Path(__file__).parent / "golden"
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]


def build(out: Path, *extra: str) -> dict:
    try:
        main(["build", "--target", "tiny", "--output", str(out), "--calib-samples", "6", *extra])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    return json.loads((out / "manifest.json").read_text())


def generate(bundle: Path, *, draft: bool = True) -> list[list[int]]:
    import yaml

    args = yaml.safe_load((bundle / "engine/llm_api.yaml").read_text())
    spec = args.pop("speculative_config")
    spec = spec if draft else None
    if spec:
        spec["speculative_model"] = str(bundle / spec["speculative_model"])
    llm = LLM(str(bundle / args.pop("model")), tokenizer=str(bundle / args.pop("tokenizer")),
              speculative_config=spec, **args)  # fmt: skip
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]  # type: ignore[union-attr]
    finally:
        llm.shutdown()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of tokens before the first divergence."""
    fr = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        fr.append(n / len(x))
    return sum(fr) / len(fr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    bundle = tmp_path_factory.mktemp("q") / "plain"
    build(bundle)
    return generate(bundle)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_tiny_bundle_serves_and_stays_lossless(tmp_path, reference, fmt, update_goldens, capsys):
    bundle = tmp_path / fmt
    manifest = build(bundle, "--quant", fmt)
    q = manifest["quantization"]["target"]
    assert q["format"] == fmt and q["source"] == "modelopt" and q["recipe"] == {"fp8": "FP8_DEFAULT_CFG",
                                                                             "nvfp4": "NVFP4_DEFAULT_CFG"}[fmt]  # fmt: skip
    ckpt = bundle / manifest["target"]["ref"]
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())
    golden = GOLDEN / f"hf_quant_config.{fmt}.json"
    if update_goldens:
        golden.write_text(json.dumps(hq, indent=2, sort_keys=True) + "\n")
    assert hq == json.loads(golden.read_text())
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if k.endswith("q_proj.weight")]  # noqa: SIM118 (safe_open is not a dict)
        dtypes = {str(f.get_slice(k).get_dtype()) for k in names}
    assert dtypes == ({"F8_E4M3"} if fmt == "fp8" else {"U8"})
    spec = generate(bundle)
    plain = generate(bundle, draft=False)
    assert spec == plain  # the quantized model is still decoded losslessly
    agree = agreement(spec, reference)
    with capsys.disabled():
        print(
            f"\n[{fmt}] greedy agreement with the unquantized tiny (tokens before first divergence): {agree:.2%}"
        )
    assert agree > 0.2, "quantized output unrelated to the original: dequantization is broken"


def test_fp8_drafter_quantization(tmp_path, reference):
    bundle = tmp_path / "qd"
    manifest = build(bundle, "--quantize-drafter")
    assert manifest["quantization"]["drafter"]["format"] == "fp8"
    assert manifest["drafter"]["ref"] == "engine/checkpoints/drafter-fp8"
    assert generate(bundle) == generate(bundle, draft=False)  # lossless whatever the drafter


@pytest.mark.triton_server
def test_fp8_bundle_serves_over_triton(tmp_path):
    from tests.serving.conftest import http_generate, start_server

    bundle = tmp_path / "fp8"
    build(bundle, "--quant", "fp8")
    srv = start_server(bundle / "model_repository", bundle=bundle)
    try:
        r = http_generate(
            srv, {"text_input": "def f():", "sampling_param_max_tokens": 8, "sampling_param_ignore_eos": True}
        )
        assert r.status_code == 200 and r.json()["num_output_tokens"] == 8
    finally:
        srv.stop()


def test_recipes_and_fp8_kv_cache_export(tmp_path):
    from dflash_trt.builder.quant import build_recipe, load_calibration, quantize_checkpoint
    from dflash_trt.tiny import ensure_tiny

    fp8 = build_recipe("fp8", kv_fp8=True)
    names = [e["quantizer_name"] for e in fp8["quant_cfg"]]
    assert names[0] == "*" and "*[kv]_bmm_quantizer" in names  # disable-all first, KV entries appended
    assert build_recipe("nvfp4", kv_fp8=False)["quant_cfg"][0] == {"quantizer_name": "*", "enable": False}
    report = quantize_checkpoint(ensure_tiny().target, tmp_path / "q", fmt="fp8", kv_fp8=True,
                                 calib_texts=load_calibration(None, 4))  # fmt: skip
    assert report["hf_quant_config"]["quantization"]["kv_cache_quant_algo"] == "FP8"
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "FP8"


def test_calibration_data_errors(tmp_path):
    from dflash_trt.builder.quant import load_calibration
    from dflash_trt.errors import UsageError

    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert load_calibration(str(tmp_path / "c.jsonl"), 10) == ["a", "b"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2 is not JSON"):
        load_calibration(str(tmp_path / "bad.jsonl"), 10)
    with pytest.raises(UsageError, match=r"--calib-data=.*is not a file"):
        load_calibration(str(tmp_path / "missing.jsonl"), 10)
