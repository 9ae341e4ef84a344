// A decode token's attention for one layer of the block-sparse cache, in one call from Python.
//
// The same steps as the sparse cache's decode path (kv/sparse/paths.py), composed of the
// same kernels: the query rotated twice (for the window, and to the retrieval distance), the
// key once, key and value written to the window column, the blocks whose anchors score highest
// for the query selected (unless the caller knows them), and the window, the sinks and those
// blocks attended. From
// Python these are five kernel calls and a dozen torch ops a layer, each slower in a decode
// step than alone (the step's ~200 MB of weights and keys evict the interpreter's data). The
// kernels are called on this object's own buffers rather than through their torch entry
// points, whose conversions and temporaries (a dozen small tensors a layer) cost ~30 us a
// layer, ~1 ms of a 30-layer step.
#include "kernels.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <utility>

#include "bf16.h"

namespace {

const uint16_t* bf16_data(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

// n rows of D bf16 values `stride` apart in `x` ([n, 1, D] with any row stride), checked.
const uint16_t* bf16_rows(const at::Tensor& x, int64_t n, int64_t D, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.size(0) == n &&
                  x.size(1) == 1 && x.size(2) == D && x.stride(2) == 1,
              what, ": bf16 [", n, ", 1, ", D, "] with contiguous rows");
  return bf16_data(x);
}

// One position's rotation table: D bf16 values.
const uint16_t* table(const at::Tensor& t, int64_t D) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.numel() == D && t.is_contiguous(),
              "cos and sin: bf16 [1, D]");
  return bf16_data(t);
}

}  // namespace

DecodeLayer::DecodeLayer(at::Tensor win_k, at::Tensor win_v, at::Tensor win_store_k,
                         at::Tensor sink_k, at::Tensor sink_v, at::Tensor pool_k,
                         at::Tensor pool_v, int64_t format, int64_t slot_unit,
                         int64_t max_blocks, at::Tensor anchors, bool quest, bool shared,
                         std::shared_ptr<BlockLru> lru, int64_t layer)
    : win_k_(win_k), win_v_(win_v), win_store_k_(win_store_k), sink_k_(sink_k), sink_v_(sink_v),
      pool_k_(pool_k), pool_v_(pool_v), anchors_(anchors), format_(format),
      slot_unit_(slot_unit), max_blocks_(max_blocks), quest_(quest), shared_(shared),
      lru_(std::move(lru)), layer_(layer) {
  for (const auto* t : {&win_k_, &win_v_, &win_store_k_}) {
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
                "window buffers: contiguous bf16 [n_kv, capacity, D]");
  }
  const int64_t n_kv = win_k_.size(0), D = win_k_.size(2);
  TORCH_CHECK(sink_k_.is_contiguous() && sink_v_.is_contiguous() &&
                  sink_k_.scalar_type() == at::kBFloat16 && sink_v_.scalar_type() == at::kBFloat16 &&
                  sink_k_.numel() == n_kv * sink_k_.size(1) * D && sink_v_.numel() == sink_k_.numel(),
              "sink buffers: contiguous bf16 [n_kv, block, D]");
  TORCH_CHECK(format_ >= 0 && format_ <= 2, "format 0, 1 or 2");
  const auto pool_dtype = format_ == 0 ? at::kBFloat16 : at::kByte;
  TORCH_CHECK(pool_k_.is_contiguous() && pool_v_.is_contiguous() &&
                  pool_k_.scalar_type() == pool_dtype && pool_v_.scalar_type() == pool_dtype &&
                  pool_k_.numel() >= n_kv * max_blocks_ * slot_unit_ &&
                  pool_v_.numel() == pool_k_.numel(),
              "block pools: contiguous, the kv dtype's elements or bytes, n_kv * max_blocks slots");
  TORCH_CHECK(anchors_.dim() == 4 && anchors_.is_contiguous() && anchors_.size(1) == n_kv &&
                  anchors_.size(3) == D &&
                  (anchors_.scalar_type() == at::kBFloat16 || anchors_.scalar_type() == at::kFloat),
              "anchors: contiguous fp32 or bf16 [n_blocks, n_kv, R, D]");
  runs_.resize(n_kv);
}

std::tuple<at::Tensor, at::Tensor> DecodeLayer::decode(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
    at::Tensor far_cos, at::Tensor far_sin, int64_t col, int64_t ws, bool sinks,
    std::optional<at::Tensor> known, int64_t first, int64_t last, int64_t budget,
    at::Tensor pinned) {
  const int64_t n_kv = win_k_.size(0), cap = win_k_.size(1), D = win_k_.size(2);
  const int64_t n_heads = q.size(0), G = n_heads / n_kv;
  TORCH_CHECK(n_heads % n_kv == 0, "n_heads must be a multiple of n_kv");
  const uint16_t* qp = bf16_rows(q, n_heads, D, "query");
  const uint16_t* kp = bf16_rows(k, n_kv, D, "key");
  const uint16_t* vp = bf16_rows(v, n_kv, D, "value");
  TORCH_CHECK(0 <= ws && ws <= col && col < cap, "the window starts at or before the token, in the buffer");

  // The rotations: qa for the window, qf for the far sets (extrapolated positions read them
  // with the query at a fixed distance; native ones with the query as it is: far_cos empty).
  qa_.resize(n_heads * D);
  ka_.resize(n_kv * D);
  const uint16_t *c = table(cos, D), *s = table(sin, D);
  kvchat::rotate_rows(qp, n_heads, q.stride(0), D, c, s, qa_.data());
  kvchat::rotate_rows(kp, n_kv, k.stride(0), D, c, s, ka_.data());
  const uint16_t* qf = qa_.data();
  if (far_cos.numel()) {
    qf_.resize(n_heads * D);
    kvchat::rotate_rows(qp, n_heads, q.stride(0), D, table(far_cos, D), table(far_sin, D),
                        qf_.data());
    qf = qf_.data();
  }
  // Key and value to window column col of each head.
  auto* wk = reinterpret_cast<uint16_t*>(win_k_.data_ptr());
  auto* wv = reinterpret_cast<uint16_t*>(win_v_.data_ptr());
  auto* wsk = reinterpret_cast<uint16_t*>(win_store_k_.data_ptr());
  for (int64_t h = 0; h < n_kv; ++h) {
    const int64_t at = (h * cap + col) * D;
    std::memcpy(wk + at, ka_.data() + h * D, D * 2);
    std::memcpy(wv + at, vp + h * v.stride(0), D * 2);
    if (wsk != wk) std::memcpy(wsk + at, kp + h * k.stride(0), D * 2);
  }
  // Both queries of each head group in fp32, [n_kv, 2, G, D], as the attention reads them.
  q32_.resize(n_kv * 2 * G * D);
  for (int64_t h = 0; h < n_kv; ++h)
    for (int64_t qid = 0; qid < 2; ++qid) {
      const uint16_t* src = (qid ? qf : qa_.data()) + h * G * D;
      float* dst = q32_.data() + (h * 2 + qid) * G * D;
      for (int64_t i = 0; i < G * D; ++i) dst[i] = kvchat::bf16_to_float(src[i]);
    }

  // The blocks to read: the caller's (a reused selection, or none), else ranked here.
  at::Tensor blocks;
  if (known) {
    blocks = known->contiguous();
    TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() >= 1 && blocks.dim() <= 2 &&
                    (blocks.dim() == 1 || blocks.size(0) == n_kv),
                "block ids: int64 [k] or [n_kv, k]");
  } else if (budget > 0 && last > first) {
    TORCH_CHECK(0 <= first && last <= anchors_.size(0), "bad candidate range");
    TORCH_CHECK(anchors_.size(2) == (quest_ ? 2 : 1), "QUEST needs 2 anchor rows, other types 1");
    const int64_t n = std::min(budget, last - first);
    blocks = at::empty(shared_ ? std::vector<int64_t>{n} : std::vector<int64_t>{n_kv, n},
                          at::kLong);
    qsel_.resize(n_heads * D);
    for (int64_t i = 0; i < n_heads * D; ++i) qsel_[i] = kvchat::bf16_to_float(qf[i]);
    TORCH_CHECK(pinned.scalar_type() == at::kLong && pinned.dim() == 1 && pinned.is_contiguous(),
                "pinned: contiguous int64 [P]");
    kvchat::rank_blocks(qsel_.data(), n_heads, anchors_.data_ptr(),
                        anchors_.scalar_type() == at::kBFloat16, n_kv, anchors_.size(2), D,
                        first, last, n, quest_, shared_, pinned.data_ptr<int64_t>(),
                        pinned.numel(), blocks.data_ptr<int64_t>());
  } else {
    blocks = at::empty({0}, at::kLong);
  }

  // The sets: the window (query 0), the sinks and the blocks (query 1); block b of head h is
  // store slot h * max_blocks + b, its run starting at slot * slot_unit (elements of FP16
  // blocks, bytes of quantized ones).
  const int64_t block = sink_k_.size(1);
  sets_.clear();
  sets_.push_back({win_k_.data_ptr(), win_v_.data_ptr(), 0, D});
  if (sinks) sets_.push_back({sink_k_.data_ptr(), sink_v_.data_ptr(), 1, D});
  const int pool = static_cast<int>(sets_.size());
  sets_.push_back({pool_k_.data_ptr(), pool_v_.data_ptr(), 1, D,
                   static_cast<kvchat::Format>(format_)});
  const int64_t k_ids = blocks.dim() ? blocks.size(-1) : 0;
  const int64_t per_head = blocks.dim() == 2 ? k_ids : 0;
  const int64_t* ids = blocks.data_ptr<int64_t>();
  for (int64_t h = 0; h < n_kv; ++h) {
    auto& runs = runs_[h];
    runs.clear();
    runs.push_back({0, (h * cap + ws) * D, col + 1 - ws});
    if (sinks) runs.push_back({1, h * block * D, block});
    for (int64_t j = 0; j < k_ids; ++j) {
      const int64_t id = ids[h * per_head + j];
      TORCH_CHECK(0 <= id && id < max_blocks_, "block id ", id, " outside the store");
      runs.push_back({pool, (h * max_blocks_ + id) * slot_unit_, block});
    }
  }
  if (lru_ && k_ids) {
    // As TorchPath.count_reads (kv/sparse/paths.py): a shared selection's keys are its block
    // ids (each the group of its heads' slots), a separate one's the store slots of every
    // head's blocks.
    keys_.clear();
    if (shared_) {
      keys_.assign(ids, ids + blocks.numel());
    } else {
      for (int64_t h = 0; h < n_kv; ++h)
        for (int64_t j = 0; j < k_ids; ++j)
          keys_.push_back(h * max_blocks_ + ids[h * per_head + j]);
    }
    lru_->touch_keys(layer_, keys_.data(), static_cast<int64_t>(keys_.size()));
  }
  out32_.resize(n_heads * D);
  kvchat::attend_sets(q32_.data(), n_kv, G, D, true, true, sets_, runs_,
                      static_cast<float>(std::pow(static_cast<double>(D), -0.5)), out32_.data());
  auto out = at::empty({n_heads, 1, D}, q.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t i = 0; i < n_heads * D; ++i) op[i] = kvchat::float_to_bf16(out32_[i]);
  return {out, blocks};
}
