// SPDX-License-Identifier: Apache-2.0
// The bf16 GEMM of gemm_bf16.c as the torch operator dflash_bf16::linear(x, w_packed, bias, n),
// registered with the dispatcher, so that a compiled round calls it as it calls aten::mm.
//
// Why: through a Python custom op and ctypes, each call of the kernel cost Python around it (the op's
// wrapper, the packed weight's lookup, the ctypes call): with smollm2-135m's 121 linears a decoding
// step, a compiled batch-1 step ran 1.14-1.28x slower than with this operator (bench/README.md). The
// kernel itself is gemm_bf16.c, included below unchanged (the C kernel's numerics and tiles); the
// operator splits every product, whatever its rows, over a team of its own threads (spin_team.h: on
// smollm2-135m's plain decoding 1.16-1.34x faster at batch 1 than the kernel's OpenMP, 1.13-1.20x at
// batch 4 and 16; bench/README.md, "The GEMM's own threads").
// w: the packed weight [ceil(N/16), K/2, 16, 2] bf16 (cpu_gemm.pack); n: N, a whole number of blocks
// (n = 16 * w.size(0)); x [..., K] bf16; bias [N] or None (read as fp32); out [..., N] bf16.
// Built by dflash_trt/layers/cpu_gemm.py (g++ with AVX512-BF16, torch's headers and libraries).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "spin_team.h"

extern "C" {
#include "gemm_bf16.c"
}

namespace {

struct Product {
  const uint16_t *x, *w;
  long M, K, N;
  const float *bias;
  uint16_t *y;
};

// Part `part` of `parts` of a product: a contiguous share of its blocks.
void product_part(const void *ctx, int part, int parts) {
  const Product &p = *static_cast<const Product *>(ctx);
  const long blocks = (p.N + 15) / 16;
  dflash_gemm_bf16_blocks(p.x, p.M, p.K, p.w, p.N, p.bias, p.y, blocks * part / parts, blocks * (part + 1) / parts);
}

// The threads a product (and the paged attention's heads) may use, set by cpu_gemm.set_threads: the
// team's width. Not an argument of linear: a compiled round would hold it as a constant, and it is the
// process's setting.
void set_threads(int64_t n) {
  TORCH_CHECK(n >= 0, "dflash_bf16::set_threads: n=", n, " (0 = torch's thread count)");
  dflash::SpinTeam::width().store(static_cast<int>(n));
}

at::Tensor linear(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &bias, int64_t n) {
  const char *op = "dflash_bf16::linear: ";
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, op, "bf16 only");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.is_contiguous(), op, "w is not packed");
  TORCH_CHECK(x.size(-1) == 2 * w.size(1), op, "x has ", x.size(-1), " features, w ", 2 * w.size(1));
  TORCH_CHECK(n > 0 && (n + 15) / 16 == w.size(0), op, "n=", n, " does not match w");
  const at::Tensor flat = x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, op, "bias has ", b.numel(), " values for n=", n);
  }
  at::Tensor out = at::empty({flat.size(0), n}, x.options());
  if (flat.size(0) > 0) {
    const int64_t own = dflash::SpinTeam::width().load();
    const Product p{reinterpret_cast<const uint16_t *>(flat.data_ptr()), reinterpret_cast<const uint16_t *>(w.data_ptr()),
                    flat.size(0), flat.size(1), n, b.defined() ? b.data_ptr<float>() : nullptr,
                    reinterpret_cast<uint16_t *>(out.data_ptr())};
    const int64_t threads = own > 0 ? own : at::get_num_threads();
    dflash::SpinTeam::run(&product_part, &p, static_cast<int>(std::min<int64_t>(threads, (n + 15) / 16)));
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY(dflash_bf16, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("set_threads(int n) -> ()", &set_threads);
}

TORCH_LIBRARY_IMPL(dflash_bf16, CPU, m) { m.impl("linear", &linear); }
