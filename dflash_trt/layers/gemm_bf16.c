// SPDX-License-Identifier: Apache-2.0
// y[M, N] = x[M, K] . W^T (+ bias), bf16 in and out, fp32 accumulation, for CPUs with AVX512-BF16.
// Built and loaded by dflash_trt/layers/cpu_gemm.py, which also packs W.
//
// W is packed as [ceil(N/16)][K/2][16][2]: blocks of 16 output columns, and within a block the K
// dimension in pairs, so that one 64-byte load holds a K-pair for 16 outputs: exactly the operand
// of one vdpbf16ps against a broadcast K-pair of one input row. Each task owns a few blocks and
// runs every input row against them while they are hot in cache, so the weight is read from
// memory once per call whatever M is.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline void store16(uint16_t *y, __m512 acc, const float *bias, long n0, int valid) {
  __mmask16 mask = (__mmask16)(valid == 16 ? 0xffff : (1u << valid) - 1);
  if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias + n0));
  __m256i h = (__m256i)_mm512_cvtneps_pbh(acc);  // round to nearest even, as torch's bf16 casts
  _mm256_mask_storeu_epi16(y + n0, mask, h);
}

// A tile of MT input rows x NT blocks (16 outputs each) over the whole K.
#define TILE(MT, NT)                                                                                  \
  static void tile_##MT##x##NT(const uint16_t *x, long K, const uint16_t *w, uint16_t *y, long N,    \
                               const float *bias, long b0) {                                         \
    const long pairs = K / 2;                                                                         \
    __m512 acc[MT][NT];                                                                               \
    for (int m = 0; m < MT; m++)                                                                      \
      for (int j = 0; j < NT; j++) acc[m][j] = _mm512_setzero_ps();                                   \
    for (long p = 0; p < pairs; p++) {                                                                \
      __m512bh wv[NT];                                                                                \
      for (int j = 0; j < NT; j++)                                                                    \
        wv[j] = (__m512bh)_mm512_loadu_si512(w + ((b0 + j) * pairs + p) * 32);                        \
      for (int m = 0; m < MT; m++) {                                                                  \
        int32_t pair;                                                                                 \
        memcpy(&pair, x + m * K + 2 * p, sizeof pair);                                                \
        __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                              \
        for (int j = 0; j < NT; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv);              \
      }                                                                                               \
    }                                                                                                 \
    for (int m = 0; m < MT; m++)                                                                      \
      for (int j = 0; j < NT; j++) {                                                                  \
        long n0 = (b0 + j) * 16;                                                                      \
        store16(y + m * N, acc[m][j], bias, n0, N - n0 >= 16 ? 16 : (int)(N - n0));                   \
      }                                                                                               \
  }

TILE(1, 4)
TILE(2, 4)
TILE(4, 4)
TILE(8, 2)
TILE(1, 1)
TILE(2, 1)
TILE(4, 1)
TILE(8, 1)

// A task is a few 16-column blocks (`dflash_gemm_bf16_wide`); it runs every input row against its
// blocks while they are hot in cache.
static inline long dflash_gemm_bf16_wide(long M) { return M >= 8 ? 2 : 4; }  // blocks per task

// Blocks [b_begin, b_end) of y = x . W^T (+ bias), in tasks from b_begin. x: [M, K] row-major (K even),
// w: packed as above, bias: [N] fp32 or NULL, y: [M, N] row-major.
void dflash_gemm_bf16_blocks(const uint16_t *x, long M, long K, const uint16_t *w, long N, const float *bias,
                             uint16_t *y, long b_begin, long b_end) {
  const long wide = dflash_gemm_bf16_wide(M);
  for (long b0 = b_begin; b0 < b_end; b0 += wide) {
    const long nblk = b_end - b0 < wide ? b_end - b0 : wide;
    for (long m = 0; m < M;) {
      const long left = M - m;
      const uint16_t *xm = x + m * K;
      uint16_t *ym = y + m * N;
      if (nblk == wide) {
        if (wide == 2 && left >= 8) { tile_8x2(xm, K, w, ym, N, bias, b0); m += 8; continue; }
        if (wide == 4 && left >= 4) { tile_4x4(xm, K, w, ym, N, bias, b0); m += 4; continue; }
        if (wide == 4 && left >= 2) { tile_2x4(xm, K, w, ym, N, bias, b0); m += 2; continue; }
        if (wide == 4) { tile_1x4(xm, K, w, ym, N, bias, b0); m += 1; continue; }
      }
      const long rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      for (long j = 0; j < nblk; j++) {
        if (rows == 8) tile_8x1(xm, K, w, ym, N, bias, b0 + j);
        else if (rows == 4) tile_4x1(xm, K, w, ym, N, bias, b0 + j);
        else if (rows == 2) tile_2x1(xm, K, w, ym, N, bias, b0 + j);
        else tile_1x1(xm, K, w, ym, N, bias, b0 + j);
      }
      m += rows;
    }
  }
}

// The whole product on OpenMP's threads (the ctypes path of cpu_gemm.gemm). A product of fewer rows runs
// on one thread there: beside a decoding step's single-threaded operators, OpenMP's idle threads sleep
// in the kernel between calls (its spinning is cut short when the process holds more threads than
// cores), and waking them for each of a step's products costs more than their share of the reads. The
// torch operator (gemm_bf16_op.cpp) splits every product over a team of its own instead.
#define DFLASH_GEMM_WIDE_ROWS 8

// threads: the most threads a product of DFLASH_GEMM_WIDE_ROWS rows or more may use.
void dflash_gemm_bf16(const uint16_t *x, long M, long K, const uint16_t *w, long N, const float *bias,
                      uint16_t *y, int threads) {
  const long blocks = (N + 15) / 16, wide = dflash_gemm_bf16_wide(M);
  const long tasks = (blocks + wide - 1) / wide;
  const int team = M >= DFLASH_GEMM_WIDE_ROWS ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static)
  for (long t = 0; t < tasks; t++)
    dflash_gemm_bf16_blocks(x, M, K, w, N, bias, y, t * wide, (t + 1) * wide < blocks ? (t + 1) * wide : blocks);
}
