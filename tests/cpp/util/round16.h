// The host's rounding of fp32 to the 16-bit products' types (bf16, fp16): to nearest, ties to
// even, fp16's subnormals and overflow to infinity, as the GPU's conversions and PyTorch's
// (src/cuda/detail/round16.cuh). For the 16-bit tests' references and bitwise checks.
#pragma once

#include <cmath>
#include <cstdint>

#include "src/common/plan.h"  // Products
#include "util/cuda_test_util.h"  // bits, from_bits

namespace fastaxial::test {

// x (not NaN) rounded to bf16 or fp16, as a 16-bit pattern.
inline uint16_t to16(float x, Products type) {
  const uint32_t u = bits(x);
  if (type == Products::kBf16) return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const float a = std::fabs(x);
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds past fp16's largest, 65504: infinity
  if (a < 0x1p-14f) return sign | (uint16_t)std::nearbyint(a * 0x1p24f);  // subnormal steps of 2^-24 (ties to even)
  const uint32_t r = (bits(a) + 0xfffu + ((bits(a) >> 13) & 1u)) & 0xffffe000u;  // 10 mantissa bits, ties to even
  return sign | (uint16_t)((((r >> 23) - 127 + 15) << 10) | ((r >> 13) & 0x3ffu));
}

// Whether h is a NaN of the type (which NaN a conversion gives is the hardware's).
inline bool is_nan16(uint16_t h, Products type) {
  return type == Products::kBf16 ? (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0
                                 : (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
}

// The value of a 16-bit pattern that is not NaN (fp16's infinity reads as 2^16: the next step
// past its largest, 65504).
inline double from16(uint16_t h, Products type) {
  if (type == Products::kBf16) return (double)from_bits((uint32_t)h << 16);
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double v = e == 0 ? std::ldexp((double)m, -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return (h & 0x8000u) ? -v : v;
}

// x (not NaN) rounded to the type, as a float (from16's value).
inline float round16(float x, Products type) { return (float)from16(to16(x, type), type); }

}  // namespace fastaxial::test
