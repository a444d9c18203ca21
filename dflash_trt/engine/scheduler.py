# SPDX-License-Identifier: Apache-2.0
"""The scheduler: which requests run in the next step, and the KV pages and batch rows they hold.

`schedule()`:
  1. admits waiting requests in arrival order while a batch row and enough KV pages are free
     (pages for prompt + max_tokens, plus a DDTree's scratch columns past the last anchor, are
     reserved up front, so a running request never runs out and a tree never writes past its own
     pages; a request that could never fit was refused by `LLMEngine.add_request`); a request of n
     sequences is admitted whole, its siblings holding their rows and pages while the leader prefills;
     with prefix caching (engine/prefix_cache.py) a request starts with the cached pages of its prompt's
     longest cached prefix and prefills from there, and its prompt's full pages are cached once written;
  2. picks prompt chunks for the requests still prefilling, so that prefill and decode tokens stay
     within max_num_tokens (a prefill always gets at least one page of tokens, so it progresses);
  3. puts every running request in the step's round.
`finish()` returns a request's pages and row. Engine-thread only.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dflash_trt.engine.prefix_cache import PrefixCache
from dflash_trt.engine.request import Request, Status
from dflash_trt.layers.kv_cache import PageAllocator, pages_for


@dataclass
class ScheduledStep:
    prefill: list[Request] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # prompt tokens [lo, hi) per prefill
    decode: list[Request] = field(default_factory=list)  # requests that run a round this step


class Scheduler:
    def __init__(
        self,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        num_pages: int,
        page_size: int,
        round_tokens: int,
        scratch_tokens: int = 0,
        prefix_caching: bool = True,
    ) -> None:
        """round_tokens: the most tokens a running request verifies per round (its block, or a tree's
        nodes and root: `RoundPlanner.round_tokens`); scratch_tokens: the cache columns a tree round
        writes past max_len (`RoundPlanner.scratch_tokens`: a tree round writes its nodes' K/V to
        columns start .. start + budget, and start <= max_len - 2 while a request runs)."""
        self.max_num_tokens = max_num_tokens
        self.page_size = page_size
        self.round_tokens = round_tokens
        self.scratch_tokens = scratch_tokens
        self.allocator = PageAllocator(num_pages)
        self.cache = PrefixCache(self.allocator, page_size) if prefix_caching else None
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.free_rows = list(range(max_batch_size - 1, -1, -1))
        self.peak_active = 0  # most requests in flight in one step (prefill + decode)

    # --- queries ----------------------------------------------------------------------------------
    def pages_needed(self, prompt_len: int, max_tokens: int) -> int:
        return pages_for(prompt_len + max_tokens + self.scratch_tokens, self.page_size)

    @property
    def pages_available(self) -> int:
        """Pages an admission may take: free, or cached and idle (evicted on demand)."""
        return self.cache.num_available if self.cache is not None else self.allocator.num_free

    @property
    def num_active(self) -> int:
        return len(self.prefilling) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # --- transitions ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduledStep:
        self._admit()
        step = ScheduledStep(decode=list(self.running))
        budget = self.max_num_tokens - len(self.running) * self.round_tokens
        if self.prefilling:
            budget = max(budget, min(self.max_num_tokens, self.page_size))
        for req in self.prefilling:
            if budget <= 0:
                break
            lo = req.prefilled
            hi = min(len(req.prompt_ids), lo + budget)
            step.prefill.append(req)
            step.chunks.append((lo, hi))
            budget -= hi - lo
        self.peak_active = max(self.peak_active, self.num_active)
        return step

    def start_decoding(self, req: Request) -> None:
        """The prompt is in the caches and the first token is out: the request joins the rounds (a
        sibling of n > 1 was never in `prefilling`: its leader prefilled for it)."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    def finish(self, req: Request) -> None:
        """Drop a request from its queue and return its pages and row (idempotent). A sibling still
        waiting for its leader's prefill is in no queue."""
        for queue in (self.waiting, self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
                break
        req.status = Status.FINISHED
        if req.pages:
            if self.cache is not None:
                self.cache.release(req.pages)
            else:
                self.allocator.free(req.pages)
            req.pages = []
        if req.row >= 0:
            self.free_rows.append(req.row)
            req.row = -1

    def prompt_done(self, req: Request) -> None:
        """The request's prompt is in its pages: cache their full pages for later requests."""
        if self.cache is not None:
            self.cache.register(req.prompt_ids, req.pages)

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            group = req.group
            need = self.pages_needed(len(req.prompt_ids), req.max_len - len(req.prompt_ids))
            hit = self._cached_prefix(req)
            available = self.pages_available - (self.cache.num_idle(hit) if self.cache is not None else 0)
            if len(group) > len(self.free_rows) or need * len(group) - len(hit) > available:
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            if self.cache is not None:
                self.cache.claim(hit)
                self.cache.count(len(req.prompt_ids), len(hit))
            now = time.perf_counter()
            for member in group:
                fresh = need - len(hit) if member is req else need
                member.pages = (hit if member is req else []) + self._allocate(fresh)
                member.reserved_pages = len(member.pages)
                member.row = self.free_rows.pop()
                member.status = Status.PREFILL
                member.first_scheduled_time = now
            req.prefilled = req.cached_tokens = len(hit) * self.page_size
            self.prefilling.append(req)

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached pages the request would start with (none without caching, or when the request
        scores its prompt: that needs every prompt position's logits)."""
        if self.cache is None or req.prompt_logprobs is not None:
            return []
        return self.cache.match(req.prompt_ids)

    def _allocate(self, n: int) -> list[int]:
        return self.cache.allocate(n) if self.cache is not None else self.allocator.allocate(n)
