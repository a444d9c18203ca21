# SPDX-License-Identifier: Apache-2.0
"""Paged KV storage shared by the drafter's context cache and the native target models.

A token at absolute position p of a sequence lives in slot `block_table[p // P] * P + p % P`
of a flat per-layer pool, P being the page size. Sequences own whole pages; the cache itself
knows nothing about sequences. "Cropping" a sequence is just lowering its length: stale slots
beyond the length are masked out and overwritten later.

Invariant (drafter): only committed context K/V is ever written; block (query) K/V never is,
so between rounds the draft cache holds exactly positions [0, start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash_trt.errors import DFlashTrtError


class PagedKVCache:
    """Per-layer K/V pools. k[layer]: [num_pages * page_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config: Any, *, num_pages: int, page_size: int, like: torch.Tensor) -> PagedKVCache:
        """A cache for a model whose config has num_hidden_layers, num_key_value_heads and head_dim,
        in the dtype and on the device of `like` (one of its weights)."""
        return cls(
            num_layers=config.num_hidden_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=like.dtype,
            device=like.device,
        )

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages src[i] -> dst[i] in every layer (a sequence forked from another's prompt)."""
        if not src:
            return
        ps = self.page_size
        offsets = torch.arange(ps, device=self.k[0].device)
        s = (torch.tensor(src, device=offsets.device)[:, None] * ps + offsets).flatten()
        d = (torch.tensor(dst, device=offsets.device)[:, None] * ps + offsets).flatten()
        for pool in (*self.k, *self.v):
            pool[d] = pool[s]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [N] long; k, v: [N, Hkv, d]."""
        store_kv(self.k[layer], self.v[layer], slots, k, v)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at slots `src` [N] to slots `dst` [N] (DDTree commit: the accepted
        nodes move to the slots of positions start..start + a).

        All sources are read before any destination is written, so the two sets may overlap.
        Entries to skip point both at the same padding slot (src == dst == 0): a no-op copy.
        """
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, dst, pool.index_select(0, src))


def store_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
):
    """Write one layer's new K/V into its pools. slots: [N] long; k, v: [N, Hkv, d]."""
    k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.index_copy_(0, slots, v.to(v_pool.dtype))


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """block_tables: [bs, max_pages]; positions: [bs, T] -> slots [bs, T]."""
    pages = block_tables.gather(1, torch.div(positions, page_size, rounding_mode="floor"))
    return pages * page_size + positions % page_size


def context_index(block_tables: torch.Tensor, page_size: int, num_pages: int | None = None) -> torch.Tensor:
    """Slots of positions [0, num_pages * page_size) for every sequence: [bs, num_pages * page_size].

    Position j of sequence i sits at column j, so masks can be built from positions directly.
    """
    tables = block_tables if num_pages is None else block_tables[:, :num_pages]
    offsets = torch.arange(page_size, device=tables.device)
    return (tables[:, :, None] * page_size + offsets).reshape(tables.shape[0], -1)


class PageAllocator:
    """Free list of page ids. Page 0 is reserved as the padding page (block tables are padded with
    it), so padded gathers read valid memory and padded writes never touch a live sequence."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise DFlashTrtError(f"KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise DFlashTrtError(f"KV pool exhausted: need {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass(slots=True)
class SequencePages:
    """The pages one sequence owns, in position order."""

    pages: list[int]
    page_size: int

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def table(self, device: torch.device | str, width: int | None = None) -> torch.Tensor:
        """[1, width] block table padded with page 0."""
        width = width or len(self.pages)
        row = self.pages + [0] * (width - len(self.pages))
        return torch.tensor([row], dtype=torch.long, device=device)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
