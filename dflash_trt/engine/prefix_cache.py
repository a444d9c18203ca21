# SPDX-License-Identifier: Apache-2.0
"""Prefix caching: full KV pages of prompts, kept after their request ends and shared read-only by
later requests whose prompt starts with the same tokens.

A page is keyed by the chain of its tokens: key_i = (hash(key_{i-1}), the page's tokens), so a page matches
only behind the same prefix. Each key hashes in O(page) (the parent enters as its 64-bit hash, not as the
whole chain): two different prefixes would have to collide in that hash for a page to match wrongly. The target and the drafter share page tables, so a cached page holds both the target's K/V and
the drafter's context K/V of its positions (KV injection): a request that hits the cache drafts exactly
as if it had prefilled them.

Only full pages of a prompt are cached, and a prompt is matched up to its last token's page at most: the
last prompt token always runs (its logits give the first token). So every write a request makes after
its prompt (its generated tokens, a DDTree's scratch) lands in pages of its own: a shared page is never
written.

Pages in use are counted (`refs`); a cached page nobody uses is evictable, least recently used first,
when `allocate` finds the free list short. Engine-thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dflash_trt.layers.kv_cache import PageAllocator

Key = tuple[int, tuple[int, ...]]  # (the parent page's key's hash, 0 for the first page; the page's tokens)


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._pages: dict[Key, int] = {}  # key -> cached page
        self._keys: dict[int, Key] = {}  # cached page -> its key
        self._refs: dict[int, int] = {}  # cached page -> requests using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody uses, oldest first
        self.queries = 0  # prompt tokens looked up (the metrics count tokens)
        self.hits = 0  # of them, found cached

    # --- queries ----------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Pages an allocation may take: free, or cached and idle (evicted on demand)."""
        return self.allocator.num_free + len(self._idle)

    def keys(self, tokens: Sequence[int], limit: int) -> list[Key]:
        """The chain keys of the first `limit` full pages of `tokens`."""
        ps = self.page_size
        out: list[Key] = []
        parent = 0
        for i in range(min(limit, len(tokens) // ps)):
            key = (parent, tuple(tokens[i * ps : (i + 1) * ps]))
            out.append(key)
            parent = hash(key)
        return out

    def match(self, prompt: Sequence[int]) -> list[int]:
        """The cached pages of the longest cached prefix of `prompt`'s full pages, its last token's page
        excluded (that token always runs). Nothing changes: `claim` takes them."""
        hit = []
        for key in self.keys(prompt, (len(prompt) - 1) // self.page_size):
            page = self._pages.get(key)
            if page is None:
                break
            hit.append(page)
        return hit

    def num_idle(self, pages: Sequence[int]) -> int:
        """How many of `pages` are idle: claiming them takes that many from `num_available`."""
        return sum(page in self._idle for page in pages)

    def claim(self, pages: Sequence[int]) -> None:
        """Take matched pages for a request (`release` gives them back): evictable no more."""
        for page in pages:
            self._refs[page] += 1
            self._idle.pop(page, None)

    def count(self, prompt_tokens: int, hit_pages: int) -> None:
        """An admitted request's lookup, in tokens (the metrics)."""
        self.queries += prompt_tokens
        self.hits += hit_pages * self.page_size

    # --- pages ------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n pages from the free list, evicting idle cached pages (least recently used first) if short."""
        while self.allocator.num_free < n and self._idle:
            page, _ = self._idle.popitem(last=False)
            self._forget(page)
            self.allocator.free([page])
        return self.allocator.allocate(n)

    def register(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """A request's prompt is in `pages` (its table, in order): cache its full pages. A page whose key
        is cached already (another request computed the same prefix meanwhile) stays the request's own."""
        for key, page in zip(self.keys(tokens, len(tokens) // self.page_size), pages):
            if key in self._pages or page in self._keys:
                continue
            self._pages[key] = page
            self._keys[page] = key
            self._refs[page] = 1  # the registering request still uses it

    def release(self, pages: Sequence[int]) -> None:
        """A request ends: its cached pages lose a user (idle ones wait for reuse or eviction), the rest
        go back to the free list."""
        own = []
        for page in pages:
            if page not in self._keys:
                own.append(page)
                continue
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._idle[page] = None
        self.allocator.free(own)

    def cached(self, page: int) -> bool:
        return page in self._keys

    def _forget(self, page: int) -> None:
        key = self._keys.pop(page)
        del self._pages[key]
        del self._refs[page]

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_pages": len(self._keys), "prefix_cache_idle_pages": len(self._idle)}  # fmt: skip
