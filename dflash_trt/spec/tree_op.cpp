// SPDX-License-Identifier: Apache-2.0
// DDTree's best-first tree of a CPU round as one torch operator:
//   dflash_tree::best_first(top_lp, top_tok, anchors, budget) -> (tokens, parents, depths, valid, visibility)
// top_lp [bs, g, k] float32: each depth's top-k log-probabilities, sorted best first (clamped to the floor;
// -inf = no such node, e.g. beyond a request's depth limit); top_tok [bs, g, k] int64: their tokens;
// anchors [bs] int64. Outputs as spec/tree.py's DraftTree, N = budget + 1 nodes (node 0 the root):
// tokens, parents, depths [bs, N] int64, valid [bs, N] bool, visibility [bs, N, N] bool.
//
// The nodes are those of `tree.best_first_tree` (the heap expansion of the paper), in the same order and
// with the same float32 scores: pop the best prefix; push its next sibling (same parent, next rank) and its
// first child (next depth, rank 0); equal scores pop in push order. Visibility: a node sees itself and
// what its parent sees (parents precede children). Padding nodes (a tree with fewer real nodes) see only
// themselves, carry token 0, parent -1, depth 0.
// Why an operator: the batched builder (`tree.build_tree`) is g - 1 dependent top-k steps, a sort and
// pointer chasing; compiled for a CPU round at batch 1 it costs ~0.3 ms of a ~2.5 ms round. The heap
// over bs * budget entries is a few microseconds.
// Built by dflash_trt/spec/native_tree.py (g++, torch's headers and libraries).
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <queue>
#include <tuple>
#include <vector>

namespace {

struct Entry {
  float score;          // the prefix's score (sum of its log-probabilities, float32, root first)
  int64_t order;        // push order: equal scores pop first-pushed first
  int64_t parent;       // parent node index
  float parent_score;   // the parent's score
  int64_t depth;        // 1..g
  int64_t rank;         // rank in its depth's top-k
};

struct Worse {  // priority_queue pops the "largest": the best score, then the earliest push
  bool operator()(const Entry &a, const Entry &b) const {
    if (a.score != b.score) return a.score < b.score;
    return a.order > b.order;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> best_first(
    const at::Tensor &lp_in, const at::Tensor &tok_in, const at::Tensor &anchors_in, int64_t budget) {
  const char *op = "dflash_tree::best_first: ";
  TORCH_CHECK(lp_in.scalar_type() == at::kFloat && lp_in.dim() == 3, op, "top_lp: [bs, g, k] float32");
  TORCH_CHECK(tok_in.scalar_type() == at::kLong && tok_in.sizes() == lp_in.sizes(), op,
              "top_tok: int64 of top_lp's shape");
  TORCH_CHECK(anchors_in.scalar_type() == at::kLong && anchors_in.dim() == 1 &&
                  anchors_in.size(0) == lp_in.size(0),
              op, "anchors: [bs] int64");
  TORCH_CHECK(budget >= 1, op, "budget=", budget, ": a tree needs at least one drafted node");
  const at::Tensor lp = lp_in.contiguous(), tok = tok_in.contiguous(), anchors = anchors_in.contiguous();
  const int64_t bs = lp.size(0), g = lp.size(1), k = lp.size(2), n1 = budget + 1;
  const auto long_opts = anchors.options();
  at::Tensor tokens = at::zeros({bs, n1}, long_opts), parents = at::full({bs, n1}, -1, long_opts);
  at::Tensor depths = at::zeros({bs, n1}, long_opts);
  at::Tensor valid = at::zeros({bs, n1}, long_opts.dtype(at::kBool));
  at::Tensor vis = at::zeros({bs, n1, n1}, long_opts.dtype(at::kBool));
  const float *L = lp.data_ptr<float>();
  const int64_t *T = tok.data_ptr<int64_t>(), *A = anchors.data_ptr<int64_t>();
  int64_t *tk = tokens.data_ptr<int64_t>(), *pa = parents.data_ptr<int64_t>(), *de = depths.data_ptr<int64_t>();
  bool *va = valid.data_ptr<bool>(), *vi = vis.data_ptr<bool>();
  for (int64_t b = 0; b < bs; b++) {
    const float *lb = L + b * g * k;
    const int64_t *tb = T + b * g * k;
    int64_t *tkb = tk + b * n1, *pab = pa + b * n1, *deb = de + b * n1;
    bool *vab = va + b * n1, *vib = vi + b * n1 * n1;
    for (int64_t i = 0; i < n1; i++) vib[i * n1 + i] = true;  // every node (padding too) sees itself
    tkb[0] = A[b];
    vab[0] = true;
    std::priority_queue<Entry, std::vector<Entry>, Worse> heap;
    int64_t pushes = 0, nodes = 1;
    if (g > 0 && k > 0 && !std::isinf(lb[0])) heap.push({0.0f + lb[0], pushes++, 0, 0.0f, 1, 0});
    while (!heap.empty() && nodes < n1) {
      const Entry e = heap.top();
      heap.pop();
      const int64_t me = nodes++;
      tkb[me] = tb[(e.depth - 1) * k + e.rank];
      pab[me] = e.parent;
      deb[me] = e.depth;
      vab[me] = true;
      const bool *from = vib + e.parent * n1;
      bool *to = vib + me * n1;
      for (int64_t j = 0; j < me; j++) to[j] = to[j] || from[j];
      if (e.rank + 1 < k) {  // next sibling
        const float next = lb[(e.depth - 1) * k + e.rank + 1];
        if (!std::isinf(next)) heap.push({e.parent_score + next, pushes++, e.parent, e.parent_score, e.depth, e.rank + 1});
      }
      if (e.depth < g) {  // first child
        const float child = lb[e.depth * k];
        if (!std::isinf(child)) heap.push({e.score + child, pushes++, me, e.score, e.depth + 1, 0});
      }
    }
  }
  return {tokens, parents, depths, valid, vis};
}

}  // namespace

TORCH_LIBRARY(dflash_tree, m) {
  m.def("best_first(Tensor top_lp, Tensor top_tok, Tensor anchors, int budget) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dflash_tree, CPU, m) { m.impl("best_first", &best_first); }
