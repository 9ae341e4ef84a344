// GGUF Q4_0 / Q4_1 weights on the CPU in a packed layout of our own: int4_linear (products of
// a few rows), int4_dequantize (the bf16 weight, for the bf16 products of prefill chunks), and
// a decode token's pass through a layer's projections in two calls, int4_qkv (RMSNorm, then
// q, k and v) and int4_tail (the output projection and the residual, RMSNorm, gate and up,
// SiLU-and-multiply, down and the residual), each in one parallel region.
//
// The weights are laid out by core/int4_layer.py's pack_int4: 16 output rows per vector, a
// tile of 16 rows stored so that 32 bytes hold a pair of adjacent inputs of each of the 16
// rows for two input pairs (low and high nibbles). A nibble q becomes the bf16 1 + q/16 by
// bit operations alone, so one vdpbf16ps multiplies 16 rows by a (broadcast) input pair
// exactly and sums in fp32: D = sum (1 + q/16) x over a group of 32, which adds
// 16 scale (D - X) + minimum X to each row, X = sum x. The scales stay the file's fp16 values
// (torch's int4 kernel rounds them to bf16).
//
// Why fused: a decode step ran torch's int4 kernel 120 times (four products a layer), each
// call with its Python, its dispatch and its own fork and join of the two threads, and the
// norm, SiLU and residual adds between them as separate calls; the main thread of a 128K step
// spent ~16% of its samples waiting in OpenMP for the other thread and ~25% in Python and
// small ops (py-spy). Here a layer is two calls with two barriers inside the second.
// Every intermediate is rounded to bf16 where the single ops round, so the fused calls give
// bit for bit what int4_linear, rms_norm, silu_mul and bf16 adds give one after another.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "bf16.h"
#include "decoder_ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KVCHAT_INT4_DPBF16 1
#else
#define KVCHAT_INT4_DPBF16 0
#endif

namespace kvchat {
const bool int4_vectorized = KVCHAT_INT4_DPBF16;
}  // namespace kvchat

namespace {

using kvchat::bf16_to_float;
using kvchat::float_to_bf16;

// A weight in pack_int4's layout: K inputs, T tiles of 16 output rows.
struct Int4Matrix {
  const uint8_t* packed;
  const uint16_t* scale;
  const uint16_t* minimum;
  int64_t K;
  int64_t T;
};

// parts = (packed uint8 [T, 8 K], scale and minimum fp16 [T, K / 32, 16]), held contiguous by
// the caller (the kernels keep pointers into them).
Int4Matrix int4_matrix(const std::vector<torch::Tensor>& parts, int64_t K, const char* what) {
  TORCH_CHECK(parts.size() == 3, what, ": (packed, scale, minimum)");
  const auto& packed = parts[0];
  const auto& scale = parts[1];
  const auto& minimum = parts[2];
  TORCH_CHECK(packed.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf &&
                  minimum.scalar_type() == at::kHalf,
              what, ": uint8 packed values, fp16 scales and minimums");
  TORCH_CHECK(packed.is_contiguous() && scale.is_contiguous() && minimum.is_contiguous(), what,
              ": contiguous parts");
  const int64_t T = packed.dim() == 2 ? packed.size(0) : 0;
  TORCH_CHECK(K % 32 == 0 && T > 0 && packed.size(1) == 8 * K && scale.dim() == 3 &&
                  scale.size(0) == T && scale.size(1) == K / 32 && scale.size(2) == 16 &&
                  minimum.sizes() == scale.sizes(),
              what, ": packed [N / 16, 8 K], scale and minimum [N / 16, K / 32, 16] for ", K,
              " inputs, K a multiple of 32");
  return {packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr()),
          reinterpret_cast<const uint16_t*>(minimum.data_ptr()), K, T};
}

const uint16_t* bf16_data(const torch::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == numel, what,
              ": a contiguous bf16 tensor of ", numel, " values");
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

#if KVCHAT_INT4_DPBF16
// Output rows 16 t .. 16 (t + NT) for the input row xr (group sums xs), NT tiles side by side:
// one tile's chain of vdpbf16ps waits on its latency, two keep the core busy (a one-thread
// 33 MB product: 6.0 -> 11.5 GB/s; on two threads both read at the memory's ~20 GB/s).
template <int NT>
void int4_tiles(const uint8_t* packed, const uint16_t* scale, const uint16_t* minimum,
                const uint16_t* xr, const float* xs, int64_t K, int64_t t, uint16_t* out) {
  const int64_t G = K / 32;
  const auto* pairs = reinterpret_cast<const int32_t*>(xr);
  const __m512i low = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);
  __m512 acc[NT];
  for (int i = 0; i < NT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 d0[NT], d1[NT];
    for (int i = 0; i < NT; ++i) d0[i] = d1[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(pairs[16 * g + 2 * c]);
      const __m512bh x1 = (__m512bh)_mm512_set1_epi32(pairs[16 * g + 2 * c + 1]);
#pragma GCC unroll 2
      for (int i = 0; i < NT; ++i) {
        const uint8_t* chunk = packed + (t + i) * 8 * K + g * 256 + 32 * c;
        const __m512i w =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(w, 3), low), one);
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 1), low), one);
        d0[i] = _mm512_dpbf16_ps(d0[i], (__m512bh)lo, x0);
        d1[i] = _mm512_dpbf16_ps(d1[i], (__m512bh)hi, x1);
      }
    }
    const __m512 sum = _mm512_set1_ps(xs[g]);
    for (int i = 0; i < NT; ++i) {
      const int64_t at = ((t + i) * G + g) * 16;
      const __m512 s16 = _mm512_mul_ps(
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + at))),
          _mm512_set1_ps(16.f));
      const __m512 mn =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + at)));
      acc[i] = _mm512_fmadd_ps(s16, _mm512_sub_ps(_mm512_add_ps(d0[i], d1[i]), sum), acc[i]);
      acc[i] = _mm512_fmadd_ps(mn, sum, acc[i]);
    }
  }
  for (int i = 0; i < NT; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * (t + i)),
                        (__m256i)_mm512_cvtneps_pbh(acc[i]));
}
#else
// The same products one value at a time (CPUs without AVX512-BF16; core/linear.py uses
// torch's kernel there, this keeps the op correct everywhere).
template <int NT>
void int4_tiles(const uint8_t* packed, const uint16_t* scale, const uint16_t* minimum,
                const uint16_t* xr, const float* xs, int64_t K, int64_t t, uint16_t* out) {
  const int64_t G = K / 32;
  for (int64_t row = 16 * t; row < 16 * (t + NT); ++row) {
    const int64_t tile = row / 16, r = row % 16;
    float acc = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = (tile * G + g) * 16 + r;
      const float s = static_cast<float>(c10::Half(scale[at], c10::Half::from_bits()));
      const float mn = static_cast<float>(c10::Half(minimum[at], c10::Half::from_bits()));
      float dot = 0.f;
      for (int c = 0; c < 8; ++c)
        for (int e = 0; e < 2; ++e) {
          const uint8_t b = packed[tile * 8 * K + g * 256 + 32 * c + 2 * r + e];
          dot += static_cast<float>(b & 15) * bf16_to_float(xr[32 * g + 4 * c + e]) +
                 static_cast<float>(b >> 4) * bf16_to_float(xr[32 * g + 4 * c + 2 + e]);
        }
      acc += s * dot + mn * xs[g];
    }
    out[row] = float_to_bf16(acc);
  }
}
#endif

// Output tiles [t0, t1) of m for the input row xr: two at a time, then an odd last one.
void int4_range(const Int4Matrix& m, const uint16_t* xr, const float* sums, int64_t t0,
                int64_t t1, uint16_t* out) {
  int64_t t = t0;
  for (; t + 1 < t1; t += 2) int4_tiles<2>(m.packed, m.scale, m.minimum, xr, sums, m.K, t, out);
  if (t < t1) int4_tiles<1>(m.packed, m.scale, m.minimum, xr, sums, m.K, t, out);
}

// The sums of K / 32 groups of 32 inputs in fp32 (one definition: every caller sums alike).
__attribute__((noinline)) void group_sums(const uint16_t* x, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    float s = 0.f;
    for (int i = 0; i < 32; ++i) s += bf16_to_float(x[32 * g + i]);
    out[g] = s;
  }
}

// Thread tid's share of n tiles among nth threads, in whole pairs (two tiles are 32 rows: one
// input group of the next product).
std::pair<int64_t, int64_t> share(int64_t n, int tid, int nth) {
  const int64_t pairs = (n + 1) / 2;
  return {std::min(n, 2 * (pairs * tid / nth)), std::min(n, 2 * (pairs * (tid + 1) / nth))};
}

// a + b in bf16 over rows [lo, hi), as torch adds two bf16 tensors.
void add_rows(const uint16_t* a, const uint16_t* b, int64_t lo, int64_t hi, uint16_t* out) {
  for (int64_t r = lo; r < hi; ++r) out[r] = float_to_bf16(bf16_to_float(a[r]) + bf16_to_float(b[r]));
}

}  // namespace

// x [M, K] bf16 times an int4 weight [N, K] in pack_int4's layout (packed, scale, minimum):
// bf16 [M, N].
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                          torch::Tensor minimum) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  x = x.contiguous();
  const std::vector<torch::Tensor> parts = {packed.contiguous(), scale.contiguous(),
                                            minimum.contiguous()};
  const Int4Matrix m = int4_matrix(parts, K, "int4_linear");
  const uint16_t* xp = bf16_data(x, M * K, "int4_linear: x");
  const int64_t N = 16 * m.T;
  auto out = torch::empty({M, N}, x.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<float> sums(M * (K / 32));
  for (int64_t r = 0; r < M; ++r) group_sums(xp + r * K, K, sums.data() + r * (K / 32));
  const int nth = at::get_num_threads();
#pragma omp parallel num_threads(nth)
  {
    const auto [lo, hi] = share(m.T, omp_get_thread_num(), omp_get_num_threads());
    for (int64_t r = 0; r < M; ++r)
      int4_range(m, xp + r * K, sums.data() + r * (K / 32), lo, hi, op + r * N);
  }
  return out;
}

// The weight [N, K] in bf16 (q * scale + minimum in fp32, rounded once) from pack_int4's
// layout: for products of many rows (prefill chunks), which a bf16 matrix product runs many
// times faster than torch's int4 kernel here (2048 rows by SmolLM2's gate_up: 105 -> 15 ms,
// and ~2 ms to unpack).
torch::Tensor int4_dequantize(torch::Tensor packed, torch::Tensor scale, torch::Tensor minimum) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) % 8 == 0, "int4_dequantize: packed [N / 16, 8 K]");
  const int64_t K = packed.size(1) / 8;
  const std::vector<torch::Tensor> parts = {packed.contiguous(), scale.contiguous(),
                                            minimum.contiguous()};
  const Int4Matrix m = int4_matrix(parts, K, "int4_dequantize");
  auto out = torch::empty({16 * m.T, K}, torch::kBFloat16);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, m.T, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t g = 0; g < K / 32; ++g)
        for (int r = 0; r < 16; ++r) {
          const int64_t at = (t * (K / 32) + g) * 16 + r;
          const float s = static_cast<float>(c10::Half(m.scale[at], c10::Half::from_bits()));
          const float mn = static_cast<float>(c10::Half(m.minimum[at], c10::Half::from_bits()));
          uint16_t* row = op + (16 * t + r) * K + 32 * g;
          for (int c = 0; c < 8; ++c)
            for (int e = 0; e < 2; ++e) {
              const uint8_t b = m.packed[t * 8 * K + g * 256 + 32 * c + 2 * r + e];
              row[4 * c + e] = float_to_bf16(static_cast<float>(b & 15) * s + mn);
              row[4 * c + 2 + e] = float_to_bf16(static_cast<float>(b >> 4) * s + mn);
            }
        }
  });
  return out;
}

// A decode token's q, k and v: rms_norm(x, norm_weight, eps) [1, H] times the fused qkv
// weight (+ bias, in bf16 as torch adds it): bf16 [1, N].
torch::Tensor int4_qkv(torch::Tensor x, torch::Tensor norm_weight, double eps,
                       std::vector<torch::Tensor> qkv, c10::optional<torch::Tensor> bias) {
  const int64_t H = x.size(-1);
  const uint16_t* xp = bf16_data(x, H, "int4_qkv: x");
  const uint16_t* wp = bf16_data(norm_weight, H, "int4_qkv: norm_weight");
  const Int4Matrix m = int4_matrix(qkv, H, "int4_qkv");
  const int64_t N = 16 * m.T;
  const uint16_t* bp = bias.has_value() ? bf16_data(*bias, N, "int4_qkv: bias") : nullptr;
  std::vector<uint16_t> h(H);
  std::vector<float> sums(H / 32);
  kvchat::norm_row(xp, wp, H, static_cast<float>(eps), h.data());
  group_sums(h.data(), H, sums.data());
  auto out = torch::empty({1, N}, x.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int nth = at::get_num_threads();
#pragma omp parallel num_threads(nth)
  {
    const auto [lo, hi] = share(m.T, omp_get_thread_num(), omp_get_num_threads());
    int4_range(m, h.data(), sums.data(), lo, hi, op);
    if (bp != nullptr) add_rows(op, bp, 16 * lo, 16 * hi, op);
  }
  return out;
}

// The rest of a decode token's layer after attention: y = x + o(attn), then
// y + down(silu(gate(h)) * up(h)) with h = rms_norm(y, norm_weight, eps). x [1, H] and attn
// [1, n_heads * head_dim] bf16; o, gate_up ([gate | up] rows) and down as pack_int4 lays them
// out. Returns bf16 [1, H].
torch::Tensor int4_tail(torch::Tensor x, torch::Tensor attn, std::vector<torch::Tensor> o,
                        torch::Tensor norm_weight, double eps, std::vector<torch::Tensor> gate_up,
                        std::vector<torch::Tensor> down) {
  const int64_t H = x.size(-1), A = attn.size(-1);
  const uint16_t* xp = bf16_data(x, H, "int4_tail: x");
  const uint16_t* ap = bf16_data(attn, A, "int4_tail: attn");
  const uint16_t* wp = bf16_data(norm_weight, H, "int4_tail: norm_weight");
  const Int4Matrix mo = int4_matrix(o, A, "int4_tail: o");
  const Int4Matrix mg = int4_matrix(gate_up, H, "int4_tail: gate_up");
  const int64_t I = 16 * mg.T / 2;
  TORCH_CHECK(16 * mo.T == H && mg.T % 2 == 0, "int4_tail: o must give H rows, gate_up 2 I");
  const Int4Matrix md = int4_matrix(down, I, "int4_tail: down");
  TORCH_CHECK(16 * md.T == H, "int4_tail: down must give H rows");
  std::vector<float> attn_sums(A / 32), act_sums(I / 32);
  group_sums(ap, A, attn_sums.data());
  std::vector<uint16_t> y(H), proj(H), gu(2 * I), act(I);
  auto out = torch::empty({1, H}, x.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  const int nth = at::get_num_threads();
#pragma omp parallel num_threads(nth)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    const auto [o_lo, o_hi] = share(mo.T, tid, n);
    int4_range(mo, ap, attn_sums.data(), o_lo, o_hi, proj.data());
    add_rows(xp, proj.data(), 16 * o_lo, 16 * o_hi, y.data());
#pragma omp barrier
    // Every thread normalises the whole row itself (H values, ~1 us) rather than waiting at
    // one more barrier for one thread to do it.
    std::vector<uint16_t> h(H);
    std::vector<float> h_sums(H / 32);
    kvchat::norm_row(y.data(), wp, H, e, h.data());
    group_sums(h.data(), H, h_sums.data());
    const int64_t half = mg.T / 2;
    const auto [g_lo, g_hi] = share(half, tid, n);
    int4_range(mg, h.data(), h_sums.data(), g_lo, g_hi, gu.data());
    int4_range(mg, h.data(), h_sums.data(), half + g_lo, half + g_hi, gu.data());
    kvchat::silu_mul_row(gu.data() + 16 * g_lo, gu.data() + I + 16 * g_lo, 16 * (g_hi - g_lo),
                         act.data() + 16 * g_lo);
    // Whole pairs of tiles: this thread's rows are whole groups of down's inputs.
    group_sums(act.data() + 16 * g_lo, 16 * (g_hi - g_lo), act_sums.data() + g_lo / 2);
#pragma omp barrier
    const auto [d_lo, d_hi] = share(md.T, tid, n);
    int4_range(md, act.data(), act_sums.data(), d_lo, d_hi, proj.data());
    add_rows(y.data(), proj.data(), 16 * d_lo, 16 * d_hi, op);
  }
  return out;
}
