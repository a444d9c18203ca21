# SPDX-License-Identifier: Apache-2.0
"""DFlash 2's Triton kernels (dflash::dynamic_conv, dflash::selector_walk) against their PyTorch
references, interpreted on CPU tensors; and the drafter's block pass and proposal with every op on its
interpreted kernel.

Run by test_dflash2_interpreter.py in a child pytest with TRITON_INTERPRET=1 set before triton is
imported. Run directly:  TRITON_INTERPRET=1 pytest tests/plugins/dflash2_kernels_interpreted.py
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - collected by hand without the variable
    raise RuntimeError("dflash2_kernels_interpreted.py needs TRITON_INTERPRET=1 before triton is imported")

import torch
import triton  # noqa: F401  (imported after the variable is set)

from dflash_trt.layers.kv_cache import context_index
from dflash_trt.plugins import _registry, dynamic_conv, load_ops, selector_walk
from dflash_trt.plugins.drafting import DrafterPlugins
from dflash_trt.plugins.drafting import selector_walk as walk_op
from dflash_trt.spec.selector import propose
from tests.conftest import make_drafter, make_target
from tests.plugins.conftest import triton_on_cpu
from tests.plugins.test_ops import _paged_context

pytestmark = pytest.mark.triton_interpret
load_ops()


def test_the_dflash2_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(dynamic_conv._dynamic_conv_kernel, InterpretedFunction)
    assert isinstance(selector_walk._walk_kernel, InterpretedFunction)


# --- dynamic conv ----------------------------------------------------------------------------------
def conv_inputs(n, blk, d, k, gs, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, blk, d + 3, generator=gen).to(dtype)[..., :d]  # row stride != D
    coeff = torch.randn(n * blk, 2 * k * (d // gs) + 5, generator=gen).to(dtype)[
        :, 5:
    ]  # a strided projection view
    base = torch.randn(2, k, d, generator=gen).to(dtype)
    return x, coeff.view(n, blk, 2, k, d // gs), base


CONV_CASES = [  # (N, B, D, K, group size)
    (1, 1, 16, 2, 16), (3, 5, 24, 2, 8), (2, 8, 48, 3, 16), (4, 2, 40, 4, 8), (2, 16, 128, 2, 16), (5, 3, 36, 1, 4),
]  # fmt: skip


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("half", [0, 1])
def test_dynamic_conv_matches_reference(case, dtype, half):
    n, blk, d, k, gs = case
    x, coeff, base = conv_inputs(n, blk, d, k, gs, dtype, seed=sum(case) + half)
    # the kernel accumulates in float32 and rounds once: hold fp16 to the float32 reference
    want = dynamic_conv.dynamic_conv_reference(x.float(), coeff.float(), base.float(), half, gs)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    block_d = 16 if d <= 48 else 64  # one channel tile for D = 16, several for the others
    got = dynamic_conv.launch_dynamic_conv(x, coeff, base, half, gs, block_d=block_d)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_dynamic_conv_rows_are_independent():
    """Row n's output depends on row n alone: a tap at slot 0 never reads the previous row's last slot."""
    x, coeff, base = conv_inputs(3, 4, 24, 3, 8, torch.float32, seed=1)
    out = dynamic_conv.launch_dynamic_conv(x, coeff, base, 0, 8)
    x2 = x.clone()
    x2[0] += 100.0
    x2[2] += 100.0
    out2 = dynamic_conv.launch_dynamic_conv(x2, coeff, base, 0, 8)
    assert torch.equal(out2[1], out[1]) and not torch.equal(out2[0], out[0])
    x3 = x.clone()
    x3[1, 0] = 0.0
    assert torch.equal(dynamic_conv.launch_dynamic_conv(x3, coeff, base, 0, 8)[1, 0], torch.zeros(24))


def test_dynamic_conv_refuses_bad_layouts():
    x, coeff, base = conv_inputs(2, 3, 24, 2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="group_size=5 must divide D=24"):
        dynamic_conv.launch_dynamic_conv(x, coeff, base, 0, 5)
    with pytest.raises(ValueError, match=r"coeff's \[2, K, G\] must be contiguous"):
        dynamic_conv.launch_dynamic_conv(x, coeff.transpose(3, 4).contiguous().transpose(3, 4), base, 0, 8)
    with pytest.raises(ValueError, match="half must be 0 or 1"):
        dynamic_conv.launch_dynamic_conv(x, coeff, base, 2, 8)


# --- selector walk -----------------------------------------------------------------------------------
def walk_inputs(n, g, k, rank, vocab, dtype, seed, ties=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, g, vocab, generator=gen) * 2
    if ties:
        logits = logits.round()  # many equal unary scores
    unary, cand = torch.topk(logits.to(dtype), k, dim=-1, sorted=False)
    proj = torch.randn(n, g, rank, generator=gen).to(dtype)
    pred, succ = (torch.randn(vocab, rank, generator=gen).to(dtype) for _ in range(2))
    if ties:
        proj.zero_()  # pair term 0: the greedy pick is decided by the first maximal unary
    temps = torch.rand(n, generator=gen) + 0.3
    greedy = torch.arange(n) % 3 == 0
    temps[greedy & (torch.arange(n) % 2 == 0)] = 0.0
    u = torch.rand(n, g, generator=gen).clamp(1e-3, 1 - 1e-3)
    return (unary, cand, proj, torch.randint(0, vocab, (n,), generator=gen), pred, succ, temps, u, greedy)


WALK_CASES = [  # (N, g, K, R, V)
    (1, 1, 1, 4, 9), (3, 4, 5, 7, 29), (6, 7, 8, 64, 61), (2, 15, 16, 256, 300), (4, 3, 3, 200, 40), (3, 0, 4, 8, 20),
]  # fmt: skip


@pytest.mark.parametrize("case", WALK_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selector_walk_matches_reference(case, dtype):
    args = walk_inputs(*case, dtype=dtype, seed=sum(case))
    picks, q = selector_walk.launch_selector_walk(*args)
    want_picks, want_q = selector_walk.selector_walk_reference(*args)
    assert torch.equal(picks, want_picks)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    if case[0] > 1 and case[1]:
        assert (~args[-1]).any() and args[-1].any()  # both greedy and sampled rows ran


def test_selector_walk_greedy_ties_take_the_first_candidate():
    args = walk_inputs(8, 5, 6, 4, 12, torch.float32, seed=3, ties=True)
    args = (*args[:-1], torch.ones(8, dtype=torch.bool))
    picks, _ = selector_walk.launch_selector_walk(*args)
    assert torch.equal(picks, selector_walk.selector_walk_reference(*args)[0])
    assert torch.equal(picks, args[0].argmax(-1))


def test_selector_walk_refuses_bad_layouts():
    args = list(walk_inputs(2, 3, 4, 8, 20, torch.float32, seed=0))
    with pytest.raises(ValueError, match="candidates must be"):
        selector_walk.launch_selector_walk(args[0], args[1].int(), *args[2:])
    with pytest.raises(ValueError, match="greedy must be"):
        selector_walk.launch_selector_walk(*args[:-1], args[-1].int())
    with pytest.raises(ValueError, match=r"succ_codebook must be \[V, R=8\]"):
        selector_walk.launch_selector_walk(*args[:5], args[5][:, :4], *args[6:])


# --- the drafter on the interpreted kernels --------------------------------------------------------------
@pytest.mark.parametrize("variant", [{}, {"variant": "swa"}])
def test_block_pass_and_proposal_on_the_kernels(monkeypatch, variant):
    """DrafterPlugins (block attention, inject, the four convs per layer on their kernels) and the walk
    op give the drafter's PyTorch results (to rounding) and the same drafts, in a ragged batch."""
    target = make_target("qwen3", seed=3, vocab=61)
    drafter = make_drafter(target, block_size=6, seed=5, std=0.5, dflash2=True, **variant)
    drafter.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
    cache, tables, lens, feats, pos, slots = _paged_context(drafter, bs=3, page=4, seed=2)
    block_lens = torch.tensor([6, 2, 4])
    positions = lens[:, None] + torch.arange(6)
    embeds = torch.randn(3, 6, 48, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        drafter.inject_context(cache, feats, pos, slots)
        want = drafter.forward_block(cache, embeds, positions, context_index(tables, 4), lens, block_lens)
        monkeypatch.setattr(_registry, "_TRITON_ON_CPU", True)
        got = DrafterPlugins(drafter).forward_block(
            cache, embeds, positions, context_index(tables, 4), lens, block_lens
        )
        valid = torch.arange(6)[None, :] < block_lens[:, None]
        torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
        kw = dict(hidden=want[:, 1:], logits=drafter.compute_logits(want[:, 1:]), anchors=torch.tensor([1, 2, 3]),
                  selector=drafter.candidate_selector, temperature=torch.tensor([0.0, 0.9, 1.2]),
                  greedy=torch.tensor([True, False, False]), u=torch.rand(3, 5, generator=torch.Generator().manual_seed(4)))  # fmt: skip
        on_kernel = propose(**kw, walk=walk_op)
        monkeypatch.setattr(_registry, "_TRITON_ON_CPU", False)
        on_torch = propose(**kw)
    assert torch.equal(on_kernel.drafts, on_torch.drafts)
    torch.testing.assert_close(on_kernel.cand_probs, on_torch.cand_probs, atol=1e-5, rtol=1e-5)


# --- the engine's round on the interpreted kernels -------------------------------------------------------
def test_engine_dflash2_round_on_the_kernels(monkeypatch, tmp_path):
    """A DFlash 2 drafter in the engine with every op of the round on its interpreted kernel (inject,
    block attention, the convs, the selector walk, greedy and rejection acceptance; static padded rounds):
    every round of greedy and sampled requests proposes, accepts and emits exactly what the engine on the
    PyTorch path does, and greedy output is the reference loop's."""
    from dflash_trt import SamplingParams
    from dflash_trt.models.checkpoint import save_drafter
    from dflash_trt.plugins import accept, block_attention, context_kv
    from tests.plugins.conftest import BLOCK, reference_greedy, run_engine

    target = make_target("qwen3", seed=31, vocab=13)
    target.save_pretrained(tmp_path / "target")
    drafter = make_drafter(target, block_size=BLOCK, seed=32, std=0.5, dflash2=True)
    with torch.no_grad():
        drafter.selector.successor_codebook.mul_(6.0)  # pair scores that overturn argmax picks
    save_drafter(drafter, tmp_path / "drafter")
    pair = (tmp_path / "target", tmp_path / "drafter", target)
    launched: set[str] = set()
    for mod, name in ((context_kv, "launch_inject_context"), (block_attention, "launch_block_attention"),
                      (dynamic_conv, "launch_dynamic_conv"), (selector_walk, "launch_selector_walk"),
                      (accept, "launch_greedy_accept"), (accept, "launch_rejection_accept")):  # fmt: skip
        real = getattr(mod, name)

        def spy(*a, _real=real, _name=name, **k):
            launched.add(_name)
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    jobs = [
        ([3, 1, 4, 1, 5], 9),
        ([2, 7], SamplingParams(max_tokens=8, temperature=0.9, seed=5)),
        ([6] * 9, 7),
    ]
    want_rounds: dict[int, list] = {}
    want, _ = run_engine(pair, jobs, use_plugins=False, rounds=want_rounds)
    assert not launched
    got_rounds: dict[int, list] = {}
    with triton_on_cpu():
        got, (_, outs) = run_engine(pair, jobs, use_plugins=True, static_rounds=True, rounds=got_rounds)
    assert launched == {"launch_inject_context", "launch_block_attention", "launch_dynamic_conv",
                        "launch_selector_walk", "launch_greedy_accept", "launch_rejection_accept"}  # fmt: skip
    assert got_rounds == want_rounds and got == want
    for (prompt, max_tokens), tokens in zip(jobs, got):
        if isinstance(max_tokens, int):
            assert tokens == reference_greedy(pair, prompt, max_tokens).output_ids
    overturned = sum(o.outputs[0].request_perf_metrics.speculative_decoding.total_overturned_draft_tokens
                     for o in outs)  # fmt: skip
    assert overturned > 0
