// Column sums of a row-major (M, N) matrix over all M rows, in a fixed order
// (column_sums.cu): the bias and LayerNorm weight gradients, which sum over
// every position of the grid. Deterministic: the rows are cut into chunks that
// depend on M alone, each chunk summed in a fixed order, then the chunks'
// sums added by a fixed tree; no atomics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

// Up to three matrices of the same shape summed in the same two launches.
struct ColumnSumJobs {
  static constexpr int kMax = 3;
  const float* a[kMax] = {};  // (M, N)
  float* sums[kMax] = {};     // (N)
  int count = 0;
  void add(const float* matrix, float* out) { a[count] = matrix, sums[count++] = out; }
};

// Chunks of rows (at most kMaxColumnSumChunks): partials must hold
// ColumnSumJobs::kMax * column_sum_chunks(M) * N doubles (the sums run in fp64).
int64_t column_sum_chunks(int64_t M);

// sums[j] (N) = sum over rows of a[j] (M, N) for each job; partials is scratch (see above).
// M = 0 gives zeros.
cudaError_t column_sums(const ColumnSumJobs& jobs, int64_t M, int N, double* partials, const DeviceCaps& dev,
                        cudaStream_t stream);

}  // namespace fastaxial::cuda
