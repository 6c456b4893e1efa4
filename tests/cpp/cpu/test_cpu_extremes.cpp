// Inputs that break naive fp32 math, forward and backward, at 1 and 3 threads, against the
// float64 reference under the accuracy rule (util/reference.h): logits large enough that a
// softmax without its row maximum overflows, LayerNorm inputs of large mean and small variance
// (where E[x^2] - mean^2 cancels), eps far from 1e-5, very large and very small magnitudes; and
// NaN and inf, which must reach exactly the outputs the reference's reach.
//
// Each case first checks that it is what it says (its logits overflow exp, its eps decides the
// result, ...): a case that stopped straining the math would pass whatever the kernel did.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "util/backward_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial::test {
namespace {

// Sets the OpenMP thread count for its lifetime (a no-op without OpenMP).
class ThreadCount {
 public:
  explicit ThreadCount(int n) {
#ifdef _OPENMP
    before_ = omp_get_max_threads();
    omp_set_num_threads(n);
#else
    (void)n;
#endif
  }
  ~ThreadCount() {
#ifdef _OPENMP
    omp_set_num_threads(before_);
#endif
  }

 private:
  int before_ = 1;
};

// The mean and the variance of the D values at x, in double, in two passes.
std::pair<double, double> mean_variance(const float* x, int64_t D) {
  double mean = 0, var = 0;
  for (int64_t c = 0; c < D; ++c) mean += x[c];
  mean /= D;
  for (int64_t c = 0; c < D; ++c) var += (x[c] - mean) * (x[c] - mean);
  return {mean, var / D};
}

// The largest |score| q.k / sqrt(hd) of p's row pass, in double (LayerNorm and the QKV product as
// the reference computes them): above 88.7, exp of it overflows fp32.
double max_row_logit(const Problem& p) {
  const Shape& s = p.shape;
  const int64_t D = s.D, hd = D / s.heads;
  double worst = 0;
  std::vector<double> qkv(s.W * 3 * D);
  for (int64_t seq = 0; seq < s.B * s.H; ++seq) {
    for (int64_t l = 0; l < s.W; ++l) {
      const float* x = &p.x[(seq * s.W + l) * D];
      const auto [mean, var] = mean_variance(x, D);
      for (int64_t j = 0; j < 3 * D; ++j) {
        double acc = 0;
        for (int64_t c = 0; c < D; ++c)
          acc += ((x[c] - mean) / std::sqrt(var + p.eps) * p.row.norm_w[c] + p.row.norm_b[c]) * p.row.qkv_w[j * D + c];
        qkv[l * 3 * D + j] = acc;
      }
    }
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t i = 0; i < s.W; ++i)
        for (int64_t j = 0; j < s.W; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < hd; ++c) dot += qkv[i * 3 * D + h * hd + c] * qkv[j * 3 * D + D + h * hd + c];
          worst = std::max(worst, std::fabs(dot) / std::sqrt(static_cast<double>(hd)));
        }
  }
  return worst;
}

// The worst relative error of the one-pass variance E[x^2] - mean^2 in fp32 over p's positions
// (sums in position order), against the two-pass variance in double.
double one_pass_variance_error(const Problem& p) {
  const int64_t D = p.shape.D;
  double worst = 0;
  for (size_t r = 0; r < p.x.size() / D; ++r) {
    float s = 0, s2 = 0;
    for (int64_t c = 0; c < D; ++c) s += p.x[r * D + c], s2 += p.x[r * D + c] * p.x[r * D + c];
    const double var = mean_variance(&p.x[r * D], D).second;
    const float m = s / D, naive = s2 / D - m * m;
    worst = std::max(worst, std::fabs(naive - var) / var);
  }
  return worst;
}

// The largest per-position variance of p's x, in double.
double max_variance(const Problem& p) {
  const int64_t D = p.shape.D;
  double worst = 0;
  for (size_t r = 0; r < p.x.size() / D; ++r) worst = std::max(worst, mean_variance(&p.x[r * D], D).second);
  return worst;
}

struct Extreme {
  const char* name;
  std::function<void(Problem*)> make;     // from a random problem
  std::function<void(const Problem&)> is;  // checks the case strains what it says
};

void scale_x(Problem* p, float f) {
  for (float& v : p->x) v *= f;
}

// QKV weights of variance 32 / D: scores of standard deviation about 32 (y ~ N(0, 1) per
// feature), as the unit-variance weights give at D = 32. A row's largest score is then
// well above 88.7: a softmax that exponentiates the scores before subtracting the row maximum
// gets inf, then NaN.
void large_logits(Problem* p) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, std::sqrt(32.0f / static_cast<float>(p->shape.D)));
  for (AxisData* a : {&p->row, &p->col})
    for (float& w : a->qkv_w) w = normal(rng);
}

// QKV weights 200 times large_logits': scaled scores near 1e6, a one-hot softmax (P = 1 in fp32 at
// each row's maximum, 0 elsewhere) with gaps so wide that fp32 itself is exact (the fp32 loops'
// error 2e-7; at 20 times, near-ties of a row's two largest scores left it at 1e-3, too coarse to
// see the bug below). Exactly, dS = P o (dP - delta) is then tiny; a delta summed otherwise than
// rowsum(P o dP) (rowsum(dO o O)) leaves a rounding residue that dQ = dS K multiplies by |K|: the
// gradients' error was 0.2 (1e6 times the fp32 loops').
void saturated_logits(Problem* p) {
  large_logits(p);
  for (AxisData* a : {&p->row, &p->col})
    for (float& w : a->qkv_w) w *= 200.0f;
}

const Extreme kExtremes[] = {
    {"large_logits", large_logits,
     [](const Problem& p) { ASSERT_GT(max_row_logit(p), 100.0) << "the softmax does not saturate"; }},
    {"saturated_logits", saturated_logits,
     [](const Problem& p) { ASSERT_GT(max_row_logit(p), 1e5) << "the softmax is not one-hot"; }},
    // x = 300 + N(0, 1): E[x^2] = 9e4 against a variance of 1, whose fp32 one-pass form loses
    // about 4 digits (the issue: error 130 times the fp32 loops').
    {"large_mean", [](Problem* p) { set_input_near_constant(p, 300.0f, 1.0f, 11u); },
     [](const Problem& p) { ASSERT_GT(one_pass_variance_error(p), 1e-4) << "E[x^2] - mean^2 does not cancel"; }},
    // x = 3 + 1e-3 N(0, 1) with eps 0.5: eps, not the variance (1e-6), sets the scale.
    {"small_variance_eps_0.5",
     [](Problem* p) {
       set_input_near_constant(p, 3.0f, 1e-3f, 12u);
       p->eps = 0.5f;
     },
     [](const Problem& p) { ASSERT_GT(eps_effect(p, 1e-4, 1e-4), 100.0) << "eps does not decide this case"; }},
    {"eps_10", [](Problem* p) { p->eps = 10.0f; },
     [](const Problem& p) { ASSERT_GT(eps_effect(p, 1e-4, 1e-4), 100.0) << "eps does not decide this case"; }},
    // |x| ~ 1e6: LayerNorm's sums of squares near 1e12 D; the residual carries 1e6 through.
    {"huge_inputs", [](Problem* p) { scale_x(p, 1e6f); },
     [](const Problem& p) { ASSERT_GT(max_variance(p), 1e10) << "the inputs are not huge"; }},
    // |x| ~ 1e-6: a variance of 1e-12, far below eps 1e-5, which decides the scale.
    {"tiny_inputs", [](Problem* p) { scale_x(p, 1e-6f); },
     [](const Problem& p) { ASSERT_LT(max_variance(p), 1e-5 * 1e-4) << "the variance does not vanish beside eps"; }},
};

// An issue-sized grid (8 x 8, dim 32, 2 heads; two images), served by blocks of sequences, and
// one long row (130 positions: at 3 threads the forward's few-sequences path with a partial row
// tile, the backward's heads across the threads).
using ExtremeCase = std::tuple<int, Shape, int>;  // index in kExtremes, shape, threads

std::string extreme_name(const ::testing::TestParamInfo<ExtremeCase>& info) {
  const auto& [e, s, threads] = info.param;
  std::string n = std::string(kExtremes[e].name) + "_" + shape_name(s) + "_threads" + std::to_string(threads);
  for (char& ch : n)
    if (ch == '.') ch = 'p';
  return n;
}

class CpuExtremes : public ::testing::TestWithParam<ExtremeCase> {
 protected:
  CpuExtremes() : threads_(std::get<2>(GetParam())) {
    const auto& [e, s, threads] = GetParam();
    p_ = random_problem(s, 2024u + static_cast<uint32_t>(e * 31 + s.W));
    kExtremes[e].make(&p_);
  }
  ThreadCount threads_;
  Problem p_;
};

TEST_P(CpuExtremes, ForwardMatchesDoubleReference) {
  kExtremes[std::get<0>(GetParam())].is(p_);
  if (HasFatalFailure()) return;
  std::vector<float> out(p_.x.size(), kNaN);
  const Status st = forward_cpu(params(p_, out.data()));
  ASSERT_TRUE(st.ok()) << st.message;
  expect_forward_within_rule(p_, out);
}

// The rule alone: fp32 itself errs by more than the ordinary problems' outright 1e-5 here
// (the fp32 loops: up to 5e-5 on the large means).
TEST_P(CpuExtremes, BackwardMatchesDoubleReference) {
  kExtremes[std::get<0>(GetParam())].is(p_);
  if (HasFatalFailure()) return;
  const Shape& s = p_.shape;
  expect_cpu_backward_matches_reference(p_, random_grad(s.B * s.H * s.W * s.D, 13), /*outright=*/false);
}

INSTANTIATE_TEST_SUITE_P(Inputs, CpuExtremes,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kExtremes))),
                                            ::testing::Values(Shape{2, 8, 8, 32, 2}, Shape{1, 1, 130, 32, 2}),
                                            ::testing::Values(1, 3)),
                         extreme_name);

// ---- NaN and inf ----------------------------------------------------------------------------
// One element of x NaN, +inf or -inf (in image 0, row 1, column 4): its position's LayerNorm is
// NaN, its key and value reach every query of its row, then every column. The forward's
// non-finite outputs must be exactly the reference's (here all of image 0), and image 1, which
// never sees the bad value, within the rule. The backward: every gradient element non-finite
// where the reference's is, and finite where it is finite.
class CpuNonFinite : public ::testing::TestWithParam<std::tuple<float, int>> {};

TEST_P(CpuNonFinite, PropagatesAsTheReference) {
  const auto [bad, threads] = GetParam();
  const Shape s{2, 3, 70, 16, 2};  // rows of 70: at 3 threads, rows of one image share no block
  Problem p = random_problem(s, 8);
  p.x[((0 * s.H + 1) * s.W + 4) * s.D + 3] = bad;
  ThreadCount set(threads);
  std::vector<float> out(p.x.size(), 0.0f);
  ASSERT_TRUE(forward_cpu(params(p, out.data())).ok());
  const std::vector<double> ref = reference_forward(p);
  const size_t image = p.x.size() / 2;
  int64_t nonfinite = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    nonfinite += !std::isfinite(ref[i]);
    ASSERT_EQ(std::isfinite(out[i]), std::isfinite(ref[i])) << "element " << i << ": " << out[i] << ", reference " << ref[i];
  }
  EXPECT_EQ(nonfinite, static_cast<int64_t>(image)) << "the reference: all of image 0 non-finite, no more";
  Problem second = random_problem({1, s.H, s.W, s.D, s.heads}, 0);
  second.row = p.row, second.col = p.col;
  second.x.assign(p.x.begin() + image, p.x.end());
  const ForwardAccuracy acc = forward_accuracy(second, std::vector<float>(out.begin() + image, out.end()));
  EXPECT_TRUE(acc.ok()) << "image 1: " << acc;

  const std::vector<double> gout = random_grad(static_cast<int64_t>(p.x.size()), 3);
  const std::vector<float> gout_f(gout.begin(), gout.end());
  Grads got(s);
  AxialGrads g = got.view();
  g.grad_out = gout_f.data();
  ASSERT_TRUE(backward_cpu(params(p, nullptr), g).ok());
  RefGrads<double> rg = reference_backward(p, gout);
  const auto refs = ref_list(rg);
  const auto list = got.all();
  for (size_t t = 0; t < list.size(); ++t)
    for (size_t i = 0; i < refs[t]->size(); ++i)
      ASSERT_EQ(std::isfinite((*list[t].first)[i]), std::isfinite((*refs[t])[i]))
          << list[t].second << "[" << i << "]: " << (*list[t].first)[i] << ", reference " << (*refs[t])[i];
}

INSTANTIATE_TEST_SUITE_P(Values, CpuNonFinite,
                         ::testing::Combine(::testing::Values(std::numeric_limits<float>::quiet_NaN(),
                                                              std::numeric_limits<float>::infinity(),
                                                              -std::numeric_limits<float>::infinity()),
                                            ::testing::Values(1, 3)),
                         [](const auto& info) {
                           const float v = std::get<0>(info.param);
                           return std::string(std::isnan(v) ? "nan" : v > 0 ? "inf" : "minus_inf") + "_threads" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace fastaxial::test
