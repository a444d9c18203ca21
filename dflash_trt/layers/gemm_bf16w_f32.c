// SPDX-License-Identifier: Apache-2.0
// y[M, N] = x[M, K] . W^T (+ bias) with x, y and bias in fp32 and W in bf16, for AVX2 CPUs (no
// native bf16): the weights stay bf16 in memory (half the bytes a decoding step streams) and are
// widened to fp32 in registers (a bf16 is the top half of an fp32: one shift or one mask).
// W is packed exactly as gemm_bf16.c packs it ([ceil(N/16)][K/2][16][2]); each 64-byte load holds a
// K-pair for 16 outputs, widened into two 8-lane halves for the even and the odd K.
// Built by dflash_trt/layers/cpu_gemm.py with AVX2 and FMA only, so it runs on CPUs without AVX-512.
#include <immintrin.h>
#include <stdint.h>

static inline void widen(__m256i h, __m256 *even, __m256 *odd) {
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline void store8(float *y, __m256 acc, const float *bias, long n0, long N) {
  long valid = N - n0;
  if (valid <= 0) return;
  if (valid >= 8) {
    if (bias) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias + n0));
    _mm256_storeu_ps(y + n0, acc);
    return;
  }
  __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  if (bias) acc = _mm256_add_ps(acc, _mm256_maskload_ps(bias + n0, mask));
  _mm256_maskstore_ps(y + n0, mask, acc);
}

// A tile of MT input rows x NT blocks (16 outputs each, as two halves of 8) over the whole K.
#define TILE(MT, NT)                                                                                  \
  static void tile_##MT##x##NT(const float *x, long K, const uint16_t *w, float *y, long N,          \
                               const float *bias, long b0) {                                         \
    const long pairs = K / 2;                                                                         \
    __m256 acc[MT][NT][2];                                                                            \
    for (int m = 0; m < MT; m++)                                                                      \
      for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();                 \
    for (long p = 0; p < pairs; p++) {                                                                \
      __m256 we[NT][2], wo[NT][2];                                                                    \
      for (int j = 0; j < NT; j++) {                                                                  \
        const uint16_t *src = w + ((b0 + j) * pairs + p) * 32;                                        \
        widen(_mm256_loadu_si256((const __m256i *)src), &we[j][0], &wo[j][0]);                        \
        widen(_mm256_loadu_si256((const __m256i *)(src + 16)), &we[j][1], &wo[j][1]);                 \
      }                                                                                               \
      for (int m = 0; m < MT; m++) {                                                                  \
        __m256 xe = _mm256_set1_ps(x[m * K + 2 * p]), xo = _mm256_set1_ps(x[m * K + 2 * p + 1]);      \
        for (int j = 0; j < NT; j++)                                                                  \
          for (int h = 0; h < 2; h++)                                                                 \
            acc[m][j][h] = _mm256_fmadd_ps(wo[j][h], xo, _mm256_fmadd_ps(we[j][h], xe, acc[m][j][h])); \
      }                                                                                               \
    }                                                                                                 \
    for (int m = 0; m < MT; m++)                                                                      \
      for (int j = 0; j < NT; j++)                                                                    \
        for (int h = 0; h < 2; h++) store8(y + m * N, acc[m][j][h], bias, (b0 + j) * 16 + h * 8, N);  \
  }

TILE(1, 2)
TILE(4, 1)
TILE(2, 1)
TILE(1, 1)

// x: [M, K] fp32 row-major (K even), w: packed bf16, bias: [N] fp32 or NULL, y: [M, N] fp32 row-major.
void dflash_gemm_bf16w_f32(const float *x, long M, long K, const uint16_t *w, long N, const float *bias,
                           float *y, int threads) {
  const long blocks = (N + 15) / 16;
  const long wide = M >= 4 ? 1 : 2;  // blocks per tile: at most 8 accumulators
  const long tasks = (blocks + wide - 1) / wide;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long t = 0; t < tasks; t++) {
    const long b0 = t * wide, nblk = blocks - b0 < wide ? blocks - b0 : wide;
    for (long m = 0; m < M;) {
      const long left = M - m;
      const float *xm = x + m * K;
      float *ym = y + m * N;
      if (nblk == 2) { tile_1x2(xm, K, w, ym, N, bias, b0); m += 1; continue; }
      const long rows = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      for (long j = 0; j < nblk; j++) {
        if (rows == 4) tile_4x1(xm, K, w, ym, N, bias, b0 + j);
        else if (rows == 2) tile_2x1(xm, K, w, ym, N, bias, b0 + j);
        else tile_1x1(xm, K, w, ym, N, bias, b0 + j);
      }
      m += rows;
    }
  }
}
