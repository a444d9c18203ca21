# SPDX-License-Identifier: Apache-2.0
"""Random inputs for dflash::tree_attention, shared by the CPU tests and the interpreter tests.

Trees come from `spec.tree.build_tree` over random drafter logits (so masks, depths and padding
nodes are the real thing); contexts are paged over scattered pages with ragged lengths (an empty
context, a full one); sizes are awkward (head_dim not a power of two, GQA groups of 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.layers.kv_cache import context_index
from dflash_trt.spec.tree import build_tree


@dataclass(frozen=True)
class TreeCase:
    bs: int
    budget: int  # T = budget + 1 nodes
    depth: int  # g
    heads: int
    kv_heads: int
    head_dim: int
    page: int
    window: int = 0
    sinks: bool = False
    dtype: torch.dtype = torch.float32
    pages_per_seq: int = 3
    vocab: int = 7  # small: trees have several children per node and padding under depth limits

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (
            f"bs{self.bs}-T{self.budget + 1}-g{self.depth}-H{self.heads}x{self.kv_heads}-d{self.head_dim}"
            f"-P{self.page}"
            + (f"-w{self.window}" if self.window else "")
            + ("-sinks" if self.sinks else "")
            + f"-{dt}"
        )


def tree_inputs(case: TreeCase, seed: int = 0) -> tuple:
    """Arguments of dflash::tree_attention for `case`."""
    gen = torch.Generator().manual_seed(seed)
    bs, h, hkv, d, page = case.bs, case.heads, case.kv_heads, case.head_dim, case.page
    t = case.budget + 1
    num_pages = 1 + bs * case.pages_per_seq + 2

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(case.dtype)

    k_cache, v_cache = randn(num_pages * page, hkv, d), randn(num_pages * page, hkv, d)
    owned = torch.randperm(num_pages - 1, generator=gen)[: bs * case.pages_per_seq] + 1
    ctx_index = context_index(owned.view(bs, case.pages_per_seq), page)
    lc = ctx_index.shape[1]
    ctx_lens = torch.randint(0, lc + 1, (bs,), generator=gen)
    ctx_lens[0] = lc
    if bs > 1:
        ctx_lens[1] = 0
    max_depth = torch.randint(1, case.depth + 1, (bs,), generator=gen)
    max_depth[0] = case.depth
    tree = build_tree(torch.randn(bs, case.depth, case.vocab, generator=gen), torch.zeros(bs, dtype=torch.long),
                      budget=case.budget, max_depth=max_depth)  # fmt: skip
    q = randn(bs, t, h, d)
    k_tree, v_tree = randn(bs, t, hkv, d), randn(bs, t, hkv, d)
    sinks = torch.randn(h, generator=gen) if case.sinks else None
    return (q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, tree.depths, tree.visibility,
            case.window, d**-0.5, sinks)  # fmt: skip


def explicit_tree_attention(args: tuple) -> torch.Tensor:
    """An independent oracle: per sequence, head and node, softmax over the keys it sees, in float64."""
    q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, mask, window, scale, sinks = args
    bs, t, h, d = q.shape
    g = h // k_tree.shape[2]
    out = torch.zeros(bs, t, h, d, dtype=torch.float64)
    for b in range(bs):
        n = int(ctx_lens[b])
        keys = torch.cat([k_cache[ctx_index[b, :n]], k_tree[b]]).double()  # [n + T, Hkv, d]
        vals = torch.cat([v_cache[ctx_index[b, :n]], v_tree[b]]).double()
        for i in range(t):
            pos = n + int(depths[b, i])
            seen = [p for p in range(n) if not window or pos - p < window]
            seen += [
                n + j
                for j in range(t)
                if mask[b, i, j] and (not window or depths[b, i] - depths[b, j] < window)
            ]
            for hh in range(h):
                s = keys[seen, hh // g] @ q[b, i, hh].double() * scale
                if sinks is not None:
                    s = torch.cat([s, sinks[hh].double()[None]])
                w = torch.softmax(s, 0)[: len(seen)]
                out[b, i, hh] = w @ vals[seen, hh // g]
    return out


TREE_CASES = [
    TreeCase(2, 6, 3, 4, 2, 12, 4),
    TreeCase(3, 16, 5, 6, 2, 10, 8),  # G = 3
    TreeCase(2, 9, 4, 8, 1, 12, 1),  # one KV head for eight query heads; one-token pages
    TreeCase(2, 32, 15, 4, 2, 16, 4),  # T * G = 66 rows: two row tiles
    TreeCase(3, 12, 6, 4, 2, 12, 4, window=5),
    TreeCase(2, 20, 8, 4, 2, 12, 4, window=3, sinks=True),
    TreeCase(2, 10, 4, 4, 4, 16, 8, sinks=True),
    TreeCase(2, 8, 4, 4, 2, 16, 4, dtype=torch.float16),
    TreeCase(2, 24, 6, 8, 2, 16, 8, window=6, sinks=True, dtype=torch.float16),
]
