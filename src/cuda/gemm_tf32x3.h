// C = A @ W^T (+ bias) (+ residual) in fp32 accuracy on the tensor cores, for
// operands stored split (tf32x3.cuh): the projections of the staged path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "axis_kernels.h"

namespace fastaxial::cuda {

struct GemmArgs {
  const float* a = nullptr;         // (M, K) split pairs
  const float* w = nullptr;         // (N, K) split pairs
  const float* bias = nullptr;      // (N), or null
  const float* residual = nullptr;  // (M, N), or null
  float* c = nullptr;               // (M, N)
  int64_t M = 0;
  int N = 0, K = 0;  // multiples of 8
};

cudaError_t gemm_tf32x3(const GemmArgs& g, const DeviceInfo& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
