// An input row rounded to 16-bit integers per group of 32 for the integer products of
// int4_layer.cpp (the int4 weights) and decoder_ops.cpp (the int8 output layer): x ~ scale
// (256 high + low) with scale = max |x| / 32512 and high, low int8, so vpdpbusd (AVX-512 VNNI)
// or vpmaddubsw (AVX2) multiplies the unsigned weight bytes by inputs' high halves, and again
// by their low halves, summing exactly; AVX2's int8 product multiplies the 16-bit integers
// themselves (vpmaddwd). Each input is within scale / 2 of its value, 1/65024 of its group's
// largest (bf16 keeps 2^-9 of each value).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

// The integer products' paths, one per CPU level (the build's -march picks it): AVX-512 VNNI,
// else AVX2 (x86-64-v3), else one value at a time.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVCHAT_VNNI 1
#define KVCHAT_AVX2_INT 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVCHAT_VNNI 0
#define KVCHAT_AVX2_INT 1
#else
#define KVCHAT_VNNI 0
#define KVCHAT_AVX2_INT 0
#endif

namespace kvchat {

// A quantized row: the 16-bit integers and their halves, each group's scale, its exact sum X
// in fp32 (what a weight's minimum multiplies) and that sum over each half group of 16, and
// the sums of its 16-bit integers over each half group (what the int8 weights' offset of 128
// multiplies). Halves, because Q6_K's scales cover 16 inputs each.
struct QuantRow {
  const int16_t* x16;
  const int8_t* high;
  const int8_t* low;
  const float* scale;
  const float* sums;
  const float* half_sums;
  const int32_t* int_sums;
};

// Storage for K inputs: a QuantRow, or rows side by side, each starting at its first group.
struct QuantBuffer {
  std::vector<int16_t> x16;
  std::vector<int8_t> high, low;
  std::vector<float> scale, sums, half_sums;
  std::vector<int32_t> int_sums;
  explicit QuantBuffer(int64_t K)
      : x16(K), high(K), low(K), scale(K / 32), sums(K / 32), half_sums(K / 16), int_sums(K / 16) {}
  QuantRow row(int64_t g0 = 0) const {
    return {x16.data() + 32 * g0, high.data() + 32 * g0,     low.data() + 32 * g0,
            scale.data() + g0,    sums.data() + g0,          half_sums.data() + 2 * g0,
            int_sums.data() + 2 * g0};
  }
};

inline float value_of(uint16_t bf16) { return bf16_to_float(bf16); }
inline float value_of(float x) { return x; }

// The K / 32 groups of the row x (bf16 or fp32) into b from group g0 on (one definition: every
// caller quantizes alike, so the fused int4 calls equal the single ones).
template <typename T>
void quantize_groups(const T* x, int64_t K, QuantBuffer& b, int64_t g0 = 0) {
  for (int64_t g = 0; g < K / 32; ++g) {
    float v[32], amax = 0.f, sum = 0.f, half[2] = {0.f, 0.f};
    for (int i = 0; i < 32; ++i) {
      v[i] = value_of(x[32 * g + i]);
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
      half[i / 16] += v[i];
    }
    const float inv = amax > 0.f ? 32512.f / amax : 0.f;
    int32_t int_sum[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      const auto x16 = static_cast<int32_t>(std::nearbyint(v[i] * inv));  // |x16| <= 127 * 256
      const int32_t high = (x16 + 128) >> 8;  // floor: low = x16 - 256 high is in [-128, 127]
      b.x16[32 * (g0 + g) + i] = static_cast<int16_t>(x16);
      b.high[32 * (g0 + g) + i] = static_cast<int8_t>(high);
      b.low[32 * (g0 + g) + i] = static_cast<int8_t>(x16 - 256 * high);
      int_sum[i / 16] += x16;
    }
    b.scale[g0 + g] = amax / 32512.f;
    b.sums[g0 + g] = sum;
    b.half_sums[2 * (g0 + g)] = half[0];
    b.half_sums[2 * (g0 + g) + 1] = half[1];
    b.int_sums[2 * (g0 + g)] = int_sum[0];
    b.int_sums[2 * (g0 + g) + 1] = int_sum[1];
  }
}

#if KVCHAT_VNNI || KVCHAT_AVX2_INT
// The `bytes` from p on into L1 (p may lie past the data's end: a prefetch never faults). For
// the weights' streams, ~1 KB ahead of their products: the hardware prefetcher alone leaves
// the kernels reading DRAM below its rate.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// 4 adjacent 8-bit inputs as one 32-bit lane.
inline int32_t lane4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
#endif

#if KVCHAT_VNNI
// 4 adjacent int8 inputs in every 32-bit lane.
inline __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(lane4(p)); }
#endif

#if KVCHAT_AVX2_INT
inline __m256i broadcast4_256(const int8_t* p) { return _mm256_set1_epi32(lane4(p)); }

// 8 fp32 values as bf16, rounded to nearest even as torch rounds (float_to_bf16, 8 at once).
inline __m128i bf16x8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  // packus works within 128-bit lanes: [0-3, -, 4-7, -] -> take lanes 0 and 2.
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

}  // namespace kvchat
