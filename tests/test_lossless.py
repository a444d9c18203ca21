# SPDX-License-Identifier: Apache-2.0
"""The invariant that matters most: greedy speculative output == plain greedy output of the
target, token for token (float32 CPU, random tiny models of every supported architecture)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from tests.conftest import make_drafter, make_target

PROMPTS = ([7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], list(range(2, 40)))


def hf_greedy(model, prompt, n):
    """transformers' own greedy decoding, independent of our loop."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        min_new_tokens=n,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("arch", "variant", "block"),
    [
        ("qwen3", "plain", 2),
        ("qwen3", "plain", 16),
        ("qwen3", "swa", 6),
        ("qwen3", "scaled", 5),
        ("llama", "llama3", 8),
        ("llama", "plain", 4),
        ("gpt_oss", "gpt_oss", 10),
        ("gpt_oss", "swa", 4),
    ],
)
def test_greedy_speculative_equals_plain_greedy(arch, variant, block):
    target = make_target(arch, seed=7)
    drafter = make_drafter(target, variant=variant, block_size=block, seed=8)
    adapter = HFTarget(target)
    for prompt in PROMPTS:
        n = 37
        plain = spec_generate(adapter, None, prompt, max_new_tokens=n)
        spec = spec_generate(adapter, drafter, prompt, max_new_tokens=n)
        assert spec.output_ids == plain.output_ids
        assert plain.output_ids == hf_greedy(target, prompt, n)
        assert len(spec.output_ids) == n and sum(spec.acceptance_lengths) == n - 1
        assert all(1 <= a <= block for a in spec.acceptance_lengths)
    # a runtime block smaller than the trained one is allowed and still lossless
    if block > 2:
        smaller = spec_generate(adapter, drafter, PROMPTS[1], max_new_tokens=20, block_size=2)
        assert smaller.output_ids == spec_generate(adapter, None, PROMPTS[1], max_new_tokens=20).output_ids


class ScriptedDrafter(DFlashDrafter):
    """Proposes a fixed function of the true continuation: the oracle (always right) or its
    negation (always wrong). It exercises the loop's accept/commit logic, not the drafter."""

    def script(self, truth: list[int], vocab: int, wrong: bool) -> None:
        self._truth, self._vocab, self._wrong, self._start = truth, vocab, wrong, 0

    def forward_block(self, cache, block_embeds, block_positions, ctx_index, ctx_lens):
        self._start = int(block_positions[0, 0])
        return super().forward_block(cache, block_embeds, block_positions, ctx_index, ctx_lens)

    def compute_logits(self, hidden):
        g = hidden.shape[0]
        logits = torch.zeros(g, self._vocab)
        for j in range(g):
            tok = self._truth[self._start + 1 + j]
            logits[j, (tok + 1) % self._vocab if self._wrong else tok] = 10.0
        return logits


@pytest.mark.parametrize("block", [2, 5, 16])
def test_oracle_drafter_gives_tau_equal_block_and_wrong_drafter_gives_one(block):
    target = make_target("qwen3", seed=4)
    adapter = HFTarget(target)
    prompt = [5, 6, 7, 8]
    n = 1 + 3 * block  # prefill token + three full rounds
    truth = prompt + spec_generate(adapter, None, prompt, max_new_tokens=n).output_ids
    proto = make_drafter(target, block_size=block)
    for wrong, expected in ((False, [block] * 3), (True, [1] * (n - 1))):
        drafter = ScriptedDrafter(proto.config)
        drafter.load_state_dict(proto.state_dict())
        drafter.script(truth + [0] * block, target.config.vocab_size, wrong)
        res = spec_generate(adapter, drafter.eval(), prompt, max_new_tokens=n)
        assert res.output_ids == truth[len(prompt) :]
        assert res.acceptance_lengths == expected
        assert res.num_accepted_draft_tokens == (3 * (block - 1) if not wrong else 0)


class CheckedTarget(HFTarget):
    """Asserts the KV invariants of dflash-algorithm.md §4 on every call."""

    calls: list[tuple[int, int]]

    def extend(self, token_ids, start, *, layer_ids, last_only=False):
        assert self.cache_length == start  # target KV length == start when a round begins
        self.calls.append((start, token_ids.shape[1]))
        return super().extend(token_ids, start, layer_ids=layer_ids, last_only=last_only)


def test_cache_invariants_and_pending_context():
    target = make_target("qwen3", seed=9)
    adapter = CheckedTarget(target)
    adapter.calls = []
    drafter = make_drafter(target, block_size=4, std=0.5, seed=2)
    injected: list[tuple[int, int]] = []
    original = drafter.inject_context

    def spy(cache, features, positions, slots):
        injected.append((int(positions[0]), int(positions[-1]) + 1))
        return original(cache, features, positions, slots)

    drafter.inject_context = spy  # type: ignore[method-assign]
    res = spec_generate(adapter, drafter, [1, 2, 3, 4, 5], max_new_tokens=30)
    # context is injected exactly once per position, contiguously, and never beyond start
    assert injected[0] == (0, 5)
    for (_, a1), (b0, _) in itertools.pairwise(injected):
        assert b0 == a1
    # round r injects a_{r-1} + 1 new positions
    assert [b - a for a, b in injected[1:]] == res.acceptance_lengths[: len(injected) - 1]
    starts = [s for s, _ in adapter.calls[1:]]
    assert starts == [5 + sum(res.acceptance_lengths[:i]) for i in range(len(starts))]


def test_max_new_tokens_truncates_last_round_and_one_token():
    target = make_target("qwen3", seed=1)
    drafter = make_drafter(target, block_size=16)
    adapter = HFTarget(target)
    one = spec_generate(adapter, drafter, [1, 2], max_new_tokens=1)
    assert len(one.output_ids) == 1 and one.num_rounds == 0 and one.mean_acceptance_length == 0.0
    res = spec_generate(adapter, drafter, [1, 2], max_new_tokens=5)
    assert len(res.output_ids) == 5 and sum(res.acceptance_lengths) == 4
