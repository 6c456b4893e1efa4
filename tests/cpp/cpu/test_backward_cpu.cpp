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

#include "util/backward_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial::test {
namespace {

// ---- the reference itself, against central differences of reference_forward -----------------

TEST(ReferenceBackward, MatchesFiniteDifferences) {
  const Shape s{1, 3, 2, 8, 2};
  const std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 7);
  EXPECT_EQ(expect_reference_backward_matches_finite_differences(random_problem(s, 99), gout), 8 + 10 * 4);
}

// ---- backward_cpu against the reference -----------------------------------------------------

// The bounds: expect_grads_match (backward_util.h) says what they are and why.
class CpuBackward : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuBackward, MatchesDoubleReference) {
  const Shape s = GetParam();
  const Problem p = random_problem(s, 777u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W));
  expect_cpu_backward_matches_reference(p, random_grad(s.B * s.H * s.W * s.D, 31u + static_cast<uint32_t>(s.H)));
}

// The same from what the forward kept (the row pass's output and both passes' q, k, v, attention
// output and probabilities: AxialParams::row_out, saved_qkv, saved_o, saved_p), as the torch
// binding's training calls run it.
TEST_P(CpuBackward, MatchesDoubleReferenceFromTheForwardsKeptTensors) {
  const Shape s = GetParam();
  const Problem p = random_problem(s, 777u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W));
  expect_cpu_backward_matches_reference(p, random_grad(s.B * s.H * s.W * s.D, 31u + static_cast<uint32_t>(s.H)),
                                        true, true);
}

// heads 1, 2, 4; head dims 1, 3, 8, 16, 24, 32; L from 1 to 40, and 600 and 1030 (a head's queries
// in 9 and 16 ranges: query_ranges); H != W; B > 1; both passes of 128 positions or more (each
// keeps its attention output, the column pass's after the row pass's), and the column pass alone.
INSTANTIATE_TEST_SUITE_P(Shapes, CpuBackward,
                         ::testing::Values(Shape{1, 1, 1, 8, 1}, Shape{2, 3, 5, 4, 4}, Shape{1, 7, 4, 6, 2},
                                           Shape{2, 5, 9, 16, 2}, Shape{1, 40, 3, 32, 2}, Shape{1, 6, 11, 32, 1},
                                           Shape{3, 16, 16, 64, 4}, Shape{1, 9, 40, 128, 4}, Shape{2, 1, 13, 8, 1},
                                           Shape{1, 2, 1030, 16, 2}, Shape{1, 1, 600, 24, 1},
                                           Shape{1, 130, 128, 8, 1}, Shape{2, 130, 3, 8, 2}),
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
  std::vector<std::vector<bool>> subsets = {
      {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},  // grad_x alone
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1},  // col.out_bias alone
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},  // col.out_weight alone
      {0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0},  // row.qkv_weight, col.norm_weight: dx1 in scratch
      {0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0},  // row weights but qkv, no grad_x
      {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1},  // col weights alone: no row backward
      {0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},  // all but grad_x
      {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},  // nothing
  };
  // And each of the eleven alone: a gradient must not lean on another's being wanted.
  for (size_t i = 0; i < 11; ++i) {
    subsets.emplace_back(11, false);
    subsets.back()[i] = true;
  }
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

// forward_cpu with row_out and saved_qkv writes the row pass's output (with the column pass's
// output weights zeroed, out = x1 + 0: the same bits) and every position's q, k, v of both passes
// there, and the same out as without; backward_cpu reads them (NaN there reaches the gradients)
// instead of running the row pass and the QKV products again. (saved_o: the next test.)
TEST_F(CpuBackwardRuns, RowOutIsWrittenByTheForwardAndReadByTheBackward) {
  const size_t n = p.x.size();
  std::vector<float> plain(n, kNaN), out(n, kNaN), row_out(n, kNaN), qkv(6 * n, kNaN);
  AxialParams a = params(p, plain.data());
  ASSERT_TRUE(forward_cpu(a).ok());
  a.out = out.data(), a.row_out = row_out.data(), a.saved_qkv = qkv.data();
  ASSERT_TRUE(forward_cpu(a).ok());
  EXPECT_TRUE(same_bits(out, plain)) << "row_out changed the forward's output";
  // q, k, v of both passes at every position: finite, and the row pass's q of position 0 is
  // LayerNorm(x_0) Wq^T (the D floats of the first position, against a float64 evaluation).
  for (size_t i = 0; i < qkv.size(); ++i) ASSERT_TRUE(std::isfinite(qkv[i])) << "saved_qkv[" << i << "] not written";
  {
    const int64_t D = s.D;
    double mean = 0, var = 0;
    for (int64_t c = 0; c < D; ++c) mean += p.x[c];
    mean /= D;
    for (int64_t c = 0; c < D; ++c) var += (p.x[c] - mean) * (p.x[c] - mean);
    const double rstd = 1.0 / std::sqrt(var / D + p.eps);
    for (int64_t j = 0; j < 3 * D; ++j) {
      double want = 0;
      for (int64_t c = 0; c < D; ++c)
        want += ((p.x[c] - mean) * rstd * p.row.norm_w[c] + p.row.norm_b[c]) * p.row.qkv_w[j * D + c];
      EXPECT_NEAR(qkv[j], want, 1e-5 * (1 + std::fabs(want))) << "row pass qkv of position 0, column " << j;
    }
  }
  Problem z = p;  // column pass's branch zero: out = x1
  std::fill(z.col.out_w.begin(), z.col.out_w.end(), 0.0f);
  std::fill(z.col.out_b.begin(), z.col.out_b.end(), 0.0f);
  std::vector<float> x1(n, kNaN);
  ASSERT_TRUE(forward_cpu(params(z, x1.data())).ok());
  EXPECT_TRUE(same_bits(row_out, x1)) << "row_out is not the row pass's output";

  Grads b(s);
  AxialGrads g = b.view();
  g.grad_out = gout_f.data();
  a.out = nullptr;
  std::vector<float> poison(n, kNaN);
  a.row_out = poison.data();
  ASSERT_TRUE(backward_cpu(a, g).ok());
  EXPECT_TRUE(std::isnan(b.col.qkv_w[0])) << "the backward did not read row_out";
  a.row_out = row_out.data();  // q, k, v poisoned, the row output kept: NaN reaches the gradients
  std::vector<float> poison_qkv(6 * n, kNaN);
  a.saved_qkv = poison_qkv.data();
  ASSERT_TRUE(backward_cpu(a, g).ok());
  EXPECT_TRUE(std::isnan(b.row.out_w[0])) << "the backward did not read saved_qkv";
  a.saved_qkv = nullptr;

  a.out = out.data();  // the forward refuses a row_out that is x or out, and writes nothing
  std::fill(out.begin(), out.end(), kNaN);
  for (float* alias : {const_cast<float*>(a.x), out.data()}) {
    a.row_out = alias;
    const Status st = forward_cpu(a);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument);
    EXPECT_NE(st.message.find("row_out must not alias x or out"), std::string::npos) << st.message;
  }
  a.row_out = row_out.data();
  a.saved_qkv = row_out.data();
  const Status st = forward_cpu(a);
  EXPECT_NE(st.message.find("saved_qkv must not alias x, out or row_out"), std::string::npos) << st.message;
  a.saved_qkv = qkv.data();
  for (float* alias : {const_cast<float*>(a.x), out.data(), row_out.data(), qkv.data()}) {
    a.saved_o = alias;
    const Status so = forward_cpu(a);
    EXPECT_NE(so.message.find("saved_o must not alias x, out, row_out or saved_qkv"), std::string::npos) << so.message;
  }
  EXPECT_TRUE(all_nan(out));
}

// forward_cpu with saved_o keeps the attention output of a pass of 128 positions or more (the
// row pass here, L = 130: equal to float64 softmax(q k^T / sqrt(hd)) v from the kept q, k, v)
// and leaves a shorter pass's part (the column pass, L = 2) unwritten; backward_cpu reads the kept
// part for dWout alone (a poisoned o reaches the row pass's output weights, nothing else).
TEST_F(CpuBackwardRuns, AttentionOutputIsKeptForLongSequences) {
  s = Shape{1, 2, 130, 16, 2};
  p = random_problem(s, 31);
  gout = random_grad(s.B * s.H * s.W * s.D, 13);
  gout_f.assign(gout.begin(), gout.end());
  const size_t n = p.x.size();
  std::vector<float> out(n, kNaN), row_out(n, kNaN), qkv(6 * n, kNaN), o(2 * n, kNaN);
  AxialParams a = params(p, out.data());
  a.row_out = row_out.data(), a.saved_qkv = qkv.data(), a.saved_o = o.data();
  ASSERT_TRUE(forward_cpu(a).ok());
  EXPECT_EQ(saved_o_floats(a), (int64_t)n) << "the row pass's o alone";
  AxialParams both = a;  // the floats saved_o takes: a B H W D for each pass of 128 positions or more
  both.height = 128;
  EXPECT_EQ(saved_o_floats(both), 2 * both.batch * both.height * both.width * both.dim);
  both.width = 127;
  EXPECT_EQ(saved_o_floats(both), both.batch * both.height * both.width * both.dim);
  both.height = 2;
  EXPECT_EQ(saved_o_floats(both), 0);
  for (size_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(o[i])) << "the row pass's saved_o[" << i << "] not written";
  for (size_t i = n; i < 2 * n; ++i) ASSERT_TRUE(std::isnan(o[i])) << "the column pass's saved_o[" << i << "] written";
  {  // the row pass's o at position 0: its row is positions 0 .. W-1; each head in float64
    const int64_t D = s.D, hd = s.D / s.heads;
    for (int64_t h = 0; h < s.heads; ++h) {
      std::vector<double> score(s.W);
      double top = -1e300, sum = 0;
      for (int64_t j = 0; j < s.W; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < hd; ++c) dot += (double)qkv[h * hd + c] * qkv[j * 3 * D + D + h * hd + c];
        score[j] = dot / std::sqrt((double)hd);
        top = std::max(top, score[j]);
      }
      for (int64_t j = 0; j < s.W; ++j) sum += score[j] = std::exp(score[j] - top);
      for (int64_t c = 0; c < hd; ++c) {
        double want = 0;
        for (int64_t j = 0; j < s.W; ++j) want += score[j] / sum * qkv[j * 3 * D + 2 * D + h * hd + c];
        EXPECT_NEAR(o[h * hd + c], want, 1e-5 * (1 + std::fabs(want))) << "o of position 0, column " << h * hd + c;
      }
    }
  }
  Grads b(s);
  AxialGrads g = b.view();
  g.grad_out = gout_f.data();
  a.out = nullptr;
  std::fill(o.begin(), o.begin() + n, kNaN);  // the kept part poisoned
  ASSERT_TRUE(backward_cpu(a, g).ok());
  EXPECT_TRUE(std::isnan(b.row.out_w[0])) << "the backward did not read the row pass's saved_o";
  for (const auto& [grad, what] : b.all())
    if (grad != &b.row.out_w) EXPECT_FALSE(std::isnan((*grad)[0])) << what << ": saved_o reached it";
}

// forward_cpu with saved_p keeps the softmax probabilities of each pass of 2 to 127 positions ((L,
// L) a sequence and head, the row pass's first): here both passes, each P of the row pass's first
// sequence and head equal to float64 softmax(q k^T / sqrt(hd)) from the kept q, k. backward_cpu
// reads them (a poisoned P reaches the gradients) in place of the scores and the softmax, and the
// gradients are those of the backward that runs them, bit for bit, at any thread count (the
// ThreadCountDoesNotChangeTheResult test keeps P too).
TEST_F(CpuBackwardRuns, ProbabilitiesAreKeptForShortSequences) {
  AxialParams shape = params(p, nullptr);  // (2, 6, 9, 16, 2): 108 positions, 2 heads
  EXPECT_EQ(saved_p_floats(shape), 108 * 2 * (9 + 6));
  shape.width = 128;  // the row pass keeps o instead
  EXPECT_EQ(saved_p_floats(shape), 2 * 6 * 128 * 2 * 6);
  shape.height = 1;  // one key: no probabilities to keep
  EXPECT_EQ(saved_p_floats(shape), 0);

  const size_t n = p.x.size();
  std::vector<float> out(n), row_out(n), qkv(6 * n), o(2 * n);
  AxialParams a = params(p, out.data());
  std::vector<float> probs(saved_p_floats(a), kNaN);
  a.row_out = row_out.data(), a.saved_qkv = qkv.data(), a.saved_o = o.data(), a.saved_p = probs.data();
  ASSERT_TRUE(forward_cpu(a).ok());
  for (size_t i = 0; i < probs.size(); ++i) ASSERT_TRUE(std::isfinite(probs[i])) << "saved_p[" << i << "] not written";
  const int64_t D = s.D, hd = s.D / s.heads;
  for (int64_t i = 0; i < s.W; ++i) {  // row pass, sequence 0, head 0: positions 0 .. W-1
    std::vector<double> score(s.W);
    double top = -1e300, sum = 0;
    for (int64_t j = 0; j < s.W; ++j) {
      double dot = 0;
      for (int64_t c = 0; c < hd; ++c) dot += (double)qkv[i * 3 * D + c] * qkv[j * 3 * D + D + c];
      top = std::max(top, score[j] = dot / std::sqrt((double)hd));
    }
    for (int64_t j = 0; j < s.W; ++j) sum += score[j] = std::exp(score[j] - top);
    for (int64_t j = 0; j < s.W; ++j) EXPECT_NEAR(probs[i * s.W + j], score[j] / sum, 1e-6) << i << ", " << j;
  }
  Grads b(s);
  AxialGrads g = b.view();
  g.grad_out = gout_f.data();
  a.out = nullptr;
  std::fill(probs.begin(), probs.begin() + 108 * 2 * 9, kNaN);  // the row pass's P poisoned
  ASSERT_TRUE(backward_cpu(a, g).ok());
  EXPECT_TRUE(std::isnan(b.row.qkv_w[0])) << "the backward did not read the row pass's saved_p";
  EXPECT_FALSE(std::isnan(b.col.qkv_w[0])) << "the row pass's saved_p reached the column pass";

  for (const Shape shape : {Shape{2, 6, 9, 16, 2}, Shape{3, 16, 16, 64, 4}, Shape{1, 40, 3, 32, 2},
                            Shape{1, 127, 2, 8, 1}}) {
    s = shape;
    p = random_problem(s, 23);
    gout_f = std::vector<float>(s.B * s.H * s.W * s.D, 0.0f);
    for (size_t i = 0; i < gout_f.size(); ++i) gout_f[i] = (float)std::sin(0.37 * (double)i);
    Grads kept = cpu_backward_after_forward(p, gout_f, true), run = cpu_backward_after_forward(p, gout_f, false);
    for (size_t i = 0; i < kept.all().size(); ++i)
      EXPECT_TRUE(same_bits(*kept.all()[i].first, *run.all()[i].first))
          << kept.all()[i].second << ", " << shape_name(s);
  }
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
// a chunk, never what is summed in which order: the results are even bitwise identical. The
// second shape's row pass is one sequence of 4 heads, whose heads go to the threads within the
// block (for_ranges); its column pass is 300 sequences of one position. The third's one head of
// 600 positions is cut into 16 query ranges (query_ranges), whose dk and dv parts add in order.
// The fourth is the shape whose forward is not bitwise the same at 1 and 2 threads
// (test_cpu_paths.cpp, ThreadCountPromise): its gradients are. The fifth's row pass is two
// sequences of 18 (head, query range) pairs: a chunk a thread at 1 and 2 threads, the blocks one
// after another with their pairs and row tiles across the threads at 3 and 8. The last three are
// few long sequences, a chunk a thread at low counts and shared at high ones: four rows of 300
// (blocks of five row tiles, whose column sums add a partial a tile, shared from 8 threads), eight
// columns of 600 (16 query ranges a head, shared at 16), two rows of 300 at dim 128 (shared from 3:
// weight-gradient partials in tiles of 32 rows, products large enough to leave the register tiles,
// whose bits depend on the tiles: a tile size that followed the thread count fails here).
TEST_F(CpuBackwardRuns, ThreadCountDoesNotChangeTheResult) {
  for (const Shape shape : {Shape{2, 16, 24, 32, 2}, Shape{1, 1, 300, 32, 4}, Shape{1, 1, 600, 16, 1},
                            Shape{1, 200, 1, 16, 2}, Shape{1, 2, 300, 32, 2}, Shape{1, 4, 300, 32, 2},
                            Shape{1, 600, 8, 16, 2}, Shape{1, 2, 300, 128, 2}}) {
    s = shape;
    p = random_problem(s, 17);
    gout = random_grad(s.B * s.H * s.W * s.D, 12);
    gout_f.assign(gout.begin(), gout.end());
    const int before = omp_get_max_threads();
    // What one forward kept (row_out, saved_qkv, saved_o, saved_p), read by the second round's
    // backwards: the kept path (q, k, v, o and P read, not recomputed) is thread-count independent too.
    const size_t n = p.x.size();
    std::vector<float> out(n, kNaN), row_out(n, kNaN), qkv(6 * n, kNaN), o(2 * n, kNaN);
    AxialParams kept = params(p, out.data());
    std::vector<float> probs(saved_p_floats(kept), kNaN);
    kept.row_out = row_out.data(), kept.saved_qkv = qkv.data(), kept.saved_o = o.data(), kept.saved_p = probs.data();
    ASSERT_TRUE(forward_cpu(kept).ok());
    kept.out = nullptr;
    for (const bool from_forward : {false, true}) {
      const auto backward = [&]() {
        Grads r(s);
        AxialGrads g = r.view();
        g.grad_out = gout_f.data();
        const Status st = backward_cpu(from_forward ? kept : params(p, nullptr), g);
        EXPECT_TRUE(st.ok()) << st.message;
        return r;
      };
      const char* how = from_forward ? " (from the forward's kept tensors)" : "";
      Grads base = backward();
      for (int threads : {1, 2, 3, 8, 16}) {
        omp_set_num_threads(threads);
        Grads r = backward();
        for (size_t i = 0; i < base.all().size(); ++i) {
          EXPECT_LE(rel_err(*r.all()[i].first,
                            std::vector<double>(base.all()[i].first->begin(), base.all()[i].first->end())),
                    1e-6)
              << base.all()[i].second << " with " << threads << " threads, " << shape_name(s) << how;
          EXPECT_TRUE(same_bits(*r.all()[i].first, *base.all()[i].first))
              << base.all()[i].second << " with " << threads << " threads, " << shape_name(s) << how;
        }
      }
      omp_set_num_threads(before);
    }
  }
}

// The same promise with dropout and with the weights' gradients alone (no grad_x: the row pass's
// backward skips dx), on the few-long-sequences shapes whose blocks the team shares.
TEST_F(CpuBackwardRuns, ThreadCountDoesNotChangeTheResultWithDropoutOrWeightsAlone) {
  std::vector<bool> weights_only(11, true);
  weights_only[0] = false;
  for (const Shape shape : {Shape{1, 4, 300, 32, 2}, Shape{1, 2, 300, 128, 2}})
    for (const bool dropout : {true, false}) {
      s = shape;
      p = random_problem(s, 19);
      gout = random_grad(s.B * s.H * s.W * s.D, 13);
      gout_f.assign(gout.begin(), gout.end());
      AxialParams a = params(p, nullptr);
      if (dropout) a.dropout = 0.3f, a.seed = 1234, a.offset = 56;
      const std::vector<bool> wanted = dropout ? std::vector<bool>(11, true) : weights_only;
      const auto backward = [&]() {
        Grads r(s);
        AxialGrads g = r.view(wanted);
        g.grad_out = gout_f.data();
        const Status st = backward_cpu(a, g);
        EXPECT_TRUE(st.ok()) << st.message;
        return r;
      };
      const int before = omp_get_max_threads();
      omp_set_num_threads(1);
      Grads base = backward();
      for (int threads : {2, 3, 8, 16}) {
        omp_set_num_threads(threads);
        Grads r = backward();
        for (size_t i = 0; i < base.all().size(); ++i)
          if (wanted[i])
            EXPECT_TRUE(same_bits(*r.all()[i].first, *base.all()[i].first))
                << base.all()[i].second << " with " << threads << " threads, " << shape_name(s)
                << (dropout ? ", dropout" : ", weights alone");
      }
      omp_set_num_threads(before);
    }
}

// A block of several row tiles adds its tiles' fp64 column sums in tile order, at every thread
// count. The column pass here is four sequences of 300 positions (tiles of 64 rows); grad_out's
// column j is 2^54 in every row of tile 0 and -2^54 in every row of tile 1 (their sums, 2^60 and
// -2^60, cancel exactly when added first) and small values elsewhere, so col.out_bias, the column
// sums of grad_out, is the small values' sum in tile order, where another order loses them all.
TEST_F(CpuBackwardRuns, TileColumnSumsAddInTileOrder) {
  s = Shape{1, 300, 4, 32, 2};
  p = random_problem(s, 29);
  const int64_t H = s.H, W = s.W, D = s.D;
  gout_f.assign(H * W * D, 0.0f);
  std::vector<double> small_sum(D, 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t w = 0; w < W; ++w)
      for (int64_t j = 0; j < D; ++j) {
        float v = 0.25f + 0.5f * (float)std::sin(0.11 * (double)(h * W * D + w * D + j));
        if (h < 64) v = std::ldexp(1.0f, 54);
        else if (h < 128) v = -std::ldexp(1.0f, 54);
        else small_sum[j] += v;
        gout_f[(h * W + w) * D + j] = v;
      }
  const int before = omp_get_max_threads();
  for (int threads : {1, 2, 8, 16}) {
    omp_set_num_threads(threads);
    Grads r(s);
    AxialGrads g = r.view();
    g.grad_out = gout_f.data();
    ASSERT_TRUE(backward_cpu(params(p, nullptr), g).ok());
    for (int64_t j = 0; j < D; ++j)
      EXPECT_NEAR(r.col.out_b[j], small_sum[j], 1e-6 * std::abs(small_sum[j]) + 1e-3)
          << "col.out_bias[" << j << "] with " << threads << " threads";
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
TEST_F(BackwardBadArguments, KeptForwardAliasesAnInputOrAGradient) {
  const char* kMessage = "row_out, saved_qkv, saved_o and saved_p must not alias";
  a.row_out = const_cast<float*>(a.x);
  expect_invalid(kMessage);
  a.row_out = const_cast<float*>(g.grad_out);
  expect_invalid(kMessage);
  a.row_out = nullptr;
  a.saved_qkv = const_cast<float*>(a.x);
  expect_invalid(kMessage);
  a.saved_qkv = nullptr;
  a.saved_o = const_cast<float*>(g.grad_out);
  expect_invalid(kMessage);
  a.saved_o = nullptr;
  std::vector<float> kept(6 * a.batch * a.height * a.width * a.dim, 0.0f);
  a.row_out = a.saved_qkv = kept.data();
  expect_invalid("saved_qkv must not alias row_out");
  a.saved_qkv = nullptr;
  a.saved_o = kept.data();
  expect_invalid("saved_o must not alias row_out or saved_qkv");
  a.saved_o = nullptr;
  a.saved_p = const_cast<float*>(g.grad_out);
  expect_invalid(kMessage);
  a.saved_p = kept.data();
  expect_invalid("saved_p must not alias row_out, saved_qkv or saved_o");
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
