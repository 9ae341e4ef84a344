// bf16 as the CPU kernels read and write it: the high half of an fp32, widened by a shift and
// rounded to nearest even (as torch rounds; NaN is not produced by the values kvchat rounds).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvchat {

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// x rounded to the nearest bf16 value, as an fp32: what a torch op in bf16 leaves.
inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// An fp32 or bf16 element as fp32: one template body serves both dtypes.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bf16_to_float(x); }

}  // namespace kvchat
