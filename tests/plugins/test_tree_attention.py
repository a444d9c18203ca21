# SPDX-License-Identifier: Apache-2.0
"""dflash::tree_attention on CPU: the reference against an explicit float64 oracle and against the
native target's own tree verification, opcheck and torch.compile. Its Triton kernel runs in
tree_kernels_interpreted.py (child process under TRITON_INTERPRET=1, via test_interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.layers.kv_cache import context_index, slot_mapping
from dflash_trt.models.decoder import Attention
from dflash_trt.models.loader import load_native_target
from dflash_trt.plugins import load_ops, tree_attention
from dflash_trt.spec.tree import build_tree, tree_positions
from tests.conftest import make_target
from tests.plugins import tree_cases

load_ops()


@pytest.mark.parametrize("case", [c for c in tree_cases.TREE_CASES if c.dtype == torch.float32], ids=str)
def test_reference_equals_explicit_softmax(case):
    args = tree_cases.tree_inputs(case, seed=1)
    got = tree_attention.tree_attention_reference(*args)
    torch.testing.assert_close(got.double(), tree_cases.explicit_tree_attention(args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])  # gpt_oss: sliding window + sinks
def test_op_equals_the_native_targets_tree_attention(tmp_path, arch, monkeypatch):
    """Inside NativeTarget's tree verification, replace every layer's (write, gather, masked SDPA) by
    the op on (context pool, the nodes' fresh K/V): the logits do not change."""
    model = make_target(arch, seed=2)
    model.save_pretrained(tmp_path)
    native = load_native_target(tmp_path, device="cpu", dtype=torch.float32)
    page, bs, budget = 4, 2, 11
    cache = native.make_cache(num_pages=14, page_size=page)
    tables = torch.tensor([[2, 5, 7, 9, 11, 13], [1, 3, 4, 6, 8, 10]])
    ctx = context_index(tables, page)
    starts = torch.tensor([10, 3])
    pos = torch.arange(10).expand(bs, -1)
    ok = pos < starts[:, None]
    with torch.no_grad():
        native(
            torch.randint(0, 60, (bs, 10)),
            pos,
            starts,
            cache,
            torch.where(ok, slot_mapping(tables, pos, page), 0),
            ctx,
        )
    tree = build_tree(
        torch.randn(bs, 5, 61), torch.tensor([1, 2]), budget=budget, max_depth=torch.tensor([5, 3])
    )
    slots = slot_mapping(tables, starts[:, None] + torch.arange(budget + 1), page)
    run = dict(cache=cache, slots=slots, ctx_index=ctx, block_mask=tree.visibility)
    with torch.no_grad():
        want, _ = native(tree.tokens, tree_positions(starts, tree), starts + budget + 1, **run)

    original = Attention.forward

    def with_op(self, x, cos, sin, k_pool, v_pool, slots, ctx_index, mask, paged=False):
        bsz, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        from dflash_trt.layers.rope import apply_rope

        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = native.config.layer_window(self.layer) or 0
        out = torch.ops.dflash.tree_attention(
            q, k, v, k_pool, v_pool, ctx_index, starts, tree.depths,
            tree.visibility, window, self.head_dim**-0.5, self.sinks,
        )  # fmt: skip
        return self.o_proj(out.reshape(bsz, t, -1))

    monkeypatch.setattr(Attention, "forward", with_op)
    with torch.no_grad():
        got, _ = native(tree.tokens, tree_positions(starts, tree), starts + budget + 1, **run)
    monkeypatch.setattr(Attention, "forward", original)
    valid = tree.valid
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)


def test_opcheck_and_compile():
    for case in (tree_cases.TREE_CASES[0], tree_cases.TREE_CASES[5]):
        torch.library.opcheck(tree_attention.tree_attention, tree_cases.tree_inputs(case))
    args = tree_cases.tree_inputs(tree_cases.TREE_CASES[4])

    def f(*a):
        return torch.ops.dflash.tree_attention(*a) * 2

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got, 2 * tree_attention.tree_attention_reference(*args))


def test_launcher_refuses_bad_layouts_without_launching():
    args = list(tree_cases.tree_inputs(tree_cases.TREE_CASES[0]))
    bad = args.copy()
    bad[8] = args[8].to(torch.int8)
    with pytest.raises(ValueError, match="tree_mask must be"):
        tree_attention._check_inputs(*bad[:9], bad[9], bad[11])
    bad = args.copy()
    bad[7] = args[7].int()
    with pytest.raises(ValueError, match="depths must be"):
        tree_attention._check_inputs(*bad[:9], bad[9], bad[11])
    with pytest.raises(ValueError, match="multiple of Hkv"):
        tree_attention._check_inputs(torch.randn(2, 7, 3, 12), *args[1:9], args[9], args[11])


# --- on a CUDA device (skipped without one; not yet run: no GPU was lent to this work) -----------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _on_cuda(args: tuple, dtype: torch.dtype) -> tuple:
    """Floating tensors to `dtype` (sinks stay float32), everything to the device."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = (a.to(dtype) if a.is_floating_point() and a.dim() > 1 else a).cuda()
        out.append(a)
    return tuple(out)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", tree_cases.TREE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_device(case, dtype):
    args = _on_cuda(tree_cases.tree_inputs(case, seed=3), dtype)
    want = tree_attention.tree_attention_reference(*args).float()
    for splits in (1, 3, None):
        got = tree_attention.launch_tree_attention(*args, num_splits=splits).float()
        torch.testing.assert_close(got, want, atol=_TOL[dtype], rtol=_TOL[dtype])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        # a Qwen3-8B-sized target layer (32 heads over 8 KV heads of 128), 65-node trees, 2k context
        tree_cases.TreeCase(4, 64, 15, 32, 8, 128, 16, pages_per_seq=130, vocab=1000, dtype=torch.bfloat16),
        # a gpt-oss-sized sliding layer with sinks (64 heads over 8 of 64, window 128)
        tree_cases.TreeCase(
            2,
            32,
            7,
            64,
            8,
            64,
            16,
            window=128,
            sinks=True,
            pages_per_seq=40,
            vocab=1000,
            dtype=torch.bfloat16,
        ),
    ],
    ids=str,
)
def test_kernel_real_sizes_in_a_cuda_graph(case):
    args = _on_cuda(tree_cases.tree_inputs(case, seed=5), case.dtype)
    want = tree_attention.tree_attention_reference(*args).float()
    torch.ops.dflash.tree_attention(*args)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dflash.tree_attention(*args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want, atol=_TOL[case.dtype], rtol=_TOL[case.dtype])
