// Conversions between the model's dtypes and float for the CPU kernels (paged_decode.cpp,
// lora_add.cpp), written as integer arithmetic the compiler vectorises where the c10 operators,
// with their NaN branches, stay scalar.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kvpilot_kernels {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
// bf16 is the top half of a float: a shift.
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}
// Rounded to the nearest bf16, ties to even.
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

}  // namespace kvpilot_kernels
