// The flash attention kernel on 16-bit products (FlashArgs::products: bf16 and fp16, fp32
// accumulation; src/cuda/detail/mma16.cuh), against float64 by issue 37's accuracy rule, and the
// plan's rule for them. Skipped without a device, but for the rule.
#include "util/flash_attention_test_util.h"  // first: whether dropout.h may include Random123

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "src/common/plan.h"
#include "src/common/smem_layout.h"  // flash_padded_head_dim, flash_wgmma16_smem_bytes
#include "src/cuda/attention/flash_attention.h"
#include "src/cuda/gemm/gemm.h"  // gemm_tf32x3_can_run: a build and device with sm_90a code
#include "util/cuda_test_util.h"
#include "util/round16.h"  // round16

namespace fastaxial::test {
namespace {

struct Case16 {
  Case shape;
  Products type;
  bool mma_sync = false;  // FlashArgs::mma_sync: the mma.sync kernel where the 16-bit wgmma one would run
  DropoutSpec drop{};     // p = 0: no dropout
  bool qkv16 = false;     // q, k, v given in 16 bits (FlashArgs::qkv16): the kQkv16 kernel
};

std::string case16_name(const Case16& c) {
  return case_name(c.shape) + (c.type == Products::kBf16 ? "_bf16" : "_fp16") + (c.mma_sync ? "_mma_sync" : "") +
         (c.drop.p > 0.0f ? "_" + dropout_name(c.drop) : "") + (c.qkv16 ? "_qkv16" : "");
}

// Whether the 16-bit wgmma kernel serves the case on dev, by the rule's terms (plan.h:
// kWgmma16): a build and device with sm_90a code, padded head dims 32, 96 and 128, L > 64.
bool wgmma16_serves(const Case16& c, const DeviceCaps& dev) {
  const int hdp = flash_padded_head_dim(c.shape.hd);
  return !c.mma_sync && cuda::gemm_tf32x3_can_run(dev) && c.shape.L > kFlashWgmmaMinLen &&
         (hdp == 32 || hdp == 96 || hdp == 128);
}

// Whether the kQkv16 kernel serves the case's sizes (plan.h's flash_qkv16_can_run terms): head dims
// 24 to 128 a multiple of 8, L > 64, no dropout; the test also gives it aligned rows alone.
bool qkv16_sizes(const Case& c) {
  return flash_qkv16_tile_head_dim(c.hd) != 0 && c.L > kFlashWgmmaMinLen && c.misalign == 0;
}

// The kernel the case runs on: kQkv16 for q, k, v in 16 bits (a build and device with sm_90a code),
// else wgmma16_serves' rule.
FlashKernel expected_kernel(const Case16& c, const DeviceCaps& dev) {
  if (c.qkv16) return FlashKernel::kQkv16;
  return wgmma16_serves(c, dev) ? FlashKernel::kWgmma16 : FlashKernel::kMmaSync;
}

// A qkv16 case needs the kernel's sm_90a code; false (with the reason) where it cannot run.
bool qkv16_runs(const Case16& c, const DeviceCaps& dev, std::string* why) {
  if (!c.qkv16 || cuda::gemm_tf32x3_can_run(dev)) return true;
  *why = "q, k, v in 16 bits run on sm_90a code alone";
  return false;
}

// 16-bit products (FlashArgs::products: q, k, v and p rounded to the type, fp32 accumulation) against
// float64 on the exact fp32 inputs, by issue 37's accuracy rule: at most twice the error of
// PyTorch's attention math run in the same type on the host: q, k and v rounded, the scores rounded
// (a 16-bit matmul's output), the softmax in float64 and its output rounded, with dropout the kept
// probabilities scaled and rounded again (dropout on the 16-bit tensor), p v summed in float64 and
// rounded. Dropout's mask is dropout_keep's (the kernels get it from seed and offset in device
// memory). Max errors over every valid element of the case. Rows outside the view stay poison; no
// NaN (it counts as an infinite error). Each case runs on the kernel the rule picks, and with
// mma_sync on the mma.sync kernel, so both 16-bit kernels meet the rule on the same inputs.
class FlashAttention16 : public ::testing::TestWithParam<Case16> {};

TEST_P(FlashAttention16, WithinTwiceTheSameTypeReference) {
  const Case16 c = GetParam();
  DeviceCaps dev;
  std::string why;
  if (!device_for(c.shape.hd, &dev, &why) || !qkv16_runs(c, dev, &why)) GTEST_SKIP() << why;
  const Problem pr = make_problem(c.shape);
  {
    cuda::FlashArgs a;
    a.pos = pr.view, a.D = (int)pr.D, a.heads = pr.heads, a.products = c.type, a.mma_sync = c.mma_sync;
    if (c.qkv16) {
      ASSERT_TRUE(cuda::flash_qkv16_chosen(a, dev));
      a.qkv16 = &why;  // (only its presence is read)
    }
    const FlashVariant v = cuda::flash_attention_variant(a, dev);
    ASSERT_EQ(v.kernel, expected_kernel(c, dev));
    ASSERT_EQ(v.splits, 1);
  }
  const bool drop = c.drop.p > 0.0f;
  DropoutParams d{};
  if (drop) {
#if defined(FASTAXIAL_NO_RANDOM123)
    GTEST_SKIP() << "a build without Random123 has no dropout";
#else
    d = dropout_params(pr.p, c.drop, pr.pass);
#endif
  }
  const DropoutParams given = drop ? kernel_dropout(d) : d;
  const uint64_t pair[2] = {d.seed, d.offset};
  Result r, r32;
  run_gpu(pr, c.shape.misalign, dev, &r, drop ? &given : nullptr, drop ? pair : nullptr, false, c.mma_sync, c.type,
          nullptr, true, c.qkv16);
  run_gpu(pr, c.shape.misalign, dev, &r32, drop ? &given : nullptr, drop ? pair : nullptr, false, true);  // 3xTF32
  if (HasFatalFailure()) return;
  // The 16-bit products ran: every case's v is rounded, so some row differs from 3xTF32's.
  EXPECT_GT(rows_differing(pr, r, r32), 0) << "the 16-bit products gave the fp32 kernel's bits";
  const int64_t D = pr.D, L = pr.L, hd = pr.hd;
  const auto r16 = [&](double x) { return (double)round16((float)x, c.type); };
  const double scale = 1.0 / std::sqrt((double)hd);
  double worst = 0.0, worst_ref = 0.0;
  std::vector<char> touched((size_t)(pr.T + kGuardRows), 0);
  std::vector<double> s((size_t)L), s16((size_t)L), o((size_t)hd), o16((size_t)hd);
  std::vector<float> mult;  // dropout's multipliers of (n, h), (L, L)
  for (int64_t n = 0; n < pr.N; ++n)
    for (int64_t h = 0; h < pr.heads; ++h) {
#if !defined(FASTAXIAL_NO_RANDOM123)
      if (drop) mult = dropout_multipliers(d, pr.pass, n, h, L);
#endif
      for (int64_t l = 0; l < L; ++l) {
        const int64_t orow = pr.view.offset(n, l);
        touched[(size_t)orow] = 1;
        const float* q = pr.qkv.data() + orow * 3 * D + h * hd;
        double m = -INFINITY, m16 = -INFINITY;
        for (int64_t k = 0; k < L; ++k) {
          const float* kr = pr.qkv.data() + pr.view.offset(n, k) * 3 * D + D + h * hd;
          double e = 0.0, e16 = 0.0;
          for (int64_t i = 0; i < hd; ++i) e += (double)q[i] * kr[i], e16 += r16(q[i]) * r16(kr[i]);
          s[k] = e * scale, s16[k] = r16(e16) * scale;
          m = std::max(m, s[k]), m16 = std::max(m16, s16[k]);
        }
        double sum = 0.0, sum16 = 0.0;
        for (int64_t k = 0; k < L; ++k) sum += std::exp(s[k] - m), sum16 += std::exp(s16[k] - m16);
        std::fill(o.begin(), o.end(), 0.0), std::fill(o16.begin(), o16.end(), 0.0);
        for (int64_t k = 0; k < L; ++k) {
          const float* vr = pr.qkv.data() + pr.view.offset(n, k) * 3 * D + 2 * D + h * hd;
          const double keep = drop ? (double)mult[(size_t)(l * L + k)] : 1.0;
          const double p = std::exp(s[k] - m) / sum * keep, p16 = r16(r16(std::exp(s16[k] - m16) / sum16) * keep);
          for (int64_t i = 0; i < hd; ++i) o[i] += p * vr[i], o16[i] += p16 * r16(vr[i]);
        }
        const float* got = r.o.data() + orow * D + h * hd;
        for (int64_t i = 0; i < hd; ++i) {
          worst = worst_abs(worst, got[i], o[i]);
          worst_ref = worst_abs(worst_ref, (float)r16(o16[i]), o[i]);
        }
      }
    }
  EXPECT_GT(worst_ref, 0.0);  // the same-type reference does round
  EXPECT_LE(worst, 2.0 * worst_ref) << "16-bit products' max error " << worst << ", the same-type reference's "
                                    << worst_ref;
  int64_t written = 0;
  for (int64_t r_ = 0; r_ < pr.T + kGuardRows; ++r_)
    if (!touched[(size_t)r_])
      for (int64_t i = 0; i < D; ++i) written += !is_poison(r.o[(size_t)(r_ * D + i)]);
  EXPECT_EQ(written, 0) << "elements of rows outside the view written";
  int64_t lse_written = 0;  // (its values are the rounded scores' softmax: no fp32 backward reads them yet)
  for (size_t i = (size_t)(2 * pr.N * pr.heads * L); i < r.lse.size(); ++i) lse_written += !is_poison(r.lse[i]);
  EXPECT_EQ(lse_written, 0) << "lse written past (2, num_seq, heads, L)";
}

// Equal scores (q = 0) give every row the mean of its sequence's v, which the 16-bit products
// compute exactly: each p is 1, v's values are integers below 256 (exact in both types), their
// sums exact in fp32; only o / l rounds (at most two fp32 roundings: 2^-23 relative). v varies with
// the key (l % 61) and the feature (64 (i % 3)), so a key read twice or missed, or a feature from
// the wrong column, shows as an error many orders above that bound.
TEST_P(FlashAttention16, EqualScoresGiveTheExactMeanOfV) {
  const Case16 c = GetParam();
  if (c.drop.p > 0.0f) GTEST_SKIP() << "the mean needs every p kept";
  DeviceCaps dev;
  std::string why;
  if (!device_for(c.shape.hd, &dev, &why) || !qkv16_runs(c, dev, &why)) GTEST_SKIP() << why;
  Problem pr = make_problem(c.shape);
  const int64_t D = pr.D, L = pr.L, hd = pr.hd;
  const auto value = [](int64_t l, int64_t i) { return (float)(l % 61 + 64 * (i % 3)); };
  for (int64_t n = 0; n < pr.N; ++n)
    for (int64_t l = 0; l < L; ++l) {
      float* row = pr.qkv.data() + pr.view.offset(n, l) * 3 * D;
      for (int64_t j = 0; j < D; ++j) row[j] = 0.0f, row[2 * D + j] = value(l, j % hd);
    }
  Result r;
  run_gpu(pr, c.shape.misalign, dev, &r, nullptr, nullptr, false, c.mma_sync, c.type, nullptr, true, c.qkv16);
  if (HasFatalFailure()) return;
  double key_sum = 0.0;
  for (int64_t l = 0; l < L; ++l) key_sum += (double)(l % 61);
  int64_t wrong = 0;
  double worst = 0.0;
  for (int64_t n = 0; n < pr.N; ++n)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t j = 0; j < D; ++j) {
        const double want = (key_sum + (double)L * 64.0 * (double)((j % hd) % 3)) / (double)L;
        const double err = std::fabs((double)r.o[(size_t)(pr.view.offset(n, l) * D + j)] - want);
        worst = std::max(worst, std::isnan(err) ? INFINITY : err);
        wrong += !(err <= std::ldexp(want, -23));
      }
  EXPECT_EQ(wrong, 0) << "elements off the exact mean by more than two fp32 roundings; worst " << worst;
}

// The output written rounded (FlashArgs::o16, the staged 16-bit pass's operand of its output
// product): on every row the view addresses, the bits of the fp32 output rounded to the type
// (nearest, ties to even: round16); the fp32 o too where it is given (the 16-bit training forward),
// the bits of the call without o16 (and the same lse), and untouched where it is null; rows
// outside the view (and the guard rows) left poison. A 3xTF32 call with o16 is refused, and a call
// with neither output.
TEST_P(FlashAttention16, RoundedOutputIsTheOutputRounded) {
  const Case16 c = GetParam();
  DeviceCaps dev;
  std::string why;
  if (!device_for(c.shape.hd, &dev, &why) || !qkv16_runs(c, dev, &why)) GTEST_SKIP() << why;
  const Problem pr = make_problem(c.shape);
  Result r, r_with16, r_both;
  std::vector<uint16_t> o16, o16_both;
  run_gpu(pr, c.shape.misalign, dev, &r, nullptr, nullptr, false, false, c.type, nullptr, true, c.qkv16);
  run_gpu(pr, c.shape.misalign, dev, &r_with16, nullptr, nullptr, false, false, c.type, &o16, /*o_too=*/false,
          c.qkv16);
  run_gpu(pr, c.shape.misalign, dev, &r_both, nullptr, nullptr, false, false, c.type, &o16_both, true, c.qkv16);
  if (HasFatalFailure()) return;
  EXPECT_TRUE(o16_both == o16) << "o16 written with o differs from o16 alone";
  const auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(r_both.o, r.o)) << "o written with o16 differs from the call without";
  EXPECT_TRUE(same(r_both.lse, r.lse)) << "the lse written with both outputs differs";
  const int64_t D = pr.D;
  std::vector<char> touched((size_t)(pr.T + kGuardRows), 0);
  for (int64_t n = 0; n < pr.N; ++n)
    for (int64_t l = 0; l < pr.L; ++l) touched[(size_t)pr.view.offset(n, l)] = 1;
  int64_t wrong = 0, o_written = 0, left = 0;
  for (int64_t row = 0; row < pr.T + kGuardRows; ++row)
    for (int64_t i = 0; i < D; ++i) {
      const size_t at = (size_t)(row * D + i);
      o_written += !is_poison(r_with16.o[at]);
      if (!touched[(size_t)row]) {
        left += o16[at] != 0xffffu;
        continue;
      }
      // The 16-bit value widened: bf16 is the high half of a float; fp16 through the host's conversion.
      const float got = c.type == Products::kBf16 ? from_bits((uint32_t)o16[at] << 16)
                                                   : (float)__half(__half_raw{o16[at]});
      wrong += bits(got) != bits(round16(r.o[at], c.type));
    }
  EXPECT_EQ(wrong, 0) << "elements of o16 that are not o rounded";
  EXPECT_EQ(o_written, 0) << "elements of o written where o16 alone was given";
  EXPECT_EQ(left, 0) << "elements of o16 written outside the view";
  cuda::FlashArgs a;
  a.pos = pr.view, a.D = (int)pr.D, a.heads = pr.heads, a.o16 = &wrong;  // (never written: refused first)
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
  a.o16 = nullptr, a.products = c.type;  // neither output
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
}

// Both types across the padded head dims (8 with one key and with many: the single-step scores),
// the 2-warp blocks of short sequences (L <= 32), one and several key tiles, the 4-byte copies
// (odd head dims, misaligned qkv), views that leave rows out. The 16-bit wgmma kernel's (head dims
// 17 to 32 and 65 to 128, L > 64): its two tiles (32: head dims 24, 32; 128: 96, 100, 128), a last
// key tile part full and full (L 130, 192, 200, 256), blocks that take several units in turn (2 x
// 32 sequences of 4 heads of 32: 512 units on two blocks an SM; 2 x 70 sequences of one head of
// 128: 280 units on one), misaligned qkv, a long sequence (L 1000); each also on the mma.sync kernel.
// The kQkv16 kernel's (head dims 24 to 128 a multiple of 8, L > 64, aligned), on q, k, v in 16
// bits: its three tiles (32: head dims 24, 32; 64: 40, 64; 128: 72, 96, 128), a query tile part
// full (L 65, 130, 150, 200), several heads, 140 blocks of one head and 2 x 32 x 4 heads, views
// that leave rows out (3 of 4 and 7 of 10 sequences), the column view, L 1000.
const Case kCases16[] = {{1, 3, 2, true, 2, 15, 0, 0},    {200, 8, 2, false, 1, 6, 0, 2},
                         {7, 16, 4, false, 3, 5, 0, 0},   {65, 40, 4, true, 2, 3, 0, 0},
                         {65, 16, 3, false, 1, 10, 7, 0}, {200, 24, 2, true, 1, 4, 3, 0},
                         {64, 64, 2, false, 2, 4, 0, 1},  {200, 96, 1, true, 1, 3, 0, 0},
                         {130, 128, 2, true, 1, 2, 0, 0}, {65, 160, 2, false, 1, 3, 0, 2},
                         {100, 256, 1, false, 1, 2, 0, 0}, {33, 32, 2, true, 2, 5, 0, 0},
                         {16, 24, 4, true, 2, 6, 0, 0},   {30, 32, 2, false, 2, 4, 0, 0},
                         {130, 64, 4, false, 8, 8, 0, 0}, {192, 64, 2, true, 1, 3, 0, 1},
                         {129, 50, 3, false, 1, 2, 0, 0}, {257, 100, 2, false, 2, 2, 3, 0},
                         {1000, 128, 1, false, 1, 1, 0, 0}, {256, 32, 4, true, 2, 32, 0, 0},
                         {130, 128, 1, false, 2, 70, 0, 0}, {130, 100, 2, false, 1, 3, 0, 1},
                         {150, 64, 2, false, 1, 10, 7, 0}, {300, 72, 1, true, 1, 2, 0, 0}};
// Dropout on the 16-bit kernels (the 16-bit training forward's): both passes, p 0.1 and 0.5, the
// wgmma kernel's two tiles (32: misaligned qkv; 128, 96 on it) and the mma.sync kernel's (each
// case also on mma.sync; head dims 64 and 16 there alone).
const std::pair<Case, DropoutSpec> kDropoutCases16[] = {
    {{130, 64, 2, false, 1, 3, 0, 1}, {0.5f, 42, 3, 0}},
    {{130, 32, 2, false, 1, 3, 0, 1}, {0.5f, 43, 4, 0}},
    {{300, 128, 1, true, 1, 3, 0, 0}, {0.1f, 7, 1000, 0}},
    {{200, 96, 1, true, 2, 2, 0, 0}, {0.5f, 0x8000000000000001ull, 9, (uint64_t{1} << 33) + 2}},
    {{97, 16, 4, true, 1, 5, 0, 0}, {0.5f, 0xfedcba9876543210ull, 0x0123456789abcdefull, 0}}};
std::vector<Case16> cases16() {
  std::vector<Case16> out;
  for (const Case& c : kCases16)
    for (Products t : {Products::kBf16, Products::kFp16}) {
      out.push_back({c, t});
      const int hdp = flash_padded_head_dim(c.hd);
      if (c.L > kFlashWgmmaMinLen && (hdp == 32 || hdp == 96 || hdp == 128))
        out.push_back({c, t, true});  // the other kernel
      if (qkv16_sizes(c)) out.push_back({c, t, false, {}, true});  // q, k, v stored in 16 bits
    }
#if !defined(FASTAXIAL_NO_RANDOM123)
  for (const auto& [c, s] : kDropoutCases16)
    for (Products t : {Products::kBf16, Products::kFp16}) {
      out.push_back({c, t, false, s});
      out.push_back({c, t, true, s});
    }
#endif
  return out;
}
INSTANTIATE_TEST_SUITE_P(Shapes, FlashAttention16, ::testing::ValuesIn(cases16()),
                         [](const auto& info) { return case16_name(info.param); });

// The kernel flash_attention picks (common/plan.h's flash_variant): wgmma for padded head dim 32
// and the wide wgmma kernel for 64, 96 and 128, past kFlashWgmmaMinLen on sm_90a code (in a build
// with it), unless the mma.sync kernel is asked for; the short kernel up to kFlashShortMaxLen.
// 16-bit products: unsplit and without split partials, where fp32 would take the short kernel, a
// wgmma one or a split; the 16-bit wgmma kernel for padded head dims 32, 96 and 128 past
// kFlashWgmmaMinLen on sm_90a where its shared memory fits, else the mma.sync kernel.
TEST(FlashAttentionRules, SixteenBitProductsUnsplitOnWgmma16OrMmaSync) {
  DeviceCaps dev;
  dev.sm90a = true, dev.sms = 132, dev.cc_major = 9, dev.smem_optin = 232448;
  struct Expect {
    FlashProblem f;
    FlashKernel kernel;
  };
  const Expect shapes[] = {{{1, 4096, 32, 1}, FlashKernel::kWgmma16},  // split in fp32; head dim 32
                           {{8, 3, 64, 2}, FlashKernel::kMmaSync},     // short in fp32
                           {{4, 300, 64, 4}, FlashKernel::kMmaSync},   // wide wgmma in fp32; no 64 tile
                           {{1, 4096, 128, 1}, FlashKernel::kWgmma16},  // split wide in fp32
                           {{2, 65, 33, 2}, FlashKernel::kMmaSync},    {{2, 65, 96, 2}, FlashKernel::kWgmma16},
                           {{2, 65, 65, 2}, FlashKernel::kWgmma16},
                           {{2, 64, 64, 2}, FlashKernel::kMmaSync},    // one key tile: L = kFlashWgmmaMinLen
                           {{2, 300, 17, 2}, FlashKernel::kWgmma16},   {{2, 300, 16, 2}, FlashKernel::kMmaSync},
                           {{2, 300, 129, 2}, FlashKernel::kMmaSync},
                           {{2, 300, 256, 2}, FlashKernel::kMmaSync}};
  for (const Expect& e : shapes) {
    FlashProblem f = e.f;
    f.partials_bytes = workspace_bytes(f, dev) + 1;
    for (Products t : {Products::kBf16, Products::kFp16}) {
      f.products = t;
      const FlashVariant v = flash_variant(f, dev);
      EXPECT_EQ(v.kernel, e.kernel) << f.len << " " << f.head_dim;
      EXPECT_EQ(v.splits, 1);
      EXPECT_EQ(workspace_bytes(f, dev), 0u);
      FlashProblem g = f;
      g.mma_sync = true;  // asked for
      EXPECT_EQ(flash_variant(g, dev).kernel, FlashKernel::kMmaSync);
      g = f, g.dropout = true;  // dropout: the same kernel
      EXPECT_EQ(flash_variant(g, dev).kernel, e.kernel);
      DeviceCaps other = dev;
      other.sm90a = false;  // no sm_90a code
      EXPECT_EQ(flash_variant(f, other).kernel, FlashKernel::kMmaSync);
      other = dev;
      other.smem_optin = (int)flash_wgmma16_smem_bytes(flash_padded_head_dim(f.head_dim)) - 1;  // too little
      if (e.kernel == FlashKernel::kWgmma16) EXPECT_EQ(flash_variant(f, other).kernel, FlashKernel::kMmaSync);
    }
  }
}

// q, k and v stored in 16 bits (FlashProblem::qkv16) run on the kQkv16 kernel, unsplit; a pass may
// store them so (flash_qkv16_can_run) with 16-bit products, head dims 24 to 128 a multiple of 8,
// L > kFlashWgmmaMinLen, no dropout, not mma_sync, sm_90a code and the tile's shared memory.
TEST(FlashAttentionRules, SixteenBitQkvOnItsKernelWhereItServes) {
  DeviceCaps dev;
  dev.sm90a = true, dev.sms = 132, dev.cc_major = 9, dev.smem_optin = 232448;
  struct Expect {
    FlashProblem f;
    bool serves;
  };
  const Expect shapes[] = {{{1, 4096, 128, 1}, true}, {{4, 300, 64, 4}, true},   {{2, 65, 40, 2}, true},
                           {{2, 65, 96, 2}, true},    {{2, 300, 72, 2}, true},   {{2, 300, 120, 2}, true},
                           {{2, 64, 64, 2}, false},   {{2, 300, 32, 2}, true},   {{2, 300, 65, 2}, false},
                           {{2, 300, 24, 2}, true},   {{2, 300, 16, 2}, false},  {{2, 300, 20, 2}, false},
                           {{2, 300, 100, 2}, false}, {{2, 300, 136, 2}, false}, {{1, 4096, 256, 1}, false}};
  for (const Expect& e : shapes)
    for (Products t : {Products::kBf16, Products::kFp16}) {
      FlashProblem f = e.f;
      f.products = t;
      EXPECT_EQ(flash_qkv16_can_run(f, dev), e.serves) << f.len << " " << f.head_dim;
      FlashProblem g = f;
      g.dropout = true;
      EXPECT_FALSE(flash_qkv16_can_run(g, dev));
      g = f, g.mma_sync = true;
      EXPECT_FALSE(flash_qkv16_can_run(g, dev));
      g = f, g.products = Products::kFp32;
      EXPECT_FALSE(flash_qkv16_can_run(g, dev));
      DeviceCaps other = dev;
      other.sm90a = false;
      EXPECT_FALSE(flash_qkv16_can_run(f, other));
      if (e.serves) {
        other = dev;
        other.smem_optin = (int)flash_qkv16_smem_bytes(flash_qkv16_tile_head_dim(f.head_dim)) - 1;
        EXPECT_FALSE(flash_qkv16_can_run(f, other));
        g = f, g.qkv16 = true;
        const FlashVariant v = flash_variant(g, dev);
        EXPECT_EQ(v.kernel, FlashKernel::kQkv16);
        EXPECT_EQ(v.splits, 1);
      }
    }
}

}  // namespace
}  // namespace fastaxial::test
