// The training path's weights as (hi, lo) TF32 planes for the 3xTF32 wgmma
// product (staged/gemm.h: C = A W^T with W (N, K) split), straight or
// transposed: the forward's products take Wqkv and Wout, the backward's
// activation gradients (d_o = dy Wout, d_xn = dqkv Wqkv) take their transposes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

struct PlaneJobs {
  static constexpr int kMax = 4;
  struct Job {
    const float* src = nullptr;  // (n, k), or (k, n) when transpose
    float* dst = nullptr;        // (n, k) hi, then (n, k) lo
    int64_t n = 0, k = 0;
    bool transpose = false;
  } job[kMax];
  int count = 0;
};

// Splits every job's matrix in one launch.
cudaError_t split_weight_planes(const PlaneJobs& jobs, const DeviceCaps& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
