# SPDX-License-Identifier: Apache-2.0
"""DDTree building blocks: the batched tree equals the paper's heap expansion, the walk follows
the target's choices, and tree verification on the paged native target equals causal decoding of
every root-to-node path, before and after the accepted path's K/V is compacted."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_trt.layers.kv_cache import PagedKVCache, context_index, slot_mapping
from dflash_trt.layers.masks import block_visibility_mask
from dflash_trt.models.loader import load_native_target
from dflash_trt.spec.tree import (
    DraftTree,
    best_first_tree,
    build_tree,
    build_tree_host,
    build_tree_native,
    commit_slots,
    gather_path,
    target_tokens,
    tree_positions,
    walk_tree,
)
from tests.conftest import make_target


def _path_to(tree: DraftTree, b: int, i: int) -> list[int]:
    """Node indices from the root to node i (inclusive)."""
    path = [i]
    while path[-1] != 0:
        path.append(int(tree.parents[b, path[-1]]))
    return path[::-1]


def _random_cases(seed: int, *, max_bs: int, max_g: int, max_vocab: int):
    """25 random (drafter logits [bs, g, V], anchors, per-request depth limits, budget) of a tree builder."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        bs = int(torch.randint(1, max_bs + 1, (), generator=gen))
        g = int(torch.randint(1, max_g + 1, (), generator=gen))
        vocab = int(torch.randint(2, max_vocab + 1, (), generator=gen))
        budget = int(torch.randint(1, 70, (), generator=gen))
        logits = torch.randn(bs, g, vocab, generator=gen) * float(torch.rand((), generator=gen) * 6 + 0.1)
        anchors = torch.randint(0, vocab, (bs,), generator=gen)
        max_depth = torch.randint(0, g + 1, (bs,), generator=gen)
        yield logits, anchors, max_depth, budget


@pytest.mark.parametrize("seed", range(6))
def test_batched_tree_equals_heap_expansion(seed):
    for logits, anchors, max_depth, budget in _random_cases(seed, max_bs=3, max_g=8, max_vocab=49):
        bs, _, vocab = logits.shape
        tree = build_tree(logits, anchors, budget=budget, max_depth=max_depth)
        host = build_tree_host(logits, anchors, budget=budget, max_depth=max_depth)
        for got, want in zip(host, tree):
            assert torch.equal(got, want)
        assert tree.tokens.shape == (bs, budget + 1) and tree.visibility.shape == (bs, budget + 1, budget + 1)
        for b in range(bs):
            want = best_first_tree(logits[b], int(anchors[b]), budget=budget, max_depth=int(max_depth[b]))
            m = len(want)
            got = list(
                zip(tree.tokens[b, :m].tolist(), tree.parents[b, :m].tolist(), tree.depths[b, :m].tolist())
            )
            assert got == want
            assert tree.valid[b, :m].all() and not tree.valid[b, m:].any()
            # available prefixes: sum over depths of min(k^d, ...) -- the tree is full whenever it can be
            k = min(budget, vocab)
            available = sum(k**d for d in range(1, int(max_depth[b]) + 1))
            assert m - 1 == min(budget, available)


@pytest.mark.parametrize("seed", range(3))
def test_native_tree_builder_equals_the_batched_builder(seed):
    """dflash_tree::best_first (spec/tree_op.cpp) gives build_tree's tensors, padding, depth limits and
    tiny vocabularies included; CI has a C++ compiler, so the operator must be available."""
    from dflash_trt.spec import native_tree

    assert native_tree.available()
    for logits, anchors, max_depth, budget in _random_cases(100 + seed, max_bs=4, max_g=15, max_vocab=299):
        want = build_tree(logits, anchors, budget=budget, max_depth=max_depth)
        got = build_tree_native(logits, anchors, budget=budget, max_depth=max_depth)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    root_only = build_tree_native(torch.zeros(2, 0, 5), torch.tensor([4, 1]), budget=3)
    for a, b in zip(root_only, build_tree(torch.zeros(2, 0, 5), torch.tensor([4, 1]), budget=3)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="budget=0"):
        build_tree_native(logits, anchors, budget=0)


def test_native_tree_builder_is_one_call_inside_a_compiled_round():
    """In a compiled graph the builder is the depths' top-k and one call of the operator (no graph
    break), and gives the eager trees."""
    from dflash_trt.spec import native_tree

    assert native_tree.available()
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs):
        graphs.append(gm)
        return gm.forward

    def build(logits, anchors, max_depth):
        return build_tree_native(logits, anchors, budget=16, max_depth=max_depth)

    logits, anchors, max_depth = (
        torch.randn(3, 15, 264) * 3,
        torch.tensor([5, 6, 7]),
        torch.tensor([15, 4, 0]),
    )
    want = build(logits, anchors, max_depth)
    got = torch.compile(build, backend=capture, fullgraph=True)(logits, anchors, max_depth)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "dflash_tree" in str(n.target)]
    assert len(calls) == 1


def test_tree_structure_invariants_with_ties_and_sure_drafts():
    """One-hot drafter logits make log-probabilities exactly 0 and many exact ties: the tree must
    still be prefix-closed with parents first, siblings distinct, and the argmax chain inside."""
    g, vocab, budget = 6, 11, 20
    logits = torch.full((2, g, vocab), -3.0)
    chain = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]])
    logits.scatter_(2, chain[..., None], 40.0)  # log q = 0 exactly for the chain
    logits[1, :, 3] = 40.0  # request 1: a tie between two sure tokens at every depth
    tree = build_tree(logits, torch.tensor([9, 9]), budget=budget)
    for b in range(2):
        for i in range(1, budget + 1):
            p = int(tree.parents[b, i])
            assert 0 <= p < i and tree.depths[b, i] == tree.depths[b, p] + 1
            path = _path_to(tree, b, i)
            want = torch.zeros(budget + 1, dtype=torch.bool)
            want[path] = True
            assert torch.equal(tree.visibility[b, i], want)
        for p in range(budget + 1):
            kids = tree.tokens[b][(tree.parents[b] == p) & tree.valid[b]].tolist()
            assert len(kids) == len(set(kids))
    # request 0: the sure chain is nodes 1..g (score 0), in depth order
    assert tree.tokens[0, 1 : g + 1].tolist() == chain[0].tolist()
    assert tree.parents[0, 1 : g + 1].tolist() == list(range(g))


def test_padding_nodes_see_only_themselves_and_root_only_trees():
    logits = torch.randn(2, 3, 2)  # vocabulary 2: at most 2 + 4 + 8 nodes, fewer with a depth limit
    tree = build_tree(logits, torch.tensor([0, 1]), budget=10, max_depth=torch.tensor([3, 1]))
    assert tree.valid[0].all() and tree.valid[1].sum() == 3
    pad = ~tree.valid[1]
    assert torch.equal(tree.visibility[1][pad], torch.eye(11, dtype=torch.bool)[pad])
    assert not tree.visibility[1][:, pad][~pad].any()  # no real node sees a padding node
    assert (tree.parents[1][pad] == -1).all() and (tree.depths[1][pad] == 0).all()
    empty = build_tree(torch.zeros(1, 0, 5), torch.tensor([4]), budget=3)
    assert empty.valid.tolist() == [[True, False, False, False]] and empty.tokens[0, 0] == 4
    for got, want in zip(build_tree_host(torch.zeros(1, 0, 5), torch.tensor([4]), budget=3), empty):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="budget=0"):
        build_tree(logits, torch.tensor([0, 1]), budget=0)


def _python_walk(tree: DraftTree, chosen: torch.Tensor, b: int) -> list[int]:
    path = [0]
    while True:
        kids = [
            i
            for i in range(tree.tokens.shape[1])
            if tree.valid[b, i]
            and tree.parents[b, i] == path[-1]
            and tree.tokens[b, i] == chosen[b, path[-1]]
        ]
        if not kids:
            return path
        path.append(kids[0])


def test_walk_follows_the_target_choices():
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        bs, g, vocab = 3, 5, 4
        logits = torch.randn(bs, g, vocab, generator=gen) * 2
        tree = build_tree(
            logits, torch.zeros(bs, dtype=torch.long), budget=14, max_depth=torch.tensor([5, 2, 0])
        )
        # target choices: mostly the tree's own tokens, so that long paths occur
        chosen = torch.randint(0, vocab, (bs, 15), generator=gen)
        walk = walk_tree(tree, chosen, max_depth=g)
        for b in range(bs):
            path = _python_walk(tree, chosen, b)
            a = len(path) - 1
            assert int(walk.accepted[b]) == a
            assert walk.path_nodes[b, : a + 1].tolist() == path and (walk.path_nodes[b, a + 1 :] == 0).all()
            assert int(walk.emitted[b]) == int(chosen[b, path[-1]])
            assert walk.path_tokens[b, :a].tolist() == tree.tokens[b, path[1:]].tolist()
            assert (walk.path_tokens[b, a:] == 0).all()


def test_greedy_and_sampled_target_tokens_are_keyed_by_position():
    """The token after node i is what plain decoding would draw at position start + depth_i + 1."""
    from dflash_trt.spec.sampling import PURPOSE_EMIT, logits_to_probs, sample_from_probs, uniform

    gen = torch.Generator().manual_seed(0)
    tree = build_tree(torch.randn(2, 4, 9, generator=gen), torch.tensor([1, 2]), budget=12)
    logits = torch.randn(2, 13, 9, generator=gen)
    starts, seeds = torch.tensor([5, 17]), torch.tensor([11, 12])
    temps, top_k, top_p = torch.tensor([0.0, 0.8]), torch.tensor([0, 4]), torch.tensor([1.0, 0.9])
    greedy = target_tokens(logits, tree, starts, seeds, temps, top_k, top_p, all_greedy=True)
    assert torch.equal(greedy, logits.argmax(-1))
    mixed = target_tokens(logits, tree, starts, seeds, temps, top_k, top_p, all_greedy=False)
    assert torch.equal(mixed[0], logits[0].argmax(-1))  # T = 0 row stays greedy
    for i in range(13):
        pos = 17 + int(tree.depths[1, i]) + 1
        probs = logits_to_probs(logits[1, i][None], temps[1:], top_k[1:], top_p[1:])
        u = uniform(seeds[1:], torch.tensor([[pos]]), PURPOSE_EMIT)[:, 0]
        assert int(mixed[1, i]) == int(sample_from_probs(probs, u)[0])
    assert torch.equal(tree_positions(starts, tree), starts[:, None] + tree.depths)


def test_block_visibility_mask_rule():
    q_pos = torch.tensor([[4, 5, 5, 6]])  # a root at 4, two children, a grandchild of the first
    vis = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    k_valid = torch.arange(10)[None] < 8  # 4 context tokens + 4 nodes, 2 padding columns
    mask = block_visibility_mask(q_pos, k_valid, torch.tensor([4]), vis, window=None)[0, 0]
    assert mask[:, :4].all() and not mask[:, 8:].any()
    assert torch.equal(mask[:, 4:8], vis[0])
    windowed = block_visibility_mask(q_pos, k_valid, torch.tensor([4]), vis, window=3)[0, 0]
    # the grandchild (position 6) sees positions 4..6 only: context 0..3 hidden, its ancestors kept
    assert windowed[3].tolist() == [False] * 4 + [True, True, False, True] + [False, False]


def _native(tmp_path, arch):
    model = make_target(arch, seed=4)
    model.save_pretrained(tmp_path)
    return model, load_native_target(tmp_path, device="cpu", dtype=torch.float32)


def _hf_last(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])  # gpt_oss: sliding window 8 + sinks
def test_native_tree_verify_and_commit_equal_causal_decoding(tmp_path, arch):
    model, native = _native(tmp_path, arch)
    page, vocab = 4, model.config.vocab_size
    contexts = [list(range(3, 14)), [5, 9, 2]]  # ragged: starts 11 and 3
    bs, budget, g = 2, 9, 4
    cache: PagedKVCache = native.make_cache(num_pages=16, page_size=page)
    tables = torch.tensor([[3, 1, 5, 2, 7, 9], [4, 6, 8, 10, 11, 12]])
    ctx = context_index(tables, page)
    starts = torch.tensor([len(c) for c in contexts])
    with torch.no_grad():  # prefill the contexts (all but the anchor)
        t = max(starts)
        ids = torch.tensor([c + [0] * (int(t) - len(c)) for c in contexts])
        pos = torch.arange(int(t)).expand(bs, -1)
        valid = pos < starts[:, None]
        native(ids, pos, starts, cache, torch.where(valid, slot_mapping(tables, pos, page), 0), ctx)
    gen = torch.Generator().manual_seed(1)
    anchors = torch.tensor([7, 8])
    tree = build_tree(torch.randn(bs, g, vocab, generator=gen), anchors, budget=budget,
                      max_depth=torch.tensor([4, 2]))  # fmt: skip
    n1 = budget + 1
    node_cols = starts[:, None] + torch.arange(n1)  # node i's K/V at column start + i
    node_slots = slot_mapping(tables, node_cols, page)
    with torch.no_grad():
        logits, taps = native(tree.tokens, tree_positions(starts, tree), starts + n1, cache, node_slots, ctx,
                              tap_layers=[1, 3], block_mask=tree.visibility)  # fmt: skip
    for b in range(bs):
        for i in range(n1):
            if tree.valid[b, i]:
                path = contexts[b] + tree.tokens[b, _path_to(tree, b, i)].tolist()
                torch.testing.assert_close(logits[b, i], _hf_last(model, path), rtol=1e-4, atol=1e-4)
    # commit: a deepest real node's path moves to positions start.., then one causal decode step
    chosen = logits.argmax(-1)
    deepest = tree.depths.argmax(dim=1)
    chosen.scatter_(1, tree.parents.clamp_min(0), tree.tokens)  # force each parent's choice onto a child
    for b in range(bs):  # ... and along the deepest node's path exactly
        for p, c in zip(_path_to(tree, b, int(deepest[b]))[:-1], _path_to(tree, b, int(deepest[b]))[1:]):
            chosen[b, p] = tree.tokens[b, c]
    walk = walk_tree(tree, chosen, max_depth=g)
    assert walk.accepted.tolist() == tree.depths.max(dim=1).values.tolist()
    dest = slot_mapping(tables, starts[:, None] + torch.arange(g + 1), page)
    src, dst = commit_slots(walk, node_slots, dest)
    cache.copy_slots(src.reshape(-1), dst.reshape(-1))
    committed = gather_path(taps, walk.path_nodes)  # [bs, g + 1, K*D]
    assert torch.equal(committed[0, 1], taps[0, int(walk.path_nodes[0, 1])])
    new_start = starts + walk.accepted + 1
    nxt = torch.tensor([[3], [4]])
    with torch.no_grad():
        step, _ = native(nxt, new_start[:, None], new_start + 1, cache,
                         slot_mapping(tables, new_start[:, None], page), ctx)  # fmt: skip
    for b in range(bs):
        a = int(walk.accepted[b])
        path = contexts[b] + [int(anchors[b])] + walk.path_tokens[b, :a].tolist() + [int(nxt[b, 0])]
        torch.testing.assert_close(step[b, 0], _hf_last(model, path), rtol=1e-4, atol=1e-4)


def test_copy_slots_handles_overlap_and_padding():
    cache = PagedKVCache(num_layers=2, num_pages=3, page_size=4, num_kv_heads=1, head_dim=2,
                         dtype=torch.float32, device="cpu")  # fmt: skip
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.arange(24, dtype=torch.float32).view(12, 1, 2) + random.random())
    before = [p.clone() for p in (*cache.k, *cache.v)]
    # slots 4..7 -> 4, 6, 7 then a padding (0 -> 0) entry: sources overlap destinations
    cache.copy_slots(torch.tensor([4, 6, 7, 0]), torch.tensor([4, 5, 6, 0]))
    for pool, old in zip((*cache.k, *cache.v), before):
        assert torch.equal(pool[4:7], old[[4, 6, 7]])
        assert torch.equal(pool[[0, 1, 2, 3, 7, 8]], old[[0, 1, 2, 3, 7, 8]])


def test_a_saved_round_builds_its_tree_without_this_process_cache(tmp_path) -> None:
    """A compiled round saved to disk and loaded by another process (a server starting from a warm
    cache) must not read `_staircase`'s per-process cache: that process's cache is empty (the served
    DDTree engine died with KeyError: (32, 32, 'cpu') on its first tree round)."""
    from dflash_trt.engine import compile as compile_mod
    from dflash_trt.spec import tree

    # the supported torch (pyproject) saves compiled rounds, and CI has a C++ compiler
    assert compile_mod.saves_compiled_rounds() and compile_mod.unsupported_reason(torch.device("cpu")) is None

    def beams(top_lp):
        return tree._beams(top_lp, 8)

    top = torch.randn(2, 4, 8).sort(dim=-1, descending=True).values
    want = beams(top)
    with compile_mod.compile_rules():
        options = {"guard_filter_fn": compile_mod._guard_filter}
        compiled = torch.compile(beams, fullgraph=True, options=options).aot_compile(((top,), {}))
    compiled.save_compiled_function(str(tmp_path / "beams.aot"))
    tree._STAIRCASES.clear()  # what a fresh process has
    with open(tmp_path / "beams.aot", "rb") as f:
        loaded = torch.compiler.load_compiled_function(f, f_globals=beams.__globals__)
    assert all(torch.equal(a, b) for a, b in zip(loaded(top), want))
