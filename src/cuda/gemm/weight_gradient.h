// The backward's weight gradients on the tensor cores: C (N, K) = A^T B for
// row-major A (T, N) and B (T, K), summed over all T rows (d_Wo = dy^T o,
// d_Wqkv = dqkv^T xn: T = B H W positions), fp32-accurate (3xTF32, on wgmma
// where the device has sm_90a code and the operands allow it, else on
// mma.sync) and deterministic: the rows are cut into S chunks by a rule of
// (T, N, K, the kernel, the device) alone (common/plan.h:
// weight_gradient_split), each chunk summed in a fixed order, and the chunks'
// partial tiles added in a fixed order by a second kernel; no atomics, so two
// calls on the same inputs give the same bits (weight_gradient.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"  // DeviceCaps, the split rule and the partials' size

namespace fastaxial::cuda {

struct WeightGradientArgs {
  const float* a = nullptr;  // (T, N), row stride lda
  const float* b = nullptr;  // (T, K), row stride ldb
  float* c = nullptr;        // (N, K), row stride ldc
  int64_t T = 0;             // rows summed over; 0 gives zeros
  int64_t lda = 0, ldb = 0, ldc = 0;
  int N = 0, K = 0;
  // Run the mma.sync kernel even where the wgmma one would (tests, comparisons); the partials
  // that weight_gradient_partials_floats sizes serve both.
  bool mma_sync = false;
  // Where not null, also A's column sums (the bias gradient of the layer whose output gradient A
  // is) in fp64 over each chunk of rows: a_sums[s][n] = sum of A[t][n] over chunk s's rows, for the
  // S = weight_gradient_variant(g, dev).split.splits chunks ([S][N] doubles); their sum over s in a
  // fixed order is the column sum (norm/column_sums.h: ColumnSumJobs::take_chunks).
  double* a_sums = nullptr;
};

// The kernel, tiles and split weight_gradient runs g with on dev: plan.h's rule
// (weight_gradient_variant) on g's sizes, pointers and hook, in a build with sm_90a code (else
// never the wgmma kernel).
WeightGradVariant weight_gradient_variant(const WeightGradientArgs& g, const DeviceCaps& dev);

// Whether that is the wgmma kernel (else the mma.sync one).
bool weight_gradient_wgmma(const WeightGradientArgs& g, const DeviceCaps& dev);

// Launches C = A^T B on `stream` (programmatic dependents, detail/launch.cuh). `partials`: scratch
// of partials_bytes >= 4 weight_gradient_partials_floats(T, N, K, dev) bytes (plan.h); may be null
// where that is 0. cudaErrorInvalidValue for negative sizes, strides below a row, or partials
// missing or too small (a plan made for another device, say).
cudaError_t weight_gradient(const WeightGradientArgs& g, float* partials, size_t partials_bytes, const DeviceCaps& dev,
                            cudaStream_t stream);

}  // namespace fastaxial::cuda
