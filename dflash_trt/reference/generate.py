# SPDX-License-Identifier: Apache-2.0
"""The batch-1 reference loop (dflash-algorithm.md §4): prefill, then rounds of
draft -> verify -> accept -> commit, with both caches cropped as the algorithm states.

Invariants checked every round (cheap, and the loop is the oracle for everything else):
  - the target cache holds exactly `start` tokens when a round begins;
  - the draft cache holds context for positions [0, start) after injection and nothing else;
  - each round's length a + 1 lies in [1, B]; the prefill token belongs to no round, so
    sum(acceptance_lengths) == len(output_ids) - 1.
Block size 1 is plain autoregressive decoding through this same code (the speedup baseline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash_trt.errors import ConfigError
from dflash_trt.layers.kv_cache import (
    PageAllocator,
    PagedKVCache,
    SequencePages,
    context_index,
    pages_for,
    slot_mapping,
)
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.reference.hf_target import TargetAdapter
from dflash_trt.spec.accept import greedy_accept, rejection_accept, rejection_accept_candidates
from dflash_trt.spec.decoding_config import TREE_BUDGET_AUTO, check_tree_drafter, parse_tree_budget
from dflash_trt.spec.prompt import check_prompt_ids
from dflash_trt.spec.sampling import (
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_EMIT,
    SamplingConfig,
    logits_to_probs,
    sample_from_probs,
    seed_tensor,
    uniform,
)
from dflash_trt.spec.selector import Proposal, propose
from dflash_trt.spec.tree import DraftTree, build_tree, target_tokens, walk_tree

DRAFT_PAGE_SIZE = 16


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens only
    acceptance_lengths: list[int]  # per round, bonus included, last round truncated
    ttft_s: float
    decode_s: float
    finish_reason: str  # "stop" | "length"
    num_draft_tokens: int = 0  # drafts proposed
    num_accepted_draft_tokens: int = 0
    num_overturned: int = 0  # DFlash 2: drafts where the selector overturned the drafter's argmax
    block_size: int = 1
    extra: dict = field(default_factory=dict)
    tree_budgets: list[int] | None = None  # DDTree runs: each round's budget (0 = a linear round)

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def overturn_rate(self) -> float:
        """Share of drafts whose DFlash 2 selector pick is not the drafter's argmax (0.0 for v1 drafters,
        whose drafts are the argmax, and when nothing was drafted)."""
        return self.num_overturned / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Mean round length (tau), bonus token included; 0.0 when no round ran."""
        if not self.acceptance_lengths:
            return 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def tree_mean_acceptance_length(self) -> float | None:
        """DDTree runs: tau over the rounds that verified a tree (None when none did)."""
        if not self.tree_budgets:
            return None
        tree = [n for n, b in zip(self.acceptance_lengths, self.tree_budgets) if b > 0]
        return sum(tree) / len(tree) if tree else None

    def to_json(self, text: str | None) -> dict:
        """The `dflash-trt generate --json` contract (DDTree runs add tree_budgets, each round's
        budget, and tree_mean_acceptance_length, tau over the tree rounds)."""
        out = {
            "output_ids": self.output_ids,
            "acceptance_lengths": self.acceptance_lengths,
            "text": text,
            "num_rounds": self.num_rounds,
            "mean_acceptance_length": self.mean_acceptance_length,
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "num_draft_tokens": self.num_draft_tokens,
            "num_overturned_draft_tokens": self.num_overturned,
            "overturn_rate": self.overturn_rate,
        }
        if self.tree_budgets is not None:
            out["tree_budgets"] = self.tree_budgets
            out["tree_mean_acceptance_length"] = self.tree_mean_acceptance_length
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class _Sampler:
    """One request's sampling parameters as batch-1 tensors, and its counter-based uniforms."""

    config: SamplingConfig
    device: torch.device
    seeds: torch.Tensor  # [1]
    temp: torch.Tensor  # [1]
    top_k: torch.Tensor  # [1]
    top_p: torch.Tensor  # [1]

    @classmethod
    def create(cls, config: SamplingConfig, device: torch.device) -> _Sampler:
        return cls(
            config=config,
            device=device,
            seeds=seed_tensor(config.seed, device=device),
            temp=torch.tensor([config.temperature], device=device),
            top_k=torch.tensor([config.top_k], device=device),
            top_p=torch.tensor([config.top_p], device=device),
        )

    def positions(self, first: int, count: int) -> torch.Tensor:  # [1, count]
        return torch.arange(first, first + count, device=self.device)[None]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [T, V] -> [T, V]
        t = logits.shape[0]
        return logits_to_probs(logits, self.temp.expand(t), self.top_k.expand(t), self.top_p.expand(t))

    def uniform(self, first: int, count: int, purpose: int) -> torch.Tensor:  # [1, count]
        return uniform(self.seeds, self.positions(first, count), purpose)


@dataclass
class _Draft:
    """The drafter with its paged context cache: one sequence owning pages for the whole generation."""

    drafter: DFlashDrafter
    cache: PagedKVCache
    pages: SequencePages
    num_overturned: int = 0  # DFlash 2: slots whose pick is not the drafter's argmax

    @classmethod
    def open(cls, drafter: DFlashDrafter, target: TargetAdapter, *, max_len: int, block_size: int) -> _Draft:
        num_pages = pages_for(max_len + block_size, DRAFT_PAGE_SIZE) + 1
        cache = drafter.make_cache(num_pages=num_pages, page_size=DRAFT_PAGE_SIZE)
        alloc = PageAllocator(num_pages)
        pages = SequencePages(alloc.allocate(num_pages - 1), DRAFT_PAGE_SIZE)
        drafter.bind_target(target.embed_weight(), *target.head())
        return cls(drafter, cache, pages)

    def hidden(self, block: torch.Tensor, pending: torch.Tensor, start: int) -> torch.Tensor:
        """Inject the target features of positions [start - len(pending), start), run the drafter
        over `block` [1, size] (anchor at `start`) and return its hidden states [1, size, D]."""
        device = block.device
        size = block.shape[1]
        table = self.pages.table(device)  # [1, P]
        ctx_pos = torch.arange(start - pending.shape[0], start, device=device)
        self.drafter.inject_context(
            self.cache, pending, ctx_pos, slot_mapping(table, ctx_pos[None], DRAFT_PAGE_SIZE)[0]
        )
        lc = pages_for(start, DRAFT_PAGE_SIZE) * DRAFT_PAGE_SIZE
        hidden = self.drafter.forward_block(
            self.cache,
            self.drafter.embed_block(block),
            torch.arange(start, start + size, device=device)[None],
            context_index(table, DRAFT_PAGE_SIZE, pages_for(start, DRAFT_PAGE_SIZE))[:, :lc],
            torch.tensor([start], device=device),
        )  # [1, size, D]
        return hidden

    def logits(self, block: torch.Tensor, pending: torch.Tensor, start: int) -> torch.Tensor:
        """The drafter's logits for slots 1.. of `block` [size - 1, V] (see `hidden`)."""
        return self.drafter.compute_logits(self.hidden(block, pending, start)[0, 1:])

    def propose(
        self, block: torch.Tensor, pending: torch.Tensor, start: int, sampler: _Sampler
    ) -> torch.Tensor | Proposal | None:
        """Draft into block[0, 1:] (see `hidden`). Returns the draft distribution q [g, V] (DFlash 2:
        the selector's proposal, q over its candidates), or None under greedy sampling (not needed)."""
        g = block.shape[1] - 1
        hidden = self.hidden(block, pending, start)[:, 1:]  # [1, g, D]
        draft_logits = self.drafter.compute_logits(hidden[0])  # [g, V]
        sampling = sampler.config
        if self.drafter.selector is not None:
            return self._select(block, hidden, draft_logits[None], start, sampler)
        draft_probs = None
        if sampling.is_greedy or sampling.greedy_draft:
            block[0, 1:] = draft_logits.argmax(dim=-1)
            if not sampling.is_greedy:  # greedy drafts under sampling: q is one-hot
                draft_probs = torch.zeros_like(draft_logits, dtype=torch.float32)
                draft_probs.scatter_(-1, block[0, 1:, None], 1.0)
        else:
            draft_probs = sampler.probs(draft_logits)  # [g, V]
            u = sampler.uniform(start + 1, g, PURPOSE_DRAFT)[0]  # [g]
            block[0, 1:] = sample_from_probs(draft_probs, u)
        return draft_probs

    def _select(
        self, block: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor, start: int, sampler: _Sampler
    ) -> Proposal | None:
        """DFlash 2: the selector's walk over the candidates (hidden [1, g, D], logits [1, g, V]) writes
        the drafts into block[0, 1:]. Returns the proposal (q over the candidates), None when greedy."""
        cfg = sampler.config
        g = logits.shape[1]
        selector = self.drafter.selector
        assert selector is not None
        proposal = propose(
            hidden=hidden, logits=logits, anchors=block[:, 0], selector=selector, temperature=sampler.temp,
            greedy=torch.tensor([cfg.is_greedy or cfg.greedy_draft], device=sampler.device),
            u=sampler.uniform(start + 1, g, PURPOSE_DRAFT), any_sampled=not (cfg.is_greedy or cfg.greedy_draft),
        )  # fmt: skip
        block[0, 1:] = proposal.drafts[0]
        self.num_overturned += int(proposal.overturned.sum())
        return None if cfg.is_greedy else proposal


def _check_request(
    target: TargetAdapter,
    drafter: DFlashDrafter | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    block_size: int | None,
) -> int:
    """Validate the arguments of spec_generate; returns the block size to run (1 without a drafter)."""
    check_prompt_ids([int(t) for t in prompt_ids], target.info.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError("max_new_tokens", max_new_tokens, "must be an integer >= 1")
    if drafter is None:
        block_size = 1
    elif block_size is None:
        block_size = drafter.block_size
    if block_size < 1 or (drafter is not None and block_size > drafter.block_size):
        raise ConfigError("block_size", block_size, "must be in [1, drafter block_size]")
    return block_size


def _prefill(
    target: TargetAdapter, prompt_ids: Sequence[int], layer_ids: list[int] | None, sampler: _Sampler
) -> tuple[int, torch.Tensor | None, float]:
    """Run the prompt through the target and pick the token after it. Returns (that token, the
    prompt's target features [n, K * D] or None without a drafter, seconds to first token)."""
    device = sampler.device
    n = len(prompt_ids)
    _sync(device)
    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    logits, feats = target.extend(ids, 0, layer_ids=layer_ids, last_only=True)
    target.crop(n)  # no-op in length; lets sliding-window caches drop states they no longer need
    if sampler.config.is_greedy:
        first = int(logits[-1].argmax())
    else:
        u = sampler.uniform(n, 1, PURPOSE_EMIT)[:, 0]
        first = int(sample_from_probs(sampler.probs(logits[-1:]), u)[0])
    _sync(device)
    return first, feats, time.perf_counter() - t0


def _until_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    """`tokens` up to and including the first stop token; True when there was one."""
    for i, tok in enumerate(tokens):
        if tok in stop:
            return tokens[: i + 1], True
    return tokens, False


def _accept(
    block: torch.Tensor,
    logits: torch.Tensor,
    draft_probs: torch.Tensor | Proposal | None,
    start: int,
    sampler: _Sampler,
) -> tuple[int, int]:
    """Compare the drafts block[0, 1:] with the target's logits [size, V] over the block:
    returns (a, token) where a drafts are accepted and `token` is the target's next token after
    them (greedy: exact match of argmax; sampling: lossless rejection sampling, with q over the
    selector's candidates for DFlash 2)."""
    if sampler.config.is_greedy:
        acc, emit = greedy_accept(block[:, 1:], logits[None])
    elif isinstance(draft_probs, Proposal):
        g = block.shape[1] - 1
        acc, emit = rejection_accept_candidates(
            block[:, 1:],
            draft_probs.candidates,
            draft_probs.cand_probs,
            sampler.probs(logits)[None],
            sampler.uniform(start + 1, g, PURPOSE_ACCEPT),
            sampler.uniform(start + 1, g + 1, PURPOSE_EMIT),
        )
    else:
        g = block.shape[1] - 1
        assert g == 0 or draft_probs is not None
        q = draft_probs if draft_probs is not None else logits.new_zeros((0, logits.shape[-1]))
        acc, emit = rejection_accept(
            block[:, 1:],
            q[None].float(),
            sampler.probs(logits)[None],
            sampler.uniform(start + 1, g, PURPOSE_ACCEPT),
            sampler.uniform(start + 1, g + 1, PURPOSE_EMIT),
        )
    return int(acc[0]), int(emit[0])


def _tree_round(
    target: TargetAdapter,
    draft: _Draft,
    block: torch.Tensor,
    pending: torch.Tensor,
    start: int,
    sampler: _Sampler,
    *,
    budget: int,
    layer_ids: list[int],
) -> tuple[list[int], list[int], torch.Tensor | None, int]:
    """One DDTree round (dflash-algorithm.md §6) for the block [1, size] (anchor, masks): draft,
    build the tree of `budget` nodes, verify it in one target pass, walk it. Returns (tokens: the
    accepted drafts then the target's token, the accepted path's node indices root first, the
    verify features of every node [T, K * D], nodes drafted). The caller commits a prefix of the path."""
    g = block.shape[1] - 1
    tree = build_tree(draft.logits(block, pending, start)[None], block[:, 0], budget=budget)
    real = int(tree.valid[0].sum())  # real nodes come first; batch 1 needs no padding
    tree = DraftTree(
        tree.tokens[:, :real], tree.parents[:, :real], tree.depths[:, :real], tree.valid[:, :real],
        tree.visibility[:, :real, :real],
    )  # fmt: skip
    logits, feats = target.extend_tree(
        tree.tokens, start, tree.depths[0], tree.visibility[0], layer_ids=layer_ids
    )  # [T, V], [T, K * D]
    s = sampler
    starts = torch.tensor([start], device=s.device)
    chosen = target_tokens(logits[None], tree, starts, s.seeds, s.temp, s.top_k, s.top_p,
                           all_greedy=s.config.is_greedy)  # fmt: skip
    walk = walk_tree(tree, chosen, max_depth=g)
    a = int(walk.accepted[0])
    tokens = [*walk.path_tokens[0, :a].tolist(), int(walk.emitted[0])]
    return tokens, walk.path_nodes[0, : a + 1].tolist(), feats, real - 1


@dataclass
class _Loop:
    """The state of one generation between rounds."""

    output: list[int]  # generated tokens; the last one is the next round's anchor
    start: int  # position of the anchor == tokens in the target cache
    pending: torch.Tensor | None  # [n_pending, K * D] features of positions [start - n_pending, start)
    finish: str  # "stop" once a stop token is out, else "length"
    rounds: list[int] = field(default_factory=list)  # tokens each round produced
    budgets: list[int] = field(default_factory=list)  # each round's DDTree budget (0 = linear)
    drafted: int = 0
    accepted: int = 0


@torch.inference_mode()
def spec_generate(
    target: TargetAdapter,
    drafter: DFlashDrafter | None,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_token_ids: Sequence[int] = (),
    block_size: int | None = None,
    tree_budget: int | str = 0,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens (prompt excluded) for one prompt.

    With `drafter=None` or `block_size=1` this is plain decoding of the target. tree_budget > 0
    verifies a DDTree of that many drafted nodes per round instead of the block's argmax chain
    (or samples, at T > 0); 0 is linear DFlash.
    """
    sampling = sampling or SamplingConfig()
    block_size = _check_request(target, drafter, prompt_ids, max_new_tokens, block_size)
    budget = _tree_budget(tree_budget, drafter)
    n = len(prompt_ids)
    max_len = n + max_new_tokens
    stop = {int(t) for t in stop_token_ids}
    sampler = _Sampler.create(sampling, target.device)
    target.reset()
    draft = None
    if drafter is not None and block_size > 1:
        draft = _Draft.open(drafter, target, max_len=max_len, block_size=block_size)
    layer_ids = list(draft.drafter.config.target_layer_ids) if draft is not None else None
    # --- prefill: the prompt through the target gives the first token and the first context
    first, feats, ttft = _prefill(target, prompt_ids, layer_ids, sampler)
    loop = _Loop(output=[first], start=n, pending=feats, finish="stop" if first in stop else "length")
    t1 = time.perf_counter()
    while loop.start + 1 < max_len and loop.finish != "stop":
        size = min(block_size, max_len - loop.start)
        _round(loop, target, draft, sampler, size=size, max_len=max_len, stop=stop, layer_ids=layer_ids,
               budget=budget)  # fmt: skip
    _sync(target.device)
    decode = time.perf_counter() - t1
    assert sum(loop.rounds) == len(loop.output) - 1
    return GenerationResult(
        output_ids=loop.output,
        acceptance_lengths=loop.rounds,
        ttft_s=ttft,
        decode_s=decode,
        finish_reason=loop.finish,
        num_draft_tokens=loop.drafted,
        num_accepted_draft_tokens=loop.accepted,
        num_overturned=draft.num_overturned if draft is not None else 0,
        block_size=block_size,
        tree_budgets=loop.budgets if budget and draft is not None else None,
    )


def _tree_budget(tree_budget: int | str, drafter: DFlashDrafter | None) -> int:
    """The DDTree budget the reference loop verifies: a fixed number of nodes (0 = linear DFlash)."""
    budget = parse_tree_budget(tree_budget, field_name="tree_budget")
    if budget == TREE_BUDGET_AUTO:
        raise ConfigError(
            "tree_budget", tree_budget, "is chosen by the serving engine's cost model; the reference loop "
            "verifies a fixed budget", hint="pass a number of nodes, e.g. 32",
        )  # fmt: skip
    assert isinstance(budget, int)
    check_tree_drafter(
        budget, dflash2=drafter is not None and drafter.config.is_dflash2, field_name="tree_budget"
    )
    return budget


def _round(
    loop: _Loop, target: TargetAdapter, draft: _Draft | None, sampler: _Sampler, *, size: int, max_len: int,
    stop: set[int], layer_ids: list[int] | None, budget: int = 0,
) -> None:  # fmt: skip
    """One round of `size` block slots: draft, verify, accept, commit (a DDTree of `budget` nodes
    instead of the block's chain when budget > 0)."""
    start = loop.start
    # --- draft: the anchor (last output token) and size - 1 mask slots the drafter fills
    mask = draft.drafter.mask_token_id if draft is not None else 0
    block = torch.full((1, size), mask, dtype=torch.long, device=sampler.device)
    block[0, 0] = loop.output[-1]
    path = None
    if size > 1 and budget:
        assert draft is not None and loop.pending is not None and layer_ids is not None
        new_tokens, path, feats, nodes = _tree_round(
            target, draft, block, loop.pending, start, sampler, budget=budget, layer_ids=layer_ids
        )
        a = len(new_tokens) - 1
        loop.drafted += nodes
    else:
        draft_probs = None
        if size > 1:
            assert draft is not None and loop.pending is not None
            draft_probs = draft.propose(block, loop.pending, start, sampler)
            loop.drafted += size - 1
        # --- verify: one target forward over the whole block
        logits, feats = target.extend(block, start, layer_ids=layer_ids)  # [size, V], [size, K*D]
        # --- accept: a matching drafts, then the target's own token after them (a + 1 tokens)
        a, token = _accept(block, logits, draft_probs, start, sampler)
        new_tokens = [*block[0, 1 : a + 1].tolist(), token]
    loop.accepted += a
    # never past max_new_tokens; a stop token ends the round and the request
    new_tokens, stopped = _until_stop(new_tokens[: min(a + 1, max_len - start - 1)], stop)
    if stopped:
        loop.finish = "stop"
    produced = len(new_tokens)
    loop.output.extend(new_tokens)
    # --- commit: the target cache keeps [0, start) plus the produced positions (a tree moves its
    # accepted nodes' K/V there); their features (anchor first) go into the draft cache at the
    # next round's injection
    loop.start = start + produced
    if path is None:
        target.crop(loop.start)
        committed = feats[:produced] if feats is not None else None
    else:
        target.keep_nodes(start, path[:produced])
        committed = feats[path[:produced]] if feats is not None else None
    if layer_ids is not None:
        loop.pending = committed
    loop.rounds.append(produced)
    loop.budgets.append(budget if path is not None else 0)
    assert 1 <= produced <= size and target.cache_length == loop.start
