// The part of ATen the kernels use: tensors and their methods, the factories they call and
// torch's thread pool. torch/extension.h, all of libtorch's C++ API, takes ~30 s to compile
// per file on a 2-core AVX2 machine; this ~8 s.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>
