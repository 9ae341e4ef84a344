// Score candidate blocks by their anchors and keep the top k, for one query (the CPU path).
//
// In torch this is a dozen small ops per layer (query weights, a matrix-vector product
// that MKL runs at ~14 GB/s, topk, sort, indexing): at 128K tokens, ~1,000 candidates per
// layer, it costs more than the attention over the selected blocks. Here the anchors are
// read once, two threads over the blocks, and the top k found by a partial sort.
//
// Every anchor type's score is linear in per-head weights derived from the query (see
// kv/selection.py): q itself, or for QUEST (anchors = per-channel min and max keys)
// (-relu(-q), relu(q)), so a KV head's group of query heads is scored by their summed weights.
//
// QUEST and BLOCK_MAX anchors are key values, stored in the keys' dtype (kv/anchors.py): bf16
// anchors are widened to fp32 here, which halves the bytes this pass reads at no loss.
#include "tensor.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "bf16.h"
#include "kernels.h"

namespace {

// Blocks ahead whose anchors are prefetched (~6 KB of SmolLM2's QUEST anchors): the anchors
// stream from DRAM (23 MB a 128K step) and the hardware prefetcher alone holds this pass to ~11
// GB/s (30 layers of a 128K step: 1.8-2.1 ms with the prefetch, 2.3-2.8 ms without, the two
// builds alternated in one process).
constexpr int64_t PREFETCH_BLOCKS = 8;

using kvchat::widen;

// Block b's score, per KV head into scores[h * n + b], or summed over heads into scores[b].
template <typename A>
void score(const A* ap, const float* w, int64_t n, int64_t n_kv, int64_t width, bool shared,
           float* scores) {
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const A* row = ap + b * n_kv * width;
      if (b + PREFETCH_BLOCKS < hi) {
        const auto* ahead = reinterpret_cast<const char*>(row + PREFETCH_BLOCKS * n_kv * width);
        for (int64_t off = 0; off < static_cast<int64_t>(sizeof(A)) * n_kv * width; off += 64)
          __builtin_prefetch(ahead + off);
      }
      float total = 0.f;
      for (int64_t h = 0; h < n_kv; ++h) {
        const float* wh = w + h * width;
        const A* ah = row + h * width;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < width; ++i) dot += wh[i] * widen(ah[i]);
        if (shared)
          total += dot;
        else
          scores[h * n + b] = dot;
      }
      if (shared) scores[b] = total;
    }
  });
}

}  // namespace

// q: fp32 [n_heads, D]; anchors: fp32 or bf16 contiguous [n_blocks, n_kv, R, D] (all stored blocks;
// candidates are first..last-1); quest: R == 2 and the bound weights; shared: one ranking
// summed over heads, else one per KV head; pinned: int64 block ids chosen before any other.
// Returns int64 block ids, ascending: [k] (shared) or [n_kv, k].
at::Tensor select_blocks(at::Tensor q, at::Tensor anchors, int64_t first, int64_t last,
                            int64_t k, bool quest, bool shared, at::Tensor pinned) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "fp32 query");
  const bool bf16 = anchors.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || anchors.scalar_type() == at::kFloat, "fp32 or bf16 anchors");
  TORCH_CHECK(anchors.dim() == 4 && anchors.is_contiguous(), "anchors: [n_blocks, n_kv, R, D]");
  const int64_t n_kv = anchors.size(1), R = anchors.size(2), D = anchors.size(3);
  const int64_t n_heads = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.size(1) == D && n_heads % n_kv == 0, "q: [n_heads, D]");
  TORCH_CHECK(R == (quest ? 2 : 1), "QUEST needs 2 anchor rows, other types 1");
  TORCH_CHECK(0 <= first && first <= last && last <= anchors.size(0), "bad candidate range");
  TORCH_CHECK(pinned.scalar_type() == at::kLong && pinned.dim() == 1, "pinned: int64 [P]");
  pinned = pinned.contiguous();
  k = std::min(k, last - first);
  auto out = at::empty(shared ? std::vector<int64_t>{k} : std::vector<int64_t>{n_kv, k},
                          at::kLong);
  kvchat::rank_blocks(q.contiguous().data_ptr<float>(), n_heads, anchors.data_ptr(), bf16, n_kv,
                      R, D, first, last, k, quest, shared, pinned.data_ptr<int64_t>(),
                      pinned.numel(), out.data_ptr<int64_t>());
  return out;
}

void kvchat::rank_blocks(const float* qp, int64_t n_heads, const void* anchors, bool bf16,
                         int64_t n_kv, int64_t R, int64_t D, int64_t first, int64_t last,
                         int64_t k, bool quest, bool shared, const int64_t* pinned,
                         int64_t n_pinned, int64_t* op) {
  const int64_t G = n_heads / n_kv, width = R * D, n = last - first;
  TORCH_CHECK(k <= n, "more blocks asked for than there are candidates");
  // Weights [n_kv, R * D]: the group's summed (bound) weights.
  std::vector<float> w(n_kv * width, 0.f);
  for (int64_t h = 0; h < n_heads; ++h) {
    float* wh = w.data() + (h / G) * width;
    for (int64_t d = 0; d < D; ++d) {
      const float x = qp[h * D + d];
      if (quest) {
        wh[d] += std::min(x, 0.f);
        wh[D + d] += std::max(x, 0.f);
      } else {
        wh[d] += x;
      }
    }
  }
  const int64_t rankings = shared ? 1 : n_kv;
  std::vector<float> scores(rankings * n);
  const int64_t offset = first * n_kv * width;
  if (bf16)
    score(static_cast<const uint16_t*>(anchors) + offset, w.data(), n, n_kv, width, shared,
          scores.data());
  else
    score(static_cast<const float*>(anchors) + offset, w.data(), n, n_kv, width, shared,
          scores.data());
  for (int64_t r = 0; r < rankings; ++r)
    for (int64_t i = 0; i < n_pinned; ++i)
      if (first <= pinned[i] && pinned[i] < last)
        scores[r * n + pinned[i] - first] = std::numeric_limits<float>::infinity();
  std::vector<int64_t> idx(n);
  for (int64_t r = 0; r < rankings; ++r) {
    const float* sr = scores.data() + r * n;
    std::iota(idx.begin(), idx.end(), 0);
    // Highest first; ties to the lower id, so the choice does not depend on the sort.
    std::nth_element(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
      return sr[a] > sr[b] || (sr[a] == sr[b] && a < b);
    });
    std::sort(idx.begin(), idx.begin() + k);
    for (int64_t i = 0; i < k; ++i) op[r * k + i] = first + idx[i];
  }
}
