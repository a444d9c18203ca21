# SPDX-License-Identifier: Apache-2.0
"""Parity with the authors' reference implementation (PyPI `dflash` 0.1.0): the same random
weights give the same drafter activations, the same tokens and the same per-round acceptance
lengths. The reference runs on CPU; its CUDA-only timer is replaced by perf_counter."""

from __future__ import annotations

import time

import dflash.model as dflash_model  # the oracle extra (dflash==0.1.0), part of the dev install
import pytest
import torch

from dflash_trt.layers.kv_cache import context_index, slot_mapping
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from tests.conftest import make_drafter, make_target

pytestmark = pytest.mark.oracle


def reference_drafter(ours):
    from transformers import Qwen3Config

    cfg = Qwen3Config(**ours.config.to_hf_config())
    ref = dflash_model.DFlashDraftModel(cfg).eval()
    result = ref.load_state_dict(ours.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return ref


@pytest.fixture(autouse=True)
def _cpu_timer(monkeypatch):
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


@pytest.mark.parametrize("variant", ["plain", "gpt_oss", "swa", "scaled", "llama3"])
def test_drafter_forward_matches_reference(variant):
    """Two consecutive draft calls (prompt context, then newly committed context) give the same
    block hidden states: KV injection, caching, RoPE, masks and norms agree."""
    target = make_target("qwen3", seed=3)
    ours = make_drafter(target, variant=variant, block_size=6, seed=5)
    ref = reference_drafter(ours)
    kd = ours.config.num_target_features * ours.config.hidden_size
    g = torch.Generator().manual_seed(0)
    ref_cache = dflash_model._make_cache(ref.config)
    cache = ours.make_cache(num_pages=6, page_size=4)
    table = torch.tensor([[1, 2, 3, 4, 5]])
    start, blk = 0, 6
    for n_new in (7, 3):  # prompt of 7 tokens, then 3 committed tokens
        feats = torch.randn(1, n_new, kd, generator=g)
        noise = torch.randn(1, blk, ours.config.hidden_size, generator=g)
        start += n_new
        pos = torch.arange(start - n_new, start + blk)[None]
        with torch.no_grad():
            ref_out = ref(target_hidden=feats, noise_embedding=noise, position_ids=pos,
                          past_key_values=ref_cache, use_cache=True)  # fmt: skip
            dflash_model._crop_to(ref_cache, start)
            ctx_pos = torch.arange(start - n_new, start)
            ours.inject_context(cache, feats[0], ctx_pos, slot_mapping(table, ctx_pos[None], 4)[0])
            out = ours.forward_block(
                cache, noise, pos[:, n_new:], context_index(table, 4), torch.tensor([start])
            )
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


CASES = [
    ("qwen3", "plain", 4, 11),
    ("qwen3", "scaled", 6, 12),
    ("llama", "llama3", 5, 13),
    ("gpt_oss", "gpt_oss", 4, 14),
    ("qwen3", "swa", 8, 15),
]


@pytest.mark.parametrize(("arch", "variant", "block", "seed"), CASES)
def test_generation_matches_reference(arch, variant, block, seed):
    """Same tokens and the same per-round acceptance lengths as `dflash_generate`."""
    # A small vocabulary makes random drafters agree with the target often enough that
    # acceptance lengths are not all 1, so the comparison has teeth.
    target = make_target(arch, seed=seed, vocab=11)
    ours = make_drafter(target, variant=variant, block_size=block, seed=seed + 100, std=0.5)
    ref = reference_drafter(ours)
    total_rounds = total_tokens = 0
    for p, prompt in enumerate(
        ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5])
    ):
        got = spec_generate(HFTarget(target), ours, prompt, max_new_tokens=33 + p)
        want = dflash_model.dflash_generate(
            ref, target, torch.tensor([prompt]), 33 + p, None, return_stats=True
        )
        assert got.output_ids == want.output_ids[0, len(prompt) :].tolist()
        assert got.acceptance_lengths == want.acceptance_lengths
        total_rounds += got.num_rounds
        total_tokens += sum(got.acceptance_lengths)
    assert total_tokens > total_rounds, "no draft was ever accepted: the case proves nothing"


def test_stop_tokens_match_reference():
    target = make_target("qwen3", seed=21, vocab=11)
    ours = make_drafter(target, block_size=5, seed=7, std=0.5)
    ref = reference_drafter(ours)
    prompt = [1, 2, 3, 4]
    full = spec_generate(HFTarget(target), ours, prompt, max_new_tokens=30)
    stop = full.output_ids[12]  # a token that does occur
    got = spec_generate(HFTarget(target), ours, prompt, max_new_tokens=30, stop_token_ids=[stop])
    want = dflash_model.dflash_generate(ref, target, torch.tensor([prompt]), 30, [stop], return_stats=True)
    assert got.output_ids == want.output_ids[0, len(prompt) :].tolist()
    assert got.acceptance_lengths == want.acceptance_lengths
    assert got.output_ids[-1] == stop and got.finish_reason == "stop"
