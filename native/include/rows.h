// Rows of a [rows, width] problem, split across torch's threads only when there are many:
// waking the pool costs more than a decode step's few rows.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace kvchat {

template <typename F>
void for_rows(int64_t rows, int64_t grain, F&& row) {
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) row(r);
  });
}

}  // namespace kvchat
