// C = A @ W^T (+ bias) (+ residual) in fp32 accuracy on Hopper's tensor cores,
// for A in fp32 and W stored split: two planes, hi then lo, of TF32 values
// (detail/tf32x3.cuh). The projections of the staged path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

struct GemmArgs {
  const float* a = nullptr;         // (M, K)
  const float* w = nullptr;         // (N, K) hi, then (N, K) lo
  const float* bias = nullptr;      // (N), or null
  const float* residual = nullptr;  // (M, N), or null
  float* c = nullptr;               // (M, N)
  int64_t M = 0;
  int N = 0, K = 0;  // N a multiple of 8, K of 4
};

// True when this build has the kernel for the device (sm_90a code, built with
// CUDA_ARCHITECTURES holding 90a, run on a compute-capability 9.0 GPU) and the
// device gives it enough shared memory (kStagedGemmSmemBytes).
bool gemm_tf32x3_can_run(const DeviceCaps& dev);

// Launches the product on `stream` (a programmatic dependent, detail/launch.cuh).
cudaError_t gemm_tf32x3(const GemmArgs& g, const DeviceCaps& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
