// The CPU kernels' entry points, for the Python bindings and for decode_layer.cpp, which
// composes them.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

torch::Tensor decode_attention(torch::Tensor q0, torch::Tensor q1,
                               std::vector<torch::Tensor> k_srcs, std::vector<torch::Tensor> v_srcs,
                               std::vector<int64_t> qids, std::vector<int64_t> strides,
                               std::vector<int64_t> rows, std::vector<torch::Tensor> starts,
                               std::vector<int64_t> formats, int64_t n_kv, double scale);

torch::Tensor select_blocks(torch::Tensor q, torch::Tensor anchors, int64_t first, int64_t last,
                            int64_t k, bool quest, bool shared);

torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// One layer of the block-sparse cache as the decode step's single call sees it (decode_layer.cpp).
class DecodeLayer {
 public:
  DecodeLayer(torch::Tensor win_k, torch::Tensor win_v, torch::Tensor win_store_k,
              torch::Tensor sink_k, torch::Tensor sink_v, torch::Tensor pool_k,
              torch::Tensor pool_v, int64_t format, int64_t slot_unit, int64_t max_blocks,
              torch::Tensor anchors, bool quest, bool shared);

  std::tuple<torch::Tensor, torch::Tensor> decode(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                  torch::Tensor cos, torch::Tensor sin,
                                                  torch::Tensor far_cos, torch::Tensor far_sin,
                                                  int64_t col, int64_t ws, bool sinks,
                                                  std::optional<torch::Tensor> known, int64_t first,
                                                  int64_t last, int64_t budget);

 private:
  torch::Tensor win_k_, win_v_, win_store_k_, sink_k_, sink_v_, pool_k_, pool_v_, anchors_;
  torch::Tensor sink_starts_;  // each head's first sink row in the sink buffers
  int64_t format_, slot_unit_, max_blocks_;
  bool quest_, shared_;
};
