// RoPE's rotation of bf16 queries and keys in one pass, bit for bit what kv/positions.py's
// torch expression gives: x * cos and rotate_half(x) * sin each rounded to bf16, their sum
// rounded again (a product of two bf16 values is exact in fp32, so the roundings match).
// Eight torch ops and their temporaries cost 17-28 us a call at decode sizes here; this 1-2.5.
#include "tensor.h"

#include "bf16.h"
#include "kernels.h"
#include "rows.h"

namespace {

using kvchat::bf16_to_float;
using kvchat::float_to_bf16;
using kvchat::round_bf16;

void rotate_row(const uint16_t* x, const uint16_t* c, const uint16_t* s, int64_t half,
                uint16_t* out) {
  for (int64_t d = 0; d < half; ++d)
    out[d] = float_to_bf16(round_bf16(bf16_to_float(x[d]) * bf16_to_float(c[d])) -
                           round_bf16(bf16_to_float(x[d + half]) * bf16_to_float(s[d])));
  for (int64_t d = half; d < 2 * half; ++d)
    out[d] = float_to_bf16(round_bf16(bf16_to_float(x[d]) * bf16_to_float(c[d])) +
                           round_bf16(bf16_to_float(x[d - half]) * bf16_to_float(s[d])));
}

}  // namespace

// x: bf16 [..., T, D]; cos, sin: bf16 [T, D]. Returns a new contiguous tensor like x.
at::Tensor rotate(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16, "rotate: bf16 tensors");
  const int64_t D = x.size(-1), T = x.dim() > 1 ? x.size(-2) : 1;
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D,
              "rotate: cos and sin must be [T, D] for x [..., T, D] with D even");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = at::empty_like(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t rows = x.numel() / D;
  // Rows of one head's D values: a prefill chunk's many, a decode step's few (kept on one thread).
  kvchat::for_rows(rows, 256, [&](int64_t r) {
    const int64_t t = r % T;
    rotate_row(xp + r * D, cp + t * D, sp + t * D, D / 2, op + r * D);
  });
  return out;
}

void kvchat::rotate_rows(const uint16_t* x, int64_t rows, int64_t x_stride, int64_t D,
                         const uint16_t* cos, const uint16_t* sin, uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) rotate_row(x + r * x_stride, cos, sin, D / 2, out + r * D);
}
