// Attention dropout on the CPU.
//  - The mask (src/common/dropout.h): Philox4x32-10 against Random123's known answers, pinned
//    words and keep bits (the CUDA kernels must reproduce these), the element index map, the
//    4-at-a-time and row helpers against single draws, the keep rate and independence within
//    binomial bounds, seed and offset (both 64-bit words) changing the mask.
//  - The float64 reference with dropout: its backward against central differences of its
//    forward under the same (fixed) mask; p = 0 and p = 1; each pass's mask mattering.
//  - forward_cpu and backward_cpu against the reference (the accuracy rule, util/reference.h) at
//    p = 0.1, 0.5 and 1 on several shapes; rows the mask drops whole (p = 0.9 on short rows);
//    the few-sequences path and the backward's heads across threads (thread count set here);
//    same (seed, offset) bitwise identical, another seed or offset different; p = 0 bitwise the
//    no-dropout result; bad p rejected.
#include <gtest/gtest.h>

#include <Random123/philox.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "src/common/dropout.h"
#include "util/backward_util.h"
#include "util/dropout_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial::test {
namespace {

DropoutParams mask_params(uint64_t seed, uint64_t offset, float rate) {
  DropoutParams d;
  d.seed = seed;
  d.offset = offset;
  d.threshold = dropout_threshold(rate);
  d.scale = dropout_scale(rate);
  return d;
}

// "0p5" for 0.5, for test names.
std::string rate_name(float p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", p);
  std::string s = buf;
  for (char& c : s)
    if (c == '.') c = 'p';
  return s;
}

// ---- the mask -------------------------------------------------------------------------------

// Random123's published known-answer vectors for philox4x32 with 10 rounds (its kat_vectors),
// through dropout_words: ctr = {lo(block), hi(block), lo(offset), hi(offset)}, key = {lo(seed), hi(seed)}.
TEST(DropoutMask, PhiloxKnownAnswers) {
  struct Kat {
    uint64_t seed, offset, block;
    uint32_t out[4];
  };
  const Kat kats[] = {
      {0, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {~uint64_t{0}, ~uint64_t{0}, ~uint64_t{0}, {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const philox4x32_ctr_t w = dropout_words(mask_params(k.seed, k.offset, 0.5f), k.block);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(w.v[i], k.out[i]) << "seed " << k.seed << " word " << i;
  }
}

// Pinned values, a regression guard for the mask's definition and the values the CUDA kernels
// must reproduce: computed here from Random123 directly, and written out.
TEST(DropoutMask, PinnedValues) {
  // seed 1234, offset 0, p = 0.5 (threshold 2^31): elements 0..7 are words 0..3 of blocks 0 and 1.
  const DropoutParams d = mask_params(1234, 0, 0.5f);
  ASSERT_EQ(d.threshold, uint64_t{1} << 31);
  const uint32_t words[8] = {0x2090b348u, 0xda7cf0abu, 0x4401906fu, 0xcbca470eu,
                             0x9eeede35u, 0x1cbe137cu, 0xfa277093u, 0x147edd50u};
  const bool bits[8] = {0, 1, 0, 1, 1, 0, 1, 0};
  for (uint32_t block = 0; block < 2; ++block) {
    const philox4x32_ctr_t direct = philox4x32_R(10, philox4x32_ctr_t{{block, 0, 0, 0}}, philox4x32_key_t{{1234, 0}});
    for (int k = 0; k < 4; ++k) {
      const int e = 4 * block + k;
      EXPECT_EQ(direct.v[k], words[e]) << "element " << e;
      EXPECT_EQ(dropout_keep(d, static_cast<uint64_t>(e)), direct.v[k] >= (1u << 31)) << "element " << e;
      EXPECT_EQ(dropout_keep(d, static_cast<uint64_t>(e)), bits[e]) << "element " << e;
    }
  }
  // A column-pass element of a non-square problem, 64-bit seed and offset, p = 0.1:
  // B 2, H 3, W 5, heads 2: base[1] = B H heads W^2 = 300; pass 1, n 5, head 1, query 2, key 1:
  // e = 300 + ((5 * 2 + 1) * 3 + 2) * 3 + 1 = 406, block 101, word 2.
  AxialParams a;
  a.batch = 2, a.height = 3, a.width = 5, a.dim = 4, a.heads = 2;
  a.dropout = 0.1f, a.seed = 0x0123456789abcdefull, a.offset = 0xfedcba9876543210ull;
  const DropoutParams q = make_dropout(a);
  EXPECT_EQ(q.threshold, 429496736u);  // 0.1f 2^32, an integer: 13421773 2^-27 2^32
  EXPECT_EQ(q.base[1], 300u);
  EXPECT_EQ(dropout_element(q, 1, 5, 1, 2, 1), 406u);
  const philox4x32_ctr_t direct =
      philox4x32_R(10, philox4x32_ctr_t{{101, 0, 0x76543210u, 0xfedcba98u}}, philox4x32_key_t{{0x89abcdefu, 0x01234567u}});
  const uint32_t words2[4] = {0x13f1abafu, 0x51c90f42u, 0x8cac9994u, 0xf3f8eff1u};
  for (int k = 0; k < 4; ++k) EXPECT_EQ(direct.v[k], words2[k]) << "word " << k;
  EXPECT_EQ(dropout_keep4(q, 101), 0xEu);  // word 0 is below the threshold
  // Keys 0..2 of queries 0..2 of (pass 1, n 5, head 1): rows "011", "010", "111".
  const char* rows[3] = {"011", "010", "111"};
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(dropout_keep(q, 1, 5, 1, i, j), rows[i][j] == '1') << i << ", " << j;
}

TEST(DropoutMask, ThresholdAndScale) {
  EXPECT_EQ(dropout_threshold(0.0f), 0u);
  EXPECT_EQ(dropout_threshold(1.0f), uint64_t{1} << 32);
  EXPECT_EQ(dropout_threshold(0.5f), uint64_t{1} << 31);
  EXPECT_EQ(dropout_threshold(0.25f), uint64_t{1} << 30);
  EXPECT_EQ(dropout_threshold(std::nextafter(1.0f, 0.0f)), (uint64_t{1} << 32) - 256);  // 1 - 2^-24
  EXPECT_EQ(dropout_threshold(1e-12f), 0u);                                            // rounds to 0
  EXPECT_EQ(dropout_threshold(1.5f * 0x1p-32f), 2u);                                   // ties round up
  EXPECT_EQ(dropout_scale(0.0f), 1.0f);
  EXPECT_EQ(dropout_scale(0.5f), 2.0f);
  EXPECT_EQ(dropout_scale(0.1f), static_cast<float>(1.0 / (1.0 - static_cast<double>(0.1f))));
  EXPECT_EQ(dropout_scale(1.0f), 0.0f);
  // p = 0 keeps, p = 1 drops, every element.
  const DropoutParams keep_all = mask_params(5, 6, 0.0f), drop_all = mask_params(5, 6, 1.0f);
  for (uint64_t b = 0; b < 4096; ++b) {
    ASSERT_EQ(dropout_keep4(keep_all, b), 0xFu);
    ASSERT_EQ(dropout_keep4(drop_all, b), 0u);
  }
  std::vector<float> row(37, -1.0f);
  dropout_row(drop_all, 3, row.size(), row.data());
  for (float v : row) EXPECT_EQ(v, 0.0f);
  dropout_row(keep_all, 3, row.size(), row.data());
  for (float v : row) EXPECT_EQ(v, 1.0f);
}

// dropout_keep4 and dropout_row against one draw per element, at every alignment.
TEST(DropoutMask, GroupHelpersMatchSingleDraws) {
  const DropoutParams d = mask_params(77, 3, 0.3f);
  for (uint64_t b = 0; b < 64; ++b) {
    const unsigned bits = dropout_keep4(d, b);
    for (int k = 0; k < 4; ++k) EXPECT_EQ((bits >> k) & 1u, dropout_keep(d, 4 * b + k) ? 1u : 0u);
  }
  // Counts from 64 take the host's batched path (16 blocks at a time) after a partial first block.
  for (uint64_t e0 : {0, 1, 2, 3, 5, 1022}) {
    for (uint64_t count : {0, 1, 2, 3, 4, 5, 7, 13, 63, 64, 65, 67, 127, 128, 131, 1000}) {
      std::vector<float> row(count + 1, -1.0f);
      dropout_row(d, e0, count, row.data());
      for (uint64_t k = 0; k < count; ++k) EXPECT_EQ(row[k], dropout_keep(d, e0 + k) ? d.scale : 0.0f) << e0 << "+" << k;
      EXPECT_EQ(row[count], -1.0f) << "dropout_row wrote past its count";
    }
  }
  // Elements with e / 4 past 2^32: the counter's high word.
  const uint64_t far = (uint64_t{5} << 32) * 4 + 1;
  const philox4x32_ctr_t w = philox4x32_R(10, philox4x32_ctr_t{{0, 5, 3, 0}}, philox4x32_key_t{{77, 0}});
  EXPECT_EQ(dropout_keep(d, far), static_cast<uint64_t>(w.v[1]) >= d.threshold);
}

// The element index: e = base[pass] + ((n heads + h) L + i) L + j covers [0, total) once, both
// passes, on grids with H < W and H > W (the passes' ranges never overlap); on a square grid it
// is (((pass N + n) heads + h) L + i) L + j.
TEST(DropoutMask, ElementIndexIsABijection) {
  for (const Shape& s : {Shape{2, 3, 5, 4, 2}, Shape{2, 5, 3, 4, 2}, Shape{1, 4, 4, 6, 3}}) {
    AxialParams a;
    a.batch = s.B, a.height = s.H, a.width = s.W, a.dim = s.D, a.heads = s.heads, a.dropout = 0.5f;
    const DropoutParams d = make_dropout(a);
    const uint64_t N[2] = {uint64_t(s.B * s.H), uint64_t(s.B * s.W)}, L[2] = {uint64_t(s.W), uint64_t(s.H)};
    const uint64_t total = N[0] * s.heads * L[0] * L[0] + N[1] * s.heads * L[1] * L[1];
    std::set<uint64_t> seen;
    for (int pass = 0; pass < 2; ++pass)
      for (uint64_t n = 0; n < N[pass]; ++n)
        for (uint64_t h = 0; h < uint64_t(s.heads); ++h)
          for (uint64_t i = 0; i < L[pass]; ++i)
            for (uint64_t j = 0; j < L[pass]; ++j) {
              const uint64_t e = dropout_element(d, pass, n, h, i, j);
              EXPECT_LT(e, total);
              EXPECT_TRUE(seen.insert(e).second) << shape_name(s) << ": element " << e << " twice";
              if (s.H == s.W) EXPECT_EQ(e, (((pass * N[pass] + n) * s.heads + h) * L[pass] + i) * L[pass] + j);
            }
    EXPECT_EQ(seen.size(), total) << shape_name(s);
  }
}

// Over n elements, the kept count is binomial(n, q), q = 1 - t / 2^32: within 5 standard
// deviations (a false failure about once in 3.5 million seeds; these are fixed, so never in fact).
// So are the agreements with the mask of the next offset (an independent stream: binomial(n,
// q^2 + (1 - q)^2)), and the count of neighbours (e, e + 1) both kept (lanes of one Philox call,
// and across calls): mean (n - 1) q^2, variance (n - 1)(q^2 - q^4) + 2 (n - 2)(q^3 - q^4), as
// overlapping pairs are correlated with their neighbours.
TEST(DropoutMask, KeepRateWithinBinomialBounds) {
  const uint64_t n = uint64_t{1} << 20;
  for (float p : {0.01f, 0.1f, 0.5f, 0.9f}) {
    const DropoutParams d = mask_params(2024, 9, p), next = mask_params(2024, 10, p);
    const double q = 1.0 - static_cast<double>(d.threshold) / 4294967296.0;  // P(keep)
    uint64_t kept = 0, pairs = 0, agree = 0;
    bool prev = false;
    for (uint64_t b = 0; b < n / 4; ++b) {
      const unsigned bits = dropout_keep4(d, b), other = dropout_keep4(next, b);
      for (int k = 0; k < 4; ++k) {
        const bool keep = (bits >> k) & 1u;
        kept += keep;
        pairs += (b + k > 0) && keep && prev;
        agree += keep == (((other >> k) & 1u) != 0);
        prev = keep;
      }
    }
    auto within = [](double count, double trials, double prob) {
      return std::fabs(count - trials * prob) <= 5.0 * std::sqrt(trials * prob * (1.0 - prob));
    };
    EXPECT_TRUE(within(double(kept), double(n), q)) << "p " << p << ": kept " << kept << " of " << n;
    const double pair_var = double(n - 1) * (q * q - q * q * q * q) + 2.0 * double(n - 2) * (q * q * q - q * q * q * q);
    EXPECT_LE(std::fabs(double(pairs) - double(n - 1) * q * q), 5.0 * std::sqrt(pair_var))
        << "p " << p << ": neighbour pairs kept " << pairs;
    EXPECT_TRUE(within(double(agree), double(n), q * q + (1 - q) * (1 - q))) << "p " << p << ": agreements " << agree;
  }
  // And through the (pass, n, h, i, j) map of a problem, per pass.
  AxialParams a;
  a.batch = 2, a.height = 24, a.width = 40, a.dim = 8, a.heads = 4, a.dropout = 0.25f, a.seed = 1;
  const DropoutParams d = make_dropout(a);
  const double q = 1.0 - static_cast<double>(d.threshold) / 4294967296.0;
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t N = pass == 0 ? a.batch * a.height : a.batch * a.width, L = pass == 0 ? a.width : a.height;
    uint64_t kept = 0, total = 0;
    for (int64_t s = 0; s < N; ++s)
      for (int64_t h = 0; h < a.heads; ++h)
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < L; ++j, ++total) kept += dropout_keep(d, pass, s, h, i, j);
    EXPECT_LE(std::fabs(double(kept) - total * q), 5.0 * std::sqrt(total * q * (1 - q))) << "pass " << pass;
  }
}

// Another seed or offset, in either 32-bit word, gives another mask: about half the keep bits
// differ at p = 0.5 (within 5 standard deviations of n / 2).
TEST(DropoutMask, SeedAndOffsetChangeTheMask) {
  const uint64_t seed = 0x1111222233334444ull, offset = 0x5555666677778888ull, n = 8192;
  const DropoutParams base = mask_params(seed, offset, 0.5f);
  const std::pair<DropoutParams, const char*> others[] = {
      {mask_params(seed + 1, offset, 0.5f), "seed + 1"},
      {mask_params(seed + (uint64_t{1} << 32), offset, 0.5f), "seed + 2^32"},
      {mask_params(seed, offset + 1, 0.5f), "offset + 1"},
      {mask_params(seed, offset + (uint64_t{1} << 32), 0.5f), "offset + 2^32"},
      {mask_params(offset, seed, 0.5f), "seed and offset swapped"},
  };
  for (const auto& [d, name] : others) {
    uint64_t differ = 0;
    for (uint64_t e = 0; e < n; ++e) differ += dropout_keep(base, e) != dropout_keep(d, e);
    EXPECT_LE(std::fabs(double(differ) - n / 2.0), 5.0 * std::sqrt(n / 4.0)) << name << ": " << differ << " differ";
  }
  // And the same (seed, offset) the same mask, every time.
  const DropoutParams again = mask_params(seed, offset, 0.5f);
  for (uint64_t e = 0; e < n; ++e) ASSERT_EQ(dropout_keep(base, e), dropout_keep(again, e));
}

// ---- the float64 reference with dropout -------------------------------------------------------

class ReferenceDropout : public ::testing::TestWithParam<float> {};

// Central differences of reference_forward under the same mask (a function of the indices alone,
// so fixed while the values move) against reference_backward, as in test_backward_cpu.cpp.
TEST_P(ReferenceDropout, BackwardMatchesFiniteDifferences) {
  const float rate = GetParam();
  const Shape s{1, 3, 4, 8, 2};  // H != W: the passes' masks differ in shape
  Problem p = with_dropout(random_problem(s, 99), rate, 31337, 2);
  int dropped = 0, total = 0;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t n = 0; n < (pass ? s.W : s.H); ++n)
      for (int64_t h = 0; h < s.heads; ++h)
        for (int64_t i = 0; i < (pass ? s.H : s.W); ++i)
          for (int64_t j = 0; j < (pass ? s.H : s.W); ++j, ++total) dropped += !p.keep(pass, n, h, i, j);
  ASSERT_GT(dropped, 0);
  if (rate < 1.0f) ASSERT_LT(dropped, total);
  const std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 7);
  EXPECT_EQ(expect_reference_backward_matches_finite_differences(p, gout), 8 + 10 * 4);
}

INSTANTIATE_TEST_SUITE_P(Rates, ReferenceDropout, ::testing::Values(0.1f, 0.5f, 1.0f),
                         [](const auto& info) { return "p" + rate_name(info.param); });

// p = 0 ignores the mask function; p = 1 leaves x + bout of each pass; each pass's mask moves
// the result far beyond the kernels' tolerance (so a kernel that skipped either pass's mask
// would fail CpuDropoutForward).
TEST(ReferenceDropoutCases, ZeroOneAndEachPass) {
  const Shape s{2, 5, 7, 16, 2};
  const Problem plain = random_problem(s, 8);
  const std::vector<double> base = reference_forward(plain);

  Problem zero = plain;
  zero.keep = [](int, int64_t, int64_t, int64_t, int64_t) { return false; };  // ignored at p = 0
  EXPECT_EQ(reference_forward(zero), base);

  Problem one = with_dropout(plain, 1.0f, 3, 4);
  const std::vector<double> y = reference_forward(one);
  for (size_t e = 0; e < y.size(); ++e) {
    const size_t c = e % s.D;
    EXPECT_EQ(y[e], double(plain.x[e]) + plain.row.out_b[c] + plain.col.out_b[c]) << e;
  }

  const Problem both = with_dropout(plain, 0.5f, 3, 4);
  const std::vector<double> full = reference_forward(both);
  const std::vector<float> full_f(full.begin(), full.end());
  EXPECT_GT(worst_ratio(std::vector<float>(base.begin(), base.end()), full, 1e-4, 1e-4), 100.0);
  for (int skip = 0; skip < 2; ++skip) {
    Problem part = both;
    const KeepFn keep = both.keep;
    part.keep = [keep, skip](int pass, int64_t n, int64_t h, int64_t i, int64_t j) {
      return pass == skip || keep(pass, n, h, i, j);
    };
    EXPECT_GT(worst_ratio(full_f, reference_forward(part), 1e-4, 1e-4), 100.0) << "pass " << skip << "'s mask";
  }
}

// ---- forward_cpu and backward_cpu against the reference --------------------------------------

using RateCase = std::tuple<Shape, float>;

std::string rate_case_name(const ::testing::TestParamInfo<RateCase>& info) {
  return shape_name(std::get<0>(info.param)) + "_p" + rate_name(std::get<1>(info.param));
}

// The drop-in contract's tolerance: here only as a yardstick of how far another mask moves the
// result (OtherSeedOrOffsetGivesOtherResults); correctness is the accuracy rule's.
constexpr double kAtol = 1e-4, kRtol = 1e-4;

// forward_cpu(p) within the accuracy rule.
void expect_forward_accurate(const Problem& p) {
  std::vector<float> out(p.x.size(), kNaN);
  const Status st = forward_cpu(params(p, out.data()));
  ASSERT_TRUE(st.ok()) << st.message;
  expect_forward_within_rule(p, out);
}

class CpuDropoutForward : public ::testing::TestWithParam<RateCase> {};

TEST_P(CpuDropoutForward, MatchesDoubleReference) {
  const auto [s, rate] = GetParam();
  expect_forward_accurate(with_dropout(random_problem(s, 1234u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W)),
                                       rate, 0xC0FFEEull + static_cast<uint64_t>(s.H), 17));
}

// L = 1 and 7, H != W, head dims 8 to 64, dims up to 128, grids with H < W and H > W; one long
// row and one long column (the threads share the sequence: the mask drawn from each query
// tile's first element).
INSTANTIATE_TEST_SUITE_P(Shapes, CpuDropoutForward,
                         ::testing::Combine(::testing::Values(Shape{1, 1, 1, 8, 1}, Shape{2, 1, 7, 16, 2},
                                                              Shape{1, 7, 1, 32, 4}, Shape{2, 5, 9, 64, 8},
                                                              Shape{1, 8, 3, 128, 4}, Shape{3, 16, 16, 64, 4},
                                                              Shape{1, 33, 17, 96, 3}, Shape{1, 1, 300, 32, 2},
                                                              Shape{1, 150, 1, 16, 2},
                                                              // the mask of key blocks (kKeyBlock 512)
                                                              Shape{1, 1, 1030, 16, 2}, Shape{1, 600, 2, 8, 1}),
                                            ::testing::Values(0.1f, 0.5f, 1.0f)),
                         rate_case_name);

// The bounds: expect_grads_match (backward_util.h), exact zeros included where the reference is
// exactly zero (at p = 1 every attention branch is).
class CpuDropoutBackward : public ::testing::TestWithParam<RateCase> {};

TEST_P(CpuDropoutBackward, MatchesDoubleReference) {
  const auto [s, rate] = GetParam();
  const Problem p = with_dropout(random_problem(s, 777u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W)), rate,
                                 0xBADC0DEull + static_cast<uint64_t>(s.W), 5);
  expect_cpu_backward_matches_reference(p, random_grad(s.B * s.H * s.W * s.D, 31u + static_cast<uint32_t>(s.H)));
}

// From the forward's kept tensors (probabilities P included, the mask drawn again over them): the
// reference's gradients, and the bits of the backward that runs the scores and softmax again.
TEST_P(CpuDropoutBackward, FromTheForwardsKeptProbabilities) {
  const auto [s, rate] = GetParam();
  const Problem p = with_dropout(random_problem(s, 777u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W)), rate,
                                 0xBADC0DEull + static_cast<uint64_t>(s.W), 5);
  const std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 31u + static_cast<uint32_t>(s.H));
  expect_cpu_backward_matches_reference(p, gout, true, true);
  const std::vector<float> gout_f(gout.begin(), gout.end());
  Grads kept = cpu_backward_after_forward(p, gout_f, true), run = cpu_backward_after_forward(p, gout_f, false);
  for (size_t i = 0; i < kept.all().size(); ++i)
    EXPECT_TRUE(same_bits(*kept.all()[i].first, *run.all()[i].first)) << kept.all()[i].second;
}

// heads 1, 2, 4; head dims 1, 3, 8, 16, 32; L from 1 to 40, and 521 (a head's queries in two
// ranges: the mask drawn from a row offset); H != W both ways; B > 1.
INSTANTIATE_TEST_SUITE_P(Shapes, CpuDropoutBackward,
                         ::testing::Combine(::testing::Values(Shape{1, 1, 1, 8, 1}, Shape{2, 3, 5, 4, 4},
                                                              Shape{1, 7, 4, 6, 2}, Shape{2, 5, 9, 16, 2},
                                                              Shape{1, 6, 11, 32, 1}, Shape{3, 16, 16, 64, 4},
                                                              Shape{1, 40, 3, 32, 2}, Shape{2, 1, 13, 8, 1},
                                                              Shape{1, 2, 521, 16, 2}),
                                            ::testing::Values(0.1f, 0.5f, 1.0f)),
                         rate_case_name);

// Rows the mask drops whole: p = 0.9 on rows of 2 and columns of 3 (a row kept in none of its
// keys with probability 0.81 and 0.73): their attention output is exactly zero (no 0/0: the
// softmax's sum is taken before the mask), the others' a few kept keys times 10.
TEST(CpuDropoutRows, FullyMaskedRows) {
  const Shape s{2, 3, 2, 16, 2};
  const Problem p = with_dropout(random_problem(s, 66), 0.9f, 1234, 5);
  int whole = 0, partial = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t N = pass ? s.B * s.W : s.B * s.H, L = pass ? s.H : s.W;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < s.heads; ++h)
        for (int64_t i = 0; i < L; ++i) {
          int kept = 0;
          for (int64_t j = 0; j < L; ++j) kept += p.keep(pass, n, h, i, j);
          (kept == 0 ? whole : partial) += 1;
        }
  }
  ASSERT_GT(whole, 0) << "no row dropped whole";
  ASSERT_GT(partial, 0) << "every row dropped whole";
  expect_forward_accurate(p);
  expect_cpu_backward_matches_reference(p, random_grad(s.B * s.H * s.W * s.D, 9));
}

#ifdef _OPENMP
// The thread-dependent branches with dropout (test_cpu_paths.cpp has them without): at 3 threads
// one long row (130) and one long column (200) take the forward's few-sequences path, whose
// query tiles draw the mask from their own first query, and the backward's heads go to the
// threads; at 1 thread, the one-thread paths. The thread count set here, whatever
// OMP_NUM_THREADS says.
class CpuDropoutThreads : public ::testing::TestWithParam<std::tuple<Shape, int>> {};

TEST_P(CpuDropoutThreads, MatchesDoubleReference) {
  const auto [s, threads] = GetParam();
  const Problem p = with_dropout(random_problem(s, 4321), 0.3f, 77, 3);
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  expect_forward_accurate(p);  // returns on a fatal failure; the thread count is restored below
  expect_cpu_backward_matches_reference(p, random_grad(s.B * s.H * s.W * s.D, 21));
  omp_set_num_threads(before);
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuDropoutThreads,
                         ::testing::Combine(::testing::Values(Shape{1, 1, 130, 32, 2}, Shape{1, 200, 1, 16, 2}),
                                            ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return shape_name(std::get<0>(info.param)) + "_threads" +
                                  std::to_string(std::get<1>(info.param));
                         });
#endif

// ---- determinism, seed and offset, p = 0 ------------------------------------------------------

class CpuDropoutRuns : public ::testing::Test {
 protected:
  Shape s{2, 16, 24, 32, 2};  // 32 and 48 sequences: several blocks and chunks per pass
  Problem plain = random_problem(s, 17);
  std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 12);
  std::vector<float> gout_f = std::vector<float>(gout.begin(), gout.end());

  std::vector<float> forward(const Problem& p) {
    std::vector<float> out(p.x.size(), kNaN);
    const Status st = forward_cpu(params(p, out.data()));
    EXPECT_TRUE(st.ok()) << st.message;
    return out;
  }
  Grads backward(const Problem& p) {
    Grads r(s);
    AxialGrads g = r.view();
    g.grad_out = gout_f.data();
    const Status st = backward_cpu(params(p, nullptr), g);
    EXPECT_TRUE(st.ok()) << st.message;
    return r;
  }
  static bool same_grads(Grads& a, Grads& b) {
    for (size_t i = 0; i < a.all().size(); ++i)
      if (!same_bits(*a.all()[i].first, *b.all()[i].first)) return false;
    return true;
  }
};

TEST_F(CpuDropoutRuns, SameSeedAndOffsetAreBitwiseIdentical) {
  const Problem p = with_dropout(plain, 0.3f, 42, 1000);
  const std::vector<float> out = forward(p);
  Grads g = backward(p);
  EXPECT_TRUE(same_bits(out, forward(p)));
  Grads again = backward(p);
  EXPECT_TRUE(same_grads(g, again));
#ifdef _OPENMP
  // The mask is a function of the element, never of the thread that draws it. The backward's
  // blocking depends on the shape alone: bitwise the same gradients. The forward's blocks depend
  // on the thread count, and so may its rounding (not its mask): equal within 1e-5.
  const int before = omp_get_max_threads();
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    EXPECT_LE(worst_ratio(forward(p), std::vector<double>(out.begin(), out.end()), 1e-5, 1e-5), 1.0)
        << threads << " threads";
    Grads r = backward(p);
    EXPECT_TRUE(same_grads(g, r)) << threads << " threads";
  }
  omp_set_num_threads(before);
#endif
}

TEST_F(CpuDropoutRuns, OtherSeedOrOffsetGivesOtherResults) {
  const Problem p = with_dropout(plain, 0.3f, 42, 1000);
  const std::vector<float> out = forward(p);
  Grads g = backward(p);
  for (const Problem& q : {with_dropout(plain, 0.3f, 43, 1000), with_dropout(plain, 0.3f, 42, 1001),
                           with_dropout(plain, 0.3f, 42 + (uint64_t{1} << 32), 1000)}) {
    const std::vector<float> o = forward(q);
    EXPECT_GT(worst_ratio(o, std::vector<double>(out.begin(), out.end()), kAtol, kRtol), 100.0)
        << "seed " << q.seed << " offset " << q.offset;
    Grads h = backward(q);
    EXPECT_FALSE(same_bits(g.x, h.x)) << "seed " << q.seed << " offset " << q.offset;
    EXPECT_FALSE(same_bits(g.row.qkv_w, h.row.qkv_w)) << "seed " << q.seed << " offset " << q.offset;
  }
}

// p = 0 runs the code without dropout whatever seed and offset say: bitwise the default params'
// results. (And those are bitwise today's: the dropout code is off that path entirely.)
TEST_F(CpuDropoutRuns, ZeroIsBitwiseNoDropout) {
  Problem zero = plain;
  zero.seed = 0xDEADBEEFull, zero.offset = 99;
  EXPECT_TRUE(same_bits(forward(zero), forward(plain)));
  Grads a = backward(zero), b = backward(plain);
  EXPECT_TRUE(same_grads(a, b));
}

// The smallest rates round to threshold 0 (every element kept) yet scale by 1 / (1 - p): the
// dropout path, the no-dropout result within rounding.
TEST_F(CpuDropoutRuns, TinyRateIsNearNoDropout) {
  const Problem tiny = with_dropout(plain, 1e-12f, 1, 2);
  const std::vector<float> base = forward(plain);
  EXPECT_LE(worst_ratio(forward(tiny), std::vector<double>(base.begin(), base.end()), 1e-6, 1e-6), 1.0);
}

TEST_F(CpuDropoutRuns, EmptyBatchZeroesWeightGradients) {
  Problem p = with_dropout(plain, 0.5f, 1, 2);
  Grads r(s);
  AxialGrads g = r.view();
  g.grad_x = nullptr;
  AxialParams a = params(p, nullptr);
  a.batch = 0;
  a.x = nullptr;
  ASSERT_TRUE(backward_cpu(a, g).ok());
  auto list = r.all();
  for (size_t i = 1; i < list.size(); ++i)
    for (float v : *list[i].first) ASSERT_EQ(v, 0.0f) << list[i].second;
}

// ---- arguments ------------------------------------------------------------------------------

TEST_F(CpuDropoutRuns, BadRateRejected) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {-0.1f, -1e-30f, 1.0001f, std::nextafter(1.0f, 2.0f), inf, -inf, kNaN}) {
    AxialParams a = params(plain, nullptr);
    std::vector<float> out(plain.x.size(), kNaN);
    a.out = out.data();
    a.dropout = bad;
    for (const Status& st : {validate(a), forward_cpu(a)}) {
      EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(st.message.find("dropout must be in [0, 1]"), std::string::npos) << st.message;
    }
    EXPECT_TRUE(all_nan(out)) << "out written for dropout " << bad;
    Grads r(s);
    AxialGrads g = r.view();
    g.grad_out = gout_f.data();
    const Status st = backward_cpu(a, g);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message.find("dropout must be in [0, 1]"), std::string::npos) << st.message;
    for (auto& [buf, name] : r.all()) EXPECT_TRUE(all_nan(*buf)) << name << " written for dropout " << bad;
  }
  std::vector<float> out(plain.x.size());
  for (float good : {0.0f, 1.0f, 0.5f}) {
    AxialParams a = params(plain, out.data());
    a.dropout = good;
    EXPECT_TRUE(validate(a).ok()) << good;
  }
}

// The mask's element count must fit uint64: a grid whose B H heads W^2 does not is rejected
// when dropout is on (and only then: without dropout the mask is never drawn).
TEST(CpuDropoutArguments, MaskElementCountOverflow) {
  AxialParams a;
  a.batch = 1, a.height = 2, a.width = int64_t{1} << 40, a.dim = 1, a.heads = 1;  // B H W D = 2^41
  a.dropout = 0.5f;
  Status st = validate(a);
  EXPECT_EQ(st.code, StatusCode::kInvalidArgument);
  EXPECT_NE(st.message.find("dropout mask"), std::string::npos) << st.message;
  a.dropout = 0.0f;
  st = validate(a);
  EXPECT_EQ(st.message.find("dropout"), std::string::npos) << st.message;  // fails on x is null instead
  // H = W = 2^20: 2^60 elements per pass fit; H = W = 2^21: 2^63 per pass, 2^64 in all, do not.
  a.dropout = 0.5f;
  a.height = a.width = int64_t{1} << 20;
  st = validate(a);
  EXPECT_EQ(st.message.find("dropout"), std::string::npos) << st.message;
  a.height = a.width = int64_t{1} << 21;
  st = validate(a);
  EXPECT_NE(st.message.find("dropout mask"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace fastaxial::test
