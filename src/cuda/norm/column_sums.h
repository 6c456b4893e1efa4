// Column sums of row-major matrices over all their rows, in a fixed order
// (column_sums.cu): the bias and LayerNorm weight gradients, which sum over
// every position of the grid. Deterministic: the rows are cut into chunks that
// depend on the row count alone, each chunk summed in a fixed order, then the
// chunks' sums added by a fixed tree; no atomics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/axis.h"  // FASTAXIAL_HOST_DEVICE
#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

// Up to three matrices of M rows each summed in the same launches. A job may be projected: its
// column sums (N) times w (N, out_cols), in fp64 before the one rounding to fp32. LayerNorm's
// bias gradient is such a job: the column sums of d_xn = dqkv Wqkv are those of dqkv times Wqkv,
// and summing dqkv first keeps the product's rounding, whose sign the tensor cores' truncation
// makes the same at every position, out of a sum over every position (docs/perf-notes.md, v77).
//
// A job's chunk partials may come from a kernel that reads its matrix anyway (the weight
// gradients' ASums: a matrix's column sums are the bias gradient where it is a layer's output
// gradient): that kernel writes them at chunk_partials(partials, j), [n][cols[j]] doubles for its n
// chunks, and take_chunks(j, n) says so; column_sums then only adds them up.
struct ColumnSumJobs {
  static constexpr int kMax = 3;  // partials_offset names jobs 0, 1 and 2
  int count = 0;
  const float* a[kMax] = {};  // (M, cols[j])
  int cols[kMax] = {};
  float* sums[kMax] = {};     // (cols[j]), or (out_cols) for the projected job
  int64_t chunks[kMax] = {};  // the chunk partials another kernel wrote for job j, else 0
  int projected = -1;         // the projected job's index, or -1
  const float* w = nullptr;   // (cols[projected], out_cols), row-major
  int out_cols = 0;
  // The job's index.
  int add(const float* matrix, int n, float* out) {
    a[count] = matrix, cols[count] = n, sums[count] = out;
    return count++;
  }
  int add_projected(const float* matrix, int n, const float* weight, int out_n, float* out) {
    projected = count, w = weight, out_cols = out_n;
    return add(matrix, n, out);
  }
  // Where job j's chunk partials start in the scratch, in doubles: kMaxColumnSumChunks a column
  // of each job before it. Constant indices (kMax = 3), so that a kernel reading it keeps its
  // parameters in place rather than copying them to local memory for a runtime index.
  FASTAXIAL_HOST_DEVICE int64_t partials_offset(int j) const {
    return kMaxColumnSumChunks * (j == 0 ? 0 : j == 1 ? cols[0] : cols[0] + cols[1]);
  }
  double* chunk_partials(double* partials, int j) const { return partials + partials_offset(j); }
  // Job j's n (1 .. kMaxColumnSumChunks) chunk partials are at chunk_partials: not summed again.
  void take_chunks(int j, int64_t n) { chunks[j] = n; }
};

// Chunks of rows a sum over M rows is cut into (at most kMaxColumnSumChunks).
int64_t column_sum_chunks(int64_t M);

// Doubles of scratch column_sums needs: kMaxColumnSumChunks a column of every job, and one more a
// column of the projected job. The backward's plan holds (5 * kMaxColumnSumChunks + 3) D: the
// jobs of a pass are dy (D), dqkv (3D, projected) and d_xn * xhat (D).
int64_t column_sum_partials(const ColumnSumJobs& jobs);

// Job `job`'s matrix a (M, cols) rounded into y (M, cols) of `type` (bf16 or fp16: round_to_16bit's
// bits), and its chunk partials, the ones column_sums would sum, in the same order (so the same sums),
// taken (take_chunks): one read of a where the 16-bit backward rounds a matrix whose column sums it
// needs (dy, dqkv). `partials` is column_sums' scratch. cudaErrorInvalidValue for another type or job.
cudaError_t round_with_column_sums(ColumnSumJobs* jobs, int job, int64_t M, void* y, Products type, double* partials,
                                   const DeviceCaps& dev, cudaStream_t stream);

// sums[j] = the column sums of a[j] (M, cols[j]) for each job, the projected job's times w; partials
// is scratch of column_sum_partials(jobs) doubles. M = 0 gives zeros.
cudaError_t column_sums(const ColumnSumJobs& jobs, int64_t M, double* partials, const DeviceCaps& dev,
                        cudaStream_t stream);

}  // namespace fastaxial::cuda
