// bf16 as the CPU kernels read it: the high half of an fp32, widened by a shift.
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

}  // namespace kvchat
