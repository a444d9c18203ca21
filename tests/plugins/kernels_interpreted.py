# SPDX-License-Identifier: Apache-2.0
"""The Triton kernels against their PyTorch references, interpreted on CPU tensors.

Run by test_interpreter.py in a child pytest process with TRITON_INTERPRET=1 set before triton is
first imported (Triton decides at decoration time whether @triton.jit kernels are interpreted).
Run directly:  TRITON_INTERPRET=1 pytest tests/plugins/kernels_interpreted.py
"""

from __future__ import annotations

import os
import zlib

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - collected by hand without the variable
    raise RuntimeError(
        "kernels_interpreted.py needs TRITON_INTERPRET=1 before triton is imported: "
        "run it as `TRITON_INTERPRET=1 pytest tests/plugins/kernels_interpreted.py` (test_interpreter.py does)"
    )

import torch
import triton  # noqa: F401  (a dev dependency; imported here, after the variable is set)

from dflash_trt.plugins import accept, block_attention, context_kv, load_ops
from tests.plugins import cases
from tests.plugins.conftest import greedy_jobs, reference_greedy, run_engine, triton_on_cpu

pytestmark = pytest.mark.triton_interpret
load_ops()


def test_the_kernels_are_interpreted():
    """Guard: otherwise every test below would be testing nothing on a CPU-only machine."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(block_attention._block_attn_kernel, InterpretedFunction)
    assert isinstance(accept._rejection_kernel, InterpretedFunction)


# --- block attention ---------------------------------------------------------------------------
def _check_attention(args: tuple, out: torch.Tensor) -> None:
    want = block_attention.block_attention_reference(*args)
    _, seen = cases.visible_rows(args)
    tol = 1e-5 if out.dtype == torch.float32 else 2e-3
    assert seen.any()
    torch.testing.assert_close(out[seen].float(), want[seen].float(), atol=tol, rtol=tol)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))  # no visible key: zeros


@pytest.mark.parametrize("case", cases.ATTN_CASES, ids=str)
def test_block_attention_matches_reference(case):
    args = cases.attn_inputs(case, seed=zlib.crc32(str(case).encode()) % 1000)
    for splits, block_n in ((1, 16), (3, 16), (None, 64)):
        _check_attention(
            args, block_attention.launch_block_attention(*args, num_splits=splits, block_n=block_n)
        )


def test_block_attention_split_heuristic_and_more_splits_than_keys():
    case = cases.AttnCase(1, 4, 4, 2, 12, 4, pages_per_seq=8)
    args = cases.attn_inputs(case, seed=3)
    assert (
        block_attention.choose_num_splits(
            bs=1, num_kv_heads=2, span=32, block_n=16, device=torch.device("cpu")
        )
        == 2
    )
    # 7 splits over a context of <= 32 keys in tiles of 16: most splits are empty and must weigh 0
    _check_attention(args, block_attention.launch_block_attention(*args, num_splits=7, block_n=16))


def test_block_attention_refuses_bad_layouts():
    args = list(cases.attn_inputs(cases.AttnCase(2, 4, 4, 2, 12, 4)))
    bad_q = torch.randn(2, 4, 4, 24)[..., ::2]  # head_dim stride 2
    with pytest.raises(ValueError, match="q needs unit stride"):
        block_attention.launch_block_attention(bad_q, *args[1:])
    with pytest.raises(ValueError, match="multiple of Hkv"):
        block_attention.launch_block_attention(torch.randn(2, 4, 3, 12), *args[1:])
    with pytest.raises(ValueError, match="lengths must be int64"):
        block_attention.launch_block_attention(*args[:6], args[6].int(), *args[7:])


# --- context KV injection ------------------------------------------------------------------------
@pytest.mark.parametrize("case", cases.CTX_CASES, ids=str)
def test_inject_context_matches_reference(case):
    args, k_got, v_got = cases.ctx_inputs(case, seed=len(str(case)))
    _, k_want, v_want = cases.ctx_inputs(case, seed=len(str(case)))
    context_kv.launch_inject_context(*args, k_got, v_got)
    context_kv.inject_context_reference(*args, k_want, v_want)
    tol = 1e-5 if case.dtype == torch.float32 else 2e-3
    live = slice(cases.PAGE, None)  # page 0 takes the ignored rows, in any order
    for got, want in zip((*k_got, *v_got), (*k_want, *v_want)):
        torch.testing.assert_close(got[live].float(), want[live].float(), atol=tol, rtol=tol)
    written = torch.zeros(k_got[0].shape[0], dtype=torch.bool)
    written[args[2]] = True
    assert all(t[~written].abs().sum() == 0 for t in (*k_got, *v_got)), "a slot outside `slots` was written"
    assert all(t[args[2][case.padding_rows :]].abs().sum() > 0 for t in k_got)


def test_inject_context_refuses_bad_pools():
    args, k_pools, v_pools = cases.ctx_inputs(cases.CtxCase(3, 2, 24, 2, 2, 8))
    with pytest.raises(ValueError, match="one K and one V pool per layer"):
        context_kv.launch_inject_context(*args, k_pools, v_pools[:1])
    with pytest.raises(ValueError, match="kv_weight must be"):
        context_kv.launch_inject_context(*args[:5], args[5][:-1], *args[6:], k_pools, v_pools)


# --- acceptance -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "g", "vocab"), cases.ACCEPT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_accept_matches_reference_exactly(n, g, vocab, dtype):
    for ties in (False, True):
        args = cases.greedy_inputs(n, g, vocab, seed=n * 31 + g, dtype=dtype, ties=ties)
        want = accept.greedy_accept_reference(*args)
        for split_len in (accept.ARGMAX_SPLIT, 256):  # one split, and several (ties across splits)
            got = accept.launch_greedy_accept(*args, split_len=split_len, block_v=256)
            for a, b in zip(got, want):
                assert torch.equal(a, b), (ties, split_len)
    assert want[0].float().mean() > 0 or g == 0


@pytest.mark.parametrize(("n", "g", "vocab"), cases.ACCEPT_SHAPES)
@pytest.mark.parametrize("mode", ["close", "topk", "onehot", "equal"])
def test_rejection_accept_matches_reference_exactly(n, g, vocab, mode):
    args = cases.rejection_inputs(n, g, vocab, seed=n * 17 + g, mode=mode)
    want = accept.rejection_accept_reference(*args)
    got = accept.launch_rejection_accept(*args, block_v=256)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    p = args[2]
    picked = p[torch.arange(n), want[0]].gather(-1, want[1][:, None])  # p_a(emitted)
    if mode in ("topk", "close"):
        assert bool((picked > 0).all()), "a zero-probability token was emitted"


def test_accepted_lengths_cover_the_whole_range():
    """The cases above are not all rejections: over many rows every length 0..g occurs."""
    drafts, q, p, ua, ue, valid = cases.rejection_inputs(64, 5, 31, seed=9, mode="close")
    acc = accept.launch_rejection_accept(drafts, q, p, ua, ue, torch.ones_like(valid))[0]
    assert set(acc.tolist()) == set(range(6))


# --- the custom ops dispatch to the kernels under the switch ------------------------------------------
def test_ops_run_the_kernels_on_cpu_under_the_switch(monkeypatch):
    calls: list[str] = []
    for mod, name in ((block_attention, "launch_block_attention"), (accept, "launch_greedy_accept")):
        real = getattr(mod, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    args = cases.attn_inputs(cases.AttnCase(2, 4, 4, 2, 12, 4))
    greedy = cases.greedy_inputs(2, 3, 13)
    torch.ops.dflash.block_attention(*args)
    torch.ops.dflash.greedy_accept(*greedy)
    assert calls == []  # switch off: references
    with triton_on_cpu():
        _check_attention(args, torch.ops.dflash.block_attention(*args))
        torch.ops.dflash.greedy_accept(*greedy)
    assert calls == ["launch_block_attention", "launch_greedy_accept"]


# --- the engine on the interpreted kernels ------------------------------------------------------------
# variant, static padded rounds, job seed (chosen for drafts that get accepted)
ENGINE_CASES = [("plain", True, 2), ("swa_noncausal", False, 2), ("gpt_oss", False, 11)]


@pytest.mark.parametrize(("variant", "static_rounds", "seed"), ENGINE_CASES)
def test_engine_greedy_is_lossless_on_the_kernels(plugin_pair, variant, static_rounds, seed, monkeypatch):
    """Every op of the round runs its interpreted Triton kernel. Greedy output equals the batch-1
    reference loop token for token, and every round of every request proposes the same drafts,
    accepts as many and emits the same token as the engine on the PyTorch path."""
    launched: set[str] = set()
    for mod, name in (
        (context_kv, "launch_inject_context"),
        (block_attention, "launch_block_attention"),
        (accept, "launch_greedy_accept"),
    ):
        real = getattr(mod, name)

        def spy(*a, _real=real, _name=name, **k):
            launched.add(_name)
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    pair = plugin_pair(variant)
    jobs = greedy_jobs(3, seed=seed)
    want_rounds: dict[int, list] = {}
    want, _ = run_engine(pair, jobs, use_plugins=False, rounds=want_rounds)
    assert not launched
    got_rounds: dict[int, list] = {}
    with triton_on_cpu():
        got, _ = run_engine(pair, jobs, use_plugins=True, static_rounds=static_rounds, rounds=got_rounds)
    assert launched == {"launch_inject_context", "launch_block_attention", "launch_greedy_accept"}
    assert got_rounds == want_rounds
    assert got == want
    for (prompt, max_tokens), tokens in zip(jobs, got):
        assert tokens == reference_greedy(pair, prompt, max_tokens).output_ids
    drafts = sum(len(d) for r in got_rounds.values() for _, _, d in r)
    accepted = sum(a for r in got_rounds.values() for a, _, _ in r)
    assert drafts > 40 and accepted >= 5, (drafts, accepted)
