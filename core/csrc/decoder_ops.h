// What decoder_ops.cpp and int4_layer.cpp share: the row functions the single ops and the
// fused int4 layer calls both use (one definition each, so both round alike), and the int4
// ops that decoder_ops.cpp binds.
#pragma once

// torch's pybind11 with its tensor conversions, without the rest of torch/extension.h: both
// files bind their ops.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

#include "tensor.h"

namespace kvchat {

// weight * (x * rsqrt(mean(x^2) + eps)) over H values: the statistics in fp32, the normalised
// row rounded to bf16, then the product with the weight rounded to bf16.
void norm_row(const uint16_t* x, const uint16_t* weight, int64_t H, float eps, uint16_t* out);

// silu(gate) * up over n values: the SiLU rounded to bf16, then the product.
void silu_mul_row(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out);

extern const bool int4_vectorized;

}  // namespace kvchat

at::Tensor int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scale,
                          at::Tensor minimum);
at::Tensor int4_dequantize(at::Tensor packed, at::Tensor scale, at::Tensor minimum);
// Registers Int4Layer, a layer's int4 projections for decode tokens (int4_layer.cpp).
void bind_int4_layer(pybind11::module& m);
