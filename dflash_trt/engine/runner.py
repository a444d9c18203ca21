# SPDX-License-Identifier: Apache-2.0
"""The host side of a step: the scheduled requests in, their tensors to the executor, tokens out.

`prefill` pads the step's prompt chunks into passes of similar lengths (`pass_groups`) and samples
the first token of each prompt that is now complete; `decode_round` builds the round's `RoundInputs`
once (engine/round.py), has the executor run it (engine/executor.py) and reads its results back once,
as a `RoundOutput`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from dflash_trt.engine.grammar import guided_round, mask_logits
from dflash_trt.engine.round import (
    RoundInputs,
    RoundOutput,
    RoundShape,
    TokenLogprob,
    page_tables,
    parse_logprobs,
    token_logprobs,
    unstack,
)
from dflash_trt.layers.kv_cache import pages_for
from dflash_trt.spec.penalties import penalize
from dflash_trt.spec.sampling import PURPOSE_EMIT, logits_to_probs, sample_from_probs, uniform

if TYPE_CHECKING:
    from dflash_trt.engine.executor import Executor
    from dflash_trt.engine.request import Request
    from dflash_trt.engine.round import RoundParts


# A prefill pass's fixed cost in padded token rows: what a chunk must waste in padding before it is
# worth a pass of its own. smollm2-135m in bf16 on 2 cores (compiled): a pass of one token ~6 ms, each
# further row of a short chunk ~0.5 ms.
PASS_OVERHEAD_ROWS = 16


def pass_groups(lengths: list[int], overhead: int = PASS_OVERHEAD_ROWS) -> list[list[int]]:
    """The chunks (their indices, by `lengths`) grouped into padded prefill passes, each padded to its
    longest chunk: the grouping of least total cost, a pass costing `overhead` rows plus its chunks
    times its longest. One pass of every chunk padded to the longest (a 358-token prompt beside
    fifteen of 42-245 tokens) computes up to 2.5x the rows it needs. The optimum groups neighbours
    in length order: a dynamic programme over the sorted lengths. Each group lists its chunks in their
    original order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    best, cut = [0] + [0] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + overhead + (j - i) * lengths[order[i]], i) for i in range(j))
    groups = []
    while n > 0:
        groups.append(sorted(order[cut[n] : n]))
        n = cut[n]
    return groups[::-1]


class Prefilled(NamedTuple):
    """A prefill pass's first tokens (None where the prompt is not complete yet) and their
    log-probabilities (None where not asked for); `forked`: the siblings (n > 1) of the leaders whose
    prompt is now complete, with their own first tokens and log-probabilities."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None]
    forked: tuple[tuple[Request, int, TokenLogprob | None], ...] = ()


class ModelRunner:
    # rounds run on the engine thread, so the engine commits each before it launches the next
    # (engine/engine.py, "Overlap")
    overlaps = False

    def __init__(self, parts: RoundParts, executor: Executor) -> None:
        self.parts = parts
        self.executor = executor
        self.device = parts.device
        self.page_size = parts.page_size
        self.times = parts.times

    @torch.inference_mode()
    def prefill(self, reqs: list[Request], chunks: list[tuple[int, int]]) -> Prefilled:
        """Run prompt chunks [lo, hi) of several sequences in padded passes (`pass_groups`).

        Writes target K/V, injects the chunk's context into the draft cache, and returns the first
        generated token for sequences whose prompt is now complete (None for the others), with its
        log-probabilities where the request asked for them. A complete leader of n sequences hands its
        caches to its siblings, which sample their own first tokens from the same logits.
        """
        t0 = time.perf_counter()
        bs, dev = len(reqs), self.device
        groups = pass_groups([hi - lo for lo, hi in chunks])
        outs = [self._pass([reqs[i] for i in g], [chunks[i] for i in g]) for g in groups]
        order = [i for g in groups for i in g]
        logits = torch.cat(outs) if len(outs) > 1 else outs[0]
        if order != list(range(bs)):  # back to the requests' order
            logits = logits.index_select(0, torch.argsort(torch.tensor(order, device=dev)))
        seq_lens = torch.tensor([hi for _, hi in chunks], device=dev)
        done = [hi == len(s.prompt_ids) for s, (_, hi) in zip(reqs, chunks)]
        out = Prefilled([None] * bs, [None] * bs)
        if any(done):
            out = self._firsts(reqs, done, logits, seq_lens)
        self.parts.sync()
        self.times.prefill_s += time.perf_counter() - t0
        return out

    def _pass(self, reqs: list[Request], chunks: list[tuple[int, int]]) -> torch.Tensor:
        """One padded prefill pass over these chunks: the logits at each chunk's last token [bs, V]."""
        bs, dev = len(reqs), self.device
        t = max(2, *(hi - lo for lo, hi in chunks))  # a compiled prefill guards on chunks of 2 or more
        ids = torch.zeros(bs, t, dtype=torch.long)
        pos = torch.zeros(bs, t, dtype=torch.long)
        valid = torch.zeros(bs, t, dtype=torch.bool)
        for i, (s, (lo, hi)) in enumerate(zip(reqs, chunks)):
            ids[i, : hi - lo] = torch.tensor(s.prompt_ids[lo:hi])
            pos[i, : hi - lo] = torch.arange(lo, hi)
            pos[i, hi - lo :] = hi  # padding rows sit after the chunk, masked as keys
            valid[i, : hi - lo] = True
        width = pages_for(max(hi for _, hi in chunks), self.page_size)
        seq_lens = torch.tensor([hi for _, hi in chunks], device=dev)
        last = torch.tensor([hi - lo - 1 for lo, hi in chunks], device=dev)
        tables = page_tables([s.pages for s in reqs], width, dev)
        args = (ids.to(dev), pos.to(dev), valid.to(dev), tables, seq_lens)
        if any(s.prompt_logprobs is not None for s in reqs):
            every = self.executor.prefill_scored(args)  # [bs, t, V]
            self._score_prompts(reqs, chunks, every)
            return every[torch.arange(bs, device=dev), last]
        return self.executor.prefill((*args, last))

    def _firsts(self, reqs: list[Request], done: list[bool], logits: torch.Tensor,
                seq_lens: torch.Tensor) -> Prefilled:  # fmt: skip
        """The first tokens of the complete prompts (and of their leaders' siblings, after the fork)."""
        bs = len(reqs)
        forks = [(i, sib) for i, (s, d) in enumerate(zip(reqs, done)) if d for sib in self._fork(s)]
        if forks:
            rows = torch.tensor(list(range(bs)) + [i for i, _ in forks], device=self.device)
            logits, seq_lens = logits[rows], seq_lens[rows]
            reqs, done = reqs + [sib for _, sib in forks], done + [True] * len(forks)
        processed = [s.processed and d for s, d in zip(reqs, done)]
        if any(processed) or self.parts.penalties is not None:
            logits = self._start_penalties(reqs, done, logits)
        guided = guided_round([s if d else None for s, d in zip(reqs, done)], self.parts.bitmask_words)
        if guided is not None:  # the first token is masked by each guide's start state
            empty = torch.zeros(len(reqs), 0, dtype=torch.long)
            logits = mask_logits(logits.clone(), guided.along(empty)[:, 0].to(logits.device))
        tokens = self._first_tokens(reqs, logits, seq_lens, min_p=any(processed))
        if any(processed):
            self._count_first(reqs, processed, tokens)
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        if any(s.logprobs is not None and d for s, d in zip(reqs, done)):
            logprobs = self._first_logprobs(reqs, done, logits, tokens)
        firsts = [tok if d else None for tok, d in zip(tokens, done)]
        forked = tuple((sib, tokens[bs + j], logprobs[bs + j]) for j, (_, sib) in enumerate(forks))
        return Prefilled(firsts[:bs], logprobs[:bs], forked)

    @staticmethod
    def _score_prompts(reqs: list[Request], chunks: list[tuple[int, int]], every: torch.Tensor) -> None:
        """Each scored chunk's log-probabilities of the prompt tokens it predicts: position p's logits
        score token p + 1 (the last prompt position's predict the first generated token: not a prompt
        token). The target's raw distribution: penalties and bias apply to generated tokens."""
        for i, (s, (lo, hi)) in enumerate(zip(reqs, chunks)):
            m = min(hi, len(s.prompt_ids) - 1) - lo
            if s.prompt_logprobs is None or m <= 0:
                continue
            chosen = torch.tensor([s.prompt_ids[lo + 1 : lo + 1 + m]], device=every.device)
            values = token_logprobs(every[i : i + 1, :m], chosen).tolist()[0]
            s.prompt_token_logprobs.extend(parse_logprobs(values, m))

    def _fork(self, leader: Request) -> list[Request]:
        """A leader's prompt is in the caches: copy its pages (target and draft) to the siblings still
        waiting for it, which then run as requests of their own. Returns them."""
        siblings, leader.siblings = leader.group[1:], []
        used = pages_for(len(leader.prompt_ids), self.page_size)
        for sib in siblings:
            self.parts.target_cache.copy_pages(leader.pages[:used], sib.pages[:used])
            if self.parts.draft_cache is not None:
                self.parts.draft_cache.copy_pages(leader.pages[:used], sib.pages[:used])
            sib.prefilled = len(sib.prompt_ids)
            sib.prompt_token_logprobs = list(leader.prompt_token_logprobs)
        return siblings

    def _first_logprobs(self, reqs: list[Request], done: list[bool], logits: torch.Tensor,
                        tokens: list[int]) -> list[TokenLogprob | None]:  # fmt: skip
        """The first tokens' log-probabilities (after penalties and bias), as a round reports them."""
        chosen = torch.tensor(tokens, device=self.device)[:, None]
        rows = token_logprobs(logits[:, None, :], chosen).tolist()
        return [parse_logprobs(r, 1)[0] if d and s.logprobs is not None else None
                for s, d, r in zip(reqs, done, rows)]  # fmt: skip

    def _first_tokens(self, reqs: list[Request], logits: torch.Tensor, seq_lens: torch.Tensor, *,
                      min_p: bool) -> list[int]:  # fmt: skip
        """Each prompt's first generated token, sampled as a round emits (keyed by its position)."""
        dev = self.device
        probs = logits_to_probs(
            logits,
            torch.tensor([s.temperature for s in reqs], device=dev),
            torch.tensor([s.top_k for s in reqs], device=dev),
            torch.tensor([s.top_p for s in reqs], device=dev),
            needs_filter=any(s.needs_filter for s in reqs),
            any_greedy=any(s.temperature == 0 for s in reqs),
            min_p=torch.tensor([s.min_p for s in reqs], device=dev) if min_p else None,
        )
        seeds = torch.tensor([s.seed for s in reqs], dtype=torch.long, device=dev)
        u = uniform(seeds, seq_lens[:, None], PURPOSE_EMIT, native=self.parts.native_uniform)[:, 0]
        return sample_from_probs(probs, u).tolist()

    def _start_penalties(self, reqs: list[Request], done: list[bool], logits: torch.Tensor) -> torch.Tensor:
        """Once the penalty buffers exist, every request whose prompt is complete sets its row (from its
        prompt and bias: a reused row forgets its last owner's); the first token's logits penalized
        (nothing generated yet: only the prompt's repetition and the bias count)."""
        state = self.parts.penalty_state()
        for s, d in zip(reqs, done):
            if d:
                state.start(s.row, s.prompt_ids, s.logit_bias, s.bad_words)
        rows = torch.tensor([s.row for s in reqs], device=self.device)
        per = [
            torch.tensor([[getattr(s, n)] for s in reqs], dtype=torch.float32, device=self.device)
            for n in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        ]  # fmt: skip  [bs, 1]
        scores = penalize(logits, state.counts[rows], state.seen[rows], state.bias[rows], *per)
        return state.ban(rows, scores[:, None], scores.new_zeros(len(reqs), 0, dtype=torch.long))[:, 0]

    def _count_first(self, reqs: list[Request], processed: list[bool], tokens: list[int]) -> None:
        rows = [s.row for s, on in zip(reqs, processed) if on]
        first = [t for t, on in zip(tokens, processed) if on]
        dev = self.device
        self.parts.penalty_state().add(torch.tensor(rows, device=dev), torch.tensor(first, device=dev)[:, None],
                                       torch.ones(len(rows), 1, dtype=torch.bool, device=dev))  # fmt: skip

    def launch_round(self, reqs: list[Request], shape: RoundShape) -> Callable[[], RoundOutput]:
        """Run the round now (the engine's launch): its result is ready when this returns."""
        out = self.decode_round(reqs, shape)
        return lambda: out

    @torch.inference_mode()
    def decode_round(self, reqs: list[Request], shape: RoundShape) -> RoundOutput:
        """One round for `reqs` (all running) of `shape`: g drafts each (0 = plain decoding), or a DDTree
        of `shape.budget` drafted nodes per request instead of the chain."""
        t0 = time.perf_counter()
        if self.parts.drafter is None:
            shape = RoundShape(0, 0, shape.flags)
        g, budget = shape.g, shape.budget
        block_lens = [min(g + 1, s.max_len - s.start) for s in reqs]
        # cache columns the round writes past each anchor: the block, or every node of the tree
        spans = [budget + 1] * len(reqs) if budget else block_lens
        self._check_scratch(reqs, spans)
        width = pages_for(max(s.start + n for s, n in zip(reqs, spans)), self.page_size)
        inputs = RoundInputs.build(reqs, block_lens, width, self.device)
        guided = guided_round(reqs, self.parts.bitmask_words)
        if guided is None:
            stacked = self.executor.round(inputs, shape)
        else:  # the matchers run on the host between the round's passes: eager (engine/grammar.py)
            self.parts.guided = guided
            try:
                stacked = self.parts.round(*inputs, **shape.kwargs())
            finally:
                self.parts.guided = None
        out = unstack(stacked.tolist(), g, budget)  # the round's one read-back
        self.times.round_s += time.perf_counter() - t0
        self.times.rounds += 1
        return out

    def _check_scratch(self, reqs: list[Request], spans: list[int]) -> None:
        """A round writes K/V to cache columns start .. start + span - 1 of each request: they must be
        its own pages (the scheduler reserves the tree's scratch columns). Never write past them."""
        for s, n in zip(reqs, spans):
            if s.start + n > len(s.pages) * self.page_size:
                raise RuntimeError(
                    f"request {s.request_id}: a round needs cache columns up to {s.start + n} but it holds "
                    f"{len(s.pages)} pages of {self.page_size} (the scheduler reserves the tree's scratch)"
                )
