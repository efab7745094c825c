// Sixteen values at a time as one vector of floats (GCC's and Clang's vector extension), for the
// CPU kernels' sums (lora_add.cpp, dense_rows.cpp): a sum kept in such a vector stays in
// registers over its reduction; written as a float[16], the compiler kept it in memory, a store
// and a load per product, at a third of the speed. A block past the end of a row is read
// through a zero-padded copy (load_first).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvpilot_kernels {

constexpr int64_t kLanes = 16;
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Shorts __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline Floats load_lanes(const float* values) {
  Floats lanes;
  std::memcpy(&lanes, values, sizeof(lanes));
  return lanes;
}
inline Floats load_lanes(const c10::BFloat16* values) {  // each bf16 the top half of a float
  Shorts halves;
  std::memcpy(&halves, values, sizeof(halves));
  const Words bits = __builtin_convertvector(halves, Words) << 16;
  Floats lanes;
  std::memcpy(&lanes, &bits, sizeof(lanes));
  return lanes;
}
inline Floats load_lanes(const c10::Half* values) {
  Floats lanes;
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = static_cast<float>(values[l]);
  return lanes;
}

// `n` values from `values`, zeros after them.
template <typename T>
inline Floats load_first(const T* values, int64_t n) {
  if (n == kLanes) return load_lanes(values);
  T padded[kLanes];
  std::fill(padded, padded + kLanes, T(0));
  std::copy(values, values + n, padded);
  return load_lanes(padded);
}

}  // namespace kvpilot_kernels
