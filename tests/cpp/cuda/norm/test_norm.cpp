// The LayerNorm kernels alone (src/cuda/norm/norm.h), forward and backward, against float64 on
// both their paths (vectorised and scalar).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/cuda/gemm/blas.h"  // round_to_16bit
#include "src/cuda/norm/norm.h"
#include "util/backward_util.h"  // same_bits
#include "util/cuda_test_util.h"

namespace fastaxial::test {
namespace {

// Largest |got - ref| / (1 + |ref|); a NaN (an element left poisoned) counts as the largest.
double worst_error(const std::vector<float>& got, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::abs(got[i] - ref[i]) / (1 + std::abs(ref[i]));
    if (!(e <= worst)) worst = e;
  }
  return worst;
}

// LayerNorm's two kernels alone (norm.h) against float64, into poisoned outputs, on each path:
// vectorised for D a multiple of 4 up to 1024 with 16-byte aligned rows (1, 2, 4 and 8 float4s
// a lane; a row whole in its lanes' last float4s, or ending part-way through them: D = 4, 72,
// 200, 452, 1020), scalar for odd D, for D > 1024, for rows one float off 16 bytes, and for an
// output alone off; norm.h's widths say which path each call takes. The backward in place
// (d_src = d_res) and with d_src left out gives the full call's values bitwise (within a D and
// shift every call takes the same path). T = 2500 positions: more than the grid's 8 a block
// times 32 blocks an SM on up to 9 SMs, so on smaller GPUs too the blocks loop.
TEST(CudaLayerNorm, BothPathsMatchDoubleReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  const int64_t T = 2500;
  const float eps = 1e-5f;
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int D : {6, 9, 4, 72, 128, 200, 256, 384, 452, 640, 1020, 1024, 1152}) {
    // shift 0: every buffer 16-byte aligned; 1: every one a float off (stats aside, read as
    // float2s on both paths); 2: the outputs out, d_src and d_norm_xhat alone a float off.
    for (int shift : {0, 1, 2}) {
      SCOPED_TRACE("D " + std::to_string(D) + ", shift " + std::to_string(shift));
      const size_t n = (size_t)T * D;
      std::vector<float> x(n), gamma(D), beta(D), dn(n), dres(n);
      for (size_t i = 0; i < n; ++i) x[i] = u(rng) + (float)(i / D % 5), dn[i] = u(rng), dres[i] = u(rng);
      for (int c = 0; c < D; ++c) gamma[c] = 1.0f + 0.5f * u(rng), beta[c] = 0.5f * u(rng);

      std::vector<DevicePtr> bufs;
      bool ok = true;  // every allocation and copy succeeded
      auto alloc = [&](size_t count, bool output) {  // count floats (NaN), shifted as `shift` says
        bufs.push_back(device_alloc(count + 1));
        float* d = bufs.back().get();
        ok = ok && d != nullptr && cudaMemset(d, 0xff, (count + 1) * sizeof(float)) == cudaSuccess;
        return d == nullptr ? nullptr : d + (shift == 1 || (shift == 2 && output) ? 1 : 0);
      };
      auto put = [&](const std::vector<float>& h, bool output) {
        float* d = alloc(h.size(), output);
        ok = ok && cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess;
        return d;
      };
      auto get = [&](const float* d, size_t count) {
        std::vector<float> h(count);
        ok = ok && cudaMemcpy(h.data(), d, count * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess;
        return h;
      };
      float *d_x = put(x, false), *d_gamma = put(gamma, false), *d_beta = put(beta, false);
      float *d_dn = put(dn, false), *d_res = put(dres, false), *d_res_in_place = put(dres, true);
      float *d_out = alloc(n, true), *d_src = alloc(n, true), *d_nx = alloc(n, true), *d_nx_alone = alloc(n, true);
      float* d_stats = alloc(2 * T, false) - (shift == 1 ? 1 : 0);  // read as float2s: kept aligned
      ASSERT_TRUE(ok) << "allocating and filling the buffers";

      // The path each call takes: vectorised where D allows and the pointers are aligned.
      const int width = D % 4 == 0 && D <= 1024 ? (D <= 128 ? 1 : D <= 256 ? 2 : D <= 512 ? 4 : 8) : 0;
      const int fwd = shift == 0 ? width : 0, bwd = shift == 0 ? width : 0;
      EXPECT_EQ(cuda::layer_norm_forward_width(D, d_x, d_gamma, d_beta, d_out), fwd);
      EXPECT_EQ(cuda::layer_norm_backward_width(D, d_x, d_gamma, d_dn, d_res, d_src, d_nx), bwd);
      EXPECT_EQ(cuda::layer_norm_backward_width(D, d_x, d_gamma, d_dn, d_res_in_place, d_res_in_place, nullptr), bwd);
      EXPECT_EQ(cuda::layer_norm_backward_width(D, d_x, d_gamma, d_dn, d_res, nullptr, d_nx_alone), bwd);

      CUDA_OK(cuda::layer_norm_forward(d_x, d_gamma, d_beta, eps, T, D, d_out, d_stats, dev, nullptr));
      CUDA_OK(cuda::layer_norm_backward(d_x, d_stats, d_gamma, d_dn, d_res, T, D, d_src, d_nx, dev, nullptr));
      CUDA_OK(cuda::layer_norm_backward(d_x, d_stats, d_gamma, d_dn, d_res_in_place, T, D, d_res_in_place, nullptr,
                                        dev, nullptr));
      CUDA_OK(cuda::layer_norm_backward(d_x, d_stats, d_gamma, d_dn, d_res, T, D, nullptr, d_nx_alone, dev, nullptr));
      CUDA_OK(cudaDeviceSynchronize());

      std::vector<double> out(n), stats(2 * T), ds(n), nx(n);
      // d_src = d_res + rstd (g - mean(g) - xhat mean(g xhat)) amplifies rounding by rstd, which
      // reaches about 90 on rows of D = 4; its bound is that of the other gradients (fastaxial's
      // rule): 2x the error of the same formula evaluated plainly in float32, or 1e-5 if larger.
      std::vector<float> ds_f32(n);
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = &x[t * D];
        double mean = 0, sq = 0;
        for (int c = 0; c < D; ++c) mean += xt[c];
        mean /= D;
        for (int c = 0; c < D; ++c) sq += (xt[c] - mean) * (xt[c] - mean);
        const double rstd = 1 / std::sqrt(sq / D + eps);
        stats[2 * t] = mean, stats[2 * t + 1] = rstd;
        double g_mean = 0, gx_mean = 0;
        for (int c = 0; c < D; ++c) {
          const double xhat = (xt[c] - mean) * rstd, g = (double)dn[t * D + c] * gamma[c];
          out[t * D + c] = xhat * gamma[c] + beta[c];
          nx[t * D + c] = dn[t * D + c] * xhat;
          g_mean += g / D, gx_mean += g * xhat / D;
        }
        for (int c = 0; c < D; ++c) {
          const double xhat = (xt[c] - mean) * rstd, g = (double)dn[t * D + c] * gamma[c];
          ds[t * D + c] = dres[t * D + c] + rstd * (g - g_mean - xhat * gx_mean);
        }
        float mean_f = 0, sq_f = 0, g_mean_f = 0, gx_mean_f = 0;
        for (int c = 0; c < D; ++c) mean_f += xt[c];
        mean_f /= D;
        for (int c = 0; c < D; ++c) sq_f += (xt[c] - mean_f) * (xt[c] - mean_f);
        const float rstd_f = 1 / std::sqrt(sq_f / D + eps);
        for (int c = 0; c < D; ++c) {
          const float g = dn[t * D + c] * gamma[c];
          g_mean_f += g, gx_mean_f += g * ((xt[c] - mean_f) * rstd_f);
        }
        g_mean_f /= D, gx_mean_f /= D;
        for (int c = 0; c < D; ++c) {
          const float xhat = (xt[c] - mean_f) * rstd_f, g = dn[t * D + c] * gamma[c];
          ds_f32[t * D + c] = dres[t * D + c] + rstd_f * (g - g_mean_f - xhat * gx_mean_f);
        }
      }
      const std::vector<float> got_out = get(d_out, n), got_stats = get(d_stats, 2 * T), got_ds = get(d_src, n),
                               got_nx = get(d_nx, n), got_in_place = get(d_res_in_place, n),
                               got_nx_alone = get(d_nx_alone, n);
      ASSERT_TRUE(ok) << "copying the results back";
      EXPECT_LE(worst_error(got_out, out), 1e-5) << "out";
      EXPECT_LE(worst_error(got_stats, stats), 1e-5) << "stats";
      const double ds_f32_error = worst_error(ds_f32, ds);
      EXPECT_LE(worst_error(got_ds, ds), std::max(1e-5, 2 * ds_f32_error))
          << "d_src (a float32 evaluation errs by " << ds_f32_error << ")";
      EXPECT_LE(worst_error(got_nx, nx), 1e-5) << "d_norm_xhat";
      EXPECT_TRUE(same_bits(got_in_place, got_ds)) << "d_src in place of d_res";
      EXPECT_TRUE(same_bits(got_nx_alone, got_nx)) << "d_norm_xhat without d_src";
    }
  }
}

// The 16-bit pass's LayerNorm (layer_norm_forward_16bit) gives the bits of the launches it
// replaces: layer_norm_forward without statistics, then round_to_16bit; add_bias for the residual
// output where it is asked for (with two jobs), nothing written there where not; round_to_16bit
// on each weight it rounds in the same launch (none, one and two jobs; jobs of odd sizes); the
// statistics where asked for (with one or two jobs), each row's mean and rstd within 1e-5 of a float64
// evaluation, untouched where not. Outputs are poisoned (NaN) one element past their end, which stays poison. Both types,
// odd D, D above a warp's 32 lanes and above 1024, T that leaves the last block part-full.
TEST(CudaLayerNorm, SixteenBitOutputIsTheRoundedFp32Output) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  const int64_t T = 1001;
  const float eps = 1e-5f;
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (Products type : {Products::kBf16, Products::kFp16})
    for (int D : {9, 64, 130, 1152})
      for (int jobs : {0, 1, 2}) {
        SCOPED_TRACE(std::string(type == Products::kBf16 ? "bf16" : "fp16") + ", D " + std::to_string(D) + ", " +
                     std::to_string(jobs) + " jobs");
        const size_t n = (size_t)T * D, n1 = 3 * (size_t)D * D + 1, n2 = (size_t)D * D + 3;
        std::vector<float> x(n), gamma(D), beta(D), w1(n1), w2(n2);
        for (size_t i = 0; i < n; ++i) x[i] = 3.0f * u(rng) + (float)(i / D % 7);
        for (int c = 0; c < D; ++c) gamma[c] = 1.0f + 0.5f * u(rng), beta[c] = 0.5f * u(rng);
        for (float& v : w1) v = u(rng);
        for (float& v : w2) v = 100.0f * u(rng);
        std::vector<DevicePtr> bufs;
        bool ok = true;
        auto put = [&](const std::vector<float>& h) {
          bufs.push_back(device_alloc(h.size()));
          float* d = bufs.back().get();
          ok = ok && d != nullptr &&
               cudaMemcpy(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess;
          return d;
        };
        auto out16 = [&](size_t count) {  // count + 1 16-bit values, poisoned
          bufs.push_back(device_alloc(count / 2 + 1));
          void* d = bufs.back().get();
          ok = ok && d != nullptr && cudaMemset(d, 0xff, (count + 1) * sizeof(uint16_t)) == cudaSuccess;
          return d;
        };
        auto get16 = [&](const void* d, size_t count) {  // count + 1 values: the last one past the end
          std::vector<uint16_t> h(count + 1);
          ok = ok && cudaMemcpy(h.data(), d, h.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost) == cudaSuccess;
          return h;
        };
        const float *d_x = put(x), *d_gamma = put(gamma), *d_beta = put(beta), *d_w1 = put(w1), *d_w2 = put(w2);
        const float* d_bias = put(w2);  // (its first D values)
        bufs.push_back(device_alloc(n));
        float* d_norm = bufs.back().get();
        float* d_res[2];  // add_bias's, then the launch's; n + 1 floats each, poisoned
        for (float*& d : d_res) {
          bufs.push_back(device_alloc(n + 1));
          d = bufs.back().get();
          ok = ok && d != nullptr && cudaMemset(d, 0xff, (n + 1) * sizeof(float)) == cudaSuccess;
        }
        bufs.push_back(device_alloc(2 * (size_t)T + 1));  // (T, 2) statistics, poisoned
        float* d_stats = bufs.back().get();
        ok = ok && d_stats != nullptr && cudaMemset(d_stats, 0xff, (2 * T + 1) * sizeof(float)) == cudaSuccess;
        void *want_x = out16(n), *want_w1 = out16(n1), *want_w2 = out16(n2);
        void *got_x = out16(n), *got_w1 = out16(n1), *got_w2 = out16(n2);
        ASSERT_TRUE(ok && d_norm != nullptr) << "allocating and filling the buffers";

        CUDA_OK(cuda::layer_norm_forward(d_x, d_gamma, d_beta, eps, T, D, d_norm, nullptr, dev, nullptr));
        CUDA_OK(cuda::round_to_16bit(d_norm, want_x, (int64_t)n, type, dev, nullptr));
        CUDA_OK(cuda::round_to_16bit(d_w1, want_w1, (int64_t)n1, type, dev, nullptr));
        CUDA_OK(cuda::round_to_16bit(d_w2, want_w2, (int64_t)n2, type, dev, nullptr));
        CUDA_OK(cuda::add_bias(d_x, d_bias, T, D, d_res[0], dev, nullptr));
        cuda::RoundJobs rounds;
        rounds.job[0] = {d_w1, got_w1, (int64_t)n1}, rounds.job[1] = {d_w2, got_w2, (int64_t)n2};
        rounds.count = jobs;
        const bool res = jobs == 2;
        CUDA_OK(cuda::layer_norm_forward_16bit(d_x, d_gamma, d_beta, eps, T, D, got_x, type, rounds,
                                               res ? d_bias : nullptr, res ? d_res[1] : nullptr,
                                               jobs >= 1 ? d_stats : nullptr, dev, nullptr));
        CUDA_OK(cudaDeviceSynchronize());

        const std::vector<uint16_t> want = get16(want_x, n), got = get16(got_x, n);
        const std::vector<uint16_t> want1 = get16(want_w1, n1), got1 = get16(got_w1, n1);
        const std::vector<uint16_t> want2 = get16(want_w2, n2), got2 = get16(got_w2, n2);
        std::vector<float> res_want(n + 1), res_got(n + 1);
        ok = ok && cudaMemcpy(res_want.data(), d_res[0], (n + 1) * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess;
        ok = ok && cudaMemcpy(res_got.data(), d_res[1], (n + 1) * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess;
        std::vector<float> stats(2 * T + 1);
        ok = ok && cudaMemcpy(stats.data(), d_stats, stats.size() * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess;
        ASSERT_TRUE(ok) << "copying the results back";
        if (jobs >= 1) {
          int64_t bad = 0;
          for (int64_t t = 0; t < T; ++t) {
            double mean = 0.0, var = 0.0;
            for (int c = 0; c < D; ++c) mean += x[t * D + c];
            mean /= D;
            for (int c = 0; c < D; ++c) var += (x[t * D + c] - mean) * (x[t * D + c] - mean);
            const double rstd = 1.0 / std::sqrt(var / D + eps), sd = std::sqrt(var / D);
            bad += !(std::abs(stats[2 * t] - mean) <= 1e-5 * (std::abs(mean) + sd)) ||
                   !(std::abs(stats[2 * t + 1] - rstd) <= 1e-5 * rstd);
          }
          EXPECT_EQ(bad, 0) << "rows whose statistics are off (row 0: " << stats[0] << ", " << stats[1] << ")";
        } else {
          EXPECT_TRUE(std::all_of(stats.begin(), stats.end() - 1, [](float v) { return std::isnan(v); }))
              << "statistics written where not asked for";
        }
        EXPECT_TRUE(std::isnan(stats.back())) << "statistics written past their end";
        const std::vector<float> res_poison(n + 1, from_bits(0xffffffffu));
        EXPECT_TRUE(same_bits(res_got, res ? res_want : res_poison)) << "the residual output";
        EXPECT_EQ(want.back(), 0xffffu) << "(round_to_16bit wrote past its end)";
        EXPECT_TRUE(got == want) << "LayerNorm's output";
        const std::vector<uint16_t> poison1(n1 + 1, 0xffffu), poison2(n2 + 1, 0xffffu);
        EXPECT_TRUE(got1 == (jobs >= 1 ? want1 : poison1)) << "the first job";
        EXPECT_TRUE(got2 == (jobs >= 2 ? want2 : poison2)) << "the second job";
      }
  // Only the 16-bit types.
  EXPECT_EQ(cuda::layer_norm_forward_16bit(nullptr, nullptr, nullptr, eps, 4, 8, nullptr, Products::kFp32, {}, nullptr,
                                           nullptr, nullptr, dev, nullptr),
            cudaErrorInvalidValue);
  float unused = 0.0f;  // a residual output without its bias: refused before any launch
  EXPECT_EQ(cuda::layer_norm_forward_16bit(nullptr, nullptr, nullptr, eps, 4, 8, nullptr, Products::kBf16, {}, nullptr,
                                           &unused, nullptr, dev, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fastaxial::test
