// Dequantization of BlockPool rows (kv/quant.py) as BlockPool.gather makes them, for the
// kernels that read quantized blocks: decode attention a tile at a time, gather_blocks whole.
#pragma once

#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KVCHAT_DPBF16 1
#else
#define KVCHAT_DPBF16 0
#endif

namespace kvchat {

// Bytes of a quantized row's values, and of its fp16 metadata: a scale per 32 values, and for
// INT4 a minimum per 32 values too (kv/quant.py).
constexpr int64_t value_bytes(Format f, int64_t D) { return f == Format::Int4 ? D / 2 : D; }
constexpr int64_t meta_bytes(Format f, int64_t D) { return (f == Format::Int4 ? 4 : 2) * (D / 32); }

// Rows [t0, t0 + tn) of an INT8 block of `rows` rows in T, as BlockPool.gather makes them:
// q * scale in fp32, rounded once to T.
template <typename T, int D>
void dequant_int8(const uint8_t* block, int64_t rows, int64_t t0, int64_t tn, T* out) {
  constexpr int GROUPS = D / 32;
  const int8_t* q = reinterpret_cast<const int8_t*>(block) + t0 * D;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(block + rows * D) + t0 * GROUPS;
  for (int64_t t = 0; t < tn; ++t) {
    for (int g = 0; g < GROUPS; ++g) {
      const float scale = static_cast<float>(c10::Half(scales[t * GROUPS + g], c10::Half::from_bits()));
      const int8_t* qg = q + t * D + 32 * g;
      T* og = out + t * D + 32 * g;
#if KVCHAT_DPBF16
      if constexpr (std::is_same_v<T, uint16_t>) {
        // vcvtne2ps2bf16 rounds to nearest even as torch does (it flushes subnormals, which
        // q * scale never is: scales are at least 2^-14).
        const __m512 sc = _mm512_set1_ps(scale);
        const __m512 lo = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)))), sc);
        const __m512 hi = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)))), sc);
        _mm512_storeu_si512(og, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        continue;
      }
#endif
      for (int i = 0; i < 32; ++i) {
        const float x = static_cast<float>(qg[i]) * scale;
        if constexpr (std::is_same_v<T, uint16_t>)
          og[i] = c10::BFloat16(x).x;
        else
          og[i] = x;
      }
    }
  }
}

// Rows [t0, t0 + tn) of an INT4 block of `rows` rows in T, as BlockPool.gather makes them:
// q * scale + minimum in fp32 (the product is exact: 4 bits times an fp16's 11, so a fused
// multiply-add rounds as torch's mul then add do), rounded once to T.
template <typename T, int D>
void dequant_int4(const uint8_t* block, int64_t rows, int64_t t0, int64_t tn, T* out) {
  constexpr int GROUPS = D / 32;
  const uint8_t* q = block + t0 * (D / 2);
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(block + rows * (D / 2)) + t0 * GROUPS;
  const uint16_t* mins = scales + rows * GROUPS;
  for (int64_t t = 0; t < tn; ++t) {
    for (int g = 0; g < GROUPS; ++g) {
      const float scale = static_cast<float>(c10::Half(scales[t * GROUPS + g], c10::Half::from_bits()));
      const float minimum = static_cast<float>(c10::Half(mins[t * GROUPS + g], c10::Half::from_bits()));
      // Byte i holds value 2i in its low nibble and value 2i + 1 in its high one.
      const uint8_t* qg = q + t * (D / 2) + 16 * g;
      T* og = out + t * D + 32 * g;
#if KVCHAT_DPBF16
      if constexpr (std::is_same_v<T, uint16_t>) {
        // Widening byte hi<<4|lo to the word hi<<8|lo lays the nibbles out in value order
        // (kv/quant.py's _unpack_int4 does the same).
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
        w = _mm256_and_si256(_mm256_or_si256(w, _mm256_slli_epi16(w, 4)), _mm256_set1_epi16(0x0F0F));
        const __m512 sc = _mm512_set1_ps(scale), mn = _mm512_set1_ps(minimum);
        const __m512 lo = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(w))), sc, mn);
        const __m512 hi = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(w, 1))), sc, mn);
        _mm512_storeu_si512(og, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        continue;
      }
#endif
      for (int i = 0; i < 16; ++i) {
        const float x0 = static_cast<float>(qg[i] & 15) * scale + minimum;
        const float x1 = static_cast<float>(qg[i] >> 4) * scale + minimum;
        if constexpr (std::is_same_v<T, uint16_t>) {
          og[2 * i] = c10::BFloat16(x0).x;
          og[2 * i + 1] = c10::BFloat16(x1).x;
        } else {
          og[2 * i] = x0;
          og[2 * i + 1] = x1;
        }
      }
    }
  }
}

}  // namespace kvchat
