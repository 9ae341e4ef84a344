// The device block cache's residency accounting (kv/device_cache.py) in C++: one LRU of keys
// per layer. In Python it costs ~20 us a layer of a decode step (0.4-0.6 ms of a 128K step: a
// list from the tensor, then a dict operation per block, all slowed by the step's evicted
// caches); here DecodeLayer counts its own reads without returning to Python, and the other
// paths call touch with a tensor.
#include "kernels.h"

BlockLru::BlockLru(int64_t n_layers, int64_t capacity) : layers_(n_layers) { resize(capacity); }

int64_t BlockLru::touch_keys(int64_t layer, const int64_t* keys, int64_t n) {
  TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(layers_.size()), "layer ", layer,
              " outside the cache's ", layers_.size());
  Layer& l = layers_[layer];
  int64_t misses = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto found = l.where.find(keys[i]);
    if (found != l.where.end()) {
      l.order.splice(l.order.end(), l.order, found->second);
      continue;
    }
    ++misses;
    l.where.emplace(keys[i], l.order.insert(l.order.end(), keys[i]));
    if (static_cast<int64_t>(l.order.size()) > capacity_) evict_oldest(l);
  }
  hits_ += n - misses;
  misses_ += misses;
  return misses;
}

int64_t BlockLru::touch(int64_t layer, at::Tensor keys) {
  const auto flat = keys.to(at::kLong).contiguous();
  return touch_keys(layer, flat.data_ptr<int64_t>(), flat.numel());
}

void BlockLru::resize(int64_t capacity) {
  TORCH_CHECK(capacity >= 0, "a negative capacity");
  capacity_ = capacity;
  for (auto& l : layers_)
    while (static_cast<int64_t>(l.order.size()) > capacity_) evict_oldest(l);
}

void BlockLru::clear() {
  for (auto& l : layers_) {
    l.order.clear();
    l.where.clear();
  }
}

int64_t BlockLru::used() const {
  int64_t n = 0;
  for (const auto& l : layers_) n += static_cast<int64_t>(l.order.size());
  return n;
}

void BlockLru::evict_oldest(Layer& l) {
  l.where.erase(l.order.front());
  l.order.pop_front();
}
