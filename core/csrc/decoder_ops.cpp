// The decoder's small per-token ops in C++ (core/cpu_ops.py builds and wraps them).
//
// A decode step on the CPU runs ~60 torch ops per layer besides its matmuls and attention, at
// ~3 us each plus Python: RMSNorm alone is eight ops (~38 us), SiLU-and-multiply three. These
// compute the same values in one pass each (every intermediate rounded to bf16 where torch's
// bf16 ops round; they sum and take exp in another order, so a value in ~1,000 may land one
// bf16 step away). int8_linear is the product with a GGUF's Q8_0, Q5_0 or Q6_K weights as
// they are stored (int8 values, a scale per 32 or per 16; reordered into tiles of 16 rows),
// half the bytes of a bf16 copy and exact but for the inputs' 16-bit rounding (1/65024 of a
// group's largest); int8_dequantize unpacks them to bf16 for products of many rows.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "decoder_ops.h"
#include "quant_row.h"
#include "rows.h"

namespace {

using kvchat::bf16_to_float;
using kvchat::float_to_bf16;
using kvchat::round_bf16;

// Rows of a norm or an MLP activation (576 to a few thousand values) per task.
constexpr int64_t GRAIN = 16;

void check_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, " must be bf16");
}

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, as core/model.py's rms_norm: the
// statistics in fp32, the normalised row rounded to bf16, then the product with the weight.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_bf16(x, "rms_norm: x");
  check_bf16(weight, "rms_norm: weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.numel() == H, "rms_norm: weight must have x's last size");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
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
at::Tensor silu_mul(at::Tensor gate_up) {
  check_bf16(gate_up, "silu_mul: gate_up");
  const int64_t width = gate_up.size(-1), I = width / 2;
  TORCH_CHECK(width % 2 == 0, "silu_mul: the last dim holds gate and up, so it must be even");
  gate_up = gate_up.contiguous();
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
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

namespace {

using kvchat::QuantBuffer;
using kvchat::QuantRow;

// The sum of the row's 16-bit integers under weight scale s of group g (S scales a group).
template <int S>
inline int32_t int_sum(const QuantRow& x, int64_t g, int s) {
  return S == 1 ? x.int_sums[2 * g] + x.int_sums[2 * g + 1] : x.int_sums[2 * g + s];
}

// The row's exact sum under weight scale s of group g, which a minimum multiplies.
template <int S>
inline float input_sum(const QuantRow& x, int64_t g, int s) {
  return S == 1 ? x.sums[g] : x.half_sums[2 * g + s];
}

#if KVCHAT_VNNI
// Output rows 16 t .. 16 (t + NT) of the int8 weight for the quantized row x, NT tiles side by
// side (as int4_layer.cpp's tiles), with S weight scales per group of 32 inputs (1: Q8_0 and
// Q5_0; 2: Q6_K's 16): per scale, D = 256 sum w h + sum w l - 128 X16 is the exact integer
// product of the signed weights q = w - 128 and the row's 16-bit integers.
template <int NT, int S>
void int8_tiles(const uint8_t* packed, const float* scale, const float* minimum,
                const QuantRow& x, int64_t K, int64_t t, float* out) {
  const int64_t G = K / 32;
  constexpr int C = 8 / S;  // chunks of 4 inputs under one scale
  __m512 acc[NT];
  for (int i = 0; i < NT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int i = 0; i < NT; ++i)
      kvchat::prefetch_bytes(packed + (t + i) * 16 * K + (g + 2) * 512, 512);
    const __m512 dx = _mm512_set1_ps(x.scale[g]);
    for (int s = 0; s < S; ++s) {
      __m512i high[NT], low[NT];
      for (int i = 0; i < NT; ++i) high[i] = low[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = C * s; c < C * (s + 1); ++c) {
        const __m512i h = kvchat::broadcast4(x.high + 32 * g + 4 * c);
        const __m512i l = kvchat::broadcast4(x.low + 32 * g + 4 * c);
#pragma GCC unroll 2
        for (int i = 0; i < NT; ++i) {
          const __m512i w = _mm512_loadu_si512(packed + (t + i) * 16 * K + g * 512 + 64 * c);
          high[i] = _mm512_dpbusd_epi32(high[i], w, h);
          low[i] = _mm512_dpbusd_epi32(low[i], w, l);
        }
      }
      const __m512i offset = _mm512_set1_epi32(128 * int_sum<S>(x, g, s));
      for (int i = 0; i < NT; ++i) {
        const __m512i d = _mm512_sub_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(high[i], 8), low[i]), offset);
        const int64_t at = (((t + i) * G + g) * S + s) * 16;
        const __m512 w_scale = _mm512_loadu_ps(scale + at);
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(w_scale, dx), _mm512_cvtepi32_ps(d), acc[i]);
        if (minimum != nullptr)
          acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(minimum + at),
                                   _mm512_set1_ps(input_sum<S>(x, g, s)), acc[i]);
      }
    }
  }
  for (int i = 0; i < NT; ++i) _mm512_storeu_ps(out + 16 * (t + i), acc[i]);
}
#elif KVCHAT_AVX2_INT
// The same products on AVX2, on the row's 16-bit integers themselves: 4 rows' 4 weights
// (16 bytes of a chunk) widened to 16 bits, times the 4 inputs (one 64-bit lane each) by
// vpmaddwd, two int32 sums a row; a scale's chunks add up in int32 (each sum is below
// 2 * 255 * 32512), and one vphaddd a pair of row quads makes them one sum a row. The sums
// are exactly the VNNI path's, so both give the same fp32 results.
template <int NT, int S>
void int8_tiles(const uint8_t* packed, const float* scale, const float* minimum,
                const QuantRow& x, int64_t K, int64_t t, float* out) {
  const int64_t G = K / 32;
  constexpr int C = 8 / S;
  // vphaddd leaves rows 0, 1, 4, 5, 2, 3, 6, 7 of two quads.
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  __m256 acc[NT][2];
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int i = 0; i < NT; ++i)
      kvchat::prefetch_bytes(packed + (t + i) * 16 * K + (g + 2) * 512, 512);
    const __m256 dx = _mm256_set1_ps(x.scale[g]);
    for (int s = 0; s < S; ++s) {
      __m256i sums[NT][4];
      for (int i = 0; i < NT; ++i)
        for (int quad = 0; quad < 4; ++quad) sums[i][quad] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = C * s; c < C * (s + 1); ++c) {
        int64_t inputs;
        std::memcpy(&inputs, x.x16 + 32 * g + 4 * c, 8);
        const __m256i xs = _mm256_set1_epi64x(inputs);
        for (int i = 0; i < NT; ++i)
          for (int quad = 0; quad < 4; ++quad) {
            const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                packed + (t + i) * 16 * K + g * 512 + 64 * c + 16 * quad)));
            sums[i][quad] = _mm256_add_epi32(sums[i][quad], _mm256_madd_epi16(w, xs));
          }
      }
      const __m256i offset = _mm256_set1_epi32(128 * int_sum<S>(x, g, s));
      for (int i = 0; i < NT; ++i)
        for (int half = 0; half < 2; ++half) {
          const __m256i rows = _mm256_permutevar8x32_epi32(
              _mm256_hadd_epi32(sums[i][2 * half], sums[i][2 * half + 1]), order);
          const __m256i d = _mm256_sub_epi32(rows, offset);
          const int64_t at = (((t + i) * G + g) * S + s) * 16 + 8 * half;
          const __m256 w_scale = _mm256_loadu_ps(scale + at);
          acc[i][half] =
              _mm256_fmadd_ps(_mm256_mul_ps(w_scale, dx), _mm256_cvtepi32_ps(d), acc[i][half]);
          if (minimum != nullptr)
            acc[i][half] = _mm256_fmadd_ps(_mm256_loadu_ps(minimum + at),
                                           _mm256_set1_ps(input_sum<S>(x, g, s)), acc[i][half]);
        }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int half = 0; half < 2; ++half) _mm256_storeu_ps(out + 16 * (t + i) + 8 * half, acc[i][half]);
}
#else
// The same products one value at a time (CPUs without AVX2 or AVX512-VNNI).
template <int NT, int S>
void int8_tiles(const uint8_t* packed, const float* scale, const float* minimum,
                const QuantRow& x, int64_t K, int64_t t, float* out) {
  const int64_t G = K / 32;
  constexpr int C = 8 / S;
  for (int64_t tile = t; tile < t + NT; ++tile) {
    float acc[16] = {};
    for (int64_t g = 0; g < G; ++g)
      for (int s = 0; s < S; ++s) {
        int32_t dot[16] = {};
        for (int c = C * s; c < C * (s + 1); ++c)
          for (int r = 0; r < 16; ++r)
            for (int j = 0; j < 4; ++j) {
              const int64_t k = 32 * g + 4 * c + j;
              dot[r] += packed[tile * 16 * K + g * 512 + 64 * c + 4 * r + j] *
                        (256 * x.high[k] + x.low[k]);
            }
        for (int r = 0; r < 16; ++r) {
          const int64_t at = ((tile * G + g) * S + s) * 16 + r;
          acc[r] = std::fma(scale[at] * x.scale[g],
                            static_cast<float>(dot[r] - 128 * int_sum<S>(x, g, s)), acc[r]);
          if (minimum != nullptr) acc[r] = std::fma(minimum[at], input_sum<S>(x, g, s), acc[r]);
        }
      }
    std::copy(acc, acc + 16, out + 16 * tile);
  }
}
#endif

// The weight scales per group of 32 inputs of an int8 weight's scale tensor [N / 16, S K / 32,
// 16]: 1 (Q8_0, Q5_0) or 2 (Q6_K).
int64_t scales_per_group(const at::Tensor& packed, const at::Tensor& scale,
                         const char* what) {
  TORCH_CHECK(packed.dim() == 2 && scale.dim() == 3 && packed.scalar_type() == at::kByte &&
                  scale.scalar_type() == at::kFloat,
              what, ": uint8 packed [N / 16, 16 K] and fp32 scale [N / 16, S K / 32, 16]");
  const int64_t T = packed.size(0), K = packed.size(1) / 16, G = K / 32;
  TORCH_CHECK(packed.size(1) % 512 == 0 && G > 0 && scale.size(0) == T && scale.size(2) == 16 &&
                  (scale.size(1) == G || scale.size(1) == 2 * G),
              what, ": packed [N / 16, 16 K] and scale [N / 16, S K / 32, 16] with S 1 or 2, K a "
              "multiple of 32");
  return scale.size(1) / G;
}

// The minimums' data (fp32, the scales' shape), or nullptr for weights without them.
const float* minimum_data(const c10::optional<at::Tensor>& minimum, const at::Tensor& scale,
                          const char* what) {
  if (!minimum.has_value()) return nullptr;
  TORCH_CHECK(minimum->scalar_type() == at::kFloat && minimum->is_contiguous() &&
                  minimum->sizes() == scale.sizes(),
              what, ": minimums fp32 and contiguous, in the scales' shape");
  return minimum->data_ptr<float>();
}

template <int S>
void int8_rows(const std::vector<QuantBuffer>& rows, const uint8_t* pp, const float* sp,
               const float* mp, int64_t K, int64_t T, float* op) {
  // Pairs of tiles (32 of the vocabulary's rows, for the head) in tasks of 16.
  at::parallel_for(0, (T + 1) / 2, 16, [&](int64_t lo, int64_t hi) {
    for (size_t m = 0; m < rows.size(); ++m) {
      const QuantRow row = rows[m].row();
      for (int64_t pair = lo; pair < hi; ++pair) {
        if (2 * pair + 1 < T)
          int8_tiles<2, S>(pp, sp, mp, row, K, 2 * pair, op + m * 16 * T);
        else
          int8_tiles<1, S>(pp, sp, mp, row, K, 2 * pair, op + m * 16 * T);
      }
    }
  });
}

}  // namespace

// x [M, K] (fp32 or bf16) times a GGUF int8 weight in core/linear.py's pack_int8 layout:
// packed uint8 [N / 16, 16 K] (the int8 values plus 128; tile t's group g is 8 chunks of 64
// bytes, byte 4 r + j of chunk c holding row 16 t + r's input 32 g + 4 c + j) and fp32 scales
// [N / 16, S K / 32, 16], one per 32 inputs (S = 1) or per 16 (S = 2), and where the weights
// have them (Q5_1, Q5_K: q * scale + minimum) fp32 minimums of the same shape: fp32 [M, N].
// The rows of x go in as 16-bit integers per group of 32 (quant_row.h), so the weights
// multiply them exactly in int32 with vpdpbusd: fp32 products run at ~12 GB/s, bound by
// widening every weight to an fp32.
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scale,
                          c10::optional<at::Tensor> minimum) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x [M, K]");
  const int64_t S = scales_per_group(packed, scale, "int8_linear");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0);
  TORCH_CHECK(packed.size(1) == 16 * K, "int8_linear: packed [N / 16, 16 K] for x [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_linear: x must be fp32 or bf16");
  x = x.contiguous();
  packed = packed.contiguous();
  scale = scale.contiguous();
  std::vector<QuantBuffer> rows;
  rows.reserve(M);
  for (int64_t m = 0; m < M; ++m) {
    rows.emplace_back(K);
    if (x.scalar_type() == at::kFloat)
      kvchat::quantize_groups(x.data_ptr<float>() + m * K, K, rows.back());
    else
      kvchat::quantize_groups(reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * K, K,
                              rows.back());
  }
  auto out = at::empty({M, 16 * T}, x.options().dtype(at::kFloat));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minimum_data(minimum, scale, "int8_linear");
  float* op = out.data_ptr<float>();
  if (S == 1)
    int8_rows<1>(rows, pp, sp, mp, K, T, op);
  else
    int8_rows<2>(rows, pp, sp, mp, K, T, op);
  return out;
}

// The bf16 weight [N', K] of int8_linear's layout, each value q * scale (+ minimum) in fp32
// rounded to bf16, for the bf16 products of prefill chunks: unpacked at each call, which a
// chunk's product amortizes (as int4_dequantize).
at::Tensor int8_dequantize(at::Tensor packed, at::Tensor scale,
                              c10::optional<at::Tensor> minimum) {
  const int64_t S = scales_per_group(packed, scale, "int8_dequantize");
  const int64_t T = packed.size(0), K = packed.size(1) / 16, G = K / 32;
  packed = packed.contiguous();
  scale = scale.contiguous();
  auto out = at::empty({16 * T, K}, at::kBFloat16);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minimum_data(minimum, scale, "int8_dequantize");
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, T, 1, [&](int64_t lo, int64_t hi) {
    // A chunk's 64 bytes in order (16 rows' 4 inputs each) vectorize; their 4-value pieces
    // are then copied to the 16 rows.
    float scales[64], minimums[64] = {};
    uint16_t values[64];
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < 8; ++c) {
          if (c % (8 / S) == 0) {
            const int64_t at = ((t * G + g) * S + c * S / 8) * 16;
            for (int i = 0; i < 64; ++i) scales[i] = sp[at + i / 4];
            if (mp != nullptr)
              for (int i = 0; i < 64; ++i) minimums[i] = mp[at + i / 4];
          }
          const uint8_t* chunk = pp + t * 16 * K + g * 512 + 64 * c;
          for (int i = 0; i < 64; ++i) {
            const int q = static_cast<int>(chunk[i]) - 128;
            values[i] = float_to_bf16(static_cast<float>(q) * scales[i] + minimums[i]);
          }
          for (int r = 0; r < 16; ++r)
            std::memcpy(op + (16 * t + r) * K + 32 * g + 4 * c, values + 4 * r, 8);
        }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  namespace py = pybind11;
  m.def("int8_linear", &int8_linear, py::arg("x"), py::arg("packed"), py::arg("scale"),
        py::arg("minimum") = py::none());
  m.def("int8_dequantize", &int8_dequantize, py::arg("packed"), py::arg("scale"),
        py::arg("minimum") = py::none());
  m.def("int4_linear", &int4_linear);
  m.def("int4_dequantize", &int4_dequantize);
  bind_int4_layer(m);
  // Whether the int4 ops have their vector path here (else they compute one value at a time).
  m.attr("int4_vectorized") = kvchat::int4_vectorized;
  // The integer products' path in this build: what a product of many rows weighs against.
  m.attr("integer_products") = KVCHAT_VNNI ? "avx512-vnni" : KVCHAT_AVX2_INT ? "avx2" : "scalar";
}
