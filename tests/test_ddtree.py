# SPDX-License-Identifier: Apache-2.0
"""DDTree in the batch-1 reference loop: greedy output equals plain greedy decoding, sampled output
is distributed as (and, seeded, equal to) plain target sampling, and the tree round keeps the
cache invariants of linear DFlash."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from dflash_trt.spec.sampling import SamplingConfig
from tests.conftest import make_drafter, make_target
from tests.test_lossless import PROMPTS, ScriptedDrafter, hf_greedy
from tests.test_sampling import chi_square_p, exact_joint


@pytest.mark.parametrize(
    ("arch", "variant", "block"),
    [("qwen3", "plain", 6), ("qwen3", "swa", 16), ("llama", "llama3", 4), ("gpt_oss", "gpt_oss", 8)],
)
def test_greedy_ddtree_equals_plain_greedy(arch, variant, block):
    target = make_target(arch, seed=7)
    drafter = make_drafter(target, variant=variant, block_size=block, seed=8, std=0.5)
    adapter = HFTarget(target)
    for prompt in PROMPTS:
        n = 37
        plain = spec_generate(adapter, None, prompt, max_new_tokens=n)
        assert plain.output_ids == hf_greedy(target, prompt, n)
        for budget in (1, 9, 48):
            tree = spec_generate(adapter, drafter, prompt, max_new_tokens=n, tree_budget=budget)
            assert tree.output_ids == plain.output_ids, (prompt, budget)
            assert sum(tree.acceptance_lengths) == n - 1
            assert all(1 <= a <= block for a in tree.acceptance_lengths)
            assert tree.num_draft_tokens <= budget * tree.num_rounds


class CheckedTreeTarget(HFTarget):
    """Asserts that every tree pass starts on a cache of exactly `start` tokens; records the passes."""

    tree_calls: list[tuple[int, int]]

    def extend_tree(self, token_ids, start, depths, visibility, *, layer_ids):
        assert self.cache_length == start
        self.tree_calls.append((start, token_ids.shape[1]))
        return super().extend_tree(token_ids, start, depths, visibility, layer_ids=layer_ids)


def test_tree_rounds_keep_the_cache_invariants_and_stop_ids():
    target = make_target("qwen3", seed=9)
    adapter = CheckedTreeTarget(target)
    adapter.tree_calls = []
    drafter = make_drafter(target, block_size=5, std=0.5, seed=2)
    injected: list[tuple[int, int]] = []
    original = drafter.inject_context

    def spy(cache, features, positions, slots):
        injected.append((int(positions[0]), int(positions[-1]) + 1))
        return original(cache, features, positions, slots)

    drafter.inject_context = spy  # type: ignore[method-assign]
    res = spec_generate(adapter, drafter, [1, 2, 3, 4, 5], max_new_tokens=40, tree_budget=12)
    starts = [s for s, _ in adapter.tree_calls]
    assert starts == [5 + sum(res.acceptance_lengths[:i]) for i in range(len(starts))]
    assert all(t == 13 for _, t in adapter.tree_calls[:-1])  # root + 12 nodes (the vocabulary is large)
    assert adapter.cache_length == 5 + sum(res.acceptance_lengths)
    # the draft cache gets each committed position once, in order: round r injects a_{r-1} + 1
    assert injected[0] == (0, 5)
    assert all(b0 == a1 for (_, a1), (b0, _) in itertools.pairwise(injected))
    assert [b - a for a, b in injected[1:]] == res.acceptance_lengths[: len(injected) - 1]
    # a stop id inside an accepted path ends the round there and the request
    plain = spec_generate(adapter, None, [1, 2, 3, 4, 5], max_new_tokens=40).output_ids
    stop = plain[9]
    cut = spec_generate(
        adapter, drafter, [1, 2, 3, 4, 5], max_new_tokens=40, tree_budget=12, stop_token_ids=[stop]
    )
    assert cut.output_ids == plain[: plain.index(stop) + 1] and cut.finish_reason == "stop"


@pytest.mark.parametrize("block", [2, 6])
def test_oracle_and_wrong_drafters(block):
    """An always-right drafter gives tau = block with any budget >= its depth; an always-wrong one
    gives tau = 1 with budget 1 (its one node is wrong), and at least 2 with a budget that also covers
    the vocabulary at depth 1 (its sure but wrong chain first, then every other token as a child of
    the root: the target's token is always in the tree)."""
    target = make_target("qwen3", seed=4, vocab=13)
    adapter = HFTarget(target)
    prompt = [5, 6, 7, 8]
    n = 1 + 3 * block
    truth = prompt + spec_generate(adapter, None, prompt, max_new_tokens=n).output_ids
    proto = make_drafter(target, block_size=block)
    for wrong, budget, check in (
        (False, block - 1, lambda taus: taus == [block] * 3),
        (True, 1, lambda taus: taus == [1] * (n - 1)),
        (True, block - 1 + 12, lambda taus: min(taus) >= 2),
    ):
        drafter = ScriptedDrafter(proto.config)
        drafter.load_state_dict(proto.state_dict())
        drafter.script(truth + [0] * block, target.config.vocab_size, wrong)
        res = spec_generate(adapter, drafter.eval(), prompt, max_new_tokens=n, tree_budget=budget)
        assert res.output_ids == truth[len(prompt) :]
        assert check(res.acceptance_lengths), (wrong, budget, res.acceptance_lengths)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_k=5),
        SamplingConfig(temperature=1.2, top_p=0.8),
    ],
    ids=["t1", "topk", "topp"],
)
def test_seeded_ddtree_sampling_equals_plain_sampling(sampling):
    """Node randomness is keyed by the position of the token it draws, exactly as plain decoding's:
    with a seed, DDTree emits the very tokens plain sampling emits (and accepts drafts doing so)."""
    target = make_target("llama", seed=3)
    drafter = make_drafter(target, block_size=6, std=0.5, seed=4)
    adapter = HFTarget(target)
    accepted = 0
    for seed in range(4):
        cfg = SamplingConfig(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=seed
        )
        plain = spec_generate(adapter, None, [1, 2, 3], max_new_tokens=30, sampling=cfg)
        tree = spec_generate(adapter, drafter, [1, 2, 3], max_new_tokens=30, sampling=cfg, tree_budget=20)
        assert tree.output_ids == plain.output_ids
        accepted += tree.num_accepted_draft_tokens
    assert accepted > 0, "no draft was ever accepted: the test proves little"
    other = spec_generate(adapter, drafter, [1, 2, 3], max_new_tokens=30, tree_budget=20,
                          sampling=SamplingConfig(temperature=1.0, seed=99))  # fmt: skip
    assert other.output_ids != plain.output_ids


@pytest.mark.slow
def test_ddtree_sampling_preserves_target_distribution():
    """The full loop (prefill token + one tree round of depth 2) many times with different seeds:
    the joint distribution of the 3 generated tokens is the target's (temperature, top-k and top-p
    together; each alone is held to plain sampling token for token by the seeded test above)."""
    sampling = SamplingConfig(temperature=0.8, top_k=4, top_p=0.85)
    target = make_target("qwen3", seed=5, vocab=5, layers=4)
    drafter = make_drafter(target, block_size=3, std=0.6, seed=3)
    adapter = HFTarget(target)
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, sampling, steps=3)  # [5, 5, 5]
    counts = torch.zeros_like(exact)
    accepted = 0
    runs = 1200
    for s in range(runs):
        cfg = SamplingConfig(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=s
        )
        res = spec_generate(adapter, drafter, prompt, max_new_tokens=3, sampling=cfg, tree_budget=4)
        counts[tuple(res.output_ids)] += 1
        accepted += res.num_accepted_draft_tokens
    assert accepted / runs > 0.1, "drafts were (almost) never accepted: the test proves little"
    assert chi_square_p(counts, exact) > 1e-3


def test_tree_budget_errors():
    target = make_target("qwen3", seed=1)
    adapter = HFTarget(target)
    drafter = make_drafter(target, block_size=4)
    for bad in (-1, 1025, True, "many"):
        with pytest.raises(ConfigError, match=r"tree_budget="):
            spec_generate(adapter, drafter, [1, 2], max_new_tokens=4, tree_budget=bad)
    with pytest.raises(ConfigError, match="cost model"):
        spec_generate(adapter, drafter, [1, 2], max_new_tokens=4, tree_budget="auto")
    # a budget without drafting (plain decoding) changes nothing
    plain = spec_generate(adapter, None, [1, 2], max_new_tokens=6, tree_budget=8)
    assert plain.output_ids == spec_generate(adapter, None, [1, 2], max_new_tokens=6).output_ids
