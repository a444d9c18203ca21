// SPDX-License-Identifier: Apache-2.0
// The counter-based uniforms of dflash_trt/spec/sampling.py as one torch operator:
//   dflash_rng::uniform(seeds, positions, purpose) -> u
// seeds [N] int64 (one per request); positions [N, ...] int64 (absolute token positions); purpose: the
// PURPOSE_* constant. u: float32, positions' shape, strictly inside (0, 1), 24 bits of resolution.
//
// The values are bit for bit those of `sampling._uniform_ops` (tests/spec/test_uniform_op.py): four rounds
// of the same 32-bit finaliser over (seed low word, seed high word, position, purpose * golden ratio).
// Why an operator: written in torch ops, the hash is ~40 int64 elementwise ops per call and three or four
// calls per sampled round; inductor turns them into large fused loop bodies whose C++ code generation
// cost ~20 s of a sampled round's compile on 2 CPU cores. As one extern call it costs nothing to compile
// and a few microseconds to run.
// Built by dflash_trt/spec/native_uniform.py (g++, torch's headers and libraries).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace {

inline uint32_t mix32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x7FEB352Du;
  x = (x ^ (x >> 15)) * 0x31848BABu;
  x = (x ^ (x >> 16)) * 0x2C1B3C6Du;
  return x ^ (x >> 15);
}

at::Tensor uniform(const at::Tensor &seeds_in, const at::Tensor &positions_in, int64_t purpose) {
  const char *op = "dflash_rng::uniform: ";
  TORCH_CHECK(seeds_in.scalar_type() == at::kLong && seeds_in.dim() == 1, op, "seeds: [N] int64");
  TORCH_CHECK(positions_in.scalar_type() == at::kLong && positions_in.dim() >= 1, op,
              "positions: [N, ...] int64");
  TORCH_CHECK(positions_in.size(0) == seeds_in.size(0), op, "positions has ", positions_in.size(0),
              " rows for ", seeds_in.size(0), " seeds");
  const at::Tensor seeds = seeds_in.contiguous(), positions = positions_in.contiguous();
  at::Tensor out = at::empty(positions.sizes(), positions.options().dtype(at::kFloat));
  const int64_t rows = positions.size(0), per_row = rows ? positions.numel() / rows : 0;
  const int64_t *s = seeds.data_ptr<int64_t>(), *p = positions.data_ptr<int64_t>();
  float *u = out.data_ptr<float>();
  const uint32_t tag = static_cast<uint32_t>(static_cast<uint64_t>(purpose) * 0x9E3779B1ull);
  for (int64_t r = 0; r < rows; r++) {
    const uint64_t seed = static_cast<uint64_t>(s[r]);
    const uint32_t h = mix32(mix32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32));
    for (int64_t i = r * per_row; i < (r + 1) * per_row; i++) {
      const uint32_t x = mix32(mix32(h ^ static_cast<uint32_t>(p[i])) ^ tag);
      u[i] = (static_cast<float>(x >> 8) + 0.5f) * (1.0f / 16777216.0f);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(dflash_rng, m) { m.def("uniform(Tensor seeds, Tensor positions, int purpose) -> Tensor"); }

TORCH_LIBRARY_IMPL(dflash_rng, CPU, m) { m.impl("uniform", &uniform); }
