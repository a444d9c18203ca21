# SPDX-License-Identifier: Apache-2.0
"""DFlash 2's compiled Triton kernels on a CUDA device against their references, at published sizes
(hidden 5120, group 16, K 2; top-16 over a 248320 vocabulary, rank 256), under CUDA-graph capture.
Skipped without CUDA. Not yet run: no GPU was lent to the session that wrote them."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.plugins import dynamic_conv, load_ops, selector_walk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    pytest.importorskip("triton")
    load_ops()

DEV = torch.device("cuda")
TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "blk", "d", "k", "gs"), [(16, 8, 5120, 2, 16), (3, 16, 4096, 9, 16), (1, 8, 130, 2, 13)]
)
def test_dynamic_conv_on_the_device(dtype, n, blk, d, k, gs):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(n, blk, d, generator=gen).to(DEV, dtype)
    coeff = torch.randn(n, blk, 2, k, d // gs, generator=gen).to(DEV, dtype)
    base = torch.randn(2, k, d, generator=gen).to(DEV, dtype)
    for half in (0, 1):
        got = torch.ops.dflash.dynamic_conv(x, coeff, base, half, gs)
        want = dynamic_conv.dynamic_conv_reference(x.float(), coeff.float(), base.float(), half, gs)
        torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "g", "k", "rank", "vocab"), [(16, 7, 16, 256, 248320), (64, 15, 8, 64, 1000)])
def test_selector_walk_on_the_device(dtype, n, g, k, rank, vocab):
    gen = torch.Generator().manual_seed(n)
    unary, cand = torch.topk(torch.randn(n, g, vocab, generator=gen).to(DEV, dtype), k, dim=-1, sorted=False)
    args = (unary, cand, torch.randn(n, g, rank, generator=gen).to(DEV, dtype), cand[:, 0, 0].contiguous(),
            torch.randn(vocab, rank, generator=gen).to(DEV, dtype), torch.randn(vocab, rank, generator=gen).to(DEV, dtype),
            torch.rand(n, generator=gen).to(DEV) + 0.3, torch.rand(n, g, generator=gen).to(DEV) * 0.98 + 0.01,
            (torch.arange(n) % 2 == 0).to(DEV))  # fmt: skip
    picks, q = torch.ops.dflash.selector_walk(*args)
    want_picks, want_q = selector_walk.selector_walk_reference(*args)
    assert (picks == want_picks).float().mean() > 0.99  # ties within rounding may differ
    torch.testing.assert_close(q[picks == want_picks], want_q[picks == want_picks], atol=1e-3, rtol=1e-3)


def test_dflash2_ops_capture_in_a_cuda_graph():
    x = torch.randn(4, 8, 256, device=DEV)
    coeff = torch.randn(4, 8, 2, 2, 16, device=DEV)
    base = torch.randn(2, 2, 256, device=DEV)
    torch.ops.dflash.dynamic_conv(x, coeff, base, 0, 16)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dflash.dynamic_conv(x, coeff, base, 0, 16)
    x.normal_()
    graph.replay()
    torch.testing.assert_close(
        out, dynamic_conv.dynamic_conv_reference(x, coeff, base, 0, 16), atol=1e-4, rtol=1e-4
    )
