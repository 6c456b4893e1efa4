// Weights as (hi, lo) TF32 planes for the 3xTF32 wgmma product (gemm.h:
// C = A W^T with W (N, K) split), straight or transposed. Both forwards'
// products take Wqkv and Wout straight, split beside the first pass's
// LayerNorm (norm.h: layer_norm_forward); the training backward's activation
// gradients (d_o = dy Wout, d_xn = dqkv Wqkv) take their transposes
// (split_weight_planes).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

// The matrices one launch splits: up to two passes' Wqkv and Wout.
struct PlaneJobs {
  static constexpr int kMax = 4;
  struct Job {
    const float* src = nullptr;  // (n, k), or (k, n) when transpose
    float* dst = nullptr;        // (n, k) hi, then (n, k) lo
    int64_t n = 0, k = 0;
    bool transpose = false;
  } job[kMax];
  int count = 0;

  void add(const float* src, float* dst, int64_t n, int64_t k, bool transpose) {
    job[count++] = {src, dst, n, k, transpose};
  }
  // Elements of all the jobs' planes (of one plane each: hi and lo hold as many).
  int64_t elements() const {
    int64_t total = 0;
    for (int j = 0; j < count; ++j) total += job[j].n * job[j].k;
    return total;
  }
};

// Splits every job's matrix in one launch.
cudaError_t split_weight_planes(const PlaneJobs& jobs, const DeviceCaps& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
