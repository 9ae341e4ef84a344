// The decoder's small per-token ops in C++ (core/cpu_ops.py builds and wraps them).
//
// A decode step on the CPU runs ~60 torch ops per layer besides its matmuls and attention, at
// ~3 us each plus Python: RMSNorm alone is eight ops (~38 us), SiLU-and-multiply three. These
// compute the same values in one pass each (every intermediate rounded to bf16 where torch's
// bf16 ops round; they sum and take exp in another order, so a value in ~1,000 may land one
// bf16 step away). int8_linear is the output layer on a GGUF's Q8_0 weights read
// as they are stored (int8 values, an fp32 scale per 32), half the bytes of a bf16 copy and
// exact: a product of an int8 value and an fp32 input is accumulated in fp32.
#include <torch/extension.h>

#include <cmath>

#include "bf16.h"
#include "decoder_ops.h"
#include "rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using kvchat::bf16_to_float;
using kvchat::float_to_bf16;
using kvchat::round_bf16;

// Rows of a norm or an MLP activation (576 to a few thousand values) per task.
constexpr int64_t GRAIN = 16;

void check_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, " must be bf16");
}

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, as core/model.py's rms_norm: the
// statistics in fp32, the normalised row rounded to bf16, then the product with the weight.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_bf16(x, "rms_norm: x");
  check_bf16(weight, "rms_norm: weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.numel() == H, "rms_norm: weight must have x's last size");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  kvchat::for_rows(x.numel() / H, GRAIN,
                   [&](int64_t r) { kvchat::norm_row(xp + r * H, wp, H, e, op + r * H); });
  return out;
}

// silu(gate) * up for gate_up = [..., gate | up] (the fused projection's two halves), as
// F.silu(gate) * up in bf16: the SiLU rounded to bf16, then the product.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "silu_mul: gate_up");
  const int64_t width = gate_up.size(-1), I = width / 2;
  TORCH_CHECK(width % 2 == 0, "silu_mul: the last dim holds gate and up, so it must be even");
  gate_up = gate_up.contiguous();
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  kvchat::for_rows(gate_up.numel() / width, GRAIN, [&](int64_t r) {
    const uint16_t* gate = gp + r * width;
    kvchat::silu_mul_row(gate, gate + I, I, op + r * I);
  });
  return out;
}

namespace kvchat {

void norm_row(const uint16_t* x, const uint16_t* weight, int64_t H, float eps, uint16_t* out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < H; ++d) squares += bf16_to_float(x[d]) * bf16_to_float(x[d]);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
  for (int64_t d = 0; d < H; ++d)
    out[d] = float_to_bf16(bf16_to_float(weight[d]) * round_bf16(bf16_to_float(x[d]) * inv));
}

void silu_mul_row(const uint16_t* gate, const uint16_t* up, int64_t n, uint16_t* out) {
  for (int64_t d = 0; d < n; ++d) {
    const float g = bf16_to_float(gate[d]);
    out[d] = float_to_bf16(round_bf16(g / (1.f + std::exp(-g))) * bf16_to_float(up[d]));
  }
}

}  // namespace kvchat

// x [M, K] (any float dtype) times the int8 weight q [N, K] with fp32 scales [N, K / 32]:
// fp32 [M, N]. Each 32-value group's products are summed, then scaled.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2, "int8_linear: 2-d tensors");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / 32;
  TORCH_CHECK(q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "int8_linear: int8 weight and fp32 scales");
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K && scales.size(0) == N && scales.size(1) == G,
              "int8_linear: q [N, K] and scales [N, K / 32] for x [M, K], K a multiple of 32");
  auto xf = x.to(torch::kFloat).contiguous();
  q = q.contiguous();
  scales = scales.contiguous();
  auto out = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Output rows (the vocabulary's, for the head) in tasks of 256.
  kvchat::for_rows(N, 256, [&](int64_t n) {
    const int8_t* qr = qp + n * K;
    const float* sr = sp + n * G;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = xp + m * K;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* qg = qr + 32 * g;
        const __m512 q0 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg))));
        const __m512 q1 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16))));
        __m512 dot = _mm512_mul_ps(q0, _mm512_loadu_ps(xr + 32 * g));
        dot = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 32 * g + 16), dot);
        acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(sr[g]), acc);
      }
      op[m * N + n] = _mm512_reduce_add_ps(acc);
#else
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
        for (int i = 0; i < 32; ++i) dot += static_cast<float>(qr[32 * g + i]) * xr[32 * g + i];
        acc += dot * sr[g];
      }
      op[m * N + n] = acc;
#endif
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("int8_linear", &int8_linear);
  m.def("int4_linear", &int4_linear);
  m.def("int4_dequantize", &int4_dequantize);
  m.def("int4_qkv", &int4_qkv);
  m.def("int4_tail", &int4_tail);
  // Whether the int4 ops have their vector path here (else they compute one value at a time).
  m.attr("int4_vectorized") = kvchat::int4_vectorized;
}
