# SPDX-License-Identifier: Apache-2.0
"""The shipped `tiny` pair: trained (not random), lossless, and its acceptance length measured here
on held-out Python prompts (stdlib files neither model was trained on) must stay high."""

from __future__ import annotations

import json

import pytest
import torch

# The guard: pooled tau (accepted tokens over all rounds, bonus included) of greedy DFlash on the
# first GUARD_PROMPTS held-out prompts, measured by this test. The recipe measured TAU_MEASURED on
# those prompts at GUARD_TOKENS new tokens (see bench/README.md); a drafter that stopped predicting
# the target (random weights give ~1.0) falls far below the guard.
TAU_MEASURED = 4.69
TAU_GUARD = 3.8
GUARD_PROMPTS = 8
GUARD_TOKENS = 96


@pytest.fixture(scope="module")
def pair():
    from dflash_trt.models.checkpoint import load_drafter
    from dflash_trt.models.sources import default_stop_token_ids, load_tokenizer
    from dflash_trt.reference.hf_target import HFTarget
    from dflash_trt.tiny import ensure_tiny

    paths = ensure_tiny()
    tok = load_tokenizer(paths.target)
    target = HFTarget.from_pretrained(paths.target, device=torch.device("cpu"), dtype=torch.float32)
    drafter = load_drafter(paths.drafter, dtype=torch.float32)
    return target, drafter, tok, default_stop_token_ids(paths.target, tok)


def test_tiny_is_the_packaged_trained_pair():
    from dflash_trt.tiny import ASSETS_DIR, build_byte_tokenizer, ensure_tiny, heldout_prompts

    paths = ensure_tiny()
    assert paths.target == ASSETS_DIR / "target" and paths.drafter == ASSETS_DIR / "drafter"
    shipped = sum(p.stat().st_size for p in ASSETS_DIR.rglob("*") if p.is_file())
    assert shipped < 8 * 2**20, f"the packaged pair grew to {shipped / 2**20:.1f} MiB"
    dcfg = json.loads((paths.drafter / "config.json").read_text())
    tcfg = json.loads((paths.target / "config.json").read_text())
    assert dcfg["num_hidden_layers"] < tcfg["num_hidden_layers"]
    assert max(dcfg["dflash_config"]["target_layer_ids"]) < tcfg["num_hidden_layers"]
    assert dcfg["dflash_config"]["mask_token_id"] == build_byte_tokenizer().convert_tokens_to_ids("<|MASK|>")
    prompts = heldout_prompts()
    assert len(prompts) >= GUARD_PROMPTS and all(p.endswith("\n") for p in prompts)


def test_tiny_greedy_is_lossless_through_the_cli(cli):
    from dflash_trt.tiny import heldout_prompts

    for prompt in ("def fibonacci(n):\n", heldout_prompts()[0]):
        base = ["generate", "--target", "tiny", "--prompt", prompt, "--max-new-tokens", "128", "--json"]
        code, out, err = cli(base)
        assert code == 0, err
        spec = json.loads(out)
        code, out, err = cli([*base, "--no-draft"])
        assert code == 0, err
        plain = json.loads(out)
        assert spec["output_ids"] == plain["output_ids"] and spec["text"] == plain["text"]
        assert spec["num_rounds"] < plain["num_rounds"]


def test_tiny_is_lossless_in_the_engine_at_batch_4():
    from dflash_trt.api.llm import LLM, SamplingParams
    from dflash_trt.tiny import heldout_prompts

    prompts = heldout_prompts()[:4]
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    with LLM("tiny", max_batch_size=4) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    spec_cfg = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}
    with LLM("tiny", speculative_config=spec_cfg, max_batch_size=4) as llm:
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert spec == plain


def test_tiny_tau_regression_guard(pair):
    """Measured now, not read from a file: greedy DFlash on held-out prompts."""
    from dflash_trt.tiny import heldout_prompts
    from dflash_trt.training.trainer import measure_tau

    target, drafter, tok, stops = pair
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts()[:GUARD_PROMPTS]]
    result = measure_tau(target, drafter, ids, max_new_tokens=GUARD_TOKENS, stop_token_ids=stops)
    assert result["num_prompts"] == GUARD_PROMPTS
    assert result["tau_pooled"] >= TAU_GUARD, (
        f"tiny's pooled tau fell to {result['tau_pooled']:.2f} on held-out prompts (guard {TAU_GUARD}, "
        f"recipe measured {TAU_MEASURED}): {result['per_prompt']}"
    )


def test_incomplete_packaged_pair_is_a_one_line_error(tmp_path, monkeypatch):
    import shutil

    from dflash_trt import tiny
    from dflash_trt.errors import DFlashTrtError

    shutil.copytree(tiny.ASSETS_DIR, tmp_path / "tiny")
    (tmp_path / "tiny" / "drafter" / "model.safetensors").unlink()
    monkeypatch.setattr(tiny, "ASSETS_DIR", tmp_path / "tiny")
    with pytest.raises(DFlashTrtError) as err:
        tiny.ensure_tiny()
    line = err.value.one_line()
    assert "drafter/model.safetensors" in line and "make tiny-pair" in line and "\n" not in line
