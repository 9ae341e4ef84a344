// A GGUF's 4-bit groups (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K) on the CPU in a packed layout of our
// own: int4_linear (products of any number of rows; prefill chunks use it where bf16 products
// are not in hardware), int4_dequantize (the bf16 weight, for the bf16 products of prefill
// chunks elsewhere), and a decode token's pass through a layer's projections in two calls of
// an Int4Layer, qkv (RMSNorm, then q, k and v) and tail (the output projection and the
// residual, RMSNorm, gate and up, SiLU-and-multiply, down and the residual), each in one
// parallel region.
//
// The weights are laid out by core/int4_layer.py's pack_int4: 16 output rows per vector, a
// tile of 16 rows stored so that 64 bytes hold 8 adjacent inputs of each of the 16 rows (4 in
// the low nibbles, the next 4 in the high ones, a row's 4 in one 32-bit lane). The input row
// is quantized per group of 32 to 16-bit integers, x ~ dx (256 h + l) with dx = max |x| /
// 32512 and h, l int8 (quant_row.h). AVX-512 VNNI: vpdpbusd multiplies 16 rows' unsigned
// nibbles q by 4 (broadcast) inputs' h, and again by their l, summing exactly in int32. AVX2
// (no VNNI): vpmaddubsw does the same for 8 rows a 32-byte half, into pairs of 16-bit sums
// that a group's 8 products a row never overflow (|8 * 2 * 15 * 128| < 2^15), widened once a
// group with vpmaddwd. Either way D = 256 sum q h + sum q l over a group (under 2^24, so exact
// in fp32 too), which adds scale dx D + minimum X to each row, X = sum x in fp32. The scales
// stay the file's values: fp16 for Q4_0 and Q4_1, fp32 for the K-quants (a sub-block's
// d * sc and dmin * m, exact only in fp32); torch's int4 kernel rounds them to bf16. Q2_K and
// Q3_K have a scale and a minimum per 16 inputs: each half of a group has its own sums D and
// X and its own scale.
//
// Why integer inputs: a nibble made a bf16 takes six vector ops for 64 products where the two
// vpdpbusd take five for 128, so a bf16 kernel is bound by its arithmetic even with the
// weights in the L3. Each input is within dx / 2 of its value, 1/65024 of its group's
// largest, where bf16 inputs are within 2^-9 of their own: decode stays as close to the exact
// weights as bf16 inputs (mean KL to the fp32 engine's next-token distribution 0.0009 against
// 0.0010 over 280 tokens of README.md). One int8 pass alone (llama.cpp's Q8 inputs, 1/254 of
// the largest) is slightly faster and sixteen times further (mean KL 0.016).
//
// Why fused: a decode step would run an int4 product 120 times (four a layer), each call with
// its Python, its dispatch and its own fork and join of the two threads, and the norm, SiLU
// and residual adds between them as separate calls. Here a layer is two calls with two
// barriers inside the second. Every intermediate is rounded to bf16 where the single ops
// round, so the fused calls give bit for bit what int4_linear, rms_norm, silu_mul and bf16
// adds give one after another.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "bf16.h"
#include "decoder_ops.h"
#include "quant_row.h"

namespace kvchat {
const bool int4_vectorized = KVCHAT_VNNI || KVCHAT_AVX2_INT;
}  // namespace kvchat

namespace {

using kvchat::bf16_to_float;
using kvchat::float_to_bf16;
using kvchat::QuantBuffer;
using kvchat::QuantRow;
using kvchat::quantize_groups;
#if KVCHAT_VNNI
using kvchat::broadcast4;
#endif

// A weight in pack_int4's layout: K inputs, T tiles of 16 output rows, scales and minimums in
// fp16 or, where `wide`, fp32, P of them a group of 32 inputs (2: Q2_K's and Q3_K's per 16).
struct Int4Matrix {
  const uint8_t* packed;
  const void* scale;
  const void* minimum;
  bool wide;
  int64_t K;
  int64_t T;
  int P;
};

// Value `at` of a matrix's scales or minimums `p`.
inline float scale_at(const void* p, bool wide, int64_t at) {
  if (wide) return static_cast<const float*>(p)[at];
  return static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[at], c10::Half::from_bits()));
}

#if KVCHAT_VNNI
// Values at .. at + 15 of a matrix's scales or minimums.
inline __m512 scales16(const void* p, bool wide, int64_t at) {
  if (wide) return _mm512_loadu_ps(static_cast<const float*>(p) + at);
  return _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + at)));
}
#elif KVCHAT_AVX2_INT
// Values at .. at + 7 of a matrix's scales or minimums.
inline __m256 scales8(const void* p, bool wide, int64_t at) {
  if (wide) return _mm256_loadu_ps(static_cast<const float*>(p) + at);
  return _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at)));
}
#endif

// parts = (packed uint8 [T, 8 K], scale and minimum fp16 or fp32 [T, K / 32, 16] or, a scale
// per 16 inputs, [T, K / 16, 16]), held contiguous by the caller (the kernels keep pointers
// into them).
Int4Matrix int4_matrix(const std::vector<at::Tensor>& parts, int64_t K, const char* what) {
  TORCH_CHECK(parts.size() == 3, what, ": (packed, scale, minimum)");
  const auto& packed = parts[0];
  const auto& scale = parts[1];
  const auto& minimum = parts[2];
  const bool wide = scale.scalar_type() == at::kFloat;
  TORCH_CHECK(packed.scalar_type() == at::kByte &&
                  (wide || scale.scalar_type() == at::kHalf) &&
                  minimum.scalar_type() == scale.scalar_type(),
              what, ": uint8 packed values, fp16 or fp32 scales and minimums of one type");
  TORCH_CHECK(packed.is_contiguous() && scale.is_contiguous() && minimum.is_contiguous(), what,
              ": contiguous parts");
  const int64_t T = packed.dim() == 2 ? packed.size(0) : 0;
  const int64_t per = scale.dim() == 3 ? scale.size(1) : 0;
  TORCH_CHECK(K % 32 == 0 && T > 0 && packed.size(1) == 8 * K && scale.dim() == 3 &&
                  scale.size(0) == T && (per == K / 32 || per == K / 16) &&
                  scale.size(2) == 16 && minimum.sizes() == scale.sizes(),
              what, ": packed [N / 16, 8 K], scale and minimum [N / 16, K / 32 or K / 16, 16] for ",
              K, " inputs, K a multiple of 32");
  const int P = per == K / 32 ? 1 : 2;
  return {packed.data_ptr<uint8_t>(), scale.data_ptr(), minimum.data_ptr(), wide, K, T, P};
}

const uint16_t* bf16_data(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == numel, what,
              ": a contiguous bf16 tensor of ", numel, " values");
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

#if KVCHAT_VNNI
// 16 fp32 values as bf16, rounded to nearest even as torch rounds.
inline __m256i bf16x16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16));
#endif
}

// Output rows 16 t .. 16 (t + NT) for the input row x, NT tiles side by side: one tile's chain
// of vpdpbusd waits on its latency, two keep the core busy. P scales a group: each covers
// 4 / P of its chunks (P = 2: chunks 0-1 are inputs 0-15, chunks 2-3 inputs 16-31), whose
// sums take their own scale, and their minimum the inputs' sum over those 32 / P.
template <int NT, int P>
void int4_tiles(const Int4Matrix& m, const QuantRow& x, int64_t t, uint16_t* out) {
  const int64_t K = m.K, G = K / 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[NT];
  for (int i = 0; i < NT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int i = 0; i < NT; ++i)
      kvchat::prefetch_bytes(m.packed + (t + i) * 8 * K + (g + 4) * 256, 256);
    const __m512 dx = _mm512_set1_ps(x.scale[g]);
    for (int p = 0; p < P; ++p) {
      __m512i high[NT], low[NT];
      for (int i = 0; i < NT; ++i) high[i] = low[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 4 / P * p; c < 4 / P * (p + 1); ++c) {
        const int64_t k = 32 * g + 8 * c;
        const __m512i h0 = broadcast4(x.high + k), h1 = broadcast4(x.high + k + 4);
        const __m512i l0 = broadcast4(x.low + k), l1 = broadcast4(x.low + k + 4);
#pragma GCC unroll 2
        for (int i = 0; i < NT; ++i) {
          const __m512i w = _mm512_loadu_si512(m.packed + (t + i) * 8 * K + g * 256 + 64 * c);
          const __m512i q0 = _mm512_and_si512(w, nibble);
          const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
          high[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(high[i], q0, h0), q1, h1);
          low[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(low[i], q0, l0), q1, l1);
        }
      }
      const __m512 sum = _mm512_set1_ps(P == 1 ? x.sums[g] : x.half_sums[2 * g + p]);
      for (int i = 0; i < NT; ++i) {
        const int64_t at = (((t + i) * G + g) * P + p) * 16;
        const __m512 s = scales16(m.scale, m.wide, at);
        const __m512 mn = scales16(m.minimum, m.wide, at);
        const __m512 d =
            _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(high[i], 8), low[i]));
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, dx), d, acc[i]);
        acc[i] = _mm512_fmadd_ps(mn, sum, acc[i]);
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * (t + i)), bf16x16(acc[i]));
}
#elif KVCHAT_AVX2_INT
// The same products on AVX2: each 64-byte chunk as two halves of 8 rows. A half's nibbles
// times 4 inputs' h (and l) by vpmaddubsw, two 16-bit sums a row; the group's (or with P = 2,
// its 16 inputs') 8 of them (4 chunks, low and high nibbles) add up in 16 bits, then vpmaddwd
// makes them one int32 a row.
template <int NT, int P>
void int4_tiles(const Int4Matrix& m, const QuantRow& x, int64_t t, uint16_t* out) {
  const int64_t K = m.K, G = K / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT][2];
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int i = 0; i < NT; ++i)
      kvchat::prefetch_bytes(m.packed + (t + i) * 8 * K + (g + 4) * 256, 256);
    const __m256 dx = _mm256_set1_ps(x.scale[g]);
    for (int p = 0; p < P; ++p) {
      __m256i high[NT][2], low[NT][2];
      for (int i = 0; i < NT; ++i)
        high[i][0] = high[i][1] = low[i][0] = low[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 4 / P * p; c < 4 / P * (p + 1); ++c) {
        const int64_t k = 32 * g + 8 * c;
        const __m256i h0 = kvchat::broadcast4_256(x.high + k);
        const __m256i h1 = kvchat::broadcast4_256(x.high + k + 4);
        const __m256i l0 = kvchat::broadcast4_256(x.low + k);
        const __m256i l1 = kvchat::broadcast4_256(x.low + k + 4);
        for (int i = 0; i < NT; ++i)
          for (int half = 0; half < 2; ++half) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                m.packed + (t + i) * 8 * K + g * 256 + 64 * c + 32 * half));
            const __m256i q0 = _mm256_and_si256(w, nibble);
            const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
            high[i][half] = _mm256_add_epi16(
                high[i][half],
                _mm256_add_epi16(_mm256_maddubs_epi16(q0, h0), _mm256_maddubs_epi16(q1, h1)));
            low[i][half] = _mm256_add_epi16(
                low[i][half],
                _mm256_add_epi16(_mm256_maddubs_epi16(q0, l0), _mm256_maddubs_epi16(q1, l1)));
          }
      }
      const __m256 sum = _mm256_set1_ps(P == 1 ? x.sums[g] : x.half_sums[2 * g + p]);
      for (int i = 0; i < NT; ++i)
        for (int half = 0; half < 2; ++half) {
          const int64_t at = (((t + i) * G + g) * P + p) * 16 + 8 * half;
          const __m256 s = scales8(m.scale, m.wide, at);
          const __m256 mn = scales8(m.minimum, m.wide, at);
          const __m256i d = _mm256_add_epi32(
              _mm256_slli_epi32(_mm256_madd_epi16(high[i][half], ones), 8),
              _mm256_madd_epi16(low[i][half], ones));
          acc[i][half] =
              _mm256_fmadd_ps(_mm256_mul_ps(s, dx), _mm256_cvtepi32_ps(d), acc[i][half]);
          acc[i][half] = _mm256_fmadd_ps(mn, sum, acc[i][half]);
        }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int half = 0; half < 2; ++half)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * (t + i) + 8 * half),
                       kvchat::bf16x8(acc[i][half]));
}

// R input rows by half h of tile t (8 output rows), for products of many rows (prefill chunks
// on CPUs without bf16 products): each weight chunk is loaded and split into nibbles once for
// the R rows, where int4_tiles reloads it from L2 for every row. The arithmetic is
// int4_tiles', in its order, so both give the same bits.
template <int R, int P>
void int4_rows(const Int4Matrix& m, const QuantRow* x, int64_t t, int h, int64_t N,
               uint16_t* out) {
  const int64_t K = m.K, G = K / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g)
    for (int p = 0; p < P; ++p) {
      __m256i high[R], low[R];
      for (int r = 0; r < R; ++r) high[r] = low[r] = _mm256_setzero_si256();
      // Not unrolled: GCC then forms all four chunks' products before adding them and spills.
#pragma GCC unroll 1
      for (int c = 4 / P * p; c < 4 / P * (p + 1); ++c) {
        const int64_t k = 32 * g + 8 * c;
        const __m256i w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(m.packed + t * 8 * K + g * 256 + 64 * c + 32 * h));
        const __m256i q0 = _mm256_and_si256(w, nibble);
        const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const __m256i h0 = kvchat::broadcast4_256(x[r].high + k);
          const __m256i h1 = kvchat::broadcast4_256(x[r].high + k + 4);
          const __m256i l0 = kvchat::broadcast4_256(x[r].low + k);
          const __m256i l1 = kvchat::broadcast4_256(x[r].low + k + 4);
          high[r] = _mm256_add_epi16(
              high[r],
              _mm256_add_epi16(_mm256_maddubs_epi16(q0, h0), _mm256_maddubs_epi16(q1, h1)));
          low[r] = _mm256_add_epi16(
              low[r],
              _mm256_add_epi16(_mm256_maddubs_epi16(q0, l0), _mm256_maddubs_epi16(q1, l1)));
        }
      }
      const int64_t at = ((t * G + g) * P + p) * 16 + 8 * h;
      const __m256 s = scales8(m.scale, m.wide, at);
      const __m256 mn = scales8(m.minimum, m.wide, at);
      for (int r = 0; r < R; ++r) {
        const __m256i d = _mm256_add_epi32(
            _mm256_slli_epi32(_mm256_madd_epi16(high[r], ones), 8),
            _mm256_madd_epi16(low[r], ones));
        const float sum = P == 1 ? x[r].sums[g] : x[r].half_sums[2 * g + p];
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(x[r].scale[g])),
                                 _mm256_cvtepi32_ps(d), acc[r]);
        acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sum), acc[r]);
      }
    }
  for (int r = 0; r < R; ++r)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * N + 16 * t + 8 * h),
                     kvchat::bf16x8(acc[r]));
}
#endif

#if !KVCHAT_VNNI && !KVCHAT_AVX2_INT
// The same products one value at a time (CPUs without AVX2 or AVX-512 VNNI: core/linear.py
// runs groups of 32 through torch's kernel there, and Q2_K's and Q3_K's scales per 16, which
// that kernel cannot take, through these).
template <int NT, int P>
void int4_tiles(const Int4Matrix& m, const QuantRow& x, int64_t t, uint16_t* out) {
  const int64_t K = m.K, G = K / 32;
  for (int64_t row = 16 * t; row < 16 * (t + NT); ++row) {
    const int64_t tile = row / 16, r = row % 16;
    float acc = 0.f;
    for (int64_t g = 0; g < G; ++g)
      for (int p = 0; p < P; ++p) {
        const int64_t at = ((tile * G + g) * P + p) * 16 + r;
        const float s = scale_at(m.scale, m.wide, at);
        const float mn = scale_at(m.minimum, m.wide, at);
        int32_t dot = 0;
        for (int c = 4 / P * p; c < 4 / P * (p + 1); ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t b = m.packed[tile * 8 * K + g * 256 + 64 * c + 4 * r + j];
            const int64_t k = 32 * g + 8 * c + j;
            dot += (b & 15) * (256 * x.high[k] + x.low[k]) +
                   (b >> 4) * (256 * x.high[k + 4] + x.low[k + 4]);
          }
        // The vector paths' arithmetic, in their order: the same sums give the same results.
        const float sum = P == 1 ? x.sums[g] : x.half_sums[2 * g + p];
        acc = std::fma(s * x.scale[g], static_cast<float>(dot), acc);
        acc = std::fma(mn, sum, acc);
      }
    out[row] = float_to_bf16(acc);
  }
}
#endif

// Output tiles [t0, t1) of m for the input row x: two at a time, then an odd last one.
template <int P>
void int4_range_of(const Int4Matrix& m, const QuantRow& x, int64_t t0, int64_t t1,
                   uint16_t* out) {
  int64_t t = t0;
  for (; t + 1 < t1; t += 2) int4_tiles<2, P>(m, x, t, out);
  if (t < t1) int4_tiles<1, P>(m, x, t, out);
}

void int4_range(const Int4Matrix& m, const QuantRow& x, int64_t t0, int64_t t1, uint16_t* out) {
  if (m.P == 1)
    int4_range_of<1>(m, x, t0, t1, out);
  else
    int4_range_of<2>(m, x, t0, t1, out);
}

#if KVCHAT_AVX2_INT
// Rows up to this many share each tile's weights while they sit in L1.
constexpr int64_t kRowBlock = 64;

// The M rows by output tiles [t0, t1): in blocks of rows that go through each tile four at a
// time (int4_rows; 4 rows keep their sums in 12 of the 16 vector registers).
template <int P>
void int4_block_of(const Int4Matrix& m, const QuantRow* x, int64_t M, int64_t t0, int64_t t1,
                   uint16_t* out) {
  const int64_t N = 16 * m.T;
  for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
    const int64_t r1 = std::min(M, r0 + kRowBlock);
    for (int64_t t = t0; t < t1; ++t) {
      int64_t r = r0;
      for (; r + 4 <= r1; r += 4)
        for (int h = 0; h < 2; ++h) int4_rows<4, P>(m, x + r, t, h, N, out + r * N);
      for (int h = 0; h < 2; ++h) switch (r1 - r) {
          case 3: int4_rows<3, P>(m, x + r, t, h, N, out + r * N); break;
          case 2: int4_rows<2, P>(m, x + r, t, h, N, out + r * N); break;
          case 1: int4_rows<1, P>(m, x + r, t, h, N, out + r * N); break;
          default: break;
        }
    }
  }
}

void int4_block(const Int4Matrix& m, const QuantRow* x, int64_t M, int64_t t0, int64_t t1,
                uint16_t* out) {
  if (m.P == 1)
    int4_block_of<1>(m, x, M, t0, t1, out);
  else
    int4_block_of<2>(m, x, M, t0, t1, out);
}
#else
void int4_block(const Int4Matrix& m, const QuantRow* x, int64_t M, int64_t t0, int64_t t1,
                uint16_t* out) {
  for (int64_t r = 0; r < M; ++r) int4_range(m, x[r], t0, t1, out + r * 16 * m.T);
}
#endif

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
at::Tensor int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scale,
                          at::Tensor minimum) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  x = x.contiguous();
  const std::vector<at::Tensor> parts = {packed.contiguous(), scale.contiguous(),
                                            minimum.contiguous()};
  const Int4Matrix m = int4_matrix(parts, K, "int4_linear");
  const uint16_t* xp = bf16_data(x, M * K, "int4_linear: x");
  const int64_t N = 16 * m.T;
  auto out = at::empty({M, N}, x.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  QuantBuffer quantized(M * K);
  std::vector<QuantRow> rows(M);
  const int nth = at::get_num_threads();
#pragma omp parallel num_threads(nth)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    for (int64_t r = M * tid / n; r < M * (tid + 1) / n; ++r) {
      quantize_groups(xp + r * K, K, quantized, r * (K / 32));
      rows[r] = quantized.row(r * (K / 32));
    }
#pragma omp barrier
    const auto [lo, hi] = share(m.T, tid, n);
    int4_block(m, rows.data(), M, lo, hi, op);
  }
  return out;
}

// The weight [N, K] in bf16 (q * scale + minimum in fp32, rounded once) from pack_int4's
// layout: for products of many rows (prefill chunks), which a bf16 matrix product runs many
// times faster than torch's int4 kernel here (2048 rows by SmolLM2's gate_up: 15 ms against
// 105, and ~2 ms to unpack).
at::Tensor int4_dequantize(at::Tensor packed, at::Tensor scale, at::Tensor minimum) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) % 8 == 0, "int4_dequantize: packed [N / 16, 8 K]");
  const int64_t K = packed.size(1) / 8;
  const std::vector<at::Tensor> parts = {packed.contiguous(), scale.contiguous(),
                                            minimum.contiguous()};
  const Int4Matrix m = int4_matrix(parts, K, "int4_dequantize");
  auto out = at::empty({16 * m.T, K}, at::kBFloat16);
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, m.T, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t g = 0; g < K / 32; ++g)
        for (int p = 0; p < m.P; ++p)
          for (int r = 0; r < 16; ++r) {
            const int64_t at = ((t * (K / 32) + g) * m.P + p) * 16 + r;
            const float s = scale_at(m.scale, m.wide, at);
            const float mn = scale_at(m.minimum, m.wide, at);
            uint16_t* row = op + (16 * t + r) * K + 32 * g;
            for (int c = 4 / m.P * p; c < 4 / m.P * (p + 1); ++c)
              for (int j = 0; j < 4; ++j) {
                const uint8_t b = m.packed[t * 8 * K + g * 256 + 64 * c + 4 * r + j];
                row[8 * c + j] = float_to_bf16(static_cast<float>(b & 15) * s + mn);
                row[8 * c + 4 + j] = float_to_bf16(static_cast<float>(b >> 4) * s + mn);
              }
          }
  });
  return out;
}

namespace {

// A layer's int4 projections for decode tokens (core/int4_layer.py's Int4DecodeLayer): the
// weights are checked once and held, so that a call converts only its activations (passing
// the weights' nine tensors and two norms each call costs a few microseconds a layer).
class Int4Layer {
 public:
  Int4Layer(std::vector<at::Tensor> qkv, c10::optional<at::Tensor> qkv_bias,
            at::Tensor attn_norm, std::vector<at::Tensor> o, at::Tensor mlp_norm,
            std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, double eps,
            std::vector<int64_t> qkv_heads)
      : eps_(static_cast<float>(eps)), heads_(std::move(qkv_heads)) {
    TORCH_CHECK(qkv.size() == 3, "qkv: (packed, scale, minimum)");
    H_ = qkv[0].size(1) / 8;
    qkv_ = int4_matrix(qkv, H_, "qkv");
    o_ = int4_matrix(o, o[0].size(1) / 8, "o");
    A_ = o_.K;
    gate_up_ = int4_matrix(gate_up, H_, "gate_up");
    I_ = 16 * gate_up_.T / 2;
    TORCH_CHECK(16 * o_.T == H_ && gate_up_.T % 2 == 0, "o must give H rows, gate_up 2 I");
    down_ = int4_matrix(down, I_, "down");
    TORCH_CHECK(16 * down_.T == H_, "down must give H rows");
    attn_norm_ = bf16_data(attn_norm, H_, "attn_norm");
    mlp_norm_ = bf16_data(mlp_norm, H_, "mlp_norm");
    const int64_t N = 16 * qkv_.T;
    bias_ = qkv_bias.has_value() ? bf16_data(*qkv_bias, N, "qkv bias") : nullptr;
    int64_t total = 0;
    for (const int64_t h : heads_) total += h;
    TORCH_CHECK(heads_.size() == 3 && total > 0 && N % total == 0,
                "qkv_heads: q, k and v heads that divide the qkv rows");
    head_dim_ = N / total;
    held_ = {attn_norm, mlp_norm};
    for (const auto* parts : {&qkv, &o, &gate_up, &down})
      held_.insert(held_.end(), parts->begin(), parts->end());
    if (qkv_bias.has_value()) held_.push_back(*qkv_bias);
  }

  // q, k and v for the token x [1, H]: rms_norm(x) times the fused weight (+ bias, in bf16 as
  // torch adds it), as [heads, 1, head_dim] views of one bf16 row, as the attention takes them.
  std::vector<at::Tensor> qkv(at::Tensor x) {
    const uint16_t* xp = bf16_data(x, H_, "int4 qkv: x");
    std::vector<uint16_t> h(H_);
    QuantBuffer hq(H_);
    kvchat::norm_row(xp, attn_norm_, H_, eps_, h.data());
    quantize_groups(h.data(), H_, hq);
    auto out = at::empty({16 * qkv_.T / head_dim_, 1, head_dim_}, x.options());
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const int nth = at::get_num_threads();
#pragma omp parallel num_threads(nth)
    {
      const auto [lo, hi] = share(qkv_.T, omp_get_thread_num(), omp_get_num_threads());
      int4_range(qkv_, hq.row(), lo, hi, op);
      if (bias_ != nullptr) add_rows(op, bias_, 16 * lo, 16 * hi, op);
    }
    return out.split_with_sizes(heads_);
  }

  // The rest of the layer after attention: y = x + o(attn), then
  // y + down(silu(gate(h)) * up(h)) with h = rms_norm(y). x [1, H]; attn bf16, its
  // n_heads * head_dim values in any shape (the attention's [n_heads, 1, head_dim] as it
  // is). Returns bf16 [1, H].
  at::Tensor tail(at::Tensor x, at::Tensor attn) {
    const int64_t H = H_, A = A_, I = I_;
    const uint16_t* xp = bf16_data(x, H, "int4 tail: x");
    const auto attn_rows = attn.contiguous();
    const uint16_t* ap = bf16_data(attn_rows, A, "int4 tail: attn");
    const Int4Matrix &mo = o_, &mg = gate_up_, &md = down_;
    QuantBuffer attn_q(A), act_q(I);
    quantize_groups(ap, A, attn_q);
    std::vector<uint16_t> y(H), proj(H), gu(2 * I), act(I);
    auto out = at::empty({1, H}, x.options());
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float e = eps_;
    const uint16_t* wp = mlp_norm_;
    const int nth = at::get_num_threads();
#pragma omp parallel num_threads(nth)
    {
      const int tid = omp_get_thread_num(), n = omp_get_num_threads();
      const auto [o_lo, o_hi] = share(mo.T, tid, n);
      int4_range(mo, attn_q.row(), o_lo, o_hi, proj.data());
      add_rows(xp, proj.data(), 16 * o_lo, 16 * o_hi, y.data());
#pragma omp barrier
      // Every thread normalises the whole row itself (H values, ~1 us) rather than waiting at
      // one more barrier for one thread to do it.
      std::vector<uint16_t> h(H);
      QuantBuffer hq(H);
      kvchat::norm_row(y.data(), wp, H, e, h.data());
      quantize_groups(h.data(), H, hq);
      const int64_t half = mg.T / 2;
      const auto [g_lo, g_hi] = share(half, tid, n);
      int4_range(mg, hq.row(), g_lo, g_hi, gu.data());
      int4_range(mg, hq.row(), half + g_lo, half + g_hi, gu.data());
      kvchat::silu_mul_row(gu.data() + 16 * g_lo, gu.data() + I + 16 * g_lo, 16 * (g_hi - g_lo),
                           act.data() + 16 * g_lo);
      // Whole pairs of tiles: this thread's rows are whole groups of down's inputs.
      quantize_groups(act.data() + 16 * g_lo, 16 * (g_hi - g_lo), act_q, g_lo / 2);
#pragma omp barrier
      const auto [d_lo, d_hi] = share(md.T, tid, n);
      int4_range(md, act_q.row(), d_lo, d_hi, proj.data());
      add_rows(y.data(), proj.data(), 16 * d_lo, 16 * d_hi, op);
    }
    return out;
  }

 private:
  // The tensors the matrices and norms point into.
  std::vector<at::Tensor> held_;
  Int4Matrix qkv_{}, o_{}, gate_up_{}, down_{};
  const uint16_t *attn_norm_ = nullptr, *mlp_norm_ = nullptr, *bias_ = nullptr;
  float eps_;
  int64_t H_ = 0, A_ = 0, I_ = 0, head_dim_ = 0;
  std::vector<int64_t> heads_;
};

}  // namespace

void bind_int4_layer(pybind11::module& m) {
  pybind11::class_<Int4Layer>(m, "Int4Layer")
      .def(pybind11::init<std::vector<at::Tensor>, c10::optional<at::Tensor>,
                          at::Tensor, std::vector<at::Tensor>, at::Tensor,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, double,
                          std::vector<int64_t>>())
      .def("qkv", &Int4Layer::qkv)
      .def("tail", &Int4Layer::tail);
}
