# SPDX-License-Identifier: Apache-2.0
"""`dflash::tree_attention`: the target's attention for DDTree verification, per layer.

Contract (bs sequences, T tree nodes each, node 0 the root at position ctx_len; spec/tree.py):
  q          [bs, T, H, d]    queries of the nodes (q_norm'ed and rotated at ctx_len + depth)
  k_tree     [bs, T, Hkv, d]  the nodes' own keys (rotated), v_tree likewise
  k_cache    [S, Hkv, d]      one layer's paged pool (v_cache likewise)
  ctx_index  [bs, Lc] int64   slot of context position p in column p (kv_cache.context_index)
  ctx_lens   [bs] int64       context keys of each sequence (= start, the root's position)
  depths     [bs, T] int64    node depth (position = ctx_len + depth)
  tree_mask  [bs, T, T] bool  [i, j] = node i sees node j (its ancestors and itself)
  window     int              sliding window (0 = none); sinks [H] float32 | None (gpt-oss)
  -> [bs, T, H, d]
Visibility: node i sees context key p < ctx_len iff (window w) ctx_len + depth_i - p < w, and node
j iff tree_mask[i, j] and (window) depth_i - depth_j < w. With sinks, softmax gets one more term
exp(sink_h) with a zero value (a learned per-head logit, as in `models/decoder.py`). Every row must
see at least itself (the tree mask's diagonal); rows of padding nodes are computed and ignored.

It is the math of `NativeTarget` with a `block_mask` (write the nodes' K/V into the pool, gather
[context ; nodes], SDPA under the ancestor mask), without the gather: the context is read through
`ctx_index` and the nodes' K/V come straight from the projections (the engine still writes them to
the pool for the commit's compaction).

Kernel: flash-decoding over the paged pool. A program owns one (sequence, KV head, tile of
BLOCK_M query rows, context split); a row is (node, query head of the KV head's group), so GQA
costs no extra K/V reads and trees of up to hundreds of nodes tile over the grid. Online softmax in
fp32 (exp2 domain); the last split also walks the T tree keys in tiles, masked by `tree_mask`.
With several splits a second kernel merges the partial (max, sum, acc) rows and adds the sink.
"""

from __future__ import annotations

import math

import torch

from dflash_trt.layers.attention import attend_paged
from dflash_trt.plugins import _registry as reg
from dflash_trt.plugins._registry import jit, tl

OP = "tree_attention"
DEFAULT_BLOCK_N = 64  # context keys per tile (untuned)
MAX_BLOCK_M = 64  # query rows per program
MAX_BLOCK_T = 64  # tree keys per tile
MAX_SPLITS = 64


# --- the PyTorch reference ---------------------------------------------------------------------
def tree_attention_reference(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_index: torch.Tensor,
    ctx_lens: torch.Tensor,
    depths: torch.Tensor,
    tree_mask: torch.Tensor,
    window: int,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Shapes as in the module docstring. Returns a fresh contiguous [bs, T, H, d]."""
    bs, t = q.shape[:2]
    lc = ctx_index.shape[1]
    dev = q.device
    q_pos = ctx_lens[:, None] + depths  # [bs, T]
    ctx_pos = torch.arange(lc, device=dev).expand(bs, lc)
    ctx_vis = (ctx_pos < ctx_lens[:, None])[:, None, :].expand(bs, t, lc)  # [bs, T, Lc]
    tree_vis = tree_mask
    if window > 0:
        ctx_vis = ctx_vis & (q_pos[:, :, None] - ctx_pos[:, None, :] < window)
        tree_vis = tree_vis & (depths[:, :, None] - depths[:, None, :] < window)
    mask = torch.cat([ctx_vis, tree_vis], dim=2)[:, None]  # [bs, 1, T, Lc + T]
    out = attend_paged(
        q, k_cache, v_cache, ctx_index, mask, scale=scale, sinks=sinks, k_new=k_tree, v_new=v_tree
    )
    return out.contiguous()


# --- Triton kernels ---------------------------------------------------------------------------
@jit
def _online_update(m_i, l_i, acc, s, v, IEEE: tl.constexpr):
    """One online-softmax step: scores s [M, N] (exp2 domain, -inf hidden) over values v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l_i, acc


@jit
def _scores(q, k, qk_scale, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    return tl.dot(q, tl.trans(k)) * qk_scale


@jit
def _finish(m_i, l_i, acc, sink, HAS_SINKS: tl.constexpr):
    """acc / l, with the sink's exp2(sink) term added to the denominator (sink in the exp2 domain)."""
    if HAS_SINKS:
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@jit
def _tree_attn_kernel(
    q_ptr, kt_ptr, vt_ptr, kc_ptr, vc_ptr, idx_ptr, ctx_lens_ptr, depth_ptr, mask_ptr, sinks_ptr,
    out_ptr, part_ptr,  # part: [bs, Hkv * M_TILES, NUM_SPLITS, BLOCK_M, BLOCK_D + 2] fp32 (split mode)
    sq0, sq1, sq2, skt0, skt1, skt2, svt0, svt1, svt2, skc0, skc1, svc0, svc1, sidx0,
    sd0, sm0, sm1, so0, so1, so2,
    lc, qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, M_TILES: tl.constexpr, WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    kvh = tl.program_id(1) // M_TILES
    tile = tl.program_id(1) % M_TILES
    split = tl.program_id(2)
    ctx_len = tl.load(ctx_lens_ptr + i)

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # rows: r = node * G + g
    row_ok = r < T * G
    node = tl.where(row_ok, r // G, 0)
    head = kvh * G + r % G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(
        q_ptr + i * sq0 + node[:, None] * sq1 + head[:, None] * sq2 + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    depth = tl.load(depth_ptr + i * sd0 + node)  # [BLOCK_M]
    q_pos = ctx_len + depth

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # context keys [lo, hi): the root (depth 0) has the widest window, deeper rows mask further
    hi = tl.minimum(ctx_len, lc)
    lo = hi * 0
    if WINDOW > 0:
        lo = tl.maximum(ctx_len - WINDOW + 1, 0)
    lo = tl.minimum(lo, hi)
    chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo_s = tl.minimum(lo + split * chunk, hi)
    hi_s = tl.minimum(lo_s + chunk, hi)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo_s, hi_s, BLOCK_N):
        p = start + offs_n
        p_ok = p < hi_s
        slot = tl.load(idx_ptr + i * sidx0 + p, mask=p_ok, other=0)
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + slot[:, None] * skc0 + kvh * skc1 + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + slot[:, None] * svc0 + kvh * svc1 + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, qk_scale, IEEE)  # [BLOCK_M, BLOCK_N]
        vis = p_ok[None, :] & row_ok[:, None]
        if WINDOW > 0:
            vis = vis & (q_pos[:, None] - p[None, :] < WINDOW)
        m_i, l_i, acc = _online_update(m_i, l_i, acc, tl.where(vis, s, float("-inf")), v, IEEE)

    if split == NUM_SPLITS - 1:  # the tree's own keys, once per row tile
        for t0 in range(0, T, BLOCK_T):
            jk = t0 + tl.arange(0, BLOCK_T)
            k_ok = jk < T
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(
                kt_ptr + i * skt0 + jk[:, None] * skt1 + kvh * skt2 + offs_d[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                vt_ptr + i * svt0 + jk[:, None] * svt1 + kvh * svt2 + offs_d[None, :], mask=kv_mask, other=0.0
            )
            s = _scores(q, k, qk_scale, IEEE)  # [BLOCK_M, BLOCK_T]
            pair_ok = row_ok[:, None] & k_ok[None, :]
            seen = tl.load(mask_ptr + i * sm0 + node[:, None] * sm1 + jk[None, :], mask=pair_ok, other=0) != 0
            if WINDOW > 0:
                k_depth = tl.load(depth_ptr + i * sd0 + jk, mask=k_ok, other=0)
                seen = seen & (depth[:, None] - k_depth[None, :] < WINDOW)
            m_i, l_i, acc = _online_update(m_i, l_i, acc, tl.where(pair_ok & seen, s, float("-inf")), v, IEEE)

    if NUM_SPLITS == 1:
        sink = 0.0
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # exp2 domain
        out = _finish(m_i, l_i, acc, sink, HAS_SINKS)
        o_ptrs = out_ptr + i * so0 + node[:, None] * so1 + head[:, None] * so2 + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        W = BLOCK_D + 2
        offs_m = tl.arange(0, BLOCK_M)
        base = part_ptr + ((i * tl.num_programs(1) + tl.program_id(1)) * NUM_SPLITS + split) * BLOCK_M * W
        tl.store(base + offs_m[:, None] * W + offs_d[None, :], acc)
        tl.store(base + offs_m * W + BLOCK_D, m_i)
        tl.store(base + offs_m * W + BLOCK_D + 1, l_i)


@jit
def _merge_kernel(
    part_ptr, sinks_ptr, out_ptr, so0, so1, so2,
    T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, M_TILES: tl.constexpr, HAS_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    kvh = tl.program_id(1) // M_TILES
    tile = tl.program_id(1) % M_TILES
    W = BLOCK_D + 2
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    base = part_ptr + (i * tl.num_programs(1) + tl.program_id(1)) * NUM_SPLITS * BLOCK_M * W
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(base + s * BLOCK_M * W + offs_m * W + BLOCK_D))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        blk = base + s * BLOCK_M * W
        w = tl.exp2(tl.load(blk + offs_m * W + BLOCK_D) - m_safe)  # an empty split weighs 0
        l_sum += w * tl.load(blk + offs_m * W + BLOCK_D + 1)
        acc += w[:, None] * tl.load(blk + offs_m[:, None] * W + offs_d[None, :])
    r = tile * BLOCK_M + offs_m
    row_ok = r < T * G
    node = tl.where(row_ok, r // G, 0)
    head = kvh * G + r % G
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    out = _finish(m_safe, l_sum, acc, sink, HAS_SINKS)
    o_ptrs = out_ptr + i * so0 + node[:, None] * so1 + head[:, None] * so2 + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < D)[None, :])


def choose_num_splits(*, programs: int, span: int, block_n: int, device: torch.device) -> int:
    """Split the context walk until there are about two programs per SM (a static function of the
    shapes, so a captured CUDA graph keeps its launch geometry)."""
    want = math.ceil(2 * reg.sm_count(device) / max(1, programs))
    return max(1, min(want, math.ceil(max(1, span) / block_n), MAX_SPLITS))


def _check_inputs(q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, window, sinks):
    bs, t, h, d = q.shape
    hkv = k_tree.shape[2]
    chk = reg.check
    chk(q.dim() == 4 and k_tree.dim() == 4 and v_tree.dim() == 4, OP, "q/k_tree/v_tree must be 4-D")
    chk(k_tree.shape == (bs, t, hkv, d) and v_tree.shape == k_tree.shape, OP, "k/v_tree shape")
    chk(hkv > 0 and h % hkv == 0, OP, f"H={h} must be a multiple of Hkv={hkv}")
    chk(k_cache.dim() == 3 and k_cache.shape[1:] == (hkv, d) and v_cache.shape == k_cache.shape, OP, "pools")
    chk(k_cache.stride(2) == 1 and v_cache.stride(2) == 1, OP, "pools need unit stride in head_dim")
    for x, name in ((q, "q"), (k_tree, "k_tree"), (v_tree, "v_tree")):
        chk(x.stride(3) == 1, OP, f"{name} needs unit stride in head_dim")
        chk(x.dtype == q.dtype, OP, f"{name} dtype {x.dtype} != q dtype {q.dtype}")
    chk(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, OP, "pools must have q's dtype")
    chk(reg.float_dtype_ok(q), OP, f"unsupported dtype {q.dtype}")
    chk(ctx_index.dim() == 2 and ctx_index.shape[0] == bs and ctx_index.dtype == torch.int64, OP, "ctx_index")
    chk(ctx_index.stride(1) == 1 or ctx_index.shape[1] <= 1, OP, "ctx_index needs unit stride in columns")
    chk(ctx_lens.shape == (bs,) and ctx_lens.dtype == torch.int64, OP, "ctx_lens must be [bs] int64")
    chk(depths.shape == (bs, t) and depths.dtype == torch.int64, OP, "depths must be [bs, T] int64")
    chk(depths.stride(1) == 1 or t <= 1, OP, "depths needs unit column stride")
    chk(
        tree_mask.shape == (bs, t, t) and tree_mask.dtype == torch.bool,
        OP,
        "tree_mask must be [bs, T, T] bool",
    )
    chk(tree_mask.stride(2) == 1 or t <= 1, OP, "tree_mask needs unit column stride")
    chk(window >= 0, OP, f"window={window} must be >= 0 (0 = none)")
    chk(sinks is None or (sinks.shape == (h,) and sinks.is_contiguous()), OP, "sinks must be [H] contiguous")
    reg.check_same_device(
        OP, q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, sinks
    )


def launch_tree_attention(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_index: torch.Tensor,
    ctx_lens: torch.Tensor,
    depths: torch.Tensor,
    tree_mask: torch.Tensor,
    window: int,
    scale: float,
    sinks: torch.Tensor | None,
    *,
    num_splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """The Triton path. num_splits None picks `choose_num_splits`; tests force 1, 2, 3..."""
    reg.require_triton(OP)
    _check_inputs(q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, window, sinks)
    bs, t, h, d = q.shape
    hkv = k_tree.shape[2]
    out = torch.empty(bs, t, h, d, dtype=q.dtype, device=q.device)
    if bs == 0 or t == 0:
        return out
    g = h // hkv
    block_m = min(reg.block(t * g), MAX_BLOCK_M)
    m_tiles = math.ceil(t * g / block_m)
    block_d = reg.block(d)
    lc = ctx_index.shape[1]
    span = min(lc, window) if window > 0 else lc
    splits = num_splits or choose_num_splits(
        programs=bs * hkv * m_tiles, span=span, block_n=block_n, device=q.device
    )
    part = (
        torch.empty(bs, hkv * m_tiles, splits, block_m, block_d + 2, dtype=torch.float32, device=q.device)
        if splits > 1
        else out  # unused in single-split mode
    )
    sink_arg = sinks if sinks is not None else out  # never read without HAS_SINKS
    common = dict(
        T=t, G=g, D=d, M_TILES=m_tiles, HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_D=block_d
    )
    _tree_attn_kernel[(bs, hkv * m_tiles, splits)](
        q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, sink_arg, out, part,
        q.stride(0), q.stride(1), q.stride(2),
        k_tree.stride(0), k_tree.stride(1), k_tree.stride(2),
        v_tree.stride(0), v_tree.stride(1), v_tree.stride(2),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ctx_index.stride(0), depths.stride(0), tree_mask.stride(0), tree_mask.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lc, scale * math.log2(math.e),
        WINDOW=int(window), NUM_SPLITS=splits, BLOCK_N=block_n, BLOCK_T=min(reg.block(t), MAX_BLOCK_T),
        IEEE=q.dtype == torch.float32, **common,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(bs, hkv * m_tiles)](
            part, sink_arg, out, out.stride(0), out.stride(1), out.stride(2), NUM_SPLITS=splits, **common
        )
    return out


# --- the custom op -----------------------------------------------------------------------------
@torch.library.custom_op("dflash::tree_attention", mutates_args=())
def tree_attention(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_index: torch.Tensor,
    ctx_lens: torch.Tensor,
    depths: torch.Tensor,
    tree_mask: torch.Tensor,
    window: int,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Default (CPU) implementation: the reference; the Triton kernel under the interpreter switch."""
    args = (q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, window, scale, sinks)
    if reg.triton_on_cpu():
        return launch_tree_attention(*args)
    return tree_attention_reference(*args)


@tree_attention.register_kernel("cuda")
def _tree_attention_cuda(
    q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, window, scale, sinks
):
    return launch_tree_attention(
        q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, window, scale, sinks
    )


@tree_attention.register_fake
def _tree_attention_fake(
    q, k_tree, v_tree, k_cache, v_cache, ctx_index, ctx_lens, depths, tree_mask, window, scale, sinks
):
    return q.new_empty(q.shape)
