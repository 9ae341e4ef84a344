// The CPU kernels' entry points, for the Python bindings and for decode_layer.cpp, which
// composes them.
#pragma once

#include "tensor.h"

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace kvchat {

// How a key set's rows are stored: in the kv dtype, or as a BlockPool's INT8 / INT4 byte rows.
enum class Format : int64_t { Plain = 0, Int8 = 1, Int4 = 2 };

// A key set: rows of head_dim elements in contiguous K and V sources, `stride` elements apart,
// read with query 0 or query 1 (the local window's and the retrieved blocks' rotations differ).
struct KeySet {
  const void* k;
  const void* v;
  int qid;
  int64_t stride;
  // Quantized blocks: each run is a block of `rows` rows of values, followed by all their
  // scales, then (INT4) all their minimums; `start` its byte offset. Dequantized a tile at a
  // time into a buffer that the rest of the kernel reads like any other rows.
  Format format = Format::Plain;
};

// `rows` rows of set `set` from element (or, quantized, byte) `start`.
struct KeyRun {
  int set;
  int64_t start;
  int64_t rows;
};

// decode_attention on raw buffers, for callers that hold them already: q fp32 [n_kv, 2, G, D]
// (each KV head's group under query 0, then query 1), runs[h] the runs head h reads (at least
// one, inside their sources: not checked here); writes out fp32 [n_kv, G, D]. bf16: the
// sources hold bf16 (else fp32); bf16_queries: the queries are bf16 values (exact in bf16).
void attend_sets(const float* q, int64_t n_kv, int64_t G, int64_t D, bool bf16, bool bf16_queries,
                 const std::vector<KeySet>& sets, const std::vector<std::vector<KeyRun>>& runs,
                 float scale, float* out);

// select_blocks on raw buffers: q fp32 [n_heads, D], anchors [n_blocks, n_kv, R, D] (bf16 when
// `bf16`, else fp32); the n_pinned block ids at `pinned` outrank every other candidate; writes
// k (<= last - first) ids ascending per ranking ([k] shared, [n_kv, k] otherwise) to out.
void rank_blocks(const float* q, int64_t n_heads, const void* anchors, bool bf16, int64_t n_kv,
                 int64_t R, int64_t D, int64_t first, int64_t last, int64_t k, bool quest,
                 bool shared, const int64_t* pinned, int64_t n_pinned, int64_t* out);

// rotate for one position: rows of D bf16 values x -> out (rotated with cos, sin: D each).
void rotate_rows(const uint16_t* x, int64_t rows, int64_t x_stride, int64_t D,
                 const uint16_t* cos, const uint16_t* sin, uint16_t* out);

}  // namespace kvchat

at::Tensor decode_attention(at::Tensor q0, at::Tensor q1,
                               std::vector<at::Tensor> k_srcs, std::vector<at::Tensor> v_srcs,
                               std::vector<int64_t> qids, std::vector<int64_t> strides,
                               std::vector<int64_t> rows, std::vector<at::Tensor> starts,
                               std::vector<int64_t> formats, int64_t n_kv, double scale);

at::Tensor select_blocks(at::Tensor q, at::Tensor anchors, int64_t first, int64_t last,
                            int64_t k, bool quest, bool shared, at::Tensor pinned);

at::Tensor rotate(at::Tensor x, at::Tensor cos, at::Tensor sin);

at::Tensor block_max(at::Tensor scores, int64_t block);

at::Tensor gather_blocks(at::Tensor storage, at::Tensor slots, at::Tensor out,
                            int64_t format);

// Which blocks each layer would find resident on the compute device (block_lru.cpp): an LRU of
// `capacity` keys per layer. A touch counts each key as a hit (made the most recent) or a
// miss (added, the least recent evicted when over capacity), in order.
class BlockLru {
 public:
  BlockLru(int64_t n_layers, int64_t capacity);
  // Returns the misses; hits() and misses() count every touch so far.
  int64_t touch(int64_t layer, at::Tensor keys);
  int64_t touch_keys(int64_t layer, const int64_t* keys, int64_t n);
  // A smaller capacity drops each layer's least recently used keys.
  void resize(int64_t capacity);
  void clear();
  int64_t used() const;
  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }

 private:
  struct Layer {
    std::list<int64_t> order;  // least recent first
    std::unordered_map<int64_t, std::list<int64_t>::iterator> where;
  };
  void evict_oldest(Layer& l);
  std::vector<Layer> layers_;
  int64_t capacity_ = 0, hits_ = 0, misses_ = 0;
};

// One layer of the block-sparse cache as the decode step's single call sees it (decode_layer.cpp).
class DecodeLayer {
 public:
  DecodeLayer(at::Tensor win_k, at::Tensor win_v, at::Tensor win_store_k,
              at::Tensor sink_k, at::Tensor sink_v, at::Tensor pool_k,
              at::Tensor pool_v, int64_t format, int64_t slot_unit, int64_t max_blocks,
              at::Tensor anchors, bool quest, bool shared, std::shared_ptr<BlockLru> lru,
              int64_t layer);

  std::tuple<at::Tensor, at::Tensor> decode(at::Tensor q, at::Tensor k, at::Tensor v,
                                                  at::Tensor cos, at::Tensor sin,
                                                  at::Tensor far_cos, at::Tensor far_sin,
                                                  int64_t col, int64_t ws, bool sinks,
                                                  std::optional<at::Tensor> known, int64_t first,
                                                  int64_t last, int64_t budget,
                                                  at::Tensor pinned);

 private:
  at::Tensor win_k_, win_v_, win_store_k_, sink_k_, sink_v_, pool_k_, pool_v_, anchors_;
  int64_t format_, slot_unit_, max_blocks_;
  bool quest_, shared_;
  // Where this layer's block reads are counted (the device block cache), as keys: block ids
  // (shared selection) or store slots.
  std::shared_ptr<BlockLru> lru_;
  int64_t layer_;
  std::vector<int64_t> keys_;
  // A step's working buffers, kept between calls: the rotated query (window, far) and key,
  // the queries and output in fp32, the selection's query, the key sets and each head's runs.
  std::vector<uint16_t> qa_, qf_, ka_;
  std::vector<float> q32_, out32_, qsel_;
  std::vector<kvchat::KeySet> sets_;
  std::vector<std::vector<kvchat::KeyRun>> runs_;
};
