# SPDX-License-Identifier: Apache-2.0
"""`dflash::inject_context`: KV injection of newly committed tokens into the drafter's context cache.

Contract (N new context rows from any number of sequences; L draft layers; D hidden; Hkv heads of d):
  features           [N, K * D]        target layer outputs of the committed tokens
  positions          [N] int64         absolute positions (RoPE)
  slots              [N] int64         cache slots (rows to ignore point at the padding page 0)
  fc_weight          [D, K * D]        drafter fc (no bias)
  hidden_norm_weight [D]
  kv_weight          [L * 2 * Hkv * d, D]  per layer l: rows [2l*Hkv*d, (2l+1)*Hkv*d) = k_proj_l,
                                            then v_proj_l (see `stack_kv_weights`)
  kv_bias            [L * 2 * Hkv * d] or None  (attention_bias drafters)
  k_norm_weight      [L, d]
  inv_freq           [d / 2] float32   RotaryEmbedding.inv_freq
  attention_scaling  float             multiplies cos and sin (yarn)
  eps                float             rms_norm_eps (hidden_norm and k_norm)
  k_caches, v_caches L pools [S, Hkv, d], written in place at `slots`
The math is the drafter's: c = hidden_norm(fc(features)); per layer k = RoPE(k_norm(k_proj c)),
v = v_proj c; cache[slot] = (k, v).

Fusion boundary (CUDA): 3 + L launches and no host synchronisation, against roughly 12 + 20 L
small launches in eager PyTorch:
  1. fc GEMM                                       (torch / cuBLAS)
  2. hidden RMSNorm                                (Triton, a tile of rows per program)
  3. one GEMM for every layer's k_proj and v_proj  (torch / cuBLAS, on the stacked weight, + bias)
  4. per layer: k_norm + RoPE (cos/sin from inv_freq in-kernel) + scatter of K and V into the
     paged pools                                   (Triton, one launch per layer; a program takes a
                                                    tile of (token, KV head) rows)
The GEMMs stay with cuBLAS on purpose: at decode sizes this op is dominated by reading fc_weight
(K * D * D elements) and kv_weight, which a GEMM library already streams at bandwidth. The epilogue
rounds to the model dtype at the points where the reference does (after k_norm's normalisation,
after the weight, cos/sin, each RoPE product and the sum), so bf16 results stay within an ulp.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from dflash_trt.layers.rope import apply_rope
from dflash_trt.plugins import _registry as reg
from dflash_trt.plugins._registry import jit, tl

OP = "inject_context"


def stack_kv_weights(
    k_weights: list[torch.Tensor],
    v_weights: list[torch.Tensor],
    k_biases: list[torch.Tensor | None],
    v_biases: list[torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-layer k_proj/v_proj weights [Hkv*d, D] (and biases) -> kv_weight [L*2*Hkv*d, D], kv_bias."""
    weight = torch.cat([w for pair in zip(k_weights, v_weights) for w in pair], dim=0)
    if all(b is None for b in (*k_biases, *v_biases)):
        return weight, None
    parts = []
    for kw, vw, kb, vb in zip(k_weights, v_weights, k_biases, v_biases):
        parts.append(kb if kb is not None else kw.new_zeros(kw.shape[0]))
        parts.append(vb if vb is not None else vw.new_zeros(vw.shape[0]))
    return weight, torch.cat(parts)


# --- the PyTorch reference: exactly DFlashDrafter.inject_context ---------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """engine.layers.RMSNorm: variance in fp32, the weight applied in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.rope.RotaryEmbedding.forward: positions [N] -> cos, sin [N, d] in dtype."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [N, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def inject_context_reference(
    features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    fc_weight: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    eps: float,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
) -> None:
    if features.shape[0] == 0:
        return
    c = _rms_norm(F.linear(features.to(fc_weight.dtype), fc_weight), hidden_norm_weight, eps)  # [N, D]
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling, c.dtype)  # [N, d]
    num_layers = len(k_caches)
    hkv, d = k_caches[0].shape[1:]
    width = hkv * d
    for layer in range(num_layers):
        kr = slice(2 * layer * width, (2 * layer + 1) * width)
        vr = slice((2 * layer + 1) * width, (2 * layer + 2) * width)
        k = F.linear(c, kv_weight[kr], None if kv_bias is None else kv_bias[kr]).unflatten(-1, (hkv, d))
        v = F.linear(c, kv_weight[vr], None if kv_bias is None else kv_bias[vr]).unflatten(-1, (hkv, d))
        k = apply_rope(_rms_norm(k, k_norm_weight[layer], eps), cos, sin)  # [N, Hkv, d]
        k_caches[layer].index_copy_(0, slots, k.to(k_caches[layer].dtype))
        v_caches[layer].index_copy_(0, slots, v.to(v_caches[layer].dtype))


# --- Triton kernels ---------------------------------------------------------------------------
@jit
def _rms_norm_rows_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, sx0, so0, dim, eps, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (offs < dim)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx0 + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / dim + eps)  # [BLOCK_R]
    dt = out_ptr.dtype.element_ty
    h = (x * rstd[:, None]).to(dt).to(tl.float32)  # RMSNorm casts back before the weight
    w = tl.load(w_ptr + offs, mask=offs < dim, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * so0 + offs[None, :], (w[None, :] * h).to(dt), mask=ok)


@jit
def _kv_epilogue_kernel(
    kv_ptr,  # [N, L * 2 * Hkv * d] projections (bias included)
    pos_ptr,
    slot_ptr,
    knw_ptr,  # [d] this layer's k_norm weight
    inv_freq_ptr,
    k_cache_ptr,
    v_cache_ptr,
    n_heads,  # N * Hkv (token, head) rows
    skv0,
    sk0,
    sk1,
    sv0,
    sv1,
    k_col,  # first column of this layer's K block in kv
    attention_scaling,
    eps,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one tile row per (token n, KV head h): m = n * HKV + h
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < n_heads
    n = m // HKV
    head = m % HKV
    half = D // 2
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    mask = m_ok[:, None] & d_ok[None, :]
    dt = k_cache_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + n, mask=m_ok, other=0)  # [BLOCK_M]
    pos = tl.load(pos_ptr + n, mask=m_ok, other=0).to(tl.float32)

    row = kv_ptr + n[:, None] * skv0 + k_col + head[:, None] * D  # this layer's K head
    # rotate_half partner: x[i + d/2] (negated) for i < d/2, x[i - d/2] after
    rot = tl.where(offs_d < half, offs_d + half, offs_d - half)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    k = tl.load(row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    k_rot = tl.load(row + rot[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(k * k, 1) / D + eps)  # [BLOCK_M]; the partner row has the same norm
    w = tl.load(knw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    w_rot = tl.load(knw_ptr + rot, mask=d_ok, other=0.0).to(tl.float32)
    kn = (w[None, :] * (k * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    kn_rot = (w_rot[None, :] * (k_rot * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)

    freq = pos[:, None] * tl.load(inv_freq_ptr + offs_d % half, mask=d_ok, other=0.0)[None, :]
    cos = (tl.cos(freq) * attention_scaling).to(dt).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    sin = (tl.sin(freq) * attention_scaling).to(dt).to(tl.float32)
    a = (kn * cos).to(dt).to(tl.float32)
    b = ((sign[None, :] * kn_rot) * sin).to(dt).to(tl.float32)
    k_out = (a + b).to(dt)
    tl.store(k_cache_ptr + slot[:, None] * sk0 + head[:, None] * sk1 + offs_d[None, :], k_out, mask=mask)

    v = tl.load(row + HKV * D + offs_d[None, :], mask=mask, other=0.0)  # V follows K in kv
    tl.store(v_cache_ptr + slot[:, None] * sv0 + head[:, None] * sv1 + offs_d[None, :], v.to(dt), mask=mask)


TILE_ELEMS = 4096  # elements per program of the row-wise kernels (untuned)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_launch(
    features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    fc_weight: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
) -> None:
    """Shapes, dtypes, strides and devices the kernels assume (a violation is an error, not garbage)."""
    chk = reg.check
    n = features.shape[0]
    num_layers = len(k_caches)
    chk(num_layers > 0 and len(v_caches) == num_layers, OP, "need one K and one V pool per layer")
    hkv, d = k_caches[0].shape[1:]
    dim = fc_weight.shape[0]
    chk(
        features.dim() == 2 and fc_weight.shape == (dim, features.shape[1]),
        OP,
        "features [N, K*D] vs fc_weight [D, K*D]",
    )
    chk(positions.shape == (n,) and slots.shape == (n,), OP, "positions and slots must be [N]")
    chk(positions.dtype == torch.int64 and slots.dtype == torch.int64, OP, "positions/slots must be int64")
    chk(hidden_norm_weight.shape == (dim,), OP, "hidden_norm_weight must be [D]")
    chk(
        kv_weight.shape == (num_layers * 2 * hkv * d, dim),
        OP,
        f"kv_weight must be [L*2*Hkv*d, D], got {tuple(kv_weight.shape)}",
    )
    chk(kv_bias is None or kv_bias.shape == (kv_weight.shape[0],), OP, "kv_bias must be [L*2*Hkv*d]")
    chk(k_norm_weight.shape == (num_layers, d), OP, "k_norm_weight must be [L, d]")
    chk(
        d % 2 == 0 and inv_freq.shape == (d // 2,) and inv_freq.dtype == torch.float32,
        OP,
        "inv_freq [d/2] float32",
    )
    chk(reg.float_dtype_ok(fc_weight), OP, f"unsupported dtype {fc_weight.dtype}")
    for kc, vc in zip(k_caches, v_caches):
        chk(kc.shape == (kc.shape[0], hkv, d) and vc.shape == kc.shape, OP, "every pool must be [S, Hkv, d]")
        chk(kc.stride(2) == 1 and vc.stride(2) == 1, OP, "pools need unit stride in head_dim")
        chk(
            kc.dtype == fc_weight.dtype and vc.dtype == fc_weight.dtype,
            OP,
            "pools must have the weights' dtype",
        )
    reg.check_same_device(
        OP, features, positions, slots, fc_weight, kv_weight, inv_freq, *k_caches, *v_caches
    )


def launch_inject_context(
    features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    fc_weight: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    eps: float,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
) -> None:
    reg.require_triton(OP)
    _check_launch(features, positions, slots, fc_weight, hidden_norm_weight, kv_weight, kv_bias, k_norm_weight,
                  inv_freq, k_caches, v_caches)  # fmt: skip
    n, num_layers, dim = features.shape[0], len(k_caches), fc_weight.shape[0]
    hkv, d = k_caches[0].shape[1:]
    if n == 0:
        return
    dtype = fc_weight.dtype
    x = F.linear(features.to(dtype), fc_weight)  # [N, D]
    c = torch.empty_like(x)
    block_d = reg.next_pow2(dim)
    block_r = max(1, TILE_ELEMS // block_d)
    _rms_norm_rows_kernel[(_cdiv(n, block_r),)](
        x, hidden_norm_weight, c, n, x.stride(0), c.stride(0), dim, eps, BLOCK_R=block_r, BLOCK=block_d
    )
    kv = F.linear(c, kv_weight, kv_bias)  # [N, L * 2 * Hkv * d], contiguous
    block_d = reg.next_pow2(d)
    block_m = max(1, TILE_ELEMS // block_d)
    for layer in range(num_layers):
        kc, vc = k_caches[layer], v_caches[layer]
        _kv_epilogue_kernel[(_cdiv(n * hkv, block_m),)](
            kv, positions, slots, k_norm_weight[layer], inv_freq, kc, vc, n * hkv,
            kv.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            2 * layer * hkv * d, float(attention_scaling), float(eps),
            HKV=hkv, D=d, BLOCK_M=block_m, BLOCK_D=block_d,
        )  # fmt: skip


# --- the custom op -----------------------------------------------------------------------------
@torch.library.custom_op("dflash::inject_context", mutates_args=("k_caches", "v_caches"))
def inject_context(
    features: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    fc_weight: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    eps: float,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
) -> None:
    """Default (CPU) implementation: the reference; the Triton kernels under the interpreter switch."""
    args = (
        features, positions, slots, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
        k_norm_weight, inv_freq, attention_scaling, eps, k_caches, v_caches,
    )  # fmt: skip
    if reg.triton_on_cpu():
        launch_inject_context(*args)
    else:
        inject_context_reference(*args)


@inject_context.register_kernel("cuda")
def _inject_context_cuda(
    features, positions, slots, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
    k_norm_weight, inv_freq, attention_scaling, eps, k_caches, v_caches,
):  # fmt: skip
    launch_inject_context(
        features, positions, slots, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
        k_norm_weight, inv_freq, attention_scaling, eps, k_caches, v_caches,
    )  # fmt: skip


@inject_context.register_fake
def _inject_context_fake(
    features, positions, slots, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
    k_norm_weight, inv_freq, attention_scaling, eps, k_caches, v_caches,
):  # fmt: skip
    return None
