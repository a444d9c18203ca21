# SPDX-License-Identifier: Apache-2.0
"""`dflash_cpu::paged_attention` (layers/paged_attention_op.cpp): attention that reads the paged KV pool
in place equals the gather-and-SDPA path for every mask the models build (causal, windowed, the
drafter's block with its own keys, a DDTree's), in float32 and bfloat16, gives a row the same bits in
any batch, runs inside a compiled graph, and keeps the engine's output identical
(layers/cpu_attention.py, attention.attend_paged)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dflash_trt import LLM, SamplingParams
from dflash_trt.layers import cpu_attention, cpu_gemm
from dflash_trt.layers.attention import attend_paged
from dflash_trt.layers.kv_cache import context_index
from dflash_trt.layers.masks import block_visibility_mask, visibility_mask

# Where the operator cannot run (not x86-64 with AVX2 and FMA, no C++ compiler) `enable` switches
# nothing and the models keep the gather path: the tests below check that instead.
HAS_OP = cpu_attention.available()
PAGE = 16


def test_the_operator_runs_exactly_where_the_cpu_has_avx2_and_fma() -> None:
    from dflash_trt.utils.device import cpu_flags

    module = nn.Module()
    module.paged_kernel = False  # type: ignore[assignment]
    switched = cpu_attention.enable(module, device=torch.device("cpu"), dtype=torch.float32)
    if not cpu_flags() >= {"avx2", "fma"} or os.environ.get(cpu_attention.SWITCH_ENV) == "0":
        assert not HAS_OP and switched == 0 and not module.paged_kernel
    else:  # x86-64 with g++ (the machines this project runs on)
        assert HAS_OP and switched == 1 and module.paged_kernel
    # never for a model with attention sinks, in float16, or off the CPU
    sinks = nn.Module()
    sinks.paged_kernel, sinks.sinks = False, torch.zeros(4)  # type: ignore[assignment]
    assert cpu_attention.enable(sinks, device=torch.device("cpu"), dtype=torch.float32) == 0
    assert cpu_attention.enable(module, device=torch.device("cpu"), dtype=torch.float16) == 0
    assert cpu_attention.enable(module, device=torch.device("meta"), dtype=torch.float32) == 0


def _pool(seed: int, *, bs: int, pages: int, hkv: int, d: int, dtype: torch.dtype):
    """A shuffled page layout: sequence i owns `pages` random pages of a pool of bs * pages + 1."""
    g = torch.Generator().manual_seed(seed)
    slots = (bs * pages + 1) * PAGE
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    order = torch.randperm(bs * pages, generator=g) + 1  # page 0 is the padding page
    tables = order.reshape(bs, pages)
    return g, k, v, context_index(tables, PAGE)


def _both(q, k, v, idx, mask, scale, k_new=None, v_new=None):
    """The operator's output and the general path's, on the rows that see at least one key (a row
    that sees none is garbage that nothing reads: zeros from the operator, checked apart)."""
    got = attend_paged(q, k, v, idx, mask, scale=scale, k_new=k_new, v_new=v_new, kernel=True)
    want = attend_paged(q, k, v, idx, mask, scale=scale, k_new=k_new, v_new=v_new, kernel=False)
    sees = mask.any(dim=-1)[:, 0].expand(q.shape[0], q.shape[1])  # [bs, T]
    assert torch.equal(got[~sees], torch.zeros_like(got[~sees]))
    return got[sees], want[sees]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "bs,t,h,hkv,d,pages,window",
    [
        (1, 1, 4, 2, 32, 2, None),
        (3, 16, 4, 2, 32, 3, None),
        (2, 5, 6, 3, 12, 5, None),
        (4, 16, 8, 1, 40, 4, 7),
        (2, 33, 2, 2, 16, 6, None),
        (3, 1, 9, 3, 64, 5, None),  # smollm2's heads at a plain step: full key tiles of d = 64
    ],
)
def test_decoder_attention_equals_gather_and_sdpa(dtype, bs, t, h, hkv, d, pages, window) -> None:
    """The target's causal (optionally windowed) attention over ragged contexts: T new rows at the
    end of each sequence's context, keys past its length hidden."""
    if not HAS_OP:
        return
    g, k, v, idx = _pool(bs * 7 + t, bs=bs, pages=pages, hkv=hkv, d=d, dtype=dtype)
    lc = idx.shape[1]
    seq_lens = torch.randint(t, lc + 1, (bs,), generator=g)
    positions = seq_lens[:, None] - t + torch.arange(t)  # [bs, T]
    k_pos = torch.arange(lc).expand(bs, lc)
    mask = visibility_mask(positions, k_pos, k_pos < seq_lens[:, None], causal=True, window=window)
    q = torch.randn(bs, t, h, d, generator=g).to(dtype)
    out = attend_paged(q, k, v, idx, mask, scale=d**-0.5, kernel=True)
    assert out.shape == (bs, t, h, d) and out.dtype == dtype and out.is_contiguous()
    got, want = _both(q, k, v, idx, mask, d**-0.5)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_mask", [True, False])
def test_drafter_block_attention_equals_gather_and_sdpa(dtype, shared_mask) -> None:
    """The drafter's block: keys are the context (in the pool) then the block's own keys (k_new, never
    written to the pool); the mask is shared by every row ([bs, 1, 1, L], full layers) or per row."""
    if not HAS_OP:
        return
    bs, blk, h, hkv, d = 3, 16, 4, 2, 32
    g, k, v, idx = _pool(11, bs=bs, pages=3, hkv=hkv, d=d, dtype=dtype)
    lc = idx.shape[1]
    ctx_lens = torch.tensor([0, 17, lc])  # no context yet, some, a full table
    block_lens = torch.tensor([16, 5, 1])
    ctx_pos = torch.arange(lc).expand(bs, lc)
    block_pos = ctx_lens[:, None] + torch.arange(blk)
    k_valid = torch.cat([ctx_pos < ctx_lens[:, None], torch.arange(blk)[None] < block_lens[:, None]], dim=1)
    if shared_mask:
        mask = k_valid[:, None, None, :]
    else:
        k_pos = torch.cat([ctx_pos, block_pos], dim=1)
        mask = visibility_mask(block_pos, k_pos, k_valid, causal=False, window=9)
    q = torch.randn(bs, blk, h, d, generator=g).to(dtype)
    k_new = torch.randn(bs, blk, hkv, d, generator=g).to(dtype)
    v_new = torch.randn(bs, blk, hkv, d, generator=g).to(dtype)
    got, want = _both(q, k, v, idx, mask, d**-0.5, k_new, v_new)
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_tree_attention_and_rows_that_see_nothing() -> None:
    """A DDTree's mask (ancestors only among the new rows, past context visible) equals the general
    path; a row with no visible key gets zeros (finite: padding rows must not spread NaNs)."""
    if not HAS_OP:
        return
    bs, n, h, hkv, d = 2, 6, 4, 2, 16
    g, k, v, idx = _pool(5, bs=bs, pages=2, hkv=hkv, d=d, dtype=torch.float32)
    parent = torch.tensor([-1, 0, 0, 1, 1, 3])  # a small tree: node i's parent
    vis = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        j = parent[i].item()
        while j >= 0:
            vis[i, j] = True
            j = parent[j].item()
    start = torch.tensor([9, 20])
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    q_pos = start[:, None] + depth
    k_valid = torch.arange(idx.shape[1])[None] < (start + n)[:, None]
    mask = block_visibility_mask(q_pos, k_valid, start, vis.expand(bs, n, n), window=None)
    q = torch.randn(bs, n, h, d, generator=g)
    got, want = _both(q, k, v, idx, mask, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    hidden = torch.zeros_like(mask)
    out = attend_paged(q, k, v, idx, hidden, scale=d**-0.5, kernel=True)
    assert torch.equal(out, torch.zeros_like(out))


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    """A sequence's output does not depend on the other sequences of the batch (batch invariance:
    a request decodes the same tokens whatever it is batched with)."""
    if not HAS_OP:
        return
    bs, t, h, hkv, d = 4, 16, 4, 2, 32
    g, k, v, idx = _pool(9, bs=bs, pages=3, hkv=hkv, d=d, dtype=torch.float32)
    lc = idx.shape[1]
    seq_lens = torch.tensor([lc, 20, 16, 33])
    positions = seq_lens[:, None] - t + torch.arange(t)
    k_pos = torch.arange(lc).expand(bs, lc)
    mask = visibility_mask(positions, k_pos, k_pos < seq_lens[:, None], causal=True, window=None)
    q = torch.randn(bs, t, h, d, generator=g)
    batched = attend_paged(q, k, v, idx, mask, scale=0.2, kernel=True)
    for i in range(bs):
        alone = attend_paged(q[i : i + 1], k, v, idx[i : i + 1], mask[i : i + 1], scale=0.2, kernel=True)
        assert torch.equal(alone, batched[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemms_team_splits_the_heads_and_changes_no_bit(dtype) -> None:
    """Where dflash-trt's bf16 GEMM holds a team of its own threads (cpu_gemm.set_threads), the operator
    splits its (sequence, KV head) groups over that team (one team per process: spin_team.h); every
    group is computed as on one thread, so the output is the same bits at any width."""
    if not (HAS_OP and cpu_gemm.bf16_op_available()):
        pytest.skip("no paged-attention operator or no bf16 GEMM operator (AVX512-BF16) on this CPU")
    bs, t, h, hkv, d = 3, 2, 6, 3, 32
    g, k, v, idx = _pool(11, bs=bs, pages=3, hkv=hkv, d=d, dtype=dtype)
    lc = idx.shape[1]
    positions = torch.tensor([lc, 30, 17])[:, None] - t + torch.arange(t)
    k_pos = torch.arange(lc).expand(bs, lc)
    mask = visibility_mask(positions, k_pos, k_pos <= positions[:, -1:], causal=True, window=None)
    q = torch.randn(bs, t, h, d, generator=g).to(dtype)
    outs = []
    try:
        for width in (0, 2, 3, 16):
            cpu_gemm.set_threads(width)
            outs.append(attend_paged(q, k, v, idx, mask, scale=0.2, kernel=True))
    finally:
        cpu_gemm.set_threads(0)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_bad_arguments_get_named_errors() -> None:
    if not HAS_OP:
        return
    q = torch.zeros(1, 2, 4, 8)
    k = torch.zeros(2 * PAGE, 2, 8)
    idx = torch.arange(PAGE)[None]
    mask = torch.ones(1, 1, 2, PAGE, dtype=torch.bool)
    op = torch.ops.dflash_cpu.paged_attention
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k, k, idx + 5 * PAGE, None, None, mask, 1.0)
    with pytest.raises(RuntimeError, match="mask has shape"):
        op(q, k, k, idx, None, None, mask[..., :-1], 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q.half(), k.half(), k.half(), idx, None, None, mask, 1.0)


def test_the_operator_runs_inside_a_compiled_graph() -> None:
    """Inductor calls the operator as an extern kernel (its fake implementation gives the shape); the
    compiled function equals the eager one."""
    if not HAS_OP:
        return
    bs, t, h, hkv, d = 2, 4, 4, 2, 16
    g, k, v, idx = _pool(2, bs=bs, pages=2, hkv=hkv, d=d, dtype=torch.float32)
    lc = idx.shape[1]
    seq_lens = torch.tensor([lc, 10])
    positions = seq_lens[:, None] - t + torch.arange(t)
    k_pos = torch.arange(lc).expand(bs, lc)
    q = torch.randn(bs, t, h, d, generator=g)

    def fn(q, positions, seq_lens):
        mask = visibility_mask(positions, k_pos, k_pos < seq_lens[:, None], causal=True, window=None)
        return attend_paged(q, k, v, idx, mask, scale=0.25, kernel=True).reshape(bs, t, h * d) * 2

    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(q, positions, seq_lens), fn(q, positions, seq_lens))


@pytest.mark.slow
def test_the_engine_gives_the_same_tokens_with_and_without_the_operator(monkeypatch) -> None:
    """`tiny` with its drafter, greedy and seeded sampling, batched: identical token ids with the
    operator and with the gather path (DFLASH_TRT_CPU_ATTENTION=0), eager rounds."""
    if not HAS_OP:
        return
    spec = {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": "tiny"}
    prompts = ["def add(a, b):", "for i in range(10):", "import os\n"]
    params = [SamplingParams(max_tokens=48), SamplingParams(max_tokens=48, temperature=0.8, seed=3)]
    outs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_attention.SWITCH_ENV, switch)
        with LLM("tiny", speculative_config=spec, compile=False) as llm:
            assert llm.engine.paged_attention == (13 if switch == "1" else 0)
            outs[switch] = [[o.outputs[0].token_ids for o in llm.generate(prompts, p)] for p in params]
    assert outs["1"] == outs["0"]
