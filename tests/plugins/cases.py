# SPDX-License-Identifier: Apache-2.0
"""Random inputs for the dflash:: ops, shared by the CPU tests and the interpreter tests.

Shapes are deliberately awkward: odd vocabularies and hidden sizes, head_dim not a power of two,
ragged context and block lengths (including an empty context and a full one), block sizes 2..16,
GQA ratios 1..8, scattered pages, and rows that must be ignored pointing at the padding page 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.layers.kv_cache import context_index


# --- block attention ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnCase:
    bs: int
    blk: int  # B
    heads: int  # H
    kv_heads: int  # Hkv
    head_dim: int
    page: int
    causal: bool = False
    window: int = 0
    dtype: torch.dtype = torch.float32
    pages_per_seq: int = 3
    strided_q: bool = False  # q as a non-contiguous view (unit stride in head_dim only)

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        kind = ("causal" if self.causal else "full") + (f"-w{self.window}" if self.window else "")
        return (
            f"bs{self.bs}-B{self.blk}-H{self.heads}x{self.kv_heads}-d{self.head_dim}-P{self.page}-{kind}-{dt}"
            + ("-strided" if self.strided_q else "")
        )


def attn_inputs(case: AttnCase, seed: int = 0) -> tuple:
    """Arguments of dflash::block_attention for `case`."""
    gen = torch.Generator().manual_seed(seed)
    bs, blk, h, hkv, d, page = case.bs, case.blk, case.heads, case.kv_heads, case.head_dim, case.page
    num_pages = 1 + bs * case.pages_per_seq + 2  # page 0 pads; two pages nobody owns
    slots = num_pages * page

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(case.dtype)

    k_cache, v_cache = randn(slots, hkv, d), randn(slots, hkv, d)
    owned = torch.randperm(num_pages - 1, generator=gen)[: bs * case.pages_per_seq] + 1
    tables = owned.view(bs, case.pages_per_seq)  # [bs, pages] scattered pages
    ctx_index = context_index(tables, page)  # [bs, Lc]
    lc = ctx_index.shape[1]
    ctx_lens = torch.randint(0, lc + 1, (bs,), generator=gen)
    ctx_lens[0] = lc  # a full context
    if bs > 1:
        ctx_lens[1] = 0  # an empty one
    block_lens = torch.randint(1, blk + 1, (bs,), generator=gen)
    block_lens[0] = blk
    if case.strided_q:  # [bs, H, B, d] storage seen as [bs, B, H, d]
        q = randn(bs, h, blk, d).transpose(1, 2)
    else:
        q = randn(bs, blk, h, d)
    k_block, v_block = randn(bs, blk, hkv, d), randn(bs, blk, hkv, d)
    return (
        q,
        k_block,
        v_block,
        k_cache,
        v_cache,
        ctx_index,
        ctx_lens,
        block_lens,
        case.causal,
        case.window,
        d**-0.5,
    )


def visible_rows(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [bs, B]: block slot inside the sequence's block; seen [bs, B]: the query sees at least
    one key). Rows that see nothing are the kernel's zeros and the reference's NaN-or-garbage."""
    q, _, _, _, _, _, ctx_lens, block_lens, causal, window, _ = args
    bs, blk = q.shape[:2]
    jq = torch.arange(blk)[None, :, None]
    jk = torch.arange(blk)[None, None, :]
    vis = jk < block_lens[:, None, None]
    if causal:
        vis = vis & (jk <= jq)
    if window:
        vis = vis & (jq - jk < window)
        if not causal:
            vis = vis & (jk - jq < window)
    ctx_seen = (ctx_lens > 0)[:, None].expand(bs, blk)  # [bs, B]
    if window:  # the nearest context key (position ctx_len - 1) is 1 + j before block slot j
        ctx_seen = ctx_seen & (1 + torch.arange(blk)[None, :] < window)
    valid = torch.arange(blk)[None, :] < block_lens[:, None]
    return valid, vis.any(-1) | ctx_seen


ATTN_CASES = [
    AttnCase(2, 4, 4, 2, 12, 4),
    AttnCase(3, 2, 4, 4, 16, 16),
    AttnCase(3, 5, 6, 2, 10, 8),
    AttnCase(2, 7, 8, 1, 12, 1),  # one KV head for eight query heads; one-token pages
    AttnCase(2, 16, 4, 2, 24, 4),
    AttnCase(4, 3, 9, 3, 12, 4),  # G = 3: rows of a GQA group are not a power of two
    AttnCase(2, 13, 8, 2, 16, 4, strided_q=True),
    AttnCase(2, 8, 4, 2, 12, 4, causal=True),
    AttnCase(3, 6, 4, 2, 12, 4, causal=True, window=5),
    AttnCase(2, 16, 6, 3, 10, 8, causal=True, window=3),
    AttnCase(2, 9, 4, 2, 12, 4, causal=False, window=4),  # is_causal=False on a sliding layer
    AttnCase(2, 4, 4, 2, 12, 16, causal=False, window=1),
    AttnCase(2, 5, 4, 2, 16, 4, dtype=torch.float16),
    AttnCase(2, 12, 8, 4, 16, 8, causal=True, window=6, dtype=torch.float16),
]


# --- context KV injection ------------------------------------------------------------------------
@dataclass(frozen=True)
class CtxCase:
    n: int  # rows
    k: int  # target layers tapped
    hidden: int  # D
    layers: int  # L
    kv_heads: int
    head_dim: int
    bias: bool = False
    scaling: float = 1.0
    dtype: torch.dtype = torch.float32
    padding_rows: int = 0  # rows written to the padding page (slot 0): ignored

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (
            f"N{self.n}-K{self.k}-D{self.hidden}-L{self.layers}-Hkv{self.kv_heads}-d{self.head_dim}"
            f"{'-bias' if self.bias else ''}{'-scaled' if self.scaling != 1 else ''}-pad{self.padding_rows}-{dt}"
        )


PAGE = 4


def ctx_inputs(case: CtxCase, seed: int = 0) -> tuple[tuple, list[torch.Tensor], list[torch.Tensor]]:
    """(args without the pools, k_caches, v_caches) for dflash::inject_context."""
    from dflash_trt.plugins.context_kv import stack_kv_weights

    gen = torch.Generator().manual_seed(seed)
    n, dim, hkv, d, layers = case.n, case.hidden, case.kv_heads, case.head_dim, case.layers

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(case.dtype)

    slots_total = PAGE * (2 + (n + PAGE - 1) // PAGE) * 2
    features = randn(n, case.k * dim)
    positions = torch.randint(0, 5000, (n,), generator=gen)
    slots = torch.randperm(slots_total - PAGE, generator=gen)[:n] + PAGE  # never the padding page
    slots[: case.padding_rows] = torch.randint(0, PAGE, (case.padding_rows,), generator=gen)
    fc = randn(dim, case.k * dim, std=(case.k * dim) ** -0.5)
    hn = 1 + randn(dim, std=0.1)
    kw = [randn(hkv * d, dim, std=dim**-0.5) for _ in range(layers)]
    vw = [randn(hkv * d, dim, std=dim**-0.5) for _ in range(layers)]
    kb = [randn(hkv * d, std=0.1) if case.bias else None for _ in range(layers)]
    vb = [randn(hkv * d, std=0.1) if case.bias else None for _ in range(layers)]
    kv_weight, kv_bias = stack_kv_weights(kw, vw, kb, vb)
    kn = 1 + randn(layers, d, std=0.1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pools_k = [torch.zeros(slots_total, hkv, d, dtype=case.dtype) for _ in range(layers)]
    pools_v = [torch.zeros(slots_total, hkv, d, dtype=case.dtype) for _ in range(layers)]
    args = (features, positions, slots, fc, hn, kv_weight, kv_bias, kn, inv_freq, case.scaling, 1e-6)
    return args, pools_k, pools_v


CTX_CASES = [
    CtxCase(1, 1, 32, 1, 1, 16),
    CtxCase(5, 2, 48, 2, 2, 12),
    CtxCase(7, 3, 40, 3, 1, 10, bias=True, scaling=1.3),
    CtxCase(33, 2, 36, 2, 3, 12, padding_rows=5),
    CtxCase(6, 5, 24, 1, 2, 24, bias=True),
    CtxCase(9, 2, 32, 3, 2, 16, bias=True, dtype=torch.float16, padding_rows=2),
]


# --- acceptance -----------------------------------------------------------------------------------
def greedy_inputs(n: int, g: int, vocab: int, *, seed: int = 0, dtype=torch.float32, ties: bool = False):
    """(draft_tokens, target_logits, valid): drafts agree with the target's argmax most of
    the time, so accepted lengths spread over 0..g."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, g + 1, vocab, generator=gen)
    if ties:  # several maxima per row: argmax must pick the first
        logits = logits.round()
        top = logits.amax(-1, keepdim=True)
        cols = torch.randint(0, vocab, (n, g + 1, 3), generator=gen)
        logits.scatter_(-1, cols, top.expand(-1, -1, 3))
    logits = logits.to(dtype)
    post = logits.float().argmax(-1)  # [n, g + 1]
    random = torch.randint(0, vocab, (n, g), generator=gen)
    agree = torch.rand(n, g, generator=gen) < 0.85
    drafts = torch.where(agree, post[:, :g], random)
    valid = torch.arange(g)[None, :] < torch.randint(0, g + 1, (n, 1), generator=gen)
    valid[0] = True
    return drafts, logits, valid


def rejection_inputs(n: int, g: int, vocab: int, *, seed: int = 0, mode: str = "close"):
    """(draft_tokens, q, p, u_accept, u_emit, valid).

    mode: close (q near p: long accepted prefixes), topk (zeros in p and q: zero-probability tokens
    must never be drawn), onehot (greedy drafts: q one-hot), equal (q == p: the residual is empty
    after a rejection, so the draw falls back to p)."""
    gen = torch.Generator().manual_seed(seed)
    logits_p = torch.randn(n, g + 1, vocab, generator=gen) * 2
    logits_q = logits_p[:, :g] + 0.3 * torch.randn(n, g, vocab, generator=gen)
    if mode == "topk":
        keep = max(2, vocab // 4)
        for lg in (logits_p, logits_q):
            kth = lg.topk(keep, dim=-1).values[..., -1:]
            lg.masked_fill_(lg < kth, float("-inf"))
    p = torch.softmax(logits_p, -1)
    q = torch.softmax(logits_q, -1)
    if mode == "equal":
        q = p[:, :g].clone()
    if g > 0:
        drafts = torch.multinomial(q.reshape(n * g, vocab), 1, generator=gen).reshape(n, g)
    else:
        drafts = torch.zeros(n, 0, dtype=torch.int64)
    if mode == "onehot":
        drafts = p[:, :g].argmax(-1)
        q = torch.zeros(n, g, vocab).scatter_(-1, drafts[..., None], 1.0)
    u_accept = torch.rand(n, g, generator=gen)
    u_emit = torch.rand(n, g + 1, generator=gen)
    valid = torch.arange(g)[None, :] < torch.randint(0, g + 1, (n, 1), generator=gen)
    if n > 0:
        valid[0] = True
    return drafts, q, p, u_accept, u_emit, valid


# (n, g, vocab): g = block_size - 1 for block sizes 1..16; odd vocabularies; several argmax splits
ACCEPT_SHAPES = [(1, 1, 13), (3, 4, 61), (5, 0, 61), (4, 7, 701), (2, 15, 97), (6, 3, 1000), (3, 12, 257)]
