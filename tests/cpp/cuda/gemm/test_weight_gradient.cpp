// The backward's weight-gradient product (src/cuda/gemm/weight_gradient.cu) on its own:
// C (N, K) = A^T B summed over T rows, against a float64 product on the host, over the edges of
// its tiles (128 x 64 on mma.sync, 128 x 128 and 128 x 64 on wgmma) and 32-row stages, one chunk
// of rows and many, aligned and misaligned operands, C with a row stride past K; and two calls
// give the same bits. Each case runs on the kernel weight_gradient picks and, where that is the
// wgmma one (sm_90a), again on mma.sync (WeightGradientArgs::mma_sync), both held to the same
// bound. Skipped without a device that runs it (compute capability 8.0).
//
// Bound: what an fp32 dot product would give, measured on the host, plus the split's own error.
// With ref the float64 sum of each element,
//   R   = max |ref3 - ref|, ref3 the exact sum of the three products the tensor cores take
//         (hi*hi + hi*lo + lo*hi, lo as the tensor core reads it: its top 10 mantissa bits;
//         detail/tf32x3.cuh): the 3xTF32 split's representation error, which no order of
//         summation removes;
//   E32 = max |s32 - ref|, s32 a plain fp32 loop over t (products rounded, added in order);
//   Q   = max 2^-24 sqrt(sum_t (s_t^2 + p_t^2)), s_t the exact partial sums, p_t the terms: the
//         size of the fp32 loop's rounding errors (one of at most 2^-24 |x| for each product and
//         each add), which E32 may undershoot by chance where C has few elements;
// the kernel's max |c - ref| must be <= R + 2 max(E32, Q).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "src/common/plan.h"
#include "src/cuda/gemm/weight_gradient.h"
#include "util/cuda_test_util.h"

namespace fastaxial::test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Case {
  int64_t T;
  int N, K;
  int64_t lda = 0, ldb = 0, ldc = 0;  // row strides; 0: N, K, K
  int a_offset = 0, b_offset = 0;     // floats from a 256-byte aligned allocation
  bool sample_rows = false;           // check some rows of C only (the largest case: host time)
};


// x = hi + lo as the kernel splits it (tf32x3.cuh: hi rounded to TF32, ties away from zero;
// lo = x - hi, exact), lo as the tensor core reads it: its low 13 bits dropped.
void split(float x, double* hi, double* lo) {
  const float h = from_bits((bits(x) + 0x1000u) & 0xffffe000u);
  *hi = h;
  *lo = from_bits(bits(x - h) & 0xffffe000u);
}

DevicePtr upload(const std::vector<float>& v) {
  DevicePtr owned = device_alloc(v.size());
  if (!owned || cudaMemcpy(owned.get(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
    return nullptr;
  return owned;
}

std::string name(const Case& c) {
  std::string s = "T" + std::to_string(c.T) + "_N" + std::to_string(c.N) + "_K" + std::to_string(c.K);
  if (c.lda != 0) s += "_lda" + std::to_string(c.lda);
  if (c.ldb != 0) s += "_ldb" + std::to_string(c.ldb);
  if (c.ldc != 0) s += "_ldc" + std::to_string(c.ldc);
  if (c.a_offset != 0) s += "_aoff" + std::to_string(c.a_offset);
  if (c.b_offset != 0) s += "_boff" + std::to_string(c.b_offset);
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> list;
  // K 64 and 24: wgmma's 128 x 64 tiles; 100, 128, 256: its 128 x 128 ones (100: columns past K
  // inside a tile); K 1, 5, 257 (not multiples of 4): mma.sync only.
  const int shapes[][2] = {{1, 1},   {3, 5},     {64, 64},   {192, 64}, {72, 24},
                           {768, 256}, {130, 257}, {200, 100}, {64, 128}};
  for (int64_t T : {1, 7, 64, 1000})
    for (const auto& s : shapes) list.push_back({T, s[0], s[1]});
  for (const auto& s : shapes)
    if (s[0] != 768) list.push_back({4096, s[0], s[1]});
  for (const auto& s : shapes)
    if (s[0] * s[1] <= 192 * 64) list.push_back({40000, s[0], s[1]});
  Case big{32768, 768, 256};  // d_Wqkv at D 256 over 32768 positions
  big.sample_rows = true;
  list.push_back(big);
  // Misaligned (4-byte copies): A one float past 16-byte alignment with an odd row stride, over
  // many chunks; B alone, three floats past, with an odd stride, in one chunk.
  list.push_back({4096, 130, 257, 131, 0, 0, 1, 0});
  list.push_back({200, 72, 24, 0, 25, 0, 0, 3});
  // Aligned with row strides past a row (wgmma where it runs), one chunk and many.
  list.push_back({1000, 130, 132, 136, 132, 0, 4, 8});
  list.push_back({4096, 200, 100, 204, 104});
  // C with a row stride past K: 16-byte stores (80) and 4-byte ones (67), one chunk and many.
  for (int64_t T : {64, 4096})
    for (int64_t ldc : {80, 67}) list.push_back({T, 64, 64, 0, 0, ldc});
  return list;
}

class WeightGradient : public ::testing::TestWithParam<Case> {};

TEST_P(WeightGradient, MatchesDoubleProductAndRepeatsBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  if (!can_run(WeightGradProblem{}, dev)) GTEST_SKIP() << "needs compute capability 8.0";

  const Case c = GetParam();
  const int64_t T = c.T, N = c.N, K = c.K;
  const int64_t lda = c.lda ? c.lda : N, ldb = c.ldb ? c.ldb : K, ldc = c.ldc ? c.ldc : K;
  std::mt19937 rng((uint32_t)(11 + T + 131 * N + 7 * K + lda + ldc + c.a_offset));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Fresh normal values in every element read; NaN in the stride padding, never read.
  std::vector<float> a(c.a_offset + T * lda, kNaN), b(c.b_offset + T * ldb, kNaN);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t n = 0; n < N; ++n) a[c.a_offset + t * lda + n] = normal(rng);
    for (int64_t k = 0; k < K; ++k) b[c.b_offset + t * ldb + k] = normal(rng);
  }
  const size_t c_floats = (size_t)((N - 1) * ldc + K), partial_floats = weight_gradient_partials_floats(T, N, K, dev);
  const DevicePtr da = upload(a), db = upload(b), dc = device_alloc(c_floats), dp = device_alloc(partial_floats);
  ASSERT_TRUE(da && db && dc && dp);

  cuda::WeightGradientArgs g;
  g.a = da.get() + c.a_offset, g.b = db.get() + c.b_offset, g.c = dc.get();
  g.T = T, g.lda = lda, g.ldb = ldb, g.ldc = ldc, g.N = (int)N, g.K = (int)K;

  // The host's sums, t outer (rows of A and B read in order): over every row of C, or some rows
  // of the largest case (each tile's edges and a few inside).
  std::vector<int64_t> rows;
  for (int64_t n = 0; n < N; ++n)
    if (!c.sample_rows || n % 128 < 2 || n % 128 > 125 || n % 97 == 5) rows.push_back(n);
  const size_t E = rows.size() * K;
  std::vector<double> ref(E, 0.0), ref3(E, 0.0), q(E, 0.0);
  std::vector<float> s32(E, 0.0f);
  std::vector<double> bh(K), bl(K);
  for (int64_t t = 0; t < T; ++t) {
    const float* at = a.data() + c.a_offset + t * lda;
    const float* bt = b.data() + c.b_offset + t * ldb;
    for (int64_t k = 0; k < K; ++k) split(bt[k], &bh[k], &bl[k]);
    for (size_t r = 0; r < rows.size(); ++r) {
      const float x = at[rows[r]];
      double ah, al;
      split(x, &ah, &al);
      const size_t e0 = r * K;
      for (int64_t k = 0; k < K; ++k) {
        const double p = (double)x * bt[k];  // exact
        ref[e0 + k] += p;
        s32[e0 + k] += (float)p;  // fl(x b): one rounding, whatever the compiler contracts
        ref3[e0 + k] += ah * bh[k] + (ah * bl[k] + al * bh[k]);
        q[e0 + k] += ref[e0 + k] * ref[e0 + k] + p * p;
      }
    }
  }
  double R = 0.0, E32 = 0.0, Q = 0.0;
  for (size_t e = 0; e < E; ++e) {
    R = std::max(R, std::fabs(ref3[e] - ref[e]));
    E32 = std::max(E32, std::fabs((double)s32[e] - ref[e]));
    Q = std::max(Q, std::ldexp(std::sqrt(q[e]), -24));
  }
  const double allowed = R + 2.0 * std::max(E32, Q);

  // The kernel weight_gradient picks, then mma.sync where that was wgmma.
  const bool wgmma = cuda::weight_gradient_wgmma(g, dev);
  for (const bool mma_sync : {false, true}) {
    if (mma_sync && !wgmma) break;
    g.mma_sync = mma_sync;
    const bool on_wgmma = cuda::weight_gradient_wgmma(g, dev);
    const std::string kernel = on_wgmma ? "wgmma" : "mma.sync";
    const int64_t splits =
        weight_gradient_split(T, N, K, dev, on_wgmma ? WeightGradKernel::kWgmma : WeightGradKernel::kMmaSync).splits;
    std::vector<float> out[2];
    for (std::vector<float>& o : out) {
      CUDA_OK(cudaMemset(dc.get(), 0xff, c_floats * 4));  // NaN everywhere, the stride's gap included
      CUDA_OK(cudaMemset(dp.get(), 0xff, std::max<size_t>(partial_floats, 1) * 4));
      CUDA_OK(cuda::weight_gradient(g, partial_floats > 0 ? dp.get() : nullptr, partial_floats * 4, dev, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      o.resize(c_floats);
      CUDA_OK(cudaMemcpy(o.data(), dc.get(), c_floats * 4, cudaMemcpyDeviceToHost));
    }
    EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), c_floats * 4), 0) << kernel << ": two calls differ";
    for (int64_t n = 0; n + 1 < N; ++n)
      for (int64_t k = K; k < ldc; ++k)
        ASSERT_EQ(bits(out[0][n * ldc + k]), 0xffffffffu)
            << kernel << ": wrote the stride's gap at (" << n << ", " << k << ")";
    double worst = 0.0;
    int64_t bad_n = -1, bad_k = -1;
    for (size_t r = 0; r < rows.size(); ++r)
      for (int64_t k = 0; k < K; ++k) {
        const double err = std::fabs((double)out[0][rows[r] * ldc + k] - ref[r * K + k]);
        if (!(err <= worst)) worst = err, bad_n = rows[r], bad_k = k;  // NaN counts as worst
      }
    EXPECT_LE(worst, allowed) << kernel << ": worst element (" << bad_n << ", " << bad_k << "): split error " << R
                              << ", fp32 loop's " << E32 << " (expected size " << Q << "), chunks " << splits;

    // Again with A's column sums (WeightGradientArgs::a_sums): C the same bits; chunk s's sum of
    // column n that of the host in float64 over the chunk's rows, to fp64 rounding (a row missed
    // or counted twice is off by about |A| ~ 1); nothing written past the [splits][N] sums.
    const int64_t chunk_rows =
        weight_gradient_split(T, N, K, dev, on_wgmma ? WeightGradKernel::kWgmma : WeightGradKernel::kMmaSync).rows;
    const size_t sums = (size_t)splits * N, kTail = 8;
    std::vector<double> want(sums, 0.0), size(sums, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const double x = a[c.a_offset + t * lda + n];
        want[t / chunk_rows * N + n] += x, size[t / chunk_rows * N + n] += std::fabs(x);
      }
    const DevicePtr ds = device_alloc(2 * (sums + kTail));
    ASSERT_TRUE(ds);
    double* const d_sums = reinterpret_cast<double*>(ds.get());
    CUDA_OK(cudaMemset(dc.get(), 0xff, c_floats * 4));
    CUDA_OK(cudaMemset(d_sums, 0xff, (sums + kTail) * sizeof(double)));
    g.a_sums = d_sums;
    CUDA_OK(cuda::weight_gradient(g, partial_floats > 0 ? dp.get() : nullptr, partial_floats * 4, dev, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    g.a_sums = nullptr;
    std::vector<float> with_sums(c_floats);
    std::vector<double> got(sums + kTail);
    CUDA_OK(cudaMemcpy(with_sums.data(), dc.get(), c_floats * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got.data(), d_sums, got.size() * sizeof(double), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(out[0].data(), with_sums.data(), c_floats * 4), 0) << kernel << ": C with the sums differs";
    for (size_t e = 0; e < sums; ++e) {
      const double bound = std::ldexp(size[e], -52) * (double)std::min(T, chunk_rows);
      ASSERT_LE(std::fabs(got[e] - want[e]), bound) << kernel << ": chunk " << e / N << ", column " << e % N << ": "
                                                    << got[e] << " against " << want[e];
    }
    for (size_t e = sums; e < got.size(); ++e)
      ASSERT_TRUE(std::isnan(got[e])) << kernel << ": wrote past the sums, " << e - sums << " doubles past";
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, WeightGradient, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name(info.param); });

// The cases run the kernel with one chunk of rows (C written by the product blocks) and with
// several (partial tiles, then their fixed-order total) on this device.
TEST(WeightGradientSplit, CasesCoverOneAndManyChunks) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  int one = 0, many = 0;
  for (const Case& c : cases())
    (weight_gradient_split(c.T, c.N, c.K, dev, WeightGradKernel::kMmaSync).splits == 1 ? one : many) += 1;
  EXPECT_GT(one, 0);
  EXPECT_GT(many, 0);
  // The misaligned and strided cases both ways too.
  EXPECT_GT(weight_gradient_partials_floats(4096, 130, 257, dev), 0u);
  EXPECT_EQ(weight_gradient_partials_floats(200, 72, 24, dev), 0u);
  EXPECT_EQ(weight_gradient_partials_floats(64, 64, 64, dev), 0u);
  EXPECT_GT(weight_gradient_partials_floats(4096, 64, 64, dev), 0u);
}

// The arguments of a case as weight_gradient sees them, for its choice of kernel: pointers with
// the case's offsets from a 256-byte aligned address, never read.
cuda::WeightGradientArgs args_of(const Case& c) {
  const float* base = reinterpret_cast<const float*>(uintptr_t{1} << 20);
  cuda::WeightGradientArgs g;
  g.a = base + c.a_offset, g.b = base + c.b_offset, g.c = const_cast<float*>(base);
  g.T = c.T, g.N = c.N, g.K = c.K;
  g.lda = c.lda ? c.lda : c.N, g.ldb = c.ldb ? c.ldb : c.K, g.ldc = c.ldc ? c.ldc : c.K;
  return g;
}

// Where the device runs the wgmma kernel (an sm_90a build on a compute-capability 9.0 GPU), the
// cases run it with one chunk and many, in both its tile widths, and run mma.sync unforced too
// (misaligned operands, K off multiples of 4); the forced runs of the test above cover mma.sync
// on the others.
TEST(WeightGradientKernels, CasesCoverBothKernels) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  if (!cuda::weight_gradient_wgmma(args_of({64, 64, 64}), dev))
    GTEST_SKIP() << "no wgmma kernel on this device or build";
  int wgmma_one = 0, wgmma_many = 0, narrow = 0, wide = 0, mma = 0;
  for (const Case& c : cases()) {
    if (!cuda::weight_gradient_wgmma(args_of(c), dev)) {
      ++mma;
      continue;
    }
    (weight_gradient_split(c.T, c.N, c.K, dev, WeightGradKernel::kWgmma).splits == 1 ? wgmma_one : wgmma_many) += 1;
    (c.K <= 64 ? narrow : wide) += 1;
  }
  EXPECT_GT(wgmma_one, 0);
  EXPECT_GT(wgmma_many, 0);
  EXPECT_GT(narrow, 0);
  EXPECT_GT(wide, 0);
  EXPECT_GT(mma, 0);
  EXPECT_FALSE(cuda::weight_gradient_wgmma(args_of({4096, 130, 257, 131, 0, 0, 1, 0}), dev)) << "misaligned A";
  EXPECT_FALSE(cuda::weight_gradient_wgmma(args_of({200, 72, 24, 0, 25, 0, 0, 3}), dev)) << "misaligned B";
  EXPECT_FALSE(cuda::weight_gradient_wgmma(args_of({64, 3, 5}), dev)) << "K 5";
  EXPECT_TRUE(cuda::weight_gradient_wgmma(args_of({4096, 200, 100, 204, 104}), dev));
  cuda::WeightGradientArgs forced = args_of({64, 64, 64});
  forced.mma_sync = true;
  EXPECT_FALSE(cuda::weight_gradient_wgmma(forced, dev));
}

// Partials missing or smaller than the split needs (a plan made for another device, say) are
// refused before anything is launched.
TEST(WeightGradientSplit, RefusesMissingOrShortPartials) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  if (!can_run(WeightGradProblem{}, dev)) GTEST_SKIP() << "the kernel does not run on this device";
  const int64_t T = 4096, N = 64, K = 64;
  const size_t floats = weight_gradient_partials_floats(T, N, K, dev);
  ASSERT_GT(floats, 0u);
  const DevicePtr da = device_alloc(T * N), db = device_alloc(T * K), dc = device_alloc(N * K),
                  dp = device_alloc(floats);
  ASSERT_TRUE(da && db && dc && dp);
  cuda::WeightGradientArgs g;
  g.a = da.get(), g.b = db.get(), g.c = dc.get(), g.T = T, g.lda = N, g.ldb = K, g.ldc = K, g.N = N, g.K = K;
  EXPECT_EQ(cuda::weight_gradient(g, nullptr, floats * 4, dev, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::weight_gradient(g, dp.get(), floats * 4 - 4, dev, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::weight_gradient(g, dp.get(), floats * 4, dev, nullptr), cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace fastaxial::test
