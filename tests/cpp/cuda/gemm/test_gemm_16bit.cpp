// The 16-bit products on cuBLAS (src/cuda/gemm/blas.h: round_to_16bit, gemm_16bit), as the
// 16-bit path's projections and the backward's products will call them: fp32 operands rounded to
// bf16 or fp16 on the device, then C = op(A) op(B) (+ beta C) with fp32 accumulation.
// round_to_16bit is checked bitwise against the host's rounding (nearest, ties to even; fp16's
// subnormals and overflow), on its 4-wide and scalar paths. The product against a float64 product
// of the same rounded operands: each element within (K + 2) 2^-22 sum_k |a_ik b_kj|, twice the
// bound of fp32 summation, so that accumulation that truncates passes, and at the small K a
// product of the unrounded fp32 operands (each product off by up to 2^-8 relative) does not. Columns past N of C's rows stay
// poison; two calls give the same bits. Skipped without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/common/plan.h"
#include "src/cuda/gemm/blas.h"
#include "util/cuda_test_util.h"
#include "util/round16.h"  // to16, is_nan16, from16

namespace fastaxial::test {
namespace {

struct Dims {
  int64_t M, N, K;
  bool trans_a, trans_b;
  int64_t ldc_pad;  // C's row stride is N + ldc_pad
};

struct Case {
  Dims d;
  Products type;
};

std::string name_of(const Case& c) {
  return "M" + std::to_string(c.d.M) + "_N" + std::to_string(c.d.N) + "_K" + std::to_string(c.d.K) +
         (c.d.trans_a ? "_At" : "") + (c.d.trans_b ? "_Bt" : "") + (c.d.ldc_pad ? "_ldcpad" + std::to_string(c.d.ldc_pad) : "") +
         (c.type == Products::kBf16 ? "_bf16" : "_fp16");
}

// n fp32 values uploaded, rounded on the device into a 16-bit buffer; checked bitwise against to16.
// `offset` elements into both buffers (an odd offset takes the scalar path). Returns the host copy
// of the 16-bit values.
std::vector<uint16_t> round_on_device(const std::vector<float>& x, Products type, const DeviceCaps& dev, int offset,
                                      DevicePtr* x_dev, DevicePtr* y_dev) {
  const size_t n = x.size();
  *x_dev = device_alloc(n + offset);
  *y_dev = device_alloc((n + offset) / 2 + 1);  // 16-bit values, counted in floats
  EXPECT_TRUE(*x_dev && *y_dev);
  if (!*x_dev || !*y_dev) return {};
  float* xd = x_dev->get() + offset;
  uint16_t* yd = reinterpret_cast<uint16_t*>(y_dev->get()) + offset;
  EXPECT_EQ(cudaMemcpy(xd, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(yd, 0xff, n * sizeof(uint16_t)), cudaSuccess);  // poison: NaN in both types
  EXPECT_EQ(cuda::round_to_16bit(xd, yd, (int64_t)n, type, dev, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> got(n);
  EXPECT_EQ(cudaMemcpy(got.data(), yd, n * sizeof(uint16_t), cudaMemcpyDeviceToHost), cudaSuccess);
  size_t wrong = 0, first = n;
  for (size_t i = 0; i < n; ++i)
    if (std::isnan(x[i]) ? !is_nan16(got[i], type) : got[i] != to16(x[i], type)) wrong += 1, first = std::min(first, i);
  EXPECT_EQ(wrong, 0u) << "elements rounded otherwise than the host; first at " << first << ": " << x[first];
  return got;
}

class Gemm16bit : public ::testing::TestWithParam<Case> {};

TEST_P(Gemm16bit, MatchesDoubleProductOfTheRoundedOperands) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  const Case c = GetParam();
  const Dims& d = c.d;
  std::mt19937 rng(1234u + (unsigned)(d.M * 131 + d.N * 7 + d.K) + (c.type == Products::kFp16));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // A is (M, K) or stored (K, M); B is (K, N) or stored (N, K).
  std::vector<float> a((size_t)(d.M * d.K)), b((size_t)(d.K * d.N));
  for (float& v : a) v = u(rng);
  for (float& v : b) v = u(rng);
  DevicePtr a32, a16, b32, b16;
  const std::vector<uint16_t> ah = round_on_device(a, c.type, dev, 0, &a32, &a16);
  const std::vector<uint16_t> bh = round_on_device(b, c.type, dev, d.K % 2, &b32, &b16);  // odd K: misaligned too
  ASSERT_FALSE(HasFailure());
  const int64_t lda = d.trans_a ? d.M : d.K, ldb = d.trans_b ? d.K : d.N, ldc = d.N + d.ldc_pad;
  const auto a_at = [&](int64_t i, int64_t k) { return from16(ah[(size_t)(d.trans_a ? k * lda + i : i * lda + k)], c.type); };
  const auto b_at = [&](int64_t k, int64_t j) { return from16(bh[(size_t)(d.trans_b ? j * ldb + k : k * ldb + j)], c.type); };

  DevicePtr cd = device_alloc((size_t)(d.M * ldc)), ws = device_alloc((32u << 20) / sizeof(float));
  ASSERT_TRUE(cd && ws);
  cublasHandle_t h = nullptr;
  ASSERT_TRUE(cuda::blas_handle(nullptr, ws.get(), 32u << 20, &h).ok());
  const uint16_t* a16p = reinterpret_cast<const uint16_t*>(a16.get());
  const uint16_t* b16p = reinterpret_cast<const uint16_t*>(b16.get()) + d.K % 2;
  std::vector<float> got[2];
  for (int run = 0; run < 2; ++run) {
    ASSERT_EQ(cudaMemset(cd.get(), 0xff, (size_t)(d.M * ldc) * sizeof(float)), cudaSuccess);  // poison (NaN)
    const Status s = cuda::gemm_16bit(h, c.type, d.trans_a, d.trans_b, d.M, d.N, d.K, a16p, lda, b16p, ldb, 0.0f,
                                      cd.get(), ldc, "test product");
    ASSERT_TRUE(s.ok()) << s.message;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got[run].resize((size_t)(d.M * ldc));
    ASSERT_EQ(cudaMemcpy(got[run].data(), cd.get(), got[run].size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)), 0) << "two calls differ";
  int64_t bad = 0, written = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < d.M; ++i) {
    for (int64_t j = 0; j < d.N; ++j) {
      double ref = 0.0, mag = 0.0;
      for (int64_t k = 0; k < d.K; ++k) {
        const double p = a_at(i, k) * b_at(k, j);
        ref += p, mag += std::fabs(p);
      }
      const double e = std::fabs((double)got[0][(size_t)(i * ldc + j)] - ref);
      const double bound = (double)(d.K + 2) * 0x1p-22 * mag;
      if (!(e <= bound)) bad += 1;  // NaN counts
      if (mag > 0) worst = std::max(worst, e / mag);
    }
    for (int64_t j = d.N; j < ldc; ++j) written += !std::isnan(got[0][(size_t)(i * ldc + j)]);
  }
  EXPECT_EQ(bad, 0) << "elements past (K + 2) 2^-22 sum |a b|; worst error / sum |a b| " << worst;
  EXPECT_EQ(written, 0) << "elements past N written";
}

// Tile edges in M, N and K (odd sizes, one row, K below and past a tile), the transposes the
// backward's products take (A^T B for weight gradients, A B^T for the projections), a padded
// C; both types.
const Dims kDims[] = {{1, 1, 1, false, true, 0},       {7, 5, 3, false, true, 0},     {64, 96, 96, false, true, 0},
                      {1000, 288, 96, false, true, 4}, {257, 130, 129, false, true, 0}, {96, 288, 1000, true, false, 0},
                      {33, 17, 4096, true, false, 3},  {128, 256, 256, false, false, 0}, {5, 2048, 64, false, true, 1}};
std::vector<Case> cases() {
  std::vector<Case> out;
  for (const Dims& d : kDims)
    for (Products t : {Products::kBf16, Products::kFp16}) out.push_back({d, t});
  return out;
}
INSTANTIATE_TEST_SUITE_P(Sizes, Gemm16bit, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name_of(info.param); });

// Values at the types' edges: fp16's subnormals, overflow to infinity and ties; bf16's ties and
// NaN; on the scalar path (7 elements) and the 4-wide one (8).
TEST(RoundTo16bit, EdgesMatchTheHostBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  const std::vector<float> edges = {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f,
                                    0x1p-24f, 0x1.8p-24f, 0x1p-25f, 3e-6f, 65504.0f, 65519.0f, 65520.0f, -70000.0f,
                                    std::nanf(""), 1e30f};
  for (Products t : {Products::kBf16, Products::kFp16})
    for (size_t n : {(size_t)7, (size_t)8, edges.size()}) {
      const std::vector<float> x(edges.begin(), edges.begin() + (long)std::min(n, edges.size()));
      DevicePtr xd, yd;
      round_on_device(x, t, dev, 0, &xd, &yd);
    }
}

// An element type other than bf16 or fp16 is refused with a message, not run.
TEST(Gemm16bit, RefusesOtherTypes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePtr ws = device_alloc((32u << 20) / sizeof(float));
  ASSERT_TRUE(ws);
  cublasHandle_t h = nullptr;
  ASSERT_TRUE(cuda::blas_handle(nullptr, ws.get(), 32u << 20, &h).ok());
  const Status s = cuda::gemm_16bit(h, Products::kFp32, false, true, 4, 4, 4, ws.get(), 4, ws.get(), 4, 0.0f, ws.get(), 4,
                                    "test product");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("bf16 or fp16"), std::string::npos) << s.message;
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  EXPECT_EQ(cuda::round_to_16bit(ws.get(), ws.get(), 4, Products::kFp32, dev, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fastaxial::test
