// SPDX-License-Identifier: Apache-2.0
// y[M, N] = x[M, K] . W^T (+ bias), all fp32, for AVX-512F CPUs: the torch operator
// dflash_f32::linear(x, w_packed, bias, n), registered with the dispatcher, so that a compiled round
// calls it as it calls aten::mm (no Python in between).
//
// Why: a decoding step multiplies a handful of rows by every weight. For small models the step is
// made of such GEMMs at 1-16 rows, where MKL's sgemm spends most of a call packing the weight
// (bench/README.md, "dflash-trt's own fp32 GEMM").
// Layout: W [N, K] is packed once, at load (cpu_gemm.pack_f32), as [ceil(N/16)][K][16] fp32, the
// output columns in blocks of 16 (one 64-byte line per K), N padded with zeros.
// Numerics: every output is one FMA chain over k = 0..K-1 in order, the same for every row count:
// a row's result does not depend on the batch it is computed in (batch invariance).
// Built by dflash_trt/layers/cpu_gemm.py (g++, torch's headers and libraries).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

namespace {

template <int MT>
void tile(const float *x, long K, const float *w, float *y, long N, const float *bias, long block) {
  __m512 acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
  const float *wb = w + block * K * 16;
  for (long k = 0; k < K; k++) {
    const __m512 wv = _mm512_loadu_ps(wb + k * 16);
    for (int m = 0; m < MT; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, acc[m]);
  }
  const long n0 = block * 16, valid = N - n0 < 16 ? N - n0 : 16;
  const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; m++) _mm512_mask_storeu_ps(y + m * N + n0, mask, _mm512_add_ps(acc[m], b));
}

void gemm(const float *x, long M, long K, const float *w, long N, const float *bias, float *y, long b0,
          long b1) {
  for (long block = b0; block < b1; block++) {
    for (long m = 0; m < M;) {
      const long left = M - m;
      const float *xm = x + m * K;
      float *ym = y + m * N;
      if (left >= 16) { tile<16>(xm, K, w, ym, N, bias, block); m += 16; }
      else if (left >= 8) { tile<8>(xm, K, w, ym, N, bias, block); m += 8; }
      else if (left >= 4) { tile<4>(xm, K, w, ym, N, bias, block); m += 4; }
      else if (left >= 2) { tile<2>(xm, K, w, ym, N, bias, block); m += 2; }
      else { tile<1>(xm, K, w, ym, N, bias, block); m += 1; }
    }
  }
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "dflash_f32::linear: fp32 only");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 16 && w.is_contiguous(), "dflash_f32::linear: w is not packed");
  TORCH_CHECK(x.size(-1) == w.size(1), "dflash_f32::linear: x has ", x.size(-1), " features, w ", w.size(1));
  TORCH_CHECK(n > 0 && (n + 15) / 16 == w.size(0), "dflash_f32::linear: n=", n, " does not match w");
  const at::Tensor flat = x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "dflash_f32::linear: bias has ", b.numel(), " values for n=", n);
  }
  at::Tensor out = at::empty({flat.size(0), n}, x.options());
  const long M = flat.size(0), K = flat.size(1), blocks = w.size(0);
  if (M > 0) {
    const float *xp = flat.data_ptr<float>(), *wp = w.data_ptr<float>();
    const float *bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float *yp = out.data_ptr<float>();
    if (at::get_num_threads() > 1 && blocks > 1) {
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { gemm(xp, M, K, wp, n, bp, yp, b0, b1); });
    } else {
      gemm(xp, M, K, wp, n, bp, yp, 0, blocks);
    }
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY(dflash_f32, m) { m.def("linear(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(dflash_f32, CPU, m) { m.impl("linear", &linear); }
