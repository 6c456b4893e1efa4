// The staged path's product kernel (src/cuda/gemm/gemm.cu) on its own:
// C = A @ W^T + bias + residual from fp32 A and split W, against a float64 product
// on the host, over tile edges in M, N and K. Skipped without a device that
// runs it (compute capability 9.0 and an sm_90a build).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "src/common/plan.h"
#include "src/cuda/gemm/gemm.h"
#include "src/cuda/gemm/weight_planes.h"
#include "util/cuda_test_util.h"

namespace fastaxial::test {
namespace {

// fp32 -> TF32 rounded to nearest, ties away from zero (cvt.rna.tf32.f32).
float to_tf32(float x) { return from_bits((bits(x) + 0x1000u) & 0xFFFFE000u); }

// [hi (n) | lo (n)] planes of v.
std::vector<float> split_planes(const std::vector<float>& v) {
  std::vector<float> out(2 * v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = to_tf32(v[i]);
    out[v.size() + i] = to_tf32(v[i] - out[i]);
  }
  return out;
}

// fp32 -> TF32 rounded to nearest, ties to even (cvt.rn.tf32.f32); NaN stays NaN.
float to_tf32_even(float x) {
  if (std::isnan(x)) return x;
  const uint32_t u = bits(x);
  return from_bits((u + 0xFFFu + ((u >> 13) & 1u)) & 0xFFFFE000u);
}

struct Dims {
  int M, N, K;
};

// A device copy of v; null where allocation or copy fails.
DevicePtr upload(const std::vector<float>& v) {
  DevicePtr owned = device_alloc(v.size());
  if (!owned || cudaMemcpy(owned.get(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
    return nullptr;
  return owned;
}

class GemmTf32x3 : public ::testing::TestWithParam<Dims> {};

TEST_P(GemmTf32x3, MatchesDoubleProduct) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  if (HasFatalFailure()) return;
  if (!cuda::gemm_tf32x3_can_run(dev)) GTEST_SKIP() << "needs compute capability 9.0 and an sm_90a build";

  const auto [M, N, K] = GetParam();
  std::mt19937 rng(7 + M + N + K);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a((size_t)M * K), w((size_t)N * K), bias(N), res((size_t)M * N);
  for (auto* v : {&a, &w, &bias, &res})
    for (float& x : *v) x = normal(rng);

  const DevicePtr da = upload(a), dw = upload(split_planes(w)), db = upload(bias), dr = upload(res),
                  dc = upload(std::vector<float>(res.size()));
  ASSERT_TRUE(da && dw && db && dr && dc);
  ASSERT_EQ(cudaMemset(dc.get(), 0xff, res.size() * 4), cudaSuccess);  // NaN

  cuda::GemmArgs g;
  g.a = da.get(), g.w = dw.get(), g.bias = db.get(), g.residual = dr.get(), g.c = dc.get(), g.M = M, g.N = N, g.K = K;
  ASSERT_EQ(cuda::gemm_tf32x3(g, dev, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> c(res.size());
  ASSERT_EQ(cudaMemcpy(c.data(), dc.get(), c.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);

  // Bound: fp32-level error of the sum of |terms| (plain TF32 is ~1e-3 off).
  double worst = 0.0;
  int bad_m = -1, bad_n = -1;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      // mag sums every term's magnitude, bias and residual each on their own
      // (their sum may cancel while the fp32 adds round at their own size).
      double ref = (double)bias[n] + res[(size_t)m * N + n],
             mag = std::fabs((double)bias[n]) + std::fabs((double)res[(size_t)m * N + n]);
      for (int k = 0; k < K; ++k) {
        const double t = (double)a[(size_t)m * K + k] * w[(size_t)n * K + k];
        ref += t;
        mag += std::fabs(t);
      }
      const double ratio = std::fabs(c[(size_t)m * N + n] - ref) / (4e-7 * mag + 1e-30);
      if (!(ratio <= worst)) worst = ratio, bad_m = m, bad_n = n;  // NaN counts as worst
    }
  EXPECT_LE(worst, 1.0) << "worst element (" << bad_m << ", " << bad_n << ")";
}

// The weight planes (gemm/weight_planes.h) that the products read: hi = w rounded to TF32 (ties
// away), lo = w - hi rounded to TF32 too (ties to even), bit for bit, straight and transposed.
// A lo left unrounded (the tensor core truncates it) loses up to 2^-22 of w a product, which
// short chains of products (a few positions, small dims) showed as gradients 4x the fp32
// reference's error. NaN stays NaN in lo; an infinity's lo is NaN (inf - inf).
TEST(WeightPlanes, BothPartsRoundedToNearest) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  if (HasFatalFailure()) return;
  const int64_t n = 24, k = 40;  // (n, k) straight, and the transpose of a (k, n) source
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w((size_t)(n * k));
  for (float& x : w) x = normal(rng) * std::ldexp(1.0f, (int)(rng() % 40) - 20);
  // Special values: lo exactly half a TF32 unit of lo (a tie), zero, subnormal, huge, inf, NaN.
  w[0] = 1.0f + std::ldexp(1.0f, -12) + std::ldexp(1.0f, -23);  // hi 1, lo 2^-12 (1 + 2^-11): a tie, to even
  w[1] = 0.0f, w[2] = -0.0f, w[3] = 1e-40f, w[4] = 3e38f;
  w[5] = INFINITY, w[6] = -INFINITY, w[7] = NAN;
  const DevicePtr src = upload(w), dst = upload(std::vector<float>(4 * w.size()));
  ASSERT_TRUE(src && dst);
  ASSERT_EQ(cudaMemset(dst.get(), 0xff, 4 * w.size() * 4), cudaSuccess);
  cuda::PlaneJobs jobs;
  jobs.add(src.get(), dst.get(), n, k, false);
  jobs.add(src.get(), dst.get() + 2 * w.size(), n, k, true);  // src read as (k, n)
  ASSERT_EQ(cuda::split_weight_planes(jobs, dev, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> out(4 * w.size());
  ASSERT_EQ(cudaMemcpy(out.data(), dst.get(), out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  int checked_nan = 0;
  for (int t = 0; t < 2; ++t)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c) {
        const float x = t == 0 ? w[(size_t)(r * k + c)] : w[(size_t)(c * n + r)];
        const float hi = out[(size_t)(2 * t * n * k + r * k + c)], lo = out[(size_t)((2 * t + 1) * n * k + r * k + c)];
        if (std::isnan(x) || std::isinf(x)) {
          EXPECT_TRUE(std::isnan(lo)) << "x " << x << " lo " << lo;
          ++checked_nan;
          continue;
        }
        const float want_hi = to_tf32(x), want_lo = to_tf32_even(x - want_hi);
        ASSERT_EQ(bits(hi), bits(want_hi)) << "x " << x << " at " << t << ", " << r << ", " << c;
        ASSERT_EQ(bits(lo), bits(want_lo)) << "x " << x << " hi " << hi << " lo " << lo << " at " << t << ", " << r
                                           << ", " << c;
      }
  EXPECT_EQ(checked_nan, 6);
}

INSTANTIATE_TEST_SUITE_P(Sizes, GemmTf32x3,
                         // On an H200 (132 SMs) the first three run 64 x 128 tiles (one
                         // warpgroup), the next two 64 x 96 (N pads less to 96); the next
                         // five have as many tiles as the SMs or more (blocks loop over
                         // tiles where more; one to two k-steps each, edges in all of M, N,
                         // K): 192 x 96 tiles (three warpgroups) twice, then 192 x 128,
                         // 128 x 96 (although 256 columns pad more to 96: one round of 132
                         // tiles against one of 88 wider ones) and 128 x 128 (common/plan.h,
                         // gemm_tiling). The last four take the same tilings (192 x 128,
                         // 192 x 96, 128 x 128, 128 x 96) with 6 or 7 k-steps a tile, more
                         // than the ring's 4 stages, so the producers refill stages the
                         // consumers released (the empty barriers' waits).
                         ::testing::Values(Dims{128, 128, 32}, Dims{300, 200, 72}, Dims{256, 384, 256},
                                           Dims{1, 8, 4}, Dims{1000, 96, 96}, Dims{17000, 136, 40},
                                           Dims{40000, 8, 4}, Dims{20000, 256, 64}, Dims{5632, 256, 64},
                                           Dims{8200, 512, 40}, Dims{20000, 256, 200}, Dims{17000, 136, 168},
                                           Dims{8200, 512, 200}, Dims{5632, 256, 200}),
                         [](const auto& info) {
                           return "M" + std::to_string(info.param.M) + "_N" + std::to_string(info.param.N) +
                                  "_K" + std::to_string(info.param.K);
                         });

}  // namespace
}  // namespace fastaxial::test
