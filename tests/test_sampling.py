# SPDX-License-Identifier: Apache-2.0
"""Sampling preserves the target distribution: unit tests of the acceptance rule with exact
distributions, and an end-to-end chi-square test of the loop at T > 0."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

from dflash_trt.errors import ConfigError
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from dflash_trt.spec.accept import greedy_accept, rejection_accept
from dflash_trt.spec.sampling import (
    PURPOSE_ACCEPT,
    PURPOSE_EMIT,
    SamplingConfig,
    logits_to_probs,
    sample_from_probs,
    uniform,
)
from tests.conftest import make_drafter, make_target


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit, pooling cells with small expectations into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    assert float(obs[~keep].sum()) == 0, "a token with zero target probability was emitted"
    return float(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


def test_uniforms_are_uniform_and_keyed():
    seeds = torch.arange(20000, dtype=torch.int64)
    u = uniform(seeds, torch.full((20000, 1), 7), PURPOSE_EMIT)[:, 0]
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    v = uniform(seeds, torch.full((20000, 1), 8), PURPOSE_EMIT)[:, 0]  # next position
    w = uniform(seeds, torch.full((20000, 1), 7), PURPOSE_ACCEPT)[:, 0]  # other purpose
    for other in (v, w):
        assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.03
    again = uniform(seeds[:5], torch.full((5, 1), 7), PURPOSE_EMIT)[:, 0]
    assert torch.equal(again, u[:5])  # a pure function of (seed, position, purpose)


def test_inverse_cdf_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4096, 5)
    u = uniform(torch.arange(4096), torch.zeros(4096, 1, dtype=torch.long), 0)[:, 0]
    tok = sample_from_probs(probs, u)
    assert set(tok.tolist()) == {1, 3}


@pytest.mark.parametrize(
    ("t", "k", "p"), [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 4, 0.6), (2.0, 50, 0.99)]
)
def test_logits_processing_matches_reference_semantics(t, k, p):
    import dflash.model as dm

    logits = torch.randn(6, 17, generator=torch.Generator().manual_seed(0)) * 3
    ours = logits_to_probs(logits, torch.full((6,), t), torch.full((6,), k), torch.full((6,), p))
    ref = dm._sampling_probs(logits, t, p, k)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_greedy_rows_are_one_hot_at_argmax():
    logits = torch.randn(3, 9)
    probs = logits_to_probs(
        logits, torch.tensor([0.0, 1.0, 0.0]), torch.zeros(3, dtype=torch.long), torch.ones(3)
    )
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 9).float())
    assert torch.allclose(probs[1], torch.softmax(logits[1], -1))


@pytest.mark.parametrize("greedy_draft", [False, True])
@pytest.mark.parametrize("g", [1, 3])
def test_rejection_rule_emits_exactly_p(greedy_draft, g):
    """Whatever q is, the first emitted token is distributed as p_1 (and, given the first draft
    was accepted, the second as p_2)."""
    torch.manual_seed(0)
    n, vocab = 60000, 5
    p = torch.softmax(torch.randn(g + 1, vocab) * 1.5, -1)  # target rows
    q = torch.softmax(torch.randn(g, vocab) * 1.5, -1)  # draft rows
    seeds = torch.arange(n, dtype=torch.int64)
    pos = torch.arange(1, g + 1)[None].expand(n, g)
    if greedy_draft:
        drafts = q.argmax(-1)[None].expand(n, g)
        q_rows = torch.nn.functional.one_hot(q.argmax(-1), vocab).float()
    else:
        u_draft = uniform(seeds, pos, 0)
        drafts = torch.stack(
            [sample_from_probs(q[j][None].expand(n, vocab), u_draft[:, j]) for j in range(g)], 1
        )
        q_rows = q
    acc, emit = rejection_accept(
        drafts,
        q_rows[None].expand(n, g, vocab),
        p[None].expand(n, g + 1, vocab),
        uniform(seeds, pos, PURPOSE_ACCEPT),
        uniform(seeds, torch.arange(1, g + 2)[None].expand(n, g + 1), PURPOSE_EMIT),
    )
    first = torch.where(acc > 0, drafts[:, 0], emit)
    assert chi_square_p(torch.bincount(first, minlength=vocab), p[0]) > 1e-3
    # expected acceptance of the first draft is sum_x min(p, q)
    expected = float(torch.minimum(p[0], q_rows[0]).sum())
    assert abs(float((acc > 0).double().mean()) - expected) < 0.01
    if g > 1:
        sel = acc > 0
        second = torch.where(acc[sel] > 1, drafts[sel, 1], emit[sel])
        assert chi_square_p(torch.bincount(second, minlength=vocab), p[1]) > 1e-3


def test_greedy_accept_prefix_rule():
    logits = torch.zeros(2, 4, 6)
    want = torch.tensor([[1, 2, 3, 4], [5, 0, 0, 1]])
    logits.scatter_(-1, want[..., None], 5.0)
    acc, emit = greedy_accept(torch.tensor([[1, 2, 0], [5, 0, 0]]), logits)
    assert acc.tolist() == [2, 3] and emit.tolist() == [3, 1]


def test_sampling_config_errors():
    with pytest.raises(ConfigError, match=r"temperature=-0.5"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ConfigError, match=r"top_p=0: must be in \(0, 1\]"):
        SamplingConfig(temperature=1.0, top_p=0)
    with pytest.raises(ConfigError, match=r"top_k=-1"):
        SamplingConfig(top_k=-1)


def test_seeded_sampling_is_reproducible():
    target = make_target("qwen3", seed=2)
    drafter = make_drafter(target, block_size=4, std=0.5)
    adapter = HFTarget(target)
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, seed=1234)
    a = spec_generate(adapter, drafter, [1, 2, 3], max_new_tokens=25, sampling=cfg)
    b = spec_generate(adapter, drafter, [1, 2, 3], max_new_tokens=25, sampling=cfg)
    c = spec_generate(
        adapter, drafter, [1, 2, 3], max_new_tokens=25, sampling=SamplingConfig(temperature=1.0, seed=99)
    )
    assert a.output_ids == b.output_ids and a.acceptance_lengths == b.acceptance_lengths
    assert a.output_ids != c.output_ids


def exact_joint(model, prompt, sampling: SamplingConfig, steps: int) -> torch.Tensor:
    """p(t1, ..., t_steps | prompt) under plain sampling, by enumeration: [V] * steps."""
    vocab = model.config.vocab_size
    out = torch.zeros((vocab,) * steps, dtype=torch.float64)
    t = torch.tensor([sampling.temperature])
    k, p = torch.tensor([sampling.top_k]), torch.tensor([sampling.top_p])
    for seq in itertools.product(range(vocab), repeat=steps - 1):
        ids = torch.tensor([list(prompt) + list(seq)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 :]  # [steps, V]
        rows = logits_to_probs(logits, t.expand(steps), k.expand(steps), p.expand(steps)).double()
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= float(rows[i, tok])
        out[seq] = prob * rows[steps - 1]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.8, top_k=3, greedy_draft=True),
        SamplingConfig(temperature=1.3, top_p=0.85),
    ],
    ids=["sampled-draft", "greedy-draft-topk", "sampled-draft-topp"],
)
def test_speculative_sampling_preserves_target_distribution(sampling):
    """Runs the full loop (prefill token + one speculative round of 2 drafts) many times with
    different seeds; the joint distribution of the 3 generated tokens must be the target's."""
    target = make_target("qwen3", seed=5, vocab=5, layers=4)
    drafter = make_drafter(target, block_size=4, std=0.6, seed=3)
    adapter = HFTarget(target)
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, sampling, steps=3)  # [5, 5, 5]
    counts = torch.zeros_like(exact)
    accepted = 0
    runs = 1500
    for s in range(runs):
        cfg = SamplingConfig(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            greedy_draft=sampling.greedy_draft, seed=s,
        )  # fmt: skip
        res = spec_generate(adapter, drafter, prompt, max_new_tokens=3, sampling=cfg)
        counts[tuple(res.output_ids)] += 1
        accepted += res.num_accepted_draft_tokens
    assert accepted / (2 * runs) > 0.05, "drafts were (almost) never accepted: the test proves little"
    assert chi_square_p(counts, exact) > 1e-3


def test_rejection_rule_without_drafts_samples_p():
    """g = 0 (speculation switched off by the schedule) must reduce to plain sampling of p."""
    p = torch.softmax(torch.randn(1, 1, 7), -1).expand(20000, 1, 7)
    seeds = torch.arange(20000, dtype=torch.int64)
    acc, emit = rejection_accept(
        torch.zeros(20000, 0, dtype=torch.long),
        torch.zeros(20000, 0, 7),
        p,
        torch.zeros(20000, 0),
        uniform(seeds, torch.ones(20000, 1, dtype=torch.long), PURPOSE_EMIT),
    )
    assert int(acc.max()) == 0
    assert chi_square_p(torch.bincount(emit, minlength=7), p[0, 0]) > 1e-3
