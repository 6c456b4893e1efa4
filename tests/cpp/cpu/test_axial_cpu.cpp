// CPU forward vs the double-precision reference (the accuracy rule of util/reference.h), the
// drop-in contract's tolerance, and argument checking.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "util/reference.h"

namespace fastaxial::test {
namespace {

// The drop-in contract's tolerance (torch.allclose's atol and rtol): checked on its own
// (ContractTolerance); the correctness tests use the accuracy rule, 100 to 500 times tighter.
constexpr double kAtol = 1e-4, kRtol = 1e-4;

// out = forward_cpu(p) into a poisoned buffer, within the accuracy rule.
void expect_accurate(const Problem& p) {
  std::vector<float> out(p.x.size(), std::numeric_limits<float>::quiet_NaN());  // poisoned
  const Status st = forward_cpu(params(p, out.data()));
  ASSERT_TRUE(st.ok()) << st.message;
  expect_forward_within_rule(p, out, shape_name(p.shape));
}

class CpuForward : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuForward, MatchesDoubleReference) {
  const Shape s = GetParam();
  expect_accurate(random_problem(s, 1234u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W)));
}

// The drop-in contract: the output within atol = rtol = 1e-4 of the float64 reference
// (elementwise, as torch.allclose) on the default problem and a long row.
TEST(CpuForward, ContractTolerance) {
  for (const Shape s : {Shape{2, 8, 8, 64, 4}, Shape{1, 1, 300, 32, 2}}) {
    const Problem p = random_problem(s, 4242);
    std::vector<float> out(p.x.size(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(forward_cpu(params(p, out.data())).ok());
    EXPECT_LE(worst_ratio(out, reference_forward(p), kAtol, kRtol), 1.0) << shape_name(s);
  }
}

// L = 1 and 7, H != W, head_dim 8, 16, 32, 64, dim up to 256.
INSTANTIATE_TEST_SUITE_P(Shapes, CpuForward,
                         ::testing::Values(Shape{1, 1, 1, 8, 1}, Shape{2, 1, 7, 16, 2}, Shape{1, 7, 1, 32, 4},
                                           Shape{2, 5, 9, 64, 8}, Shape{1, 6, 11, 64, 4}, Shape{1, 8, 3, 128, 4},
                                           Shape{1, 4, 6, 256, 4}, Shape{3, 16, 16, 64, 4},
                                           Shape{1, 33, 17, 96, 3}, Shape{1, 7, 7, 64, 1},
                                           // one long row or column: the threads share the sequence
                                           // (row tiles of 64, the last partial; the column in place)
                                           Shape{1, 1, 300, 32, 2}, Shape{1, 1, 129, 48, 3},
                                           Shape{1, 200, 1, 16, 2},
                                           // keys in blocks of 512 (kKeyBlock): one row of 1030
                                           // (three blocks, the last of 6 keys), three columns of
                                           // 600 (query tiles of 256 over two key blocks)
                                           Shape{1, 1, 1030, 16, 2}, Shape{1, 600, 3, 24, 2}),
                         [](const auto& info) { return shape_name(info.param); });

// LayerNorm eps other than the default 1e-5. Each case checks first that
// its eps decides the result: the float64 forward with eps 1e-5 instead is
// more than 100 times even the contract's tolerance away (in fact thousands of times: on x =
// 3 + 1e-3 N(0, 1), each position's variance is ~1e-6, so LayerNorm divides
// by sqrt(0.5) with eps 0.5 but by ~3.3e-3 with eps 1e-5, and the normalised
// values, ~1.4e-3 against ~0.3, reach the output through both passes'
// products at ~1e-1 against a tolerance of ~4e-4; on x ~ N(0, 1), eps 10 and
// 1e-5 scale the normalised values by 0.3 and 1). So a kernel that ignored
// p.eps would fail here.

class CpuForwardEps : public ::testing::TestWithParam<EpsCase> {};

TEST_P(CpuForwardEps, MatchesDoubleReference) {
  const Problem p = eps_problem(GetParam());
  ASSERT_GT(eps_effect(p, kAtol, kRtol), 100.0) << "eps does not decide this case: a kernel that ignored it would pass";
  expect_accurate(p);
}

INSTANTIATE_TEST_SUITE_P(LargeEps, CpuForwardEps,
                         ::testing::Values(EpsCase{{2, 5, 9, 64, 8}, 0.5f, true}, EpsCase{{2, 5, 9, 64, 8}, 10.0f, false},
                                           EpsCase{{1, 7, 6, 24, 2}, 0.5f, true},
                                           EpsCase{{1, 33, 17, 96, 3}, 10.0f, true},
                                           EpsCase{{1, 8, 3, 128, 4}, 0.5f, false}),
                         [](const auto& info) { return eps_case_name(info.param); });

TEST(CpuForward, DifferentSeedsDifferentOutputs) {
  // Guards against a kernel that ignores its input.
  const Shape s{1, 3, 4, 16, 2};
  const Problem a = random_problem(s, 1), b = random_problem(s, 2);
  std::vector<float> oa(a.x.size()), ob(b.x.size());
  ASSERT_TRUE(forward_cpu(params(a, oa.data())).ok());
  ASSERT_TRUE(forward_cpu(params(b, ob.data())).ok());
  EXPECT_NE(oa, ob);
}

TEST(CpuForward, EmptyBatchIsOk) {
  const Problem p = random_problem({1, 2, 2, 8, 2}, 3);
  AxialParams a = params(p, nullptr);
  a.batch = 0;
  a.x = nullptr;
  EXPECT_TRUE(forward_cpu(a).ok());
}

class BadArguments : public ::testing::Test {
 protected:
  Problem p = random_problem({1, 2, 3, 8, 2}, 5);
  std::vector<float> out = std::vector<float>(p.x.size());
  AxialParams a = params(p, out.data());

  void expect_invalid(const std::string& needle) {
    const Status s = forward_cpu(a);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
    EXPECT_NE(s.message.find(needle), std::string::npos) << "message: " << s.message;
  }
};

TEST_F(BadArguments, HeadsNotDividingDim) {
  a.heads = 3;
  expect_invalid("divisible by heads");
}
TEST_F(BadArguments, ZeroHeads) {
  a.heads = 0;
  expect_invalid("heads must be >= 1");
}
TEST_F(BadArguments, ZeroDim) {
  a.dim = 0;
  expect_invalid("dim must be >= 1");
}
TEST_F(BadArguments, NegativeSize) {
  a.height = -1;
  expect_invalid("height must be >= 0");
}
TEST_F(BadArguments, NullInput) {
  a.x = nullptr;
  expect_invalid("x is null");
}
TEST_F(BadArguments, NullOutput) {
  a.out = nullptr;
  expect_invalid("out is null");
}
TEST_F(BadArguments, OutputAliasesInput) {
  a.out = const_cast<float*>(a.x);
  expect_invalid("alias");
}
TEST_F(BadArguments, NullWeight) {
  a.col.qkv_weight = nullptr;
  expect_invalid("col.qkv_weight is null");
}
TEST_F(BadArguments, NegativeEps) {
  a.eps = -1.0f;
  expect_invalid("eps");
}
TEST_F(BadArguments, NanEps) {  // !(eps >= 0), not eps < 0: NaN is no eps
  a.eps = std::numeric_limits<float>::quiet_NaN();
  expect_invalid("eps must be >= 0");
}
// Each of the ten weights, null alone, named in the message; out left unwritten.
TEST_F(BadArguments, EachNullWeight) {
  const std::pair<AxisWeights AxialParams::*, const char*> axes[] = {{&AxialParams::row, "row"},
                                                                      {&AxialParams::col, "col"}};
  const std::pair<const float* AxisWeights::*, const char*> weights[] = {
      {&AxisWeights::norm_weight, "norm_weight"}, {&AxisWeights::norm_bias, "norm_bias"},
      {&AxisWeights::qkv_weight, "qkv_weight"},   {&AxisWeights::out_weight, "out_weight"},
      {&AxisWeights::out_bias, "out_bias"}};
  const AxialParams good = a;
  for (const auto& [axis, axis_name] : axes)
    for (const auto& [weight, weight_name] : weights) {
      std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
      a = good;
      (a.*axis).*weight = nullptr;
      expect_invalid(std::string(axis_name) + "." + weight_name + " is null");
      for (float v : out) ASSERT_TRUE(std::isnan(v)) << "out written with a null " << axis_name << "." << weight_name;
    }
}
// Each negative size, named; and dim not a multiple of heads where heads < dim (8, 3) and
// heads > dim (8, 16).
TEST_F(BadArguments, EachNegativeSize) {
  const std::pair<int64_t AxialParams::*, const char*> sizes[] = {
      {&AxialParams::batch, "batch"}, {&AxialParams::height, "height"}, {&AxialParams::width, "width"}};
  const AxialParams good = a;
  for (const auto& [size, name] : sizes) {
    a = good;
    a.*size = -3;
    expect_invalid(std::string(name) + " must be >= 0");
  }
}
TEST_F(BadArguments, MoreHeadsThanDim) {
  a.heads = 16;
  expect_invalid("divisible by heads");
}
TEST_F(BadArguments, SizeOverflow) {
  a.batch = a.height = a.width = int64_t{1} << 30;
  expect_invalid("overflows");
}

// The CUDA entry points check sizes before they look for a device, so these
// run in every build, with or without a GPU.
TEST(CudaEntryPoint, ValidatesBeforeAnythingElse) {
  const Problem p = random_problem({1, 2, 3, 8, 2}, 6);
  std::vector<float> out(p.x.size());
  AxialParams a = params(p, out.data());
  a.heads = 3;
  EXPECT_EQ(forward_cuda(a, nullptr, 0, nullptr).code, StatusCode::kInvalidArgument);
  CudaPlan plan;
  EXPECT_EQ(plan_cuda(a, &plan).code, StatusCode::kInvalidArgument);
  size_t bytes = 0;
  EXPECT_EQ(cuda_workspace_bytes(a, &bytes).code, StatusCode::kInvalidArgument);
}

// A negative size is an error, not a workspace of ~1.8e19 bytes (a size_t
// product of a negative int64).
TEST(CudaEntryPoint, NegativeSizeIsInvalidNotAHugeWorkspace) {
  const Problem p = random_problem({1, 2, 3, 8, 2}, 7);
  for (int64_t AxialParams::*size : {&AxialParams::batch, &AxialParams::height, &AxialParams::width}) {
    AxialParams a = params(p, nullptr);
    a.*size = -1;
    size_t bytes = 12345;
    const Status s = cuda_workspace_bytes(a, &bytes);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
    EXPECT_NE(s.message.find("must be >= 0"), std::string::npos) << s.message;
    EXPECT_EQ(bytes, 12345u) << "left untouched on error";
    CudaPlan plan;
    EXPECT_EQ(plan_cuda(a, &plan).code, StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace fastaxial::test
