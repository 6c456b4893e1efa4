// fp32 values to the 16-bit types of the 16-bit products (bf16, fp16): to nearest, ties to even, as
// PyTorch's conversions (fp16 overflows to infinity). The one conversion of every kernel that
// rounds (the operands' rounding, gemm/blas.cu; the 16-bit LayerNorm, norm/norm.cu; the flash
// kernel's rounded output, online_softmax.cuh; the mma.sync fragments, mma16.cuh), so that a
// rounding fused into a kernel gives the bits of the separate one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fastaxial::cuda {

template <class T>
__device__ __forceinline__ T round16(float v) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or fp16");
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(v);
  else
    return __float2half_rn(v);
}

// T's pair type (__nv_bfloat162, __half2).
template <class T>
using Pair16 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;

// lo and hi rounded as round16 does, lo in the pair's lower half.
template <class T>
__device__ __forceinline__ Pair16<T> round16x2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __floats2bfloat162_rn(lo, hi);
  else
    return __floats2half2_rn(lo, hi);
}

}  // namespace fastaxial::cuda
