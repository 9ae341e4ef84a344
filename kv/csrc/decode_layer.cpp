// A decode token's attention for one layer of the block-sparse cache, in one call from Python.
//
// The same steps as kv/sparse.py's decode path, composed of the same kernels: the query
// rotated twice (for the window, and to the retrieval distance), the key once, key and value
// written to the window column, the blocks whose anchors score highest for the query selected
// (unless the caller knows them), and the window, the sinks and those blocks attended. From
// Python these were five kernel calls and a dozen torch ops a layer, each slower in a decode
// step than alone (the step's ~200 MB of weights and keys evict the interpreter's data).
#include "kernels.h"

#include <cmath>
#include <cstring>
#include <optional>

namespace {

// Row `col` of a [n_kv, capacity, D] buffer <- x [n_kv, 1, D] (any row strides).
void write_column(torch::Tensor& buffer, const torch::Tensor& x, int64_t col) {
  const int64_t n_kv = buffer.size(0), cap = buffer.size(1), D = buffer.size(2);
  TORCH_CHECK(col >= 0 && col < cap, "window column out of range");
  TORCH_CHECK(x.size(0) == n_kv && x.size(-1) == D && x.stride(-1) == 1, "key rows: [n_kv, 1, D]");
  auto* dst = reinterpret_cast<uint16_t*>(buffer.data_ptr()) + col * D;
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t h = 0; h < n_kv; ++h) std::memcpy(dst + h * cap * D, src + h * x.stride(0), D * 2);
}

// Element offsets [n_kv, 1] of each head's row `row` in a contiguous [n_kv, rows, D] buffer.
torch::Tensor head_starts(const torch::Tensor& buffer, int64_t row) {
  const int64_t n_kv = buffer.size(0), rows = buffer.size(1), D = buffer.size(2);
  auto starts = torch::empty({n_kv, 1}, torch::kLong);
  int64_t* p = starts.data_ptr<int64_t>();
  for (int64_t h = 0; h < n_kv; ++h) p[h] = (h * rows + row) * D;
  return starts;
}

}  // namespace

DecodeLayer::DecodeLayer(torch::Tensor win_k, torch::Tensor win_v, torch::Tensor win_store_k,
                         torch::Tensor sink_k, torch::Tensor sink_v, torch::Tensor pool_k,
                         torch::Tensor pool_v, int64_t format, int64_t slot_unit,
                         int64_t max_blocks, torch::Tensor anchors, bool quest, bool shared)
    : win_k_(win_k), win_v_(win_v), win_store_k_(win_store_k), sink_k_(sink_k), sink_v_(sink_v),
      pool_k_(pool_k), pool_v_(pool_v), anchors_(anchors), format_(format),
      slot_unit_(slot_unit), max_blocks_(max_blocks), quest_(quest), shared_(shared) {
  for (const auto* t : {&win_k_, &win_v_, &win_store_k_}) {
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
                "window buffers: contiguous bf16 [n_kv, capacity, D]");
  }
  TORCH_CHECK(sink_k_.is_contiguous() && sink_v_.is_contiguous(), "sink buffers: contiguous");
  sink_starts_ = head_starts(sink_k_, 0);
}

std::tuple<torch::Tensor, torch::Tensor> DecodeLayer::decode(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor far_cos, torch::Tensor far_sin, int64_t col, int64_t ws, bool sinks,
    std::optional<torch::Tensor> known, int64_t first, int64_t last, int64_t budget) {
  const int64_t n_kv = win_k_.size(0), D = win_k_.size(2), n_heads = q.size(0);
  TORCH_CHECK(q.dim() == 3 && q.size(1) == 1 && q.size(2) == D, "one query token: [n_heads, 1, D]");
  TORCH_CHECK(0 <= ws && ws <= col, "the window starts at or before the token");
  auto qa = rotate(q, cos, sin);
  auto ka = rotate(k, cos, sin);
  // Extrapolated positions read the far sets with the query at a fixed distance; native ones
  // with the query as it is (far_cos empty).
  auto q_far = far_cos.numel() ? rotate(q, far_cos, far_sin) : qa;
  write_column(win_k_, ka, col);
  write_column(win_v_, v, col);
  if (win_store_k_.data_ptr() != win_k_.data_ptr()) write_column(win_store_k_, k, col);

  // The blocks to read: the caller's (a reused selection, or none), else ranked here.
  torch::Tensor blocks = known.value_or(torch::Tensor());
  if (!known && budget > 0 && last > first)
    blocks = select_blocks(q_far.view({n_heads, D}).to(torch::kFloat), anchors_, first, last,
                           budget, quest_, shared_);
  std::vector<torch::Tensor> ks{win_k_}, vs{win_v_}, starts{head_starts(win_k_, ws)};
  std::vector<int64_t> qids{0}, strides{D}, rows{col + 1 - ws}, formats{0};
  if (sinks) {
    const int64_t block = sink_k_.size(1);
    ks.push_back(sink_k_);
    vs.push_back(sink_v_);
    starts.push_back(sink_starts_);
    qids.push_back(1);
    strides.push_back(D);
    rows.push_back(block);
    formats.push_back(0);
  }
  if (blocks.defined() && blocks.size(-1)) {
    // Block b of head h is store slot h * max_blocks + b, its run starting at slot * slot_unit
    // (elements of FP16 blocks, bytes of quantized ones). A loop: as six torch ops these were
    // ~2% of a 128K step (py-spy).
    TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() <= 2, "block ids: int64 [k] or [n_kv, k]");
    blocks = blocks.contiguous();
    const int64_t k = blocks.size(-1), per_head = blocks.dim() == 2 ? k : 0;
    const int64_t* ids = blocks.data_ptr<int64_t>();
    auto runs = torch::empty({n_kv, k}, torch::kLong);
    int64_t* p = runs.data_ptr<int64_t>();
    for (int64_t h = 0; h < n_kv; ++h)
      for (int64_t j = 0; j < k; ++j) p[h * k + j] = (h * max_blocks_ + ids[h * per_head + j]) * slot_unit_;
    ks.push_back(pool_k_);
    vs.push_back(pool_v_);
    starts.push_back(runs);
    qids.push_back(1);
    strides.push_back(D);
    rows.push_back(sink_k_.size(1));  // a block's rows, as the sink block's
    formats.push_back(format_);
  } else if (!blocks.defined()) {
    blocks = torch::empty({0}, torch::kLong);
  }
  auto out = decode_attention(qa, q_far, ks, vs, qids, strides, rows, starts, formats, n_kv,
                              std::pow(static_cast<double>(D), -0.5));
  return {out, blocks};
}
