// CPU backward: the float64 reference backward against finite differences of the float64
// forward, backward_cpu against that reference, null gradients, determinism, argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backward_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial::test {
namespace {

// ---- the reference itself, against central differences of reference_forward -----------------

TEST(ReferenceBackward, MatchesFiniteDifferences) {
  const Shape s{1, 3, 2, 8, 2};
  Problem p = random_problem(s, 99);
  const std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 7);
  RefGrads<double> ref = reference_backward(p, gout);
  auto loss = [&]() {
    const std::vector<double> y = reference_forward(p);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += gout[i] * y[i];
    return l;
  };
  std::vector<std::vector<float>*> values = {&p.x,         &p.row.norm_w, &p.row.norm_b, &p.row.qkv_w,
                                             &p.row.out_w, &p.row.out_b,  &p.col.norm_w, &p.col.norm_b,
                                             &p.col.qkv_w, &p.col.out_w,  &p.col.out_b};
  const auto refs = ref_list(ref);
  std::mt19937 rng(5);
  int checked = 0;
  for (size_t t = 0; t < values.size(); ++t) {
    std::vector<float>& v = *values[t];
    for (int k = 0; k < (t == 0 ? 8 : 4); ++k) {
      const size_t i = std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng);
      const float v0 = v[i];
      const float hi = v0 + 1e-3f, lo = v0 - 1e-3f;  // the step actually taken: hi - lo in double
      v[i] = hi;
      const double lhi = loss();
      v[i] = lo;
      const double llo = loss();
      v[i] = v0;
      const double fd = (lhi - llo) / (static_cast<double>(hi) - static_cast<double>(lo));
      const double an = (*refs[t])[i];
      // Central differences err by h^2 f'''/6 ~ 1e-7 here; a wrong formula errs by O(|grad|).
      EXPECT_NEAR(fd, an, 1e-5 + 1e-4 * std::fabs(an)) << "tensor " << t << " index " << i;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 8 + 10 * 4);
}

// ---- backward_cpu against the reference -----------------------------------------------------

// Two bounds per gradient, on the norm-relative error ||g - ref|| / ||ref||:
//  - 1e-5 outright. fp32's unit roundoff is 6e-8; each gradient is a few products deep (two
//    passes, each with LayerNorm, the QKV, score, softmax and output products and their
//    transposes) with sums over D, L and, for the weights, every position (up to ~1500 here),
//    whose rounding errors, of random sign, grow like sqrt(length) u: a few 1e-7 measured
//    (1e-7 .. 5e-7 on these shapes), so 1e-5 leaves a margin of 20 for other instruction sets'
//    summation orders, while a wrong formula errs by O(1);
//  - within 4 times (plus 1e-7, for gradients that fp32 gets exact) the error of the plainest
//    fp32 evaluation, reference_backward_as<float> (the same formulas as sequential loops):
//    no worse than fp32 arithmetic itself, whatever the shape. Measured: 0.3 to 1.5 times it.
constexpr double kRelTol = 1e-5;

class CpuBackward : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuBackward, MatchesDoubleReference) {
  const Shape s = GetParam();
  const Problem p = random_problem(s, 777u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W));
  const std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 31u + static_cast<uint32_t>(s.H));
  const std::vector<float> gout_f(gout.begin(), gout.end());
  Grads got(s);
  AxialGrads g = got.view();
  g.grad_out = gout_f.data();
  const Status st = backward_cpu(params(p, nullptr), g);
  ASSERT_TRUE(st.ok()) << st.message;

  RefGrads<double> ref = reference_backward(p, gout);
  RefGrads<float> ref32 = reference_backward_as<float>(p, gout);
  const auto refs = ref_list(ref);
  const auto refs32 = ref_list(ref32);
  const auto list = got.all();
  for (size_t i = 0; i < list.size(); ++i) {
    const double err = rel_err(*list[i].first, *refs[i]);
    const double err32 = rel_err(*refs32[i], *refs[i]);
    EXPECT_LE(err, kRelTol) << list[i].second << " (plain fp32: " << err32 << ")";
    EXPECT_LE(err, 4 * err32 + 1e-7) << list[i].second << ": worse than plain fp32 (" << err32 << ")";
    char note[64];
    std::snprintf(note, sizeof note, "%.2e (fp32 loops %.2e)", err, err32);
    RecordProperty(list[i].second, note);
  }
}

// heads 1, 2, 4; head dims 1, 3, 8, 16, 32; L from 1 to 40; H != W; B > 1.
INSTANTIATE_TEST_SUITE_P(Shapes, CpuBackward,
                         ::testing::Values(Shape{1, 1, 1, 8, 1}, Shape{2, 3, 5, 4, 4}, Shape{1, 7, 4, 6, 2},
                                           Shape{2, 5, 9, 16, 2}, Shape{1, 40, 3, 32, 2}, Shape{1, 6, 11, 32, 1},
                                           Shape{3, 16, 16, 64, 4}, Shape{1, 9, 40, 128, 4}, Shape{2, 1, 13, 8, 1}),
                         [](const auto& info) { return shape_name(info.param); });

// ---- null gradients, aliasing, determinism ----------------------------------------------------

class CpuBackwardRuns : public ::testing::Test {
 protected:
  Shape s{2, 6, 9, 16, 2};
  Problem p = random_problem(s, 4242);
  std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 11);
  std::vector<float> gout_f = std::vector<float>(gout.begin(), gout.end());

  Grads run(const std::vector<bool>& wanted = std::vector<bool>(11, true)) {
    Grads r(s);
    AxialGrads g = r.view(wanted);
    g.grad_out = gout_f.data();
    const Status st = backward_cpu(params(p, nullptr), g);
    EXPECT_TRUE(st.ok()) << st.message;
    return r;
  }
};

TEST_F(CpuBackwardRuns, NullGradientsAreSkippedOthersUnchanged) {
  Grads full = run();
  for (auto& [buf, name] : full.all()) ASSERT_FALSE(std::isnan((*buf)[0])) << name;
  // Order of Grads::all(): x, row (g, b, qkv, out, bout), col (g, b, qkv, out, bout).
  const std::vector<std::vector<bool>> subsets = {
      {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},  // grad_x alone
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1},  // col.out_bias alone
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},  // col.out_weight alone
      {0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0},  // row.qkv_weight, col.norm_weight: dx1 in scratch
      {0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0},  // row weights but qkv, no grad_x
      {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1},  // col weights alone: no row backward
      {0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},  // all but grad_x
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},  // nothing
  };
  for (const auto& wanted : subsets) {
    Grads part = run(wanted);
    auto pl = part.all();
    auto fl = full.all();
    for (size_t i = 0; i < pl.size(); ++i) {
      if (wanted[i])
        EXPECT_TRUE(same_bits(*pl[i].first, *fl[i].first)) << pl[i].second << " differs from the full run";
      else
        EXPECT_TRUE(all_nan(*pl[i].first)) << pl[i].second << " was written";
    }
  }
}

TEST_F(CpuBackwardRuns, GradXMayBeGradOut) {
  Grads full = run();
  std::vector<float> inout = gout_f;
  Grads r(s);
  AxialGrads g = r.view();
  g.grad_out = inout.data();
  g.grad_x = inout.data();
  ASSERT_TRUE(backward_cpu(params(p, nullptr), g).ok());
  EXPECT_TRUE(same_bits(inout, full.x));
  EXPECT_TRUE(same_bits(r.col.qkv_w, full.col.qkv_w));
  EXPECT_TRUE(same_bits(r.row.qkv_w, full.row.qkv_w));
}

TEST_F(CpuBackwardRuns, OutputIsNotRead) {
  Grads a = run();
  std::vector<float> junk(p.x.size(), kNaN);
  Grads b(s);
  AxialGrads g = b.view();
  g.grad_out = gout_f.data();
  ASSERT_TRUE(backward_cpu(params(p, junk.data()), g).ok());
  for (size_t i = 0; i < a.all().size(); ++i) EXPECT_TRUE(same_bits(*a.all()[i].first, *b.all()[i].first));
}

TEST_F(CpuBackwardRuns, RepeatedCallsAreBitwiseIdentical) {
  s = Shape{2, 16, 24, 32, 2};  // 32 and 48 sequences: several blocks and chunks per pass
  p = random_problem(s, 17);
  gout = random_grad(s.B * s.H * s.W * s.D, 12);
  gout_f.assign(gout.begin(), gout.end());
  Grads a = run(), b = run();
  for (size_t i = 0; i < a.all().size(); ++i)
    EXPECT_TRUE(same_bits(*a.all()[i].first, *b.all()[i].first)) << a.all()[i].second;
}

#ifdef _OPENMP
// Block and chunk sizes depend on the shape alone, so the thread count changes who computes
// a chunk, never what is summed in which order: the results are even bitwise identical.
TEST_F(CpuBackwardRuns, ThreadCountDoesNotChangeTheResult) {
  s = Shape{2, 16, 24, 32, 2};
  p = random_problem(s, 17);
  gout = random_grad(s.B * s.H * s.W * s.D, 12);
  gout_f.assign(gout.begin(), gout.end());
  const int before = omp_get_max_threads();
  Grads base = run();
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    Grads r = run();
    for (size_t i = 0; i < base.all().size(); ++i) {
      EXPECT_LE(rel_err(*r.all()[i].first, std::vector<double>(base.all()[i].first->begin(), base.all()[i].first->end())),
                1e-6)
          << base.all()[i].second << " with " << threads << " threads";
      EXPECT_TRUE(same_bits(*r.all()[i].first, *base.all()[i].first))
          << base.all()[i].second << " with " << threads << " threads";
    }
  }
  omp_set_num_threads(before);
}
#endif

// ---- arguments ------------------------------------------------------------------------------

class BackwardBadArguments : public CpuBackwardRuns {
 protected:
  Grads r = Grads(s);
  AxialParams a = params(p, nullptr);
  AxialGrads g = [this] {
    AxialGrads v = r.view();
    v.grad_out = gout_f.data();
    return v;
  }();

  void expect_invalid(const std::string& needle) {
    const Status st = backward_cpu(a, g);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument);
    EXPECT_NE(st.message.find(needle), std::string::npos) << "message: " << st.message;
    for (auto& [buf, name] : r.all()) EXPECT_TRUE(all_nan(*buf)) << name << " written on error";
  }
};

TEST_F(BackwardBadArguments, NullGradOut) {
  g.grad_out = nullptr;
  expect_invalid("grad_out is null");
}
TEST_F(BackwardBadArguments, NullInput) {
  a.x = nullptr;
  expect_invalid("x is null");
}
TEST_F(BackwardBadArguments, NullWeight) {
  a.row.norm_bias = nullptr;
  expect_invalid("row.norm_bias is null");
}
TEST_F(BackwardBadArguments, GradXAliasesInput) {
  g.grad_x = const_cast<float*>(a.x);
  expect_invalid("alias");
}
TEST_F(BackwardBadArguments, HeadsNotDividingDim) {
  a.heads = 3;
  expect_invalid("divisible by heads");
}
TEST_F(BackwardBadArguments, NegativeSize) {
  a.width = -2;
  expect_invalid("width must be >= 0");
}
TEST_F(BackwardBadArguments, SizeOverflow) {
  a.batch = a.height = a.width = int64_t{1} << 30;
  expect_invalid("overflows");
}

TEST(CpuBackward, EmptyBatchZeroesWeightGradients) {
  const Shape s{1, 4, 3, 8, 2};
  const Problem p = random_problem(s, 3);
  Grads r(s);
  AxialGrads g = r.view();
  g.grad_x = nullptr;  // B H W = 0: no positions, nothing read
  AxialParams a = params(p, nullptr);
  a.batch = 0;
  a.x = nullptr;
  ASSERT_TRUE(backward_cpu(a, g).ok());
  auto list = r.all();
  for (size_t i = 1; i < list.size(); ++i)
    for (float v : *list[i].first) ASSERT_EQ(v, 0.0f) << list[i].second;
}

}  // namespace
}  // namespace fastaxial::test
