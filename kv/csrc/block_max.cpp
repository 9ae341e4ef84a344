// The pinning vote's reduction (kv/pinning.py): each block's best score per query row, from
// the scores of every key. torch's amax over the middle dimension of bf16 [heads, keys, rows]
// scores costs more than the matmul that makes them; here each key's row of scores is read
// once, widened in registers and folded into its block's running maxima.
#include "tensor.h"

#include <algorithm>

#include "bf16.h"
#include "kernels.h"
#include "rows.h"

namespace {

using kvchat::widen;

template <typename T>
void block_max_rows(const T* s, int64_t groups, int64_t block, int64_t R, float* out) {
  kvchat::for_rows(groups, 1, [&](int64_t g) {
    const T* rows = s + g * block * R;
    float* best = out + g * R;
    for (int64_t r = 0; r < R; ++r) best[r] = widen(rows[r]);
    for (int64_t t = 1; t < block; ++t) {
      const T* row = rows + t * R;
      for (int64_t r = 0; r < R; ++r) best[r] = std::max(best[r], widen(row[r]));
    }
  });
}

}  // namespace

// scores: contiguous [H, n * block, R] in bf16 or fp32; returns fp32 [H, n, R], each the
// largest of its block's `block` rows.
at::Tensor block_max(at::Tensor scores, int64_t block) {
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous(), "scores: contiguous [H, keys, rows]");
  TORCH_CHECK(block > 0 && scores.size(1) % block == 0, "keys must be whole blocks");
  const int64_t H = scores.size(0), n = scores.size(1) / block, R = scores.size(2);
  auto out = at::empty({H, n, R}, scores.options().dtype(at::kFloat));
  if (H * n * R == 0) return out;
  if (scores.scalar_type() == at::kBFloat16)
    block_max_rows(reinterpret_cast<const uint16_t*>(scores.data_ptr()), H * n, block, R,
                   out.data_ptr<float>());
  else if (scores.scalar_type() == at::kFloat)
    block_max_rows(scores.data_ptr<float>(), H * n, block, R, out.data_ptr<float>());
  else
    TORCH_CHECK(false, "scores must be bf16 or fp32");
  return out;
}
