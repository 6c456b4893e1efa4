// Column sums in two launches (column_sums.h), a third for a projected job:
// a block per (32 columns, chunk of rows, job) sums its chunk, 8 row lanes
// per column each taking every 8th row and then added in lane order; a warp
// per column adds the chunks; a projected job's sums then multiply its
// weight, a block per 32 output columns with 32 lanes over the inputs. A job
// whose chunk partials another kernel wrote (ColumnSumJobs::take_chunks)
// skips the first launch.
// The sums run in fp64 and round to fp32 once at the end: a bias gradient is
// a sum over every position of the grid (tens of thousands of terms), and an
// fp32 tree over them adds rounding errors of the order of the terms' own
// (docs/perf-notes.md); the kernels are memory-bound, so the wider adds cost
// nothing.
#include "column_sums.h"

#include <algorithm>

#include "../detail/launch.cuh"
#include "../detail/round16.cuh"
#include "../detail/warp_ops.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int kCols = 32, kRowLanes = 8;
// The projection's lanes over its K inputs: a short chain each (K / 32 products, the loads
// unrolled), since the launch has only out_cols / 32 blocks.
constexpr int kProjectLanes = 32;
constexpr int64_t kMaxChunks = kMaxColumnSumChunks;  // the plan's partials region holds this many

// Job j's fields by a constant index (a runtime one would copy the parameters to local memory).
template <typename T>
__device__ __forceinline__ T of_job(const T (&field)[ColumnSumJobs::kMax], int j) {
  return j == 0 ? field[0] : j == 1 ? field[1] : field[2];
}

// partials[blockIdx.y][c] = the sum of a[r][c] (a is (M, N)) over chunk blockIdx.y's rows, for the
// block's 32 columns c: 8 row lanes, each every 8th row, then the lanes' sums in lane order.
// visit(r N + c, a[r][c]) sees each element summed (rounded_chunk_sums_kernel stores it rounded).
template <class Visit>
__device__ __forceinline__ void chunk_partial(const float* __restrict__ a, int N, int64_t M, int64_t rows_per_chunk,
                                              double* __restrict__ partials, const Visit& visit) {
  __shared__ double lane_sums[kRowLanes][kCols];
  const int c = blockIdx.x * kCols + threadIdx.x;
  const int64_t begin = blockIdx.y * rows_per_chunk, end = begin + rows_per_chunk < M ? begin + rows_per_chunk : M;
  double sum = 0.0;
  if (c < N) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) {
      const float v = a[r * N + c];
      visit(r * N + c, v);
      sum += (double)v;
    }
  }
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < N) {
    double total = 0.0;
    for (int l = 0; l < kRowLanes; ++l) total += lane_sums[l][threadIdx.x];
    partials[blockIdx.y * (int64_t)N + c] = total;
  }
}

// partials[chunk][c] = sum of a[r][c] over the chunk's rows, for job blockIdx.z.
__global__ void __launch_bounds__(kCols* kRowLanes)
    chunk_sums_kernel(const ColumnSumJobs jobs, int64_t M, int64_t rows_per_chunk, double* __restrict__ partials) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int j = blockIdx.z, N = of_job(jobs.cols, j);
  // Past this job's columns (the grid covers the widest), or its partials are in already.
  if (blockIdx.x * kCols >= N || of_job(jobs.chunks, j) > 0) return;
  const float* __restrict__ a = of_job(jobs.a, j);
  chunk_partial(a, N, M, rows_per_chunk, partials + jobs.partials_offset(j), [](int64_t, float) {});
}

// chunk_sums_kernel's partials of one matrix a (M, N), the same sums in the same order, while it
// writes y = a rounded to T (round_to_16bit's bits): the 16-bit backward's operands, read once.
template <class T>
__global__ void __launch_bounds__(kCols* kRowLanes)
    rounded_chunk_sums_kernel(const float* __restrict__ a, T* __restrict__ y, int N, int64_t M,
                              int64_t rows_per_chunk, double* __restrict__ partials) {
  grid_dependency_wait();
  allow_dependent_launch();
  chunk_partial(a, N, M, rows_per_chunk, partials, [y](int64_t i, float v) { y[i] = round16<T>(v); });
}

// Column c of job blockIdx.y: the sum of partials[k][c] over the job's chunks k (`chunks`, or
// those another kernel wrote), a warp per column, lane l adding chunks l, l + 32, ... in order, then
// the lanes' sums by a fixed butterfly (the same tree every call). A thread per column walking all
// chunks would wait out a memory latency per chunk. Rounded into sums, or for the projected job
// kept in fp64 at `totals`.
__global__ void chunk_total_kernel(const double* __restrict__ partials, int64_t chunks, const ColumnSumJobs jobs,
                                   double* __restrict__ totals) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int j = blockIdx.y, N = of_job(jobs.cols, j);
  const int c = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (c >= N) return;
  if (of_job(jobs.chunks, j) > 0) chunks = of_job(jobs.chunks, j);
  partials += jobs.partials_offset(j);
  double total = 0.0;
  for (int64_t k = lane; k < chunks; k += 32) total += partials[k * N + c];
  total = warp_sum(total);
  if (lane != 0) return;
  if (j == jobs.projected) totals[c] = total;
  else of_job(jobs.sums, j)[c] = (float)total;
}

// out[o] = sum over c < K of totals[c] w[c][o], in fp64: lane threadIdx.y takes every 32nd c, then
// the lanes add in order.
__global__ void __launch_bounds__(kCols* kProjectLanes)
    project_kernel(const double* __restrict__ totals, const float* __restrict__ w, int K, int out_cols,
                   float* __restrict__ out) {
  grid_dependency_wait();
  allow_dependent_launch();
  __shared__ double lane_sums[kProjectLanes][kCols];
  const int o = blockIdx.x * kCols + threadIdx.x;
  double sum = 0.0;
  if (o < out_cols) {
#pragma unroll 4
    for (int c = threadIdx.y; c < K; c += kProjectLanes) sum += totals[c] * (double)w[(int64_t)c * out_cols + o];
  }
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && o < out_cols) {
    double total = 0.0;
    for (int l = 0; l < kProjectLanes; ++l) total += lane_sums[l][threadIdx.x];
    out[o] = (float)total;
  }
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

int64_t column_sum_partials(const ColumnSumJobs& jobs) {
  int64_t cols = 0;
  for (int j = 0; j < jobs.count; ++j) cols += jobs.cols[j];
  return kMaxChunks * cols + (jobs.projected >= 0 ? jobs.cols[jobs.projected] : 0);
}

cudaError_t column_sums(const ColumnSumJobs& jobs, int64_t M, double* partials, const DeviceCaps& dev,
                        cudaStream_t stream) {
  if (jobs.count == 0) return cudaSuccess;
  int widest = 0, widest_here = 0, cols = 0;  // widest_here: of the jobs whose chunks are summed here
  for (int j = 0; j < jobs.count; ++j) {
    if (jobs.chunks[j] < 0 || jobs.chunks[j] > kMaxChunks) return cudaErrorInvalidValue;
    widest = std::max(widest, jobs.cols[j]), cols += jobs.cols[j];
    if (jobs.chunks[j] == 0) widest_here = std::max(widest_here, jobs.cols[j]);
  }
  if (widest == 0) return cudaSuccess;
  const int64_t per = rows_per_chunk(M), chunks = column_sum_chunks(M);
  double* totals = partials + kMaxChunks * cols;  // the projected job's sums
  if (widest_here > 0) {
    const dim3 grid((widest_here + kCols - 1) / kCols, (unsigned)chunks, jobs.count);
    if (cudaError_t e = launch_kernel<chunk_sums_kernel>(grid, dim3(kCols, kRowLanes), 0, stream, dev, jobs, M, per,
                                                         partials);
        e != cudaSuccess)
      return e;
  }
  if (cudaError_t e = launch_kernel<chunk_total_kernel>(dim3((widest + 7) / 8, jobs.count), 256, 0, stream, dev,
                                                        partials, chunks, jobs, totals);
      e != cudaSuccess || jobs.projected < 0)
    return e;
  return launch_kernel<project_kernel>(dim3((jobs.out_cols + kCols - 1) / kCols), dim3(kCols, kProjectLanes), 0, stream,
                                       dev, totals, jobs.w, jobs.cols[jobs.projected], jobs.out_cols,
                                       jobs.sums[jobs.projected]);
}

cudaError_t round_with_column_sums(ColumnSumJobs* jobs, int job, int64_t M, void* y, Products type, double* partials,
                                   const DeviceCaps& dev, cudaStream_t stream) {
  if (job < 0 || job >= jobs->count || (type != Products::kBf16 && type != Products::kFp16)) return cudaErrorInvalidValue;
  const int N = jobs->cols[job];
  const int64_t per = rows_per_chunk(M), chunks = column_sum_chunks(M);
  if (N > 0) {
    const dim3 grid((N + kCols - 1) / kCols, (unsigned)chunks);
    double* at = jobs->chunk_partials(partials, job);
    const auto launch = [&](auto* typed_y) {
      return launch_kernel<rounded_chunk_sums_kernel<std::remove_pointer_t<decltype(typed_y)>>>(
          grid, dim3(kCols, kRowLanes), 0, stream, dev, jobs->a[job], typed_y, N, M, per, at);
    };
    const cudaError_t e =
        type == Products::kBf16 ? launch(static_cast<__nv_bfloat16*>(y)) : launch(static_cast<__half*>(y));
    if (e != cudaSuccess) return e;
  }
  jobs->take_chunks(job, chunks);
  return cudaSuccess;
}

}  // namespace fastaxial::cuda
