# SPDX-License-Identifier: Apache-2.0
"""DFlash 2's ops on CPU (their PyTorch references), in this process without the interpreter:
the plugin's block pass equals the drafter's own bit for bit (convs included, ragged block lengths),
the selector walk through the op equals `spec.selector`, opcheck and torch.compile(fullgraph=True).
The Triton kernels are tested in test_dflash2_interpreter.py (child process, TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.layers.kv_cache import context_index
from dflash_trt.plugins import dynamic_conv, load_ops, selector_walk
from dflash_trt.plugins.drafting import DrafterPlugins
from dflash_trt.plugins.drafting import selector_walk as walk_op
from dflash_trt.spec.selector import propose
from dflash_trt.spec.selector import selector_walk as walk_reference
from tests.conftest import make_drafter, make_target
from tests.plugins.test_ops import _paged_context

load_ops()
OPS = torch.ops.dflash


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", seed=3, vocab=61)


def conv_args(n=3, blk=5, d=24, k=2, gs=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = d // gs
    x = torch.randn(n, blk, d, generator=gen).to(dtype)
    coeff = torch.randn(n * blk, 2 * k * g, generator=gen).to(dtype).view(n, blk, 2, k, g)
    base = torch.randn(2, k, d, generator=gen).to(dtype)
    return x, coeff, base


def walk_args(n=3, g=4, k=5, rank=7, vocab=29, seed=0):
    gen = torch.Generator().manual_seed(seed)
    unary, cand = torch.topk(torch.randn(n, g, vocab, generator=gen), k, dim=-1, sorted=False)
    return (
        unary, cand, torch.randn(n, g, rank, generator=gen), torch.randint(0, vocab, (n,), generator=gen),
        torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen),
        torch.tensor([0.0, 1.0, 0.6][:n]), torch.rand(n, g, generator=gen), torch.tensor([True, False, False][:n]),
    )  # fmt: skip


@pytest.mark.parametrize("variant", [{}, {"variant": "swa"}, {"variant": "gpt_oss"}])
@pytest.mark.parametrize("page", [1, 4])
def test_block_pass_equals_the_drafter_exactly(target, variant, page):
    drafter = make_drafter(target, block_size=7, seed=5, std=0.5, dflash2=True, **variant)
    plug = DrafterPlugins(drafter)
    cache, tables, lens, feats, pos, slots = _paged_context(drafter, bs=3, page=page, seed=page)
    with torch.inference_mode():
        drafter.inject_context(cache, feats, pos, slots)
        bq = 7
        block_lens = torch.tensor([bq, 3, 1])
        positions = lens[:, None] + torch.arange(bq)
        embeds = torch.randn(3, bq, drafter.config.hidden_size, generator=torch.Generator().manual_seed(1))
        args = (embeds, positions, context_index(tables, page), lens)
        want = drafter.forward_block(cache, *args, block_lens)
        got = plug.forward_block(cache, *args, block_lens)
        valid = torch.arange(bq)[None, :] < block_lens[:, None]
        assert torch.equal(want[valid], got[valid])
        assert torch.equal(drafter.forward_block(cache, *args), plug.forward_block(cache, *args))


def test_conv_op_is_the_modules_halves(target):
    drafter = make_drafter(target, dflash2=True, std=0.5)
    conv = drafter.layers[0].convs[0]
    h = torch.randn(2, 4, 48)
    with torch.no_grad():
        out, coeff = conv.prepare(h)
        assert torch.equal(OPS.dynamic_conv(h, coeff, conv.base_kernel, 0, conv.group_size), out)
        assert torch.equal(
            OPS.dynamic_conv(h, coeff, conv.base_kernel, 1, conv.group_size), conv.finish(h, coeff)
        )


def test_propose_on_the_walk_op_equals_the_reference(target):
    drafter = make_drafter(target, dflash2=True, std=0.5)
    gen = torch.Generator().manual_seed(2)
    kw = dict(hidden=torch.randn(3, 5, 48, generator=gen), logits=torch.randn(3, 5, 61, generator=gen),
              anchors=torch.tensor([1, 2, 3]), selector=drafter.candidate_selector,
              temperature=torch.tensor([0.0, 1.0, 0.5]), greedy=torch.tensor([True, False, True]),
              u=torch.rand(3, 5, generator=gen))  # fmt: skip
    with torch.no_grad():
        a, b = propose(**kw), propose(**kw, walk=walk_op)
    assert torch.equal(a.drafts, b.drafts) and torch.equal(a.cand_probs, b.cand_probs)
    assert torch.equal(a.overturned, b.overturned)


def test_opcheck_the_dflash2_ops():
    torch.library.opcheck(dynamic_conv.dynamic_conv, (*conv_args(), 0, 8))
    torch.library.opcheck(dynamic_conv.dynamic_conv, (*conv_args(k=3, blk=2), 1, 8))
    torch.library.opcheck(selector_walk.selector_walk, walk_args())
    torch.library.opcheck(selector_walk.selector_walk, walk_args(g=0))


def test_torch_compile_fullgraph_calls_the_dflash2_ops():
    conv, walk = conv_args(), walk_args()

    def step(conv, walk):
        out = OPS.dynamic_conv(*conv, 1, 8)
        picks, q = OPS.selector_walk(*walk)
        return out.sum(-1), picks, q

    want = step(conv, walk)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(conv, walk)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b)
    assert torch.equal(want[1], walk_reference(*walk)[0])


def test_self_check_covers_the_dflash2_ops(monkeypatch, caplog, target):
    """enable_plugins(check=True) also runs dflash::dynamic_conv and dflash::selector_walk at a DFlash 2
    drafter's sizes; a wrong kernel disables the plugin with a warning naming it."""
    import logging

    from dflash_trt.plugins import _registry, accept, block_attention, context_kv
    from dflash_trt.plugins.drafting import enable_plugins

    drafter = make_drafter(target, block_size=5, seed=2, std=0.5, dflash2=True)
    assert enable_plugins(drafter, torch.device("cpu"), check=True)[0] is not None
    monkeypatch.setattr(_registry, "_TRITON_ON_CPU", True)  # route every op to its (patched) launcher
    monkeypatch.setattr(accept, "launch_greedy_accept", accept.greedy_accept_reference)
    monkeypatch.setattr(accept, "launch_rejection_accept", accept.rejection_accept_reference)
    monkeypatch.setattr(context_kv, "launch_inject_context", context_kv.inject_context_reference)
    monkeypatch.setattr(block_attention, "launch_block_attention", block_attention.block_attention_reference)
    monkeypatch.setattr(
        dynamic_conv, "launch_dynamic_conv", lambda *a: dynamic_conv.dynamic_conv_reference(*a) * 1.5
    )
    monkeypatch.setattr(selector_walk, "launch_selector_walk", selector_walk.selector_walk_reference)
    with caplog.at_level(logging.WARNING, logger="dflash_trt.plugins.drafting"):
        assert enable_plugins(drafter, torch.device("cpu"), check=True)[0] is None
    assert "dynamic_conv disagrees" in caplog.text
    monkeypatch.setattr(dynamic_conv, "launch_dynamic_conv", dynamic_conv.dynamic_conv_reference)

    def wrong_walk(*args):
        picks, q = selector_walk.selector_walk_reference(*args)
        return (picks + 1) % q.shape[-1], q

    monkeypatch.setattr(selector_walk, "launch_selector_walk", wrong_walk)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_trt.plugins.drafting"):
        assert enable_plugins(drafter, torch.device("cpu"), check=True)[0] is None
    assert "selector_walk disagrees" in caplog.text
