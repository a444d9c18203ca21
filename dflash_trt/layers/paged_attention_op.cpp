// SPDX-License-Identifier: Apache-2.0
// Attention of a few query rows over a paged KV pool, read in place: the torch operator
//   dflash_cpu::paged_attention(q, k_pool, v_pool, ctx_index, k_new, v_new, mask, scale) -> out
// q [bs, T, H, d]; k_pool, v_pool [S, Hkv, d] (one layer's pool); ctx_index [bs, Lc] int64: the pool slot
// of each sequence's context column; k_new, v_new [bs, B, Hkv, d] or None: keys after the context (the
// drafter's block, never written to the pool); mask bool [bs, 1, T or 1, Lc + B] (any strides; True =
// visible). Query head h reads KV head h / (H / Hkv). out [bs, T, H, d], contiguous, q's dtype.
//
// Why: a decode step or a DFlash block has 1-32 query rows per sequence. The general path first copies
// every context key and value into a [bs, Hkv, Lc, d] tensor (twice per layer) and then runs SDPA on it;
// at a batch of 16 that copy is most of the attention's time. Here each key is read once from its slot,
// for all the query heads that share it, and the output is written token-major, as o_proj reads it.
//
// Numerics: fp32 throughout (bf16 inputs are widened exactly); each score is one multiply-add chain
// over the head dimension in order; keys in column order in tiles of 32, an online softmax per query
// row. A row's result depends only on its own sequence (batch invariance), not on the batch around it.
// A row that sees no key gets zeros (SDPA would give NaN).
// Built by dflash_trt/layers/cpu_attention.py (g++, torch's headers and libraries).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "spin_team.h"

namespace {

constexpr int TILE = 32;  // keys per tile

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
struct Args {
  const T *q, *k_pool, *v_pool, *k_new, *v_new;
  const int64_t *ctx;
  const bool *mask;
  T *out;
  long bs, t, h, hkv, d, lc, b, s;
  long m_b, m_t, m_j;  // mask strides (m_t = 0 for a mask shared by every query row)
  float scale;
};

// 16 lanes in GCC's vector extension: one AVX-512 register, or two AVX2 ones (the build's -m flags).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint8_t vb16 __attribute__((vector_size(16)));

inline vf16 load16(const float *p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf16 load16(const at::BFloat16 *p) {  // widened exactly: the bf16 bits are a float's top half
  vh16 h;
  std::memcpy(&h, p, sizeof h);
  const vu16 u = __builtin_convertvector(h, vu16) << 16;
  vf16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store16(float *p, vf16 v) { std::memcpy(p, &v, sizeof v); }

// What one (sequence, KV head) carries across its key tiles (see attend_group).
template <typename T>
struct Group {
  const float *qf;    // [rows, d] the scaled queries
  const float *kt;    // [d, TILE] the tile's keys, key-minor
  const T *const *vp; // [TILE] the tile's values
  const bool *mask;   // this sequence's mask; row i at i * m_t, column j at j * m_j
  float *acc, *m, *l; // [rows, d] unnormalised outputs; [rows] running maximum and sum
  long d, t, m_t, m_j;
};

// exp(x) of 16 lanes for x <= 0 (a score minus its row's running maximum; -inf for a hidden key):
// 2^n * P(r) with n = round(x / ln 2), r = x - n ln 2 in two parts, P Cephes' degree-6 polynomial for
// expf (relative error ~1e-7, as torch's vectorised exp); below -87 it is 0.
inline vf16 exp16(vf16 x) {
  const vf16 lo = x < -87.f ? vf16{} - 87.f : x;
  const vf16 n = (lo * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const vf16 r = (lo - n * 0.693359375f) + n * 2.12194440e-4f;
  vf16 poly = vf16{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? vf16{} : poly * scale;
}

// Horizontal max and sum of 16 lanes: four folds of the vector onto itself (shuffles, no stores).
inline vf16 fold(vf16 v, int step) {
  switch (step) {
    case 8: return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    case 4: return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    case 2: return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    default: return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  }
}

inline float hmax(vf16 v) {
  for (int step = 8; step >= 1; step /= 2) {
    const vf16 w = fold(v, step);
    v = v > w ? v : w;
  }
  return v[0];
}

inline float hsum(vf16 v) {
  for (int step = 8; step >= 1; step /= 2) v += fold(v, step);
  return v[0];
}

// The tile's visibility for one row as two 16-lane masks (-1 = visible), keys past n hidden.
inline void visible(const bool *vis, long m_j, long n, vi16 &v0, vi16 &v1) {
  uint8_t bytes[TILE];
  if (m_j == 1 && n == TILE) {
    std::memcpy(bytes, vis, TILE);
  } else {
    for (long jj = 0; jj < TILE; jj++) bytes[jj] = jj < n && vis[jj * m_j];
  }
  vb16 b0, b1;
  std::memcpy(&b0, bytes, 16);
  std::memcpy(&b1, bytes + 16, 16);
  v0 = __builtin_convertvector(b0, vi16) != 0;
  v1 = __builtin_convertvector(b1, vi16) != 0;
}

// Rows r0 .. r0 + RB - 1 against the tile of keys j0 .. j0 + n - 1: RB rows at a time share each load
// of a key or a value (independent FMA chains: the block is not bound by one chain's latency).
template <int RB, typename T>
void row_block(const Group<T> &gp, long r0, long j0, long n) {
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  const long d = gp.d;
  vf16 s0[RB] = {}, s1[RB] = {};
  for (long x = 0; x < d; x++) {
    const vf16 k0 = load16(gp.kt + x * TILE), k1 = load16(gp.kt + x * TILE + 16);
    for (int b = 0; b < RB; b++) {
      const float qx = gp.qf[(r0 + b) * d + x];
      s0[b] += qx * k0;
      s1[b] += qx * k1;
    }
  }
  alignas(64) float p[RB][TILE];
  float keep[RB];
  bool any = false;
  for (int b = 0; b < RB; b++) {
    const long r = r0 + b;
    vi16 v0, v1;
    visible(gp.mask + (r % gp.t) * gp.m_t + j0 * gp.m_j, gp.m_j, n, v0, v1);
    const vf16 neg = vf16{} + NEG;
    const vf16 a0 = v0 ? s0[b] : neg, a1 = v1 ? s1[b] : neg;
    const float top = hmax(a0 > a1 ? a0 : a1);
    if (top == NEG) {  // nothing visible to this row in this tile: it keeps its state
      keep[b] = 1.f;
      store16(p[b], vf16{});
      store16(p[b] + 16, vf16{});
      continue;
    }
    any = true;
    const float m_new = gp.m[r] > top ? gp.m[r] : top;
    keep[b] = std::exp(gp.m[r] - m_new);  // 0 on the row's first visible tile
    const vf16 p0 = exp16(a0 - m_new), p1 = exp16(a1 - m_new);  // hidden keys: exp(-inf) = 0
    store16(p[b], p0);
    store16(p[b] + 16, p1);
    gp.l[r] = gp.l[r] * keep[b] + hsum(p0 + p1);
    gp.m[r] = m_new;
  }
  if (!any) return;
  long x = 0;
  for (; x + 16 <= d; x += 16) {  // 16 output values per row in registers across the tile's keys
    vf16 o[RB];
    for (int b = 0; b < RB; b++) o[b] = load16(gp.acc + (r0 + b) * d + x) * keep[b];
    for (long jj = 0; jj < n; jj++) {
      const vf16 v = load16(gp.vp[jj] + x);
      for (int b = 0; b < RB; b++) o[b] += p[b][jj] * v;
    }
    for (int b = 0; b < RB; b++) store16(gp.acc + (r0 + b) * d + x, o[b]);
  }
  for (; x < d; x++) {
    for (int b = 0; b < RB; b++) {
      float o = gp.acc[(r0 + b) * d + x] * keep[b];
      for (long jj = 0; jj < n; jj++) o += p[b][jj] * widen(gp.vp[jj][x]);
      gp.acc[(r0 + b) * d + x] = o;
    }
  }
}

// Stage `s` of a 16 x 16 transpose in registers (rows a = i and b = i + s, i & s == 0): the row pair with
// its off-diagonal s x s blocks swapped. Stages 8, 4, 2, 1 in turn transpose the whole block.
inline vf16 swap_blocks(vf16 a, vf16 b, int s, bool hi) {
  switch (s) {
    case 8: return hi ? __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
                   : __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    case 4: return hi ? __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31)
                   : __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    case 2: return hi ? __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)
                   : __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    default: return hi ? __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31)
                   : __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
  }
}

// kt's rows x0 .. x0 + 15, keys k0 .. k0 + 15, from those keys' dimensions x0 .. x0 + 15: sixteen loads, a
// transpose in registers (64 shuffles) and sixteen stores, where element by element it takes 256 scalar
// loads and stores.
template <typename T>
void transpose_block(const T *const *kp, long k0, long x0, float *kt) {
  vf16 r[16];
  for (int i = 0; i < 16; i++) r[i] = load16(kp[k0 + i] + x0);
  for (int s = 8; s >= 1; s /= 2)
    for (int i = 0; i < 16; i++)
      if ((i & s) == 0) {
        const vf16 a = r[i], b = r[i + s];
        r[i] = swap_blocks(a, b, s, false);
        r[i + s] = swap_blocks(a, b, s, true);
      }
  for (int i = 0; i < 16; i++) store16(kt + (x0 + i) * TILE + k0, r[i]);
}

// The tile's n keys (kp[jj]: d values each) widened into kt [d][TILE], key-minor; the missing keys of a
// short last tile are zeros (they score 0 and are then hidden). Written a row of 16 keys at a time:
// stores that walk kt with a stride of TILE floats are several times slower. A full tile with d a
// multiple of 16 goes in 16 x 16 blocks transposed in registers (float32, AVX-512; the same values; the
// operator 1.3-2.1x as fast at T = 1 on `tiny`: bench/README.md, "The paged attention's key tiles in registers").
template <typename T>
void transpose_keys(const T *const *kp, long n, long d, float *kt) {
#ifdef __AVX512F__  // with AVX2 the compiler splits each shuffle into slower sequences than the scalar moves
  // float32 only: with bfloat16 keys (smollm2's heads) it measured no faster, and slower at 64 sequences of
  // 1024 keys (24 against 18 ms a call)
  if (std::is_same<T, float>::value && n == TILE && d % 16 == 0) {
    for (long k0 = 0; k0 < TILE; k0 += 16)
      for (long x0 = 0; x0 < d; x0 += 16) transpose_block(kp, k0, x0, kt);
    return;
  }
#endif
  for (long x = 0; x < d; x++) {
    alignas(64) float row[TILE];
    for (long jj = 0; jj < n; jj++) row[jj] = widen(kp[jj][x]);
    for (long jj = n; jj < TILE; jj++) row[jj] = 0.f;
    std::memcpy(kt + x * TILE, row, sizeof row);
  }
}

// One (sequence, KV head): its G query heads x T rows against every visible key, a tile of keys at a
// time. A tile's keys are widened into kt [d][TILE] (key-minor), so that a row's scores for the whole
// tile are one vectorised multiply-add per head dimension; a tile no row sees is skipped unread.
template <typename T>
void attend_group(const Args<T> &a, long seq, long kvh, std::vector<float> &work) {
  const long g = a.h / a.hkv, rows = g * a.t, d = a.d, keys = a.lc + a.b;
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  work.assign(rows * (2 * d + 2) + d * TILE, 0.f);
  float *qf = work.data(), *acc = qf + rows * d, *m = acc + rows * d, *l = m + rows, *kt = l + rows;
  for (long r = 0; r < rows; r++) {  // row r = (head j of the group, token i): r = j * T + i
    const long i = r % a.t, head = kvh * g + r / a.t;
    const T *src = a.q + ((seq * a.t + i) * a.h + head) * d;
    for (long x = 0; x < d; x++) qf[r * d + x] = widen(src[x]) * a.scale;
    m[r] = NEG;
  }
  const int64_t *ctx = a.ctx + seq * a.lc;
  const bool *mask = a.mask + seq * a.m_b;
  const long mask_rows = a.m_t == 0 ? 1 : a.t;
  const T *vp[TILE];
  const T *kp[TILE];
  const Group<T> st{qf, kt, vp, mask, acc, m, l, d, a.t, a.m_t, a.m_j};
  for (long j0 = 0; j0 < keys; j0 += TILE) {
    const long n = keys - j0 < TILE ? keys - j0 : TILE;
    bool seen = false;
    for (long i = 0; i < mask_rows && !seen; i++)
      for (long jj = 0; jj < n; jj++) seen = seen || mask[i * a.m_t + (j0 + jj) * a.m_j];
    if (!seen) continue;
    for (long jj = 0; jj < n; jj++) {
      const long j = j0 + jj;
      if (j < a.lc) {
        const int64_t slot = ctx[j];
        TORCH_CHECK(slot >= 0 && slot < a.s, "dflash_cpu::paged_attention: slot ", slot, " outside the pool");
        kp[jj] = a.k_pool + (slot * a.hkv + kvh) * d;
        vp[jj] = a.v_pool + (slot * a.hkv + kvh) * d;
      } else {
        kp[jj] = a.k_new + ((seq * a.b + (j - a.lc)) * a.hkv + kvh) * d;
        vp[jj] = a.v_new + ((seq * a.b + (j - a.lc)) * a.hkv + kvh) * d;
      }
    }
    transpose_keys(kp, n, d, kt);
    long r = 0;
    for (; r + 4 <= rows; r += 4) row_block<4>(st, r, j0, n);
    for (; r < rows; r++) row_block<1>(st, r, j0, n);
  }
  for (long r = 0; r < rows; r++) {
    const long i = r % a.t, head = kvh * g + r / a.t;
    T *dst = a.out + ((seq * a.t + i) * a.h + head) * d;
    const float inv = l[r] > 0 ? 1.f / l[r] : 0.f;
    for (long x = 0; x < d; x++) dst[x] = static_cast<T>(acc[r * d + x] * inv);
  }
}

template <typename T>
void attend_groups(const Args<T> &a, long g0, long g1) {
  std::vector<float> work;
  for (long gi = g0; gi < g1; gi++) attend_group(a, gi / a.hkv, gi % a.hkv, work);
}

template <typename T>
void attend_part(const void *ctx, int part, int parts) {
  const Args<T> &a = *static_cast<const Args<T> *>(ctx);
  const long groups = a.bs * a.hkv;
  attend_groups(a, groups * part / parts, groups * (part + 1) / parts);
}

// The (sequence, KV head) groups on the GEMM's team where it has a width (an engine that keeps torch on
// one thread: spin_team.h), else on torch's threads.
template <typename T>
void run(const Args<T> &a) {
  const long groups = a.bs * a.hkv;
  const int width = dflash::SpinTeam::width().load();
  if (width > 1) return dflash::SpinTeam::run(&attend_part<T>, &a, static_cast<int>(std::min<long>(width, groups)));
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) { attend_groups(a, g0, g1); });
}

// The checked tensors of one call as raw pointers and sizes (kn, vn undefined: no keys past the context).
template <typename T>
void launch(const at::Tensor &q, const at::Tensor &k_pool, const at::Tensor &v_pool, const at::Tensor &kn,
            const at::Tensor &vn, const at::Tensor &ctx, const at::Tensor &mask, at::Tensor &out, float scale) {
  const auto ptr = [](const at::Tensor &x) -> const T * { return x.defined() ? x.data_ptr<T>() : nullptr; };
  const Args<T> a{q.data_ptr<T>(), k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), ptr(kn), ptr(vn),
                  ctx.data_ptr<int64_t>(), mask.data_ptr<bool>(), out.data_ptr<T>(),
                  q.size(0), q.size(1), q.size(2), k_pool.size(1), q.size(3), ctx.size(1),
                  kn.defined() ? kn.size(1) : 0, k_pool.size(0),
                  mask.stride(0), mask.size(2) == 1 ? 0 : mask.stride(2), mask.stride(3), scale};
  run(a);
}

at::Tensor paged_attention(const at::Tensor &q_in, const at::Tensor &k_pool, const at::Tensor &v_pool,
                           const at::Tensor &ctx_index, const std::optional<at::Tensor> &k_new,
                           const std::optional<at::Tensor> &v_new, const at::Tensor &mask, double scale) {
  const char *op = "dflash_cpu::paged_attention: ";
  TORCH_CHECK(q_in.dim() == 4 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), op, "bad ranks");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), op, "the pools must be contiguous");
  TORCH_CHECK(q_in.scalar_type() == k_pool.scalar_type() && v_pool.scalar_type() == k_pool.scalar_type(), op,
              "q and the pools must share a dtype");
  TORCH_CHECK(ctx_index.scalar_type() == at::kLong && ctx_index.dim() == 2, op, "ctx_index: [bs, Lc] int64");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4, op, "mask: bool [bs, 1, T or 1, L]");
  const at::Tensor q = q_in.contiguous(), ctx = ctx_index.contiguous();
  const long bs = q.size(0), t = q.size(1), h = q.size(2), d = q.size(3);
  const long hkv = k_pool.size(1), lc = ctx.size(1);
  TORCH_CHECK(k_pool.size(2) == d && hkv > 0 && h % hkv == 0, op, "head sizes do not match");
  TORCH_CHECK(ctx.size(0) == bs, op, "ctx_index has ", ctx.size(0), " rows for a batch of ", bs);
  at::Tensor kn, vn;
  long b = 0;
  if (k_new.has_value() && k_new->defined()) {
    TORCH_CHECK(v_new.has_value() && v_new->defined(), op, "k_new without v_new");
    kn = k_new->contiguous();
    vn = v_new->contiguous();
    TORCH_CHECK(kn.dim() == 4 && kn.size(0) == bs && kn.size(2) == hkv && kn.size(3) == d &&
                    vn.sizes() == kn.sizes() && kn.scalar_type() == q.scalar_type(),
                op, "k_new/v_new: [bs, B, Hkv, d] in q's dtype");
    b = kn.size(1);
  }
  TORCH_CHECK(mask.size(0) == bs && mask.size(1) == 1 && (mask.size(2) == t || mask.size(2) == 1) &&
                  mask.size(3) == lc + b,
              op, "mask has shape ", mask.sizes(), " for T=", t, " and ", lc + b, " keys");
  at::Tensor out = at::empty({bs, t, h, d}, q.options());
  if (bs == 0 || t == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    launch<float>(q, k_pool, v_pool, kn, vn, ctx, mask, out, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, op, "float32 or bfloat16 only, not ", q.scalar_type());
    launch<at::BFloat16>(q, k_pool, v_pool, kn, vn, ctx, mask, out, static_cast<float>(scale));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor ctx_index, Tensor? k_new, Tensor? v_new, "
      "Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
