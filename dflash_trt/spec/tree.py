# SPDX-License-Identifier: Apache-2.0
"""DDTree: a tree of drafts from one DFlash pass, verified in one target pass (arXiv 2604.12989).

The drafter's block pass is unchanged: it gives a distribution q_δ for every depth δ = 1..g of the
block. Instead of verifying only the argmax chain, a tree of `budget` nodes is built from those
distributions and the target scores all of it at once under an ancestor-only mask.

Tree (best-first under a factorised surrogate). A node at depth δ is a prefix (t_1..t_δ) where
each t_i is one of the top-k tokens of q_i (k = min(budget, V)); its score is Σ_i log q_i(t_i).
Log-probabilities are <= 0, so a child never outscores its parent and a lower-ranked sibling never
outscores a higher-ranked one: the `budget` best-scoring prefixes are therefore closed under
taking parents, and popping a max-heap (parent -> first child and next sibling) yields exactly
them in non-increasing score order. `build_tree` computes the same set without a heap: because the
score of (parent, rank r) is score(parent) + L_δ[r] with L_δ the same for every parent, the best
`budget` nodes at depth δ descend from the best `budget` at depth δ - 1, so a beam of width
`budget` per depth followed by one stable sort over all depths selects them, on device with no
host sync (CUDA graphs, torch.compile). `best_first_tree` is the heap itself, and `build_tree_host`
packs its trees into the same tensors: cheaper on CPU at small batch, where `build_tree`'s g - 1
top-k steps cost more in dispatch than a few hundred heap operations. `build_tree_native` is the
heap as a CPU operator (`dflash_tree::best_first`, spec/native_tree.py) over every request at
once, eager or inside a compiled round: CPU rounds use it where it can be built. Node order =
selection order, so parents precede children.

Tensors of a tree for bs requests, N = budget + 1 nodes (node 0 is the root: the anchor at
position `start`; node i sits at position start + depth_i): see `DraftTree`. Requests whose tree
has fewer real nodes (tiny vocabularies, depth limits) carry padding nodes that see only
themselves and that nobody sees.

Verification and walk. The target computes a token y_i at every node i: argmax, or a sample of
its processed distribution with the uniform keyed by (seed, start + depth_i + 1, PURPOSE_EMIT),
the key plain decoding uses for the token at that position. The walk starts at the root and moves
to the child whose token equals y of the current node while there is one (siblings have distinct
tokens, so there is at most one); the visited nodes are accepted and y of the last is emitted.
Lossless: along the realised path every emitted token is the target's own choice given exactly the
tokens before it, and each depth's uniform is read by one node of the path only, so the output is
distributed as target sampling (and, with a seed, equals plain decoding's output token for token
up to kernel numerics).

Commit. The accepted nodes' K/V move to the slots of positions start..start + a (`commit_slots`
+ `PagedKVCache.copy_slots`) and their target features become the next round's pending context
(`gather_path`); the drafter's cache is handled as in linear DFlash.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
import torch

from dflash_trt.spec.sampling import PURPOSE_EMIT, logits_to_probs, sample_from_probs, uniform

# Log-probabilities are clamped to this floor so that real (even impossible) tokens keep finite
# scores, while -inf marks candidates that do not exist (beyond a depth limit or the vocabulary).
LOG_PROB_FLOOR = -1.0e6


class DraftTree(NamedTuple):
    """Per-request padded trees of N = budget + 1 nodes (node 0 is the root)."""

    tokens: torch.Tensor  # [bs, N] long: root = anchor; padding nodes 0
    parents: torch.Tensor  # [bs, N] long: parent node index; -1 for the root and padding nodes
    depths: torch.Tensor  # [bs, N] long: 0 for the root (and padding), 1..g for drafted nodes
    valid: torch.Tensor  # [bs, N] bool: real nodes (the root always)
    visibility: torch.Tensor  # [bs, N, N] bool: [i, j] = j is i or an ancestor of i


class TreeWalk(NamedTuple):
    """The accepted path of every request's tree (g = the tree's maximum depth)."""

    accepted: torch.Tensor  # [bs] long: a = accepted drafted nodes (the path has a + 1 nodes)
    emitted: torch.Tensor  # [bs] long: the target's token at the last path node
    path_nodes: torch.Tensor  # [bs, g + 1] long: node index at depth 0..a; 0 beyond a
    path_tokens: torch.Tensor  # [bs, g] long: accepted drafted tokens at depth 1..a; 0 beyond a


def _pad_columns(x: torch.Tensor, width: int, value: float | int) -> torch.Tensor:
    """x: [bs, w <= width] -> [bs, width], right-padded with `value`."""
    if x.shape[1] == width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1]), value)
    return torch.cat([x, pad], dim=1)


def _root_only(anchors: torch.Tensor, budget: int) -> DraftTree:
    bs, n1 = anchors.shape[0], budget + 1
    dev = anchors.device
    tokens = torch.zeros(bs, n1, dtype=torch.long, device=dev)
    tokens[:, 0] = anchors
    valid = torch.zeros(bs, n1, dtype=torch.bool, device=dev)
    valid[:, 0] = True
    eye = torch.eye(n1, dtype=torch.bool, device=dev).expand(bs, n1, n1).clone()
    parents = torch.full((bs, n1), -1, dtype=torch.long, device=dev)
    return DraftTree(tokens, parents, torch.zeros_like(tokens), valid, eye)


def ancestor_visibility(parents: torch.Tensor, valid: torch.Tensor, *, max_depth: int) -> torch.Tensor:
    """parents: [bs, N] (parents precede children; -1 at the root and padding); valid: [bs, N] ->
    [bs, N, N] bool, [i, j] = j is i or an ancestor of i (padding nodes: only themselves).
    Pointer chasing: max_depth + 1 gathers, each marking one ancestor level of every node."""
    bs, n1 = parents.shape
    idx = torch.arange(n1, device=parents.device).expand(bs, n1)
    up = torch.where(valid & (parents >= 0), parents, idx)  # the root and padding point at themselves
    vis = torch.zeros(bs, n1, n1, dtype=torch.bool, device=parents.device)
    cur = idx
    for _ in range(max_depth + 1):
        vis.scatter_(2, cur[..., None], True)
        cur = up.gather(1, cur)
    return vis


_STAIRCASES: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _staircase(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent column j, rank r) pairs with (j + 1)(r + 1) <= n and r < k, j-major (cached when eager).

    Inside a compiled round they are constants of the graph, never a read of the cache: a saved round
    reads the globals it names at every call, and in the next process (a server loading the round
    from disk) the cache is empty (KeyError)."""
    if torch.compiler.is_compiling():
        return _staircase_tensors(n, k, device)
    key = (n, k, str(device))
    if key not in _STAIRCASES:
        _STAIRCASES[key] = _staircase_tensors(n, k, device)
    return _STAIRCASES[key]


def _staircase_tensors(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [(j, r) for j in range(n) for r in range(min(k, n // (j + 1)))]
    both = torch.tensor(pairs, dtype=torch.long, device=device)
    return both[:, 0].contiguous(), both[:, 1].contiguous()


def _beams(top_lp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n best nodes of every depth. top_lp: [bs, g, k] the depths' sorted top-k log-probs
    (-inf: no such node). Returns, depth-major over g beams of n columns: scores [bs, g * n],
    ranks [bs, g, n] (the node's rank in its depth's top-k), parent columns [bs, g * n] (the
    parent's column in the flattened beams; -1 at depth 1, whose parent is the root)."""
    bs, g, k = top_lp.shape
    dev = top_lp.device
    # Depth 1's beam is its top-k (flat index = rank), padded with non-nodes; a deeper beam keeps
    # the flat index parent_column * k + rank. Beams and top-k rows are sorted best first, so the
    # child (j, r) is outscored by the (j + 1)(r + 1) - 1 pairs (j' <= j, r' <= r): only pairs with
    # (j + 1)(r + 1) <= n can make the beam, about n ln n of them instead of n * k.
    score = _pad_columns(top_lp[:, 0], n, float("-inf"))  # [bs, n]
    scores, picks = [score], []
    cand_j, cand_r = _staircase(n, k, dev)  # [C], [C]
    child_lp = top_lp[:, :, cand_r]  # [bs, g, C]
    for d in range(1, g):
        score, pick = (score[:, cand_j] + child_lp[:, d]).topk(n, dim=-1)  # [bs, n]
        scores.append(score)
        picks.append(pick)
    flat_all = _pad_columns(torch.arange(k, device=dev).expand(bs, k), n, 0)[:, None]  # [bs, 1, n]
    if picks:
        deeper = torch.stack(picks, dim=1)  # [bs, g - 1, n] indices into the staircase
        flat_all = torch.cat([flat_all, cand_j[deeper] * k + cand_r[deeper]], dim=1)  # [bs, g, n]
    depth_base = torch.arange(-1, g - 1, device=dev)[None, :, None] * n  # beam d - 1 starts at (d - 1) * n
    parent_cols = torch.where(depth_base < 0, -1, depth_base + flat_all // k).reshape(bs, g * n)
    return torch.cat(scores, dim=1), flat_all % k, parent_cols


def depth_candidates(
    draft_logits: torch.Tensor, *, budget: int, max_depth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every depth's top-k (k = min(budget, V)) log-probabilities [bs, g, k] float32, sorted best first
    and clamped to LOG_PROB_FLOOR (-inf past a request's depth limit), and their tokens [bs, g, k]."""
    if budget < 1:
        raise ValueError(f"budget={budget}: a tree needs at least one drafted node")
    g, vocab = draft_logits.shape[1], draft_logits.shape[2]
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    top_lp, top_tok = log_q.topk(min(budget, vocab), dim=-1)
    top_lp = top_lp.clamp_min(LOG_PROB_FLOOR)
    if max_depth is not None:
        too_deep = torch.arange(1, g + 1, device=draft_logits.device)[None, :] > max_depth[:, None]  # [bs, g]
        top_lp = top_lp.masked_fill(too_deep[..., None], float("-inf"))
    return top_lp, top_tok


def build_tree_native(
    draft_logits: torch.Tensor,
    anchors: torch.Tensor,
    *,
    budget: int,
    max_depth: torch.Tensor | None = None,
) -> DraftTree:
    """`build_tree`'s arguments, `best_first_tree`'s nodes for every request, from the CPU operator
    `dflash_tree::best_first` (spec/native_tree.py; the caller checks that it is available). Eager or
    inside a compiled round: one extern call after the depths' top-k."""
    top_lp, top_tok = depth_candidates(draft_logits, budget=budget, max_depth=max_depth)
    return DraftTree(*torch.ops.dflash_tree.best_first(top_lp, top_tok, anchors.long(), budget))


def build_tree(
    draft_logits: torch.Tensor,
    anchors: torch.Tensor,
    *,
    budget: int,
    max_depth: torch.Tensor | None = None,
) -> DraftTree:
    """The `budget` best prefixes of the drafter's block, as padded tree tensors (no host sync).

    draft_logits: [bs, g, V] (slot δ - 1 = depth δ, raw logits: no temperature); anchors: [bs];
    max_depth: [bs] optional per-request depth limit in [0, g] (a block of size B_i has depth B_i - 1).
    """
    bs, g, _ = draft_logits.shape
    top_lp, top_tok = depth_candidates(draft_logits, budget=budget, max_depth=max_depth)
    if g == 0:
        return _root_only(anchors, budget)
    n = budget
    dev = draft_logits.device

    all_scores, ranks, parent_cols = _beams(top_lp, n)

    # One stable sort over every depth's beam (depth-major): ties keep shallower nodes first, so a
    # parent (score >= its child's) is always selected before its child.
    order = all_scores.sort(dim=1, descending=True, stable=True).indices[:, :n]  # [bs, n]
    valid = torch.isfinite(all_scores.gather(1, order))
    all_tokens = top_tok.gather(2, ranks).reshape(bs, g * n)
    node_of = torch.full((bs, g * n), -1, dtype=torch.long, device=dev)
    node_of.scatter_(1, order, torch.arange(1, n + 1, device=dev).expand(bs, n))
    parent_col = parent_cols.gather(1, order)  # [bs, n]
    parent = torch.where(parent_col < 0, 0, node_of.gather(1, parent_col.clamp_min(0)))
    depth = torch.div(order, n, rounding_mode="floor") + 1

    root = torch.ones(bs, 1, dtype=torch.bool, device=dev)
    valid = torch.cat([root, valid], dim=1)  # [bs, N]
    tokens = torch.cat([anchors[:, None].long(), all_tokens.gather(1, order)], dim=1)
    parents = torch.cat([torch.full_like(parent[:, :1], -1), parent], dim=1)
    depths = torch.cat([torch.zeros_like(depth[:, :1]), depth], dim=1)
    tokens = torch.where(valid, tokens, 0)
    parents = torch.where(valid, parents, -1)
    depths = torch.where(valid, depths, 0)
    return DraftTree(tokens, parents, depths, valid, ancestor_visibility(parents, valid, max_depth=g))


def best_first_tree(
    draft_logits: torch.Tensor, anchor: int, *, budget: int, max_depth: int | None = None
) -> list[tuple[int, int, int]]:
    """The paper's heap expansion for one request, as (token, parent, depth) per node, root first.

    draft_logits: [g, V]. The oracle for `build_tree` (same scores, summed in the same order).
    """
    g, vocab = draft_logits.shape
    limit = g if max_depth is None else min(g, max_depth)
    k = min(budget, vocab)
    top_lp_t, top_tok_t = torch.log_softmax(draft_logits.float(), dim=-1).topk(k, dim=-1)
    top_lp = top_lp_t.clamp_min(LOG_PROB_FLOOR).cpu().numpy().astype(np.float32)  # [g, k]
    top_tok = top_tok_t.tolist()
    nodes = [(int(anchor), -1, 0)]
    if limit == 0:
        return nodes
    # entries: (-score, push order, parent node, parent score, depth, rank); float32 sums as in the beams
    heap = [(-float(top_lp[0, 0]), 0, 0, np.float32(0.0), 1, 0)]
    pushes = 1
    while heap and len(nodes) < budget + 1:
        neg, _, parent, parent_score, depth, rank = heapq.heappop(heap)
        nodes.append((top_tok[depth - 1][rank], parent, depth))
        me, score = len(nodes) - 1, np.float32(-neg)
        if rank + 1 < k:  # next sibling
            sib = parent_score + top_lp[depth - 1, rank + 1]
            heapq.heappush(heap, (-float(sib), pushes, parent, parent_score, depth, rank + 1))
            pushes += 1
        if depth < limit:  # first child
            heapq.heappush(heap, (-float(score + top_lp[depth, 0]), pushes, me, score, depth + 1, 0))
            pushes += 1
    return nodes


def build_tree_host(
    draft_logits: torch.Tensor,
    anchors: torch.Tensor,
    *,
    budget: int,
    max_depth: torch.Tensor | None = None,
) -> DraftTree:
    """`build_tree`'s result computed on the host with the heap, one request at a time.

    Same arguments and tensors (equal whenever no two prefixes tie in score). For CPU rounds at
    small batch, where a few hundred heap operations cost less than `build_tree`'s per-depth
    operator dispatches; it reads the logits on the host, so on CUDA it would synchronise.
    """
    bs, g, _ = draft_logits.shape
    if budget < 1:
        raise ValueError(f"budget={budget}: a tree needs at least one drafted node")
    n1 = budget + 1
    limits = [g] * bs if max_depth is None else max_depth.tolist()
    anchor_ids = anchors.tolist()
    tokens = np.zeros((bs, n1), dtype=np.int64)
    parents = np.full((bs, n1), -1, dtype=np.int64)
    depths = np.zeros((bs, n1), dtype=np.int64)
    valid = np.zeros((bs, n1), dtype=bool)
    vis = np.zeros((bs, n1, n1), dtype=bool)
    vis[:, np.arange(n1), np.arange(n1)] = True  # every node (padding too) sees itself
    for b in range(bs):
        nodes = (
            best_first_tree(draft_logits[b], anchor_ids[b], budget=budget, max_depth=int(limits[b]))
            if g
            else [(int(anchor_ids[b]), -1, 0)]
        )
        for i, (tok, parent, depth) in enumerate(nodes):
            tokens[b, i], parents[b, i], depths[b, i], valid[b, i] = tok, parent, depth, True
            if parent >= 0:
                vis[b, i] |= vis[b, parent]  # parents precede children
    dev = draft_logits.device
    return DraftTree(*(torch.from_numpy(x).to(dev) for x in (tokens, parents, depths, valid, vis)))


def tree_positions(starts: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """starts: [bs] anchor positions -> [bs, N] position ids of the nodes (start + depth)."""
    return starts[:, None] + tree.depths


def target_tokens(
    logits: torch.Tensor,
    tree: DraftTree,
    starts: torch.Tensor,
    seeds: torch.Tensor,
    temps: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    all_greedy: bool,
    any_greedy: bool | None = None,
    needs_filter: bool | None = None,
    native: bool = False,
) -> torch.Tensor:
    """The target's own token after every node: logits [bs, N, V] -> [bs, N] long.

    Greedy rows take the argmax; sampled rows draw from the processed distribution (temperature,
    top-k, top-p, as in linear DFlash) with the uniform of (seed, start + depth + 1, PURPOSE_EMIT).
    starts/seeds/temps/top_k/top_p: [bs]. The flags are as in `logits_to_probs`; native as in `uniform`.
    """
    if all_greedy:
        return logits.argmax(dim=-1)
    bs, n1, vocab = logits.shape
    probs = logits_to_probs(
        logits.reshape(bs * n1, vocab),
        temps.repeat_interleave(n1),
        top_k.repeat_interleave(n1),
        top_p.repeat_interleave(n1),
        needs_filter=needs_filter,
        any_greedy=any_greedy,
    )
    u = uniform(seeds, tree_positions(starts, tree) + 1, PURPOSE_EMIT, native=native)  # [bs, N]
    return sample_from_probs(probs, u.reshape(-1)).reshape(bs, n1)


def walk_tree(tree: DraftTree, chosen: torch.Tensor, *, max_depth: int) -> TreeWalk:
    """chosen: [bs, N] the target's token at every node (`target_tokens`); max_depth: g (static).

    A node is on the path iff it and every ancestor below the root carry the token their parent's
    target choice named; those nodes form one chain from the root (siblings have distinct tokens).
    """
    bs, n1 = chosen.shape
    g = max_depth
    parent_choice = chosen.gather(1, tree.parents.clamp_min(0))  # [bs, N]
    match = tree.valid & (tree.tokens == parent_choice)
    match[:, 0] = True
    on_path = ~(tree.visibility & ~match[:, None, :]).any(dim=-1)  # [bs, N]
    accepted = on_path.sum(dim=1) - 1  # [bs]
    # node of depth t at column t; nodes off the path go to a discarded last column
    column = torch.where(on_path, tree.depths, g + 1)
    nodes = torch.arange(n1, device=chosen.device).expand(bs, n1)
    path = torch.zeros(bs, g + 2, dtype=torch.long, device=chosen.device)
    path.scatter_(1, column, nodes)
    path_nodes = path[:, : g + 1]
    last = path_nodes.gather(1, accepted[:, None])  # [bs, 1]
    emitted = chosen.gather(1, last)[:, 0]
    inside = torch.arange(1, g + 1, device=chosen.device)[None, :] <= accepted[:, None]  # [bs, g]
    path_tokens = torch.where(inside, tree.tokens.gather(1, path_nodes[:, 1:]), 0)
    return TreeWalk(accepted, emitted, path_nodes, path_tokens)


def gather_path(values: torch.Tensor, path_nodes: torch.Tensor) -> torch.Tensor:
    """values: [bs, N, ...] per node (e.g. target taps [bs, N, K*D]) -> [bs, g + 1, ...] along the
    path (rows beyond the accepted length repeat the root: callers keep only a + 1 of them)."""
    index = path_nodes.reshape(*path_nodes.shape, *([1] * (values.dim() - 2)))
    return values.gather(1, index.expand(-1, -1, *values.shape[2:]))


def commit_slots(
    walk: TreeWalk, node_slots: torch.Tensor, dest_slots: torch.Tensor, *, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each accepted node's K/V is and where it must go.

    node_slots: [bs, N] cache slots the verify pass wrote node i's K/V to; dest_slots: [bs, g + 1]
    the slots of positions start .. start + g; keep: [bs] optional number of path nodes to commit
    (default a + 1; fewer when a stop token or the length limit cut the round). Returns (src, dst)
    [bs, g + 1]; entries beyond a request's kept length are (0, 0): the padding page, a no-op copy.
    """
    length = walk.accepted + 1 if keep is None else keep
    inside = torch.arange(dest_slots.shape[1], device=dest_slots.device)[None, :] < length[:, None]
    src = node_slots.gather(1, walk.path_nodes)
    return torch.where(inside, src, 0), torch.where(inside, dest_slots, 0)
