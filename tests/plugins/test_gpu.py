# SPDX-License-Identifier: Apache-2.0
"""The compiled Triton kernels on a CUDA device: against their references (fp32, fp16, bf16, real
drafter sizes), under CUDA-graph capture and torch.compile, and in the engine (lossless, CUDA
graphs on). Skipped without CUDA. Not yet run: no GPU was available when these were written
(see dflash_trt/plugins/README.md)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.plugins import accept, block_attention, context_kv, load_ops
from tests.plugins import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

if torch.cuda.is_available():
    pytest.importorskip("triton")
    load_ops()

DEV = torch.device("cuda")
TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _cuda(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a.to(DEV))
        elif isinstance(a, list):
            out.append([t.to(DEV) for t in a])
        else:
            out.append(a)
    return tuple(out)


def _attention_case(case: cases.AttnCase, dtype: torch.dtype, seed: int = 0):
    args = cases.attn_inputs(case, seed=seed)
    args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return args


@pytest.mark.parametrize("case", cases.ATTN_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_on_device(case, dtype):
    args = _attention_case(case, dtype)
    _, seen = cases.visible_rows(args)
    dev_args = _cuda(args)
    want = block_attention.block_attention_reference(*dev_args).float()
    for splits in (1, 3, None):
        got = block_attention.launch_block_attention(*dev_args, num_splits=splits).float()
        torch.testing.assert_close(got[seen.to(DEV)], want[seen.to(DEV)], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    "case",
    [
        # a Qwen3-8B-sized drafter: 32 query heads over 8 KV heads of 128, block 16, long context
        cases.AttnCase(4, 16, 32, 8, 128, 16, pages_per_seq=130, dtype=torch.bfloat16),
        # gpt-oss-sized: 64 heads over 8 of 64, sliding layers (window 128)
        cases.AttnCase(2, 16, 64, 8, 64, 16, causal=True, window=128, pages_per_seq=40, dtype=torch.bfloat16),
        cases.AttnCase(1, 8, 32, 8, 128, 16, pages_per_seq=260, dtype=torch.float16),
    ],
    ids=str,
)
def test_block_attention_real_sizes(case):
    args = _cuda(cases.attn_inputs(case, seed=1))
    _, seen = cases.visible_rows(cases.attn_inputs(case, seed=1))
    want = block_attention.block_attention_reference(*args).float()
    got = torch.ops.dflash.block_attention(*args).float()
    torch.testing.assert_close(
        got[seen.to(DEV)], want[seen.to(DEV)], atol=TOL[case.dtype], rtol=TOL[case.dtype]
    )


@pytest.mark.parametrize("case", cases.CTX_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inject_context_on_device(case, dtype):
    args, k_got, v_got = cases.ctx_inputs(case)
    _, k_want, v_want = cases.ctx_inputs(case)
    conv = tuple(
        a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and i != 8 else a
        for i, a in enumerate(args)
    )
    args = _cuda(conv)
    k_got, v_got, k_want, v_want = ([t.to(DEV, dtype) for t in ts] for ts in (k_got, v_got, k_want, v_want))
    torch.ops.dflash.inject_context(*args, k_got, v_got)
    context_kv.inject_context_reference(*args, k_want, v_want)
    for got, want in zip((*k_got, *v_got), (*k_want, *v_want)):
        torch.testing.assert_close(
            got[cases.PAGE :].float(), want[cases.PAGE :].float(), atol=4 * TOL[dtype], rtol=4 * TOL[dtype]
        )


@pytest.mark.parametrize(("n", "g", "vocab"), [*cases.ACCEPT_SHAPES, (32, 15, 151936), (1, 15, 201088)])
def test_accept_on_device_exactly(n, g, vocab):
    for dtype in (torch.float32, torch.bfloat16):
        args = _cuda(cases.greedy_inputs(n, g, vocab, seed=g, dtype=dtype, ties=True))
        for a, b in zip(torch.ops.dflash.greedy_accept(*args), accept.greedy_accept_reference(*args)):
            assert torch.equal(a, b)
    for mode in ("close", "topk", "onehot", "equal"):
        args = _cuda(cases.rejection_inputs(n, g, vocab, seed=g, mode=mode))
        got = torch.ops.dflash.rejection_accept(*args)
        want = accept.rejection_accept_reference(*args)
        assert torch.equal(got[0], want[0])
        # inverse-CDF draws agree unless u * total lies within rounding of a CDF step
        assert (got[1] != want[1]).float().mean() <= 0.01


def test_ops_capture_in_a_cuda_graph():
    """Static shapes, no host sync: each op records into a CUDA graph and replays on new data."""
    attn = _cuda(cases.attn_inputs(cases.AttnCase(2, 8, 8, 2, 64, 16, causal=True, window=7), seed=0))
    greedy = _cuda(cases.greedy_inputs(4, 7, 5003, seed=0))
    ctx, k_pools, v_pools = cases.ctx_inputs(cases.CtxCase(9, 2, 64, 2, 2, 32, bias=True))
    ctx = _cuda(ctx)
    k_pools, v_pools = [t.to(DEV) for t in k_pools], [t.to(DEV) for t in v_pools]

    def run():
        torch.ops.dflash.inject_context(*ctx, k_pools, v_pools)
        return torch.ops.dflash.block_attention(*attn), torch.ops.dflash.greedy_accept(*greedy)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_attn, out_acc = run()
    fresh_attn = _cuda(cases.attn_inputs(cases.AttnCase(2, 8, 8, 2, 64, 16, causal=True, window=7), seed=5))
    for dst, src in zip(attn, fresh_attn):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    fresh_greedy = _cuda(cases.greedy_inputs(4, 7, 5003, seed=5))
    for dst, src in zip(greedy, fresh_greedy):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _, seen = cases.visible_rows(tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in attn))
    want = block_attention.block_attention_reference(*attn)
    torch.testing.assert_close(out_attn[seen.to(DEV)], want[seen.to(DEV)], atol=2e-4, rtol=2e-4)
    for a, b in zip(out_acc, accept.greedy_accept_reference(*greedy)):
        assert torch.equal(a, b)


def test_torch_compile_on_device():
    attn = _cuda(cases.attn_inputs(cases.AttnCase(2, 4, 4, 2, 16, 4), seed=2))
    greedy = _cuda(cases.greedy_inputs(3, 4, 61))

    def f(attn, greedy):
        return torch.ops.dflash.block_attention(*attn).sum(-1), torch.ops.dflash.greedy_accept(*greedy)[0] + 1

    want = f(attn, greedy)
    got = torch.compile(f, fullgraph=True)(attn, greedy)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "swa", "gpt_oss"])
def test_self_check_passes_on_device(variant, dtype):
    from dflash_trt.plugins.drafting import self_check
    from tests.conftest import make_drafter, make_target
    from tests.plugins.conftest import VARIANTS

    target = make_target("qwen3", seed=3, vocab=61)
    drafter = make_drafter(target, block_size=16, **VARIANTS[variant]).to(DEV, dtype)  # bf16 inv_freq too
    assert self_check(drafter, DEV) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_kernels_is_lossless_on_device(plugin_pair, dtype):
    """CUDA graphs on; greedy output with the kernels equals the output without them (bf16: the
    target is the same either way, so greedy tokens must match exactly)."""
    from dflash_trt import LLM, SamplingParams
    from tests.plugins.conftest import BLOCK, greedy_jobs

    tdir, ddir, _ = plugin_pair("plain")
    spec = {"decoding_type": "DFlash", "max_draft_len": BLOCK - 1, "speculative_model": str(ddir)}
    jobs = greedy_jobs(12, seed=4)
    outs = []
    for use_plugins in (True, False):
        with LLM(str(tdir), speculative_config=spec, device="cuda", dtype=dtype, max_batch_size=8,
                 max_seq_len=128, use_plugins=use_plugins) as llm:  # fmt: skip
            executor = llm.engine.executor
            assert llm.engine.parts.backend.plugins == use_plugins, (
                "the device self-check disabled the plugin"
            )
            res = llm.generate([p for p, _ in jobs], [SamplingParams(max_tokens=m) for _, m in jobs])
            outs.append([r.outputs[0].token_ids for r in res])
            assert executor._graphs and not executor._graph_failed
    assert outs[0] == outs[1]
