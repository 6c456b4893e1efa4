// Column sums in two launches (column_sums.h): a block per (32 columns,
// chunk of rows) sums its chunk, 8 row lanes per column each taking every
// 8th row and then added in lane order; a warp per column adds the chunks.
// The sums run in fp64 and round to fp32 once at the end: a bias gradient is
// a sum over every position of the grid (tens of thousands of terms), and an
// fp32 tree over them adds rounding errors of the order of the terms' own
// (docs/perf-notes.md); the kernels are memory-bound, so the wider adds cost
// nothing.
#include "column_sums.h"

#include <algorithm>

#include "../detail/launch.cuh"
#include "../detail/warp_ops.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int kCols = 32, kRowLanes = 8;
constexpr int64_t kMaxChunks = kMaxColumnSumChunks;  // the plan's partials region holds this many

// partials[chunk][c] = sum of a[r][c] over the chunk's rows.
// Job blockIdx.z's partials at partials + blockIdx.z * gridDim.y * N.
__global__ void __launch_bounds__(kCols* kRowLanes)
    chunk_sums_kernel(const ColumnSumJobs jobs, int64_t M, int N, int64_t rows_per_chunk, double* __restrict__ partials) {
  grid_dependency_wait();
  allow_dependent_launch();
  __shared__ double lane_sums[kRowLanes][kCols];
  // A constant index per job (a runtime one would copy the parameters to local memory).
  const float* __restrict__ a = blockIdx.z == 0 ? jobs.a[0] : blockIdx.z == 1 ? jobs.a[1] : jobs.a[2];
  partials += blockIdx.z * (int64_t)gridDim.y * N;
  const int c = blockIdx.x * kCols + threadIdx.x;
  const int64_t begin = blockIdx.y * rows_per_chunk, end = begin + rows_per_chunk < M ? begin + rows_per_chunk : M;
  double sum = 0.0;
  if (c < N) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) sum += (double)a[r * N + c];
  }
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < N) {
    double total = 0.0;
    for (int l = 0; l < kRowLanes; ++l) total += lane_sums[l][threadIdx.x];
    partials[blockIdx.y * (int64_t)N + c] = total;
  }
}

// sums[c] = the sum of partials[k][c] over the chunks k: a warp per column, lane l adding chunks
// l, l + 32, ... in order, then the lanes' sums by a fixed butterfly (the same tree every call).
// A thread per column walking all chunks would wait out a memory latency per chunk.
__global__ void chunk_total_kernel(const double* __restrict__ partials, int64_t chunks, int N,
                                   const ColumnSumJobs jobs) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int c = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (c >= N) return;
  float* sums = blockIdx.y == 0 ? jobs.sums[0] : blockIdx.y == 1 ? jobs.sums[1] : jobs.sums[2];
  partials += blockIdx.y * chunks * N;
  double total = 0.0;
  for (int64_t k = lane; k < chunks; k += 32) total += partials[k * N + c];
  total = warp_sum(total);
  if (lane == 0) sums[c] = (float)total;
}

int64_t rows_per_chunk(int64_t M) {
  const int64_t chunks = std::min<int64_t>(kMaxChunks, std::max<int64_t>(1, (M + 63) / 64));
  return std::max<int64_t>(1, (M + chunks - 1) / chunks);
}

}  // namespace

int64_t column_sum_chunks(int64_t M) {
  const int64_t per = rows_per_chunk(M);
  return std::max<int64_t>(1, (M + per - 1) / per);
}

cudaError_t column_sums(const ColumnSumJobs& jobs, int64_t M, int N, double* partials, const DeviceCaps& dev,
                        cudaStream_t stream) {
  if (N == 0 || jobs.count == 0) return cudaSuccess;
  const int64_t per = rows_per_chunk(M), chunks = column_sum_chunks(M);
  const dim3 grid((N + kCols - 1) / kCols, (unsigned)chunks, jobs.count);
  if (cudaError_t e = launch_kernel<chunk_sums_kernel>(grid, dim3(kCols, kRowLanes), 0, stream, dev, jobs, M, N, per,
                                                       partials);
      e != cudaSuccess)
    return e;
  return launch_kernel<chunk_total_kernel>(dim3((N + 7) / 8, jobs.count), 256, 0, stream, dev, partials, chunks, N,
                                           jobs);
}

}  // namespace fastaxial::cuda
