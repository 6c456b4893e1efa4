// Helpers of the backward suites (CPU, CUDA, dropout): the eleven gradients in
// poisoned buffers, the reference's in the same order, the comparison of a
// backward's gradients with the reference, and the reference's own check
// against finite differences.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "reference.h"

namespace fastaxial::test {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline std::vector<double> random_grad(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> g(n);
  for (double& e : g) e = static_cast<float>(normal(rng));  // representable in float
  return g;
}

// The gradients at eleven buffers in the order of Grads::all() (x; then per axis, rows first: LayerNorm
// weight and bias, QKV weight, output weight and bias); a null buffer: that gradient is not wanted.
inline AxialGrads grads_at(const std::vector<float*>& ptr) {
  AxialGrads g;
  g.grad_x = ptr[0];
  g.row = {ptr[1], ptr[2], ptr[3], ptr[4], ptr[5]};
  g.col = {ptr[6], ptr[7], ptr[8], ptr[9], ptr[10]};
  return g;
}

// The eleven gradients of backward_cpu, each in its own (poisoned) buffer.
struct Grads {
  std::vector<float> x;
  struct Axis {
    std::vector<float> norm_w, norm_b, qkv_w, out_w, out_b;
  } row, col;

  explicit Grads(const Shape& s) {
    const int64_t D = s.D;
    x.assign(s.B * s.H * s.W * D, kNaN);
    for (Axis* a : {&row, &col}) {
      a->norm_w.assign(D, kNaN), a->norm_b.assign(D, kNaN), a->qkv_w.assign(3 * D * D, kNaN);
      a->out_w.assign(D * D, kNaN), a->out_b.assign(D, kNaN);
    }
  }
  // The eleven buffers in a fixed order, with names.
  std::vector<std::pair<std::vector<float>*, std::string>> all() {
    return {{&x, "x"},
            {&row.norm_w, "row.norm_weight"}, {&row.norm_b, "row.norm_bias"}, {&row.qkv_w, "row.qkv_weight"},
            {&row.out_w, "row.out_weight"},   {&row.out_b, "row.out_bias"},   {&col.norm_w, "col.norm_weight"},
            {&col.norm_b, "col.norm_bias"},   {&col.qkv_w, "col.qkv_weight"}, {&col.out_w, "col.out_weight"},
            {&col.out_b, "col.out_bias"}};
  }
  // Every pointer set, except where wanted[i] is false (order of all()).
  AxialGrads view(const std::vector<bool>& wanted = std::vector<bool>(11, true)) {
    std::vector<float*> ptr;
    auto list = all();
    for (size_t i = 0; i < list.size(); ++i) ptr.push_back(wanted[i] ? list[i].first->data() : nullptr);
    return grads_at(ptr);
  }
};

template <typename Real>
std::vector<std::vector<Real>*> ref_list(RefGrads<Real>& r) {
  return {&r.x,         &r.row.norm_w, &r.row.norm_b, &r.row.qkv_w, &r.row.out_w, &r.row.out_b,
          &r.col.norm_w, &r.col.norm_b, &r.col.qkv_w, &r.col.out_w, &r.col.out_b};
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline bool all_nan(const std::vector<float>& a) {
  for (float v : a)
    if (!std::isnan(v)) return false;
  return true;
}

// Two bounds per gradient of `got`, on the norm-relative error ||g - ref|| / ||ref||:
//  - the accuracy rule (reference.h): within kAccuracyFactor times the error of the plainest fp32
//    evaluation, reference_backward_as<float> (the same formulas as sequential loops), plus
//    kAccuracyFloor: no worse than fp32 arithmetic itself, whatever the shape and inputs;
//  - where `outright` (the suites' ordinary random problems), 1e-5 as well. The unit roundoff
//    of fp32 is 6e-8; each gradient is a few products deep (two passes, each with LayerNorm, the
//    QKV, score, softmax and output products and their transposes) with sums over D, L and, for
//    the weights, every position (up to ~1500 in the CPU suite), whose rounding errors, of
//    random sign, grow like sqrt(length) u: a few 1e-7 measured (1e-7 .. 5e-7), so 1e-5 leaves a
//    margin of 20 for the summation orders of other instruction sets, while a wrong formula errs
//    by O(1). Inputs chosen to strain fp32 (test_cpu_extremes.cpp: means of 300, logits of 100)
//    cost fp32 itself more than 1e-5 (the fp32 loops: up to 5e-5): there the rule alone applies.
// A gradient whose reference is exactly zero (with dropout 1 every attention branch is zero,
// and so are the gradients of the QKV, LayerNorm and output weights) must be exactly zero.
// Each gradient's error is recorded as a test property.
constexpr double kBackwardRelTol = 1e-5;

inline void expect_grads_match(Grads& got, RefGrads<double>& ref, RefGrads<float>& ref32, bool outright = true) {
  const auto refs = ref_list(ref);
  const auto refs32 = ref_list(ref32);
  const auto list = got.all();
  for (size_t i = 0; i < list.size(); ++i) {
    double norm = 0;
    for (double v : *refs[i]) norm += v * v;
    if (norm == 0) {
      for (size_t e = 0; e < list[i].first->size(); ++e)
        ASSERT_EQ((*list[i].first)[e], 0.0f) << list[i].second << "[" << e << "]: the reference is exactly zero";
      continue;
    }
    const double err = rel_err(*list[i].first, *refs[i]);
    const double err32 = rel_err(*refs32[i], *refs[i]);
    if (outright) EXPECT_LE(err, kBackwardRelTol) << list[i].second << " (plain fp32: " << err32 << ")";
    EXPECT_TRUE(within_rule(err, err32)) << list[i].second << ": error " << err << ", worse than " << kAccuracyFactor
                                         << " x plain fp32's (" << err32 << ") + " << kAccuracyFloor;
    char note[64];
    std::snprintf(note, sizeof note, "%.2e (fp32 loops %.2e)", err, err32);
    ::testing::Test::RecordProperty(list[i].second, note);
  }
}

// backward_cpu(p) for the output gradient gout against the float64 reference (expect_grads_match).
// from_forward: forward_cpu first, keeping the row pass's output, both passes' q, k, v, attention
// output and probabilities (AxialParams::row_out, saved_qkv, saved_o, saved_p; poisoned with NaN
// before), which the backward then reads instead of running the row pass, the QKV products, p v
// and the scores' softmax again.
inline void expect_cpu_backward_matches_reference(const Problem& p, const std::vector<double>& gout,
                                                  bool outright = true, bool from_forward = false) {
  const std::vector<float> gout_f(gout.begin(), gout.end());
  Grads got(p.shape);
  AxialGrads g = got.view();
  g.grad_out = gout_f.data();
  AxialParams a = params(p, nullptr);
  std::vector<float> out, row_out, qkv, o, probs;  // the forward's, where from_forward
  if (from_forward) {
    out.resize(p.x.size());
    row_out.assign(p.x.size(), std::numeric_limits<float>::quiet_NaN());
    qkv.assign(6 * p.x.size(), std::numeric_limits<float>::quiet_NaN());
    o.assign(2 * p.x.size(), std::numeric_limits<float>::quiet_NaN());
    probs.assign(saved_p_floats(a), std::numeric_limits<float>::quiet_NaN());
    a.out = out.data(), a.row_out = row_out.data(), a.saved_qkv = qkv.data(), a.saved_o = o.data();
    a.saved_p = probs.data();
    const Status fs = forward_cpu(a);
    ASSERT_TRUE(fs.ok()) << fs.message;
    a.out = nullptr;  // (the backward does not read it)
  }
  const Status st = backward_cpu(a, g);
  ASSERT_TRUE(st.ok()) << st.message;
  RefGrads<double> ref = reference_backward(p, gout);
  RefGrads<float> ref32 = reference_backward_as<float>(p, gout);
  expect_grads_match(got, ref, ref32, outright);
}

// backward_cpu's gradients for the output gradient gout after forward_cpu kept x1, both passes' q,
// k, v and o (AxialParams::row_out, saved_qkv, saved_o), with the forward's probabilities read
// (keep_p: AxialParams::saved_p) or the scores and softmax run again.
inline Grads cpu_backward_after_forward(const Problem& p, const std::vector<float>& gout, bool keep_p) {
  const size_t n = p.x.size();
  std::vector<float> out(n), row_out(n, kNaN), qkv(6 * n, kNaN), o(2 * n, kNaN);
  AxialParams a = params(p, out.data());
  std::vector<float> probs(saved_p_floats(a), kNaN);
  a.row_out = row_out.data(), a.saved_qkv = qkv.data(), a.saved_o = o.data();
  a.saved_p = keep_p ? probs.data() : nullptr;
  Grads got(p.shape);
  const Status fs = forward_cpu(a);
  EXPECT_TRUE(fs.ok()) << fs.message;
  AxialGrads g = got.view();
  g.grad_out = gout.data();
  a.out = nullptr;
  const Status st = backward_cpu(a, g);
  EXPECT_TRUE(st.ok()) << st.message;
  return got;
}

// reference_backward(p, gout) against central differences of the loss gout . reference_forward(p)
// (the dropout mask of p, a function of the indices alone, stays fixed while the values move),
// at 8 random entries of x and 4 of each weight; returns how many were checked.
inline int expect_reference_backward_matches_finite_differences(Problem p, const std::vector<double>& gout) {
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
  return checked;
}


}  // namespace fastaxial::test
