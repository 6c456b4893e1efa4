// The backward's column sums alone (src/cuda/norm/column_sums.h): every job's sums over all rows,
// and a projected job's sums times its weight, against float64, into poisoned outputs; the 16-bit
// backward's rounding that takes a job's chunk partials on the way.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "src/cuda/gemm/blas.h"  // round_to_16bit
#include "src/cuda/norm/column_sums.h"
#include "util/backward_util.h"  // same_bits
#include "util/cuda_test_util.h"

namespace fastaxial::test {
namespace {

// Matrices (M, cols[j]) of terms around 2 with a per-column offset (sums far from zero, where an
// fp32 tree would lose many ulps), then a weight (3D, D) for the projected job, drawn in that order.
std::vector<std::vector<float>> column_sum_inputs(std::mt19937& rng, int64_t M, const std::vector<int>& cols, int D,
                                                  std::vector<float>* w) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::vector<float>> a(cols.size());
  for (size_t j = 0; j < cols.size(); ++j) {
    a[j].resize((size_t)M * cols[j]);
    for (size_t i = 0; i < a[j].size(); ++i) a[j][i] = 2.0f + u(rng) + 0.25f * (float)(i % cols[j] % 3);
  }
  w->resize((size_t)3 * D * D);
  for (float& v : *w) v = u(rng);
  return a;
}

// A test's device buffers, freed with it: copies of host vectors (a float of room past the end)
// and poisoned ones (every byte 0xff). ok stays true while every allocation and copy succeeded.
struct DeviceBuffers {
  std::vector<DevicePtr> bufs;
  bool ok = true;
  float* put(const std::vector<float>& h) {
    bufs.push_back(device_alloc(h.size() + 1));
    float* d = bufs.back().get();
    ok = ok && d != nullptr && cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess;
    return d;
  }
  float* poisoned(size_t floats) {
    bufs.push_back(device_alloc(floats));
    float* d = bufs.back().get();
    ok = ok && d != nullptr && cudaMemset(d, 0xff, floats * sizeof(float)) == cudaSuccess;
    return d;
  }
};

// The jobs of a backward pass (dy (D), dqkv (3D) projected by Wqkv (3D, D), d_xn * xhat (D)) over
// M rows: no rows, fewer than a chunk, one chunk per 64 rows, and the most chunks with rows left
// over. The rows have a mean far from zero (as a bias gradient's terms can), so that a sum in fp32
// would be off by many ulps; the sums run in fp64 and round once, so each result is the float64
// sum rounded: within an ulp. Two calls give the same bits. Then again with the first two jobs'
// chunk partials written by another kernel (the weight gradients' ASums; here from the host, in
// fp64, over chunks of their own count): their matrices are not given, and the sums are the same.
TEST(CudaColumnSums, JobsAndProjectedJobMatchDouble) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  std::mt19937 rng(77);
  for (int D : {1, 24, 96, 200}) {
    for (int64_t M : {0, 5, 640, 9001}) {
      for (bool taken : {false, true}) {
        SCOPED_TRACE("D " + std::to_string(D) + ", M " + std::to_string(M) + (taken ? ", chunks taken" : ""));
        const int cols[3] = {D, 3 * D, D};
        std::vector<float> w;
        const std::vector<std::vector<float>> a = column_sum_inputs(rng, M, {cols[0], cols[1], cols[2]}, D, &w);
        DeviceBuffers buf;
        cuda::ColumnSumJobs jobs;
        float* out[3] = {buf.poisoned(D), buf.poisoned(D), buf.poisoned(D)};
        EXPECT_EQ(jobs.add(taken ? nullptr : buf.put(a[0]), D, out[0]), 0);
        EXPECT_EQ(jobs.add_projected(taken ? nullptr : buf.put(a[1]), 3 * D, buf.put(w), D, out[1]), 1);
        EXPECT_EQ(jobs.add(buf.put(a[2]), D, out[2]), 2);
        const int64_t partials = cuda::column_sum_partials(jobs);
        EXPECT_LE(partials, kColumnPartialsPerDim * D) << "the plan's scratch holds a pass's jobs";
        double* scratch = nullptr;
        ASSERT_EQ(cudaMalloc(&scratch, partials * sizeof(double)), cudaSuccess);
        ASSERT_TRUE(buf.ok) << "allocating and filling the buffers";
        CUDA_OK(cudaMemset(scratch, 0xff, partials * sizeof(double)));
        if (taken) {
          // Chunks of 97 rows (the last shorter), at most kMaxColumnSumChunks: the last takes the rest.
          const int64_t n = std::min<int64_t>(kMaxColumnSumChunks, std::max<int64_t>(1, (M + 96) / 97));
          for (int j = 0; j < 2; ++j) {
            std::vector<double> chunk_sums((size_t)n * cols[j], 0.0);
            for (int64_t r = 0; r < M; ++r)
              for (int c = 0; c < cols[j]; ++c) chunk_sums[std::min(r / 97, n - 1) * cols[j] + c] += a[j][r * cols[j] + c];
            CUDA_OK(cudaMemcpy(jobs.chunk_partials(scratch, j), chunk_sums.data(), chunk_sums.size() * sizeof(double),
                               cudaMemcpyHostToDevice));
            jobs.take_chunks(j, n);
          }
        }
        CUDA_OK(cuda::column_sums(jobs, M, scratch, dev, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<std::vector<float>> got(3, std::vector<float>(D)), again(3, std::vector<float>(D));
        for (int j = 0; j < 3; ++j)
          CUDA_OK(cudaMemcpy(got[j].data(), out[j], D * sizeof(float), cudaMemcpyDeviceToHost));
        CUDA_OK(cuda::column_sums(jobs, M, scratch, dev, nullptr));
        for (int j = 0; j < 3; ++j)
          CUDA_OK(cudaMemcpy(again[j].data(), out[j], D * sizeof(float), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaFree(scratch));

        for (int j = 0; j < 3; ++j) {
          std::vector<double> sums(cols[j], 0.0);
          for (int64_t r = 0; r < M; ++r)
            for (int c = 0; c < cols[j]; ++c) sums[c] += a[j][r * cols[j] + c];
          std::vector<double> ref = sums;
          if (j == 1) {  // the projected job: sums (3D) times w (3D, D)
            ref.assign(D, 0.0);
            for (int c = 0; c < 3 * D; ++c)
              for (int o = 0; o < D; ++o) ref[o] += sums[c] * w[(size_t)c * D + o];
          }
          for (int o = 0; o < D; ++o) {
            const float want = (float)ref[o];
            const double ulp = std::nextafter(std::abs(want), INFINITY) - std::abs(want);
            ASSERT_LE(std::abs(got[j][o] - ref[o]), ulp) << "job " << j << ", column " << o << ": " << got[j][o]
                                                         << " against " << ref[o];
          }
          EXPECT_TRUE(same_bits(got[j], again[j])) << "job " << j << ": a second call";
        }
      }
    }
  }
}

// round_with_column_sums: a job's matrix rounded to bf16 or fp16 with the bits round_to_16bit
// gives, nothing written past it (poison), and its chunk partials taken, so that column_sums gives
// the bits it gives without them (the same chunks summed in the same order); the projected job too.
// D above a block's 32 columns and not a multiple of them, M from none to several chunks.
TEST(CudaColumnSums, RoundedWithTheSumsGivesTheSameSums) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  std::mt19937 rng(78);
  for (Products type : {Products::kBf16, Products::kFp16})
    for (int D : {24, 72})
      for (int64_t M : {0, 5, 9001}) {
        SCOPED_TRACE(std::string(type == Products::kBf16 ? "bf16" : "fp16") + ", D " + std::to_string(D) + ", M " +
                     std::to_string(M));
        const int cols[2] = {D, 3 * D};
        std::vector<float> w;
        const std::vector<std::vector<float>> a = column_sum_inputs(rng, M, {cols[0], cols[1]}, D, &w);
        DeviceBuffers buf;
        const float *da = buf.put(a[0]), *dqkv = buf.put(a[1]), *dw = buf.put(w);
        float* plain[2] = {buf.poisoned(D), buf.poisoned(D)};
        float* fused[2] = {buf.poisoned(D), buf.poisoned(D)};
        void* want16[2] = {buf.poisoned((size_t)M * cols[0] / 2 + 1), buf.poisoned((size_t)M * cols[1] / 2 + 1)};
        void* got16[2] = {buf.poisoned((size_t)M * cols[0] / 2 + 1), buf.poisoned((size_t)M * cols[1] / 2 + 1)};
        cuda::ColumnSumJobs jobs, rounded;
        jobs.add(da, D, plain[0]), jobs.add_projected(dqkv, 3 * D, dw, D, plain[1]);
        rounded.add(da, D, fused[0]), rounded.add_projected(dqkv, 3 * D, dw, D, fused[1]);
        const int64_t partials = cuda::column_sum_partials(jobs);
        double* scratch = nullptr;
        ASSERT_EQ(cudaMalloc(&scratch, partials * sizeof(double)), cudaSuccess);
        ASSERT_TRUE(buf.ok) << "allocating and filling the buffers";
        CUDA_OK(cudaMemset(scratch, 0xff, partials * sizeof(double)));
        CUDA_OK(cuda::column_sums(jobs, M, scratch, dev, nullptr));
        CUDA_OK(cudaMemset(scratch, 0xff, partials * sizeof(double)));  // the partials from the rounding alone
        for (int j = 0; j < 2; ++j) {
          CUDA_OK(cuda::round_to_16bit(j == 0 ? da : dqkv, want16[j], M * cols[j], type, dev, nullptr));
          CUDA_OK(cuda::round_with_column_sums(&rounded, j, M, got16[j], type, scratch, dev, nullptr));
          EXPECT_EQ(rounded.chunks[j], cuda::column_sum_chunks(M)) << "job " << j << "'s chunks not taken";
        }
        CUDA_OK(cuda::column_sums(rounded, M, scratch, dev, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        for (int j = 0; j < 2; ++j) {
          std::vector<float> want(D), got(D);
          CUDA_OK(cudaMemcpy(want.data(), plain[j], D * sizeof(float), cudaMemcpyDeviceToHost));
          CUDA_OK(cudaMemcpy(got.data(), fused[j], D * sizeof(float), cudaMemcpyDeviceToHost));
          EXPECT_TRUE(same_bits(got, want)) << "job " << j << "'s sums";
          const size_t n = (size_t)M * cols[j] + 1;  // one past the end: poison
          std::vector<uint16_t> w16(n), g16(n);
          CUDA_OK(cudaMemcpy(w16.data(), want16[j], n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
          CUDA_OK(cudaMemcpy(g16.data(), got16[j], n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
          EXPECT_TRUE(g16 == w16) << "job " << j << " rounded";
          EXPECT_EQ(g16.back(), 0xffffu) << "job " << j << ": written past its end";
        }
        CUDA_OK(cudaFree(scratch));
      }
  cuda::ColumnSumJobs one;
  one.add(nullptr, 4, nullptr);
  EXPECT_EQ(cuda::round_with_column_sums(&one, 1, 8, nullptr, Products::kBf16, nullptr, dev, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::round_with_column_sums(&one, 0, 8, nullptr, Products::kFp32, nullptr, dev, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fastaxial::test
