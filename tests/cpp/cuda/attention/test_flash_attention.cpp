// The staged path's flash attention kernel (src/cuda/attention/flash_attention.cu)
// on its own: o = softmax(q k^T / sqrt(hd)) v and the log-sum-exp of each
// query's scaled scores, per (sequence, head), against float64 on the host.
// Views as the row and column passes give them (strides in rows of the
// (T, 3D) qkv and (T, D) o matrices), sequence lengths across the kernel's
// query and key tile edges, head dims across its padded sizes, aligned and
// misaligned qkv (its 16-byte and 4-byte copies). Attention dropout: the
// reference applies dropout_keep's mask (src/common/dropout.h), so the
// kernel must draw exactly that mask, on both passes, at p = 0.1, 0.5 and 1,
// with 64-bit seeds and offsets and element indices past 2^32; lse the
// undropped softmax's (bitwise that of the kernel without dropout); two
// calls bitwise equal; threshold 0 bitwise the kernel without dropout.
// Split-KV (a partials buffer given, as the inference forward does): one
// or two long sequences, whose keys the launcher splits over several
// blocks and merges, against the same float64 reference, bitwise
// repeatable.
// Every case that another kernel takes (on an sm_90a device the wgmma ones:
// head dims 17 to 32, and 49 to 128 on the wide kernel, L > 64; anywhere the
// short-sequence one: L <= 4) runs twice, on it and on the mma.sync kernel,
// each against the reference; the dropout and split cases it takes draw
// their mask or split their keys there.
// Skipped without a device, but for the host-side rules.
#include "util/attention_dropout_util.h"  // first: whether dropout.h may include Random123

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "src/common/axis.h"
#include "src/common/plan.h"
#include "src/common/smem_layout.h"
#include "src/cuda/attention/flash_attention.h"
#include "src/cuda/gemm/gemm.h"  // gemm_tf32x3_can_run: whether the build has sm_90a code
#include "util/cuda_test_util.h"
#include "util/flash_attention_test_util.h"

namespace fastaxial::test {
namespace {

// r against float64 on the host, mask (where given) the multipliers of
// (sequence n, head h): mask(n, h)[i L + j], 0 or the dropout scale.
template <class Mask>
void expect_matches_reference(const Problem& pr, const Result& r, Mask mask) {
  // Every valid element against float64, beside the same formula in plain
  // fp32 on the host: the kernel's error may be at most twice the fp32
  // evaluation's, plus a floor for what 3xTF32 adds where fp32 happens to be
  // exact (L = 1: o = v). The tensor core reads 10 of lo's 13 bits, so a
  // product is off by up to 2^-21 relative: o (a convex combination of v) by
  // up to 2^-21 max|v|, a score by 2^-21 sum_i |q_i k_i|; the floor is about
  // twice that. Plain TF32 anywhere would be ~1e-3 off. With dropout, o is
  // sum_k p_k m_k v_k / sum_k p_k, m the multipliers; lse is the undropped
  // softmax's.
  const int64_t D = pr.D, T = pr.T, N = pr.N, L = pr.L, hd = pr.hd;
  const AxisView& view = pr.view;
  const std::vector<float>& qkv = pr.qkv;
  const double scale = 1.0 / std::sqrt((double)hd);
  const float scale32 = 1.0f / std::sqrt((float)hd);
  double worst_o = 0.0, worst_o32 = 0.0, worst_lse = 0.0, worst_lse32 = 0.0, vmax = 0.0, mag_max = 0.0;
  int64_t lo_too_large = 0;
  std::vector<char> touched((size_t)(T + kGuardRows), 0);
  std::vector<double> kd((size_t)(L * hd)), vd((size_t)(L * hd)), s64((size_t)L), o64((size_t)hd);
  std::vector<float> kf((size_t)(L * hd)), vf((size_t)(L * hd)), s32((size_t)L), o32((size_t)hd);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < pr.heads; ++h) {
      // The multipliers, empty where there is no dropout.
      const std::vector<float> m = mask(n, h);
      const auto row = [&](int64_t l) { return view.offset(n, l); };  // in rows
      for (int64_t l = 0; l < L; ++l) {
        const float* r_ = qkv.data() + row(l) * 3 * D + h * hd;
        for (int64_t i = 0; i < hd; ++i) {
          kf[l * hd + i] = r_[D + i], vf[l * hd + i] = r_[2 * D + i];
          kd[l * hd + i] = r_[D + i], vd[l * hd + i] = r_[2 * D + i];
          vmax = std::max(vmax, std::fabs((double)r_[2 * D + i]));
        }
      }
      for (int64_t l = 0; l < L; ++l) {
        const int64_t orow = row(l);
        touched[(size_t)orow] = 1;
        const float* q = qkv.data() + orow * 3 * D + h * hd;
        double m64 = -std::numeric_limits<double>::infinity(), mag = 0.0;
        float m32 = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < L; ++k) {
          double s = 0.0, a_ = 0.0;
          float sf = 0.0f;
          for (int64_t i = 0; i < hd; ++i) {
            const double t = (double)q[i] * kd[k * hd + i];
            s += t, a_ += std::fabs(t);
            sf += q[i] * kf[k * hd + i];
          }
          s64[k] = s * scale, s32[k] = sf * scale32;
          m64 = std::max(m64, s64[k]), m32 = std::max(m32, s32[k]);
          mag = std::max(mag, a_ * scale);
        }
        mag_max = std::max(mag_max, mag);
        double sum64 = 0.0;
        float sum32 = 0.0f;
        std::fill(o64.begin(), o64.end(), 0.0);
        std::fill(o32.begin(), o32.end(), 0.0f);
        for (int64_t k = 0; k < L; ++k) {
          double p64 = std::exp(s64[k] - m64);
          float p32 = std::exp(s32[k] - m32);
          sum64 += p64, sum32 += p32;
          if (!m.empty()) p64 *= m[(size_t)(l * L + k)], p32 *= m[(size_t)(l * L + k)];
          for (int64_t i = 0; i < hd; ++i) o64[i] += p64 * vd[k * hd + i], o32[i] += p32 * vf[k * hd + i];
        }
        const float* got = r.o.data() + orow * D + h * hd;
        for (int64_t i = 0; i < hd; ++i) {
          const double ref = o64[i] / sum64;
          worst_o = worst_abs(worst_o, got[i], ref);
          worst_o32 = worst_abs(worst_o32, o32[i] / sum32, ref);
        }
        // lse2 (log2 units) = hi + lo (detail/lse.cuh), lo within half an ulp of hi.
        const double lse64 = (m64 + std::log(sum64)) / std::log(2.0);
        const size_t at = (size_t)((n * pr.heads + h) * L + l), rows = (size_t)(N * pr.heads * L);
        const float hi = r.lse[at], lo = r.lse[rows + at];
        worst_lse = worst_abs(worst_lse, (double)hi + (double)lo, lse64);
        worst_lse32 = worst_abs(worst_lse32, (m32 + std::log(sum32)) / std::log(2.0f), lse64);
        const double half_ulp = 0.5 * ((double)std::nextafter(std::fabs(hi), INFINITY) - std::fabs(hi));
        if (!(std::fabs((double)lo) <= half_ulp)) ++lo_too_large;
      }
    }
  const double bound_o = 2.0 * worst_o32 + 1e-6 * vmax;
  const double bound_lse = 2.0 * worst_lse32 + 1e-6 * (1.0 + mag_max) / std::log(2.0);  // log2 units
  EXPECT_LE(worst_o, bound_o) << "o: fp32 host error " << worst_o32 << ", max |v| " << vmax;
  EXPECT_LE(worst_lse, bound_lse) << "lse: fp32 host error " << worst_lse32 << ", max scaled sum |q k| " << mag_max;
  EXPECT_EQ(lo_too_large, 0) << "lse rows whose lo is not within half an ulp of hi";

  // Rows the view does not address (and the guard rows past T) untouched;
  // lse past (N, heads, L) untouched.
  int64_t written = 0;
  for (int64_t r_ = 0; r_ < T + kGuardRows; ++r_) {
    if (touched[(size_t)r_]) continue;
    for (int64_t i = 0; i < D; ++i) written += !is_poison(r.o[(size_t)(r_ * D + i)]);
  }
  EXPECT_EQ(written, 0) << "elements of rows outside the view written";
  int64_t lse_written = 0;
  for (size_t i = (size_t)(2 * N * pr.heads * L); i < r.lse.size(); ++i) lse_written += !is_poison(r.lse[i]);
  EXPECT_EQ(lse_written, 0) << "lse written past (2, num_seq, heads, L)";
}

// Whether flash_attention runs pr's pass on another kernel than the mma.sync one on dev (a
// wgmma kernel, or the short-sequence one), which FlashArgs::mma_sync overrides.
bool takes_other_kernel(const Problem& pr, const DeviceCaps& dev) {
  cuda::FlashArgs a;
  a.pos = pr.view, a.D = (int)pr.D, a.heads = pr.heads;
  return cuda::flash_attention_variant(a, dev).kernel != FlashKernel::kMmaSync;
}

class FlashAttention : public ::testing::TestWithParam<Case> {};

TEST_P(FlashAttention, MatchesDoubleReference) {
  const Case c = GetParam();
  DeviceCaps dev;
  std::string why;
  if (!device_for(c.hd, &dev, &why)) GTEST_SKIP() << why;
  ASSERT_TRUE(can_run(FlashProblem{1, c.L, c.hd, 1}, dev));
  const Problem pr = make_problem(c);
  ASSERT_EQ(pr.view.len, c.L);
  ASSERT_LE(pr.view.num_seq, (c.col ? col_view(pr.p) : row_view(pr.p)).num_seq);
  Result r;
  run_gpu(pr, c.misalign, dev, &r);
  if (HasFatalFailure()) return;
  const auto no_mask = [](int64_t, int64_t) { return std::vector<float>(); };
  expect_matches_reference(pr, r, no_mask);
  if (takes_other_kernel(pr, dev)) {  // the mma.sync kernel as well
    Result m;
    run_gpu(pr, c.misalign, dev, &m, nullptr, nullptr, false, true);
    if (HasFatalFailure()) return;
    expect_matches_reference(pr, m, no_mask);
  }
}

// L across the 64-query tiles, the 16- and 32-query blocks of short
// sequences (L <= 16, L <= 32) and the key tiles (64 keys up to head_dim
// 64, 32 up to 128, 16 beyond, at most a block's queries; one buffer where
// L is a single tile); head_dim across the padded sizes (8, 16, 32, 48,
// 64, 96, 128, 192, 256), odd ones on the 4-byte copies, aligned ones too
// where qkv is misaligned; up to a few hundred sequences; some views that
// leave sequences out, so that stray writes land in rows that must stay
// poison. The float64 reference costs about N heads L^2 hd: these stay
// within a few seconds of host time.
INSTANTIATE_TEST_SUITE_P(
    Shapes, FlashAttention,
    ::testing::Values(Case{1, 3, 2, true, 2, 150, 0, 0}, Case{7, 1, 4, false, 3, 50, 0, 0},
                      Case{64, 8, 4, true, 2, 40, 0, 0}, Case{65, 16, 3, false, 1, 100, 97, 0},
                      Case{200, 24, 2, true, 1, 20, 13, 0}, Case{1024, 32, 1, false, 2, 1, 0, 0},
                      Case{2051, 64, 1, true, 1, 2, 1, 0}, Case{65, 40, 4, true, 2, 16, 0, 0},
                      Case{200, 48, 3, false, 2, 8, 0, 0}, Case{64, 64, 2, false, 4, 16, 0, 1},
                      Case{7, 80, 4, true, 5, 40, 0, 0}, Case{200, 96, 1, true, 1, 10, 0, 0},
                      Case{1024, 128, 2, true, 1, 1, 0, 0}, Case{65, 160, 2, false, 1, 30, 0, 2},
                      Case{1024, 256, 1, false, 1, 1, 0, 0}, Case{1, 256, 4, false, 2, 100, 0, 0}, Case{1, 128, 1, true, 4, 1024, 1000, 0},
                      Case{2, 128, 1, true, 2, 300, 0, 0}, Case{16, 64, 4, false, 2, 30, 50, 0},
                      Case{12, 3, 2, true, 1, 9, 0, 2}, Case{3, 3, 2, true, 1, 9, 0, 2}, Case{4, 96, 2, false, 3, 40, 0, 0}, Case{16, 256, 2, false, 1, 4, 0, 0}, Case{17, 128, 2, true, 2, 20, 0, 0},
                      Case{2051, 3, 4, true, 1, 2, 0, 0}, Case{200, 128, 4, false, 1, 4, 3, 0},
                      Case{1024, 16, 4, false, 1, 3, 0, 0}, Case{7, 256, 1, true, 3, 5, 0, 1},
                      Case{64, 1, 1, true, 2, 100, 0, 0}, Case{200, 8, 2, false, 1, 6, 0, 2},
                      Case{1024, 48, 2, true, 1, 1, 0, 3}, Case{65, 80, 3, false, 2, 5, 0, 0},
                      Case{200, 160, 1, true, 2, 3, 0, 0}, Case{64, 24, 4, true, 1, 8, 0, 0},
                      Case{7, 40, 1, false, 10, 30, 0, 0}, Case{200, 1, 3, true, 1, 12, 0, 0},
                      Case{65, 256, 2, true, 1, 6, 5, 0}, Case{200, 64, 4, false, 2, 4, 0, 0},
                      Case{32, 128, 3, false, 4, 32, 0, 0}, Case{48, 40, 4, true, 4, 48, 0, 0},
                      Case{45, 96, 2, false, 2, 7, 0, 1}, Case{30, 256, 1, true, 1, 5, 2, 0},
                      Case{17, 24, 2, false, 3, 4, 0, 0}, Case{33, 128, 1, true, 2, 3, 0, 0},
                      Case{24, 192, 2, false, 2, 3, 0, 1}, Case{29, 64, 2, true, 2, 5, 3, 0},
                      Case{21, 16, 3, false, 2, 4, 0, 2},
                      // One warp a block (L <= 16: 16-key tiles) and two (L <= 32: 32-key tiles, one stage).
                      Case{16, 24, 4, true, 4, 16, 0, 0}, Case{32, 32, 2, false, 2, 9, 0, 0}, Case{9, 64, 2, true, 3, 7, 0, 1},
                      // The wgmma kernel (head dims 17..32, L > 64) and its edges (L = 33 and 64, head
                      // dims 9..16 stay on mma.sync): two key tiles and more, partial query and key
                      // tiles, odd head dims on the 4-byte copies, misaligned qkv, a sequence of
                      // 4096; more units than an H200's 132 blocks, so that blocks take several
                      // units in turn (640 and 320 units).
                      Case{100, 32, 4, false, 4, 40, 0, 0}, Case{100, 20, 4, true, 2, 40, 0, 1},
                      Case{33, 32, 2, true, 2, 9, 0, 0}, Case{64, 16, 4, false, 3, 7, 0, 0},
                      Case{65, 32, 1, false, 1, 9, 4, 0}, Case{127, 20, 2, true, 2, 3, 0, 0},
                      Case{128, 32, 4, false, 2, 5, 0, 1}, Case{129, 9, 3, true, 1, 4, 0, 0},
                      Case{256, 32, 4, true, 1, 6, 0, 0}, Case{300, 17, 2, false, 1, 3, 0, 3},
                      Case{4096, 32, 1, false, 1, 1, 0, 0}, Case{1000, 12, 2, true, 1, 2, 1, 0}),
    [](const auto& info) { return case_name(info.param); });

TEST(FlashAttentionRules, KernelVariant) {
  DeviceCaps h = h200();
  const bool sm90a_build = cuda::gemm_tf32x3_can_run(h);  // a build without sm_90a code never takes wgmma
  const FlashKernel wgmma = sm90a_build ? FlashKernel::kWgmma : FlashKernel::kMmaSync;
  const FlashKernel wide = sm90a_build ? FlashKernel::kWgmmaWide : FlashKernel::kMmaSync;
  cuda::FlashArgs a;
  a.pos = {2, 65, 1, 65, 1, 130};
  a.heads = 4;
  const auto kernel = [&](int hd) {
    a.D = 4 * hd;
    return cuda::flash_attention_variant(a, h).kernel;
  };
  for (int hd : {17, 24, 32}) EXPECT_EQ(kernel(hd), wgmma) << hd;
  for (int hd : {49, 64, 65, 80, 96, 100, 128}) EXPECT_EQ(kernel(hd), wide) << hd;
  for (int hd : {1, 8, 9, 16, 33, 48, 129, 192, 256}) EXPECT_EQ(kernel(hd), FlashKernel::kMmaSync) << hd;
  a.pos.len = kFlashWgmmaMinLen;
  EXPECT_EQ(kernel(32), FlashKernel::kMmaSync);
  EXPECT_EQ(kernel(128), FlashKernel::kMmaSync);
  a.pos.len = 33;
  EXPECT_EQ(kernel(32), FlashKernel::kMmaSync);
  a.pos.len = kFlashShortMaxLen;
  EXPECT_EQ(kernel(32), FlashKernel::kShort);
  EXPECT_EQ(kernel(256), FlashKernel::kShort);
  a.mma_sync = true;
  EXPECT_EQ(kernel(32), FlashKernel::kMmaSync);
  a.pos.len = 4096;
  EXPECT_EQ(kernel(32), FlashKernel::kMmaSync);
  EXPECT_EQ(kernel(128), FlashKernel::kMmaSync);
  a.mma_sync = false;
  EXPECT_EQ(kernel(32), wgmma);
  EXPECT_EQ(kernel(128), wide);
  a.D = 4 * 32;
  EXPECT_EQ(cuda::flash_wgmma_chosen(a, h), sm90a_build);
  h.sm90a = false;  // another GPU, or a build without sm_90a
  EXPECT_EQ(kernel(32), FlashKernel::kMmaSync);
  EXPECT_EQ(kernel(128), FlashKernel::kMmaSync);
}

// Split-KV where partials of the rule's size are given and dropout is off: the mma.sync kernel
// at head dim 32 (not the wgmma one), the wide kernel at 64 to 128 with its own splits.
TEST(FlashAttentionRules, SplitKernelVariant) {
  const DeviceCaps h = h200();
  const bool sm90a_build = cuda::gemm_tf32x3_can_run(h);
  cuda::FlashArgs a;
  a.pos = {1, 4096, 1, 4096, 1, 4096};
  a.heads = 1;
  float room;  // never written: nothing launches
  a.partials = &room;
  const auto variant = [&](int hd, size_t bytes) {
    a.D = hd, a.partials_bytes = bytes;
    return cuda::flash_attention_variant(a, h);
  };
  const size_t bytes32 = flash_partials_bytes(1, 4096, 32, 1, h.sms);
  const size_t bytes128 = flash_partials_bytes(1, 4096, 128, 1, h.sms);
  EXPECT_EQ(variant(32, bytes32).kernel, FlashKernel::kMmaSync);
  EXPECT_EQ(variant(32, bytes32).splits, 6);
  EXPECT_EQ(variant(32, bytes32 - 1).splits, 1) << "too little room: no split";
  EXPECT_EQ(variant(128, bytes128).kernel, sm90a_build ? FlashKernel::kWgmmaWide : FlashKernel::kMmaSync);
  EXPECT_EQ(variant(128, bytes128).splits, 4);
  a.dropout.threshold = dropout_threshold(0.5f);
  EXPECT_EQ(variant(32, bytes32).splits, 1) << "the split kernels have no dropout";
  a.dropout.threshold = 0, a.partials = nullptr;
  EXPECT_EQ(variant(32, bytes32).splits, 1) << "no partials";

  // The wide kernel's splits: one sequence of 4096 is 32 tiles of 128 queries, so 4 splits fill
  // 132 SMs; never more than the rule's.
  EXPECT_EQ(flash_wgmma_wide_splits(1, 4096, 1, 4, 132), 4);
  EXPECT_EQ(flash_wgmma_wide_splits(1, 4096, 1, 16, 132), 4);
  EXPECT_EQ(flash_wgmma_wide_splits(1, 4096, 1, 3, 132), 3);
  EXPECT_EQ(flash_wgmma_wide_splits(1, 4096, 1, 1, 132), 1);
  EXPECT_EQ(flash_wgmma_wide_splits(1, 2048, 2, 8, 132), 4);  // 32 tiles
  EXPECT_EQ(flash_wgmma_wide_splits(8, 1024, 2, 2, 132), 1);  // 128 tiles: one round already
}

// ---- split-KV ------------------------------------------------------------------------------------

class FlashAttentionSplit : public ::testing::TestWithParam<Case> {};

// With a partials buffer: the float64 reference as above, rows outside the
// view untouched, two calls bitwise equal; from L = 1030 the keys are split
// (on an H200 and on this device), below 1024 keys a buffer given changes nothing.
TEST_P(FlashAttentionSplit, MatchesDoubleReference) {
  const Case c = GetParam();
  const Problem pr = make_problem(c);
  const size_t h200_bytes = workspace_bytes(FlashProblem{pr.N, pr.L, pr.hd, pr.heads}, h200());
  if (c.L >= 1030) EXPECT_GT(h200_bytes, 0u) << "no split on an H200";
  DeviceCaps dev;
  std::string why;
  if (!device_for(c.hd, &dev, &why)) GTEST_SKIP() << why;
  const size_t bytes = workspace_bytes(FlashProblem{pr.N, pr.L, pr.hd, pr.heads}, dev);
  if (c.L >= 1030 && dev.sms >= 100) EXPECT_GT(bytes, 0u) << "no split on this device (" << dev.sms << " SMs)";
  Result r, again;
  run_gpu(pr, c.misalign, dev, &r, nullptr, nullptr, true);
  if (HasFatalFailure()) return;
  expect_matches_reference(pr, r, [](int64_t, int64_t) { return std::vector<float>(); });
  run_gpu(pr, c.misalign, dev, &again, nullptr, nullptr, true);
  if (HasFatalFailure()) return;
  EXPECT_EQ(rows_differing(pr, r, again), 0);
  EXPECT_EQ(std::memcmp(r.lse.data(), again.lse.data(), r.lse.size() * sizeof(float)), 0);
}

// One sequence and head (the row pass of (1, 1, L, hd, 1)) across the tile
// edges and the padded head dims, then two heads, a column view that leaves
// a sequence out and misaligned qkv (4-byte copies), and two sequences. The
// float64 reference of L = 4096 is the slow part (L^2 hd).
INSTANTIATE_TEST_SUITE_P(
    Shapes, FlashAttentionSplit,
    ::testing::Values(Case{1, 8, 1, false, 1, 1, 0, 0}, Case{63, 32, 1, false, 1, 1, 0, 0},
                      Case{64, 256, 1, false, 1, 1, 0, 0}, Case{65, 24, 1, false, 1, 1, 0, 0},
                      Case{65, 128, 1, false, 1, 1, 0, 0}, Case{1030, 8, 1, false, 1, 1, 0, 0},
                      Case{1030, 24, 1, false, 1, 1, 0, 0}, Case{1030, 64, 1, false, 1, 1, 0, 0},
                      Case{1030, 128, 1, false, 1, 1, 0, 0}, Case{1030, 256, 1, false, 1, 1, 0, 0},
                      Case{2051, 32, 1, false, 1, 1, 0, 0}, Case{2051, 64, 1, false, 1, 1, 0, 0},
                      Case{2051, 256, 1, false, 1, 1, 0, 0}, Case{4096, 32, 1, false, 1, 1, 0, 0},
                      Case{4096, 128, 1, false, 1, 1, 0, 0}, Case{1030, 40, 2, true, 1, 2, 1, 1},
                      Case{2051, 96, 1, false, 1, 1, 0, 0}, Case{1030, 80, 2, true, 1, 2, 1, 1},
                      Case{1030, 100, 1, false, 1, 1, 0, 3}, Case{3000, 64, 2, true, 1, 1, 0, 0},
                      Case{2051, 3, 2, false, 2, 1, 0, 0}, Case{1030, 96, 2, true, 1, 3, 0, 2}),
    [](const auto& info) { return case_name(info.param); });

// The split rule's blocks an SM (smem_layout.h's flash_split_blocks_per_sm) are those of this
// build on a Hopper GPU (sm_90a code, 64K registers and 228 KB of shared memory an SM, as the
// H200 the table was read for): were the kernels' registers to change, the rule would pick its
// splits from wrong rounds.
TEST(FlashAttentionSplit, BlocksAnSmAsTheRuleCounts) {
  DeviceCaps dev;
  std::string why;
  if (!device_for(8, &dev, &why)) GTEST_SKIP() << why;
  if (!dev.sm90a) GTEST_SKIP() << "the table is for sm_90a code on a compute-capability 9.0 GPU";
  for (int hd : {8, 16, 32, 48, 64, 96, 128, 192, 256})
    EXPECT_EQ(cuda::flash_split_occupancy(hd, dev), flash_split_blocks_per_sm(flash_padded_head_dim(hd)))
        << "head_dim " << hd;
}

// The split rule (smem_layout.h's flash_kv_splits) on an H200, without a device.
TEST(FlashAttentionRules, SplitRule) {
  const DeviceCaps h = h200();
  // (1, 1, 4096, 32, 1)'s row pass: 64 query tiles, 64 key tiles, 3 blocks an SM -> 6 splits,
  // 384 blocks: one round of 396 with 10 or 11 key tiles a block.
  EXPECT_EQ(flash_kv_splits(1, 4096, 32, 1, h.sms), 6);
  EXPECT_EQ(workspace_bytes(FlashProblem{1, 4096, 32, 1}, h), 6u * 4096u * 34u * 4u);
  // Two blocks an SM at head dims 64 and 128: 4 splits (256 blocks, one round), where 5 took
  // two rounds (measured slower than 3 and 8: docs/perf-notes.md, v45).
  EXPECT_EQ(flash_kv_splits(1, 4096, 64, 1, h.sms), 4);
  EXPECT_EQ(flash_kv_splits(1, 4096, 128, 1, h.sms), 4);
  EXPECT_EQ(flash_kv_splits(1, 4096, 16, 1, h.sms), 8);  // four blocks an SM: 512 blocks
  EXPECT_EQ(flash_kv_splits(1, 8192, 32, 1, h.sms), 3);  // 128 query tiles: 384 blocks
  EXPECT_EQ(flash_kv_splits(4, 4096, 32, 1, h.sms), 1);  // 256 blocks: a second round costs more than S = 2 saves
  // 16 query tiles: each split keeps two of the 16 key tiles (64 keys) at head dim 32; at head
  // dim 256 (64 key tiles of 16, one block an SM) 8 splits fill one round; none below 1024 keys.
  EXPECT_EQ(flash_kv_splits(1, 1024, 32, 1, h.sms), 8);
  EXPECT_EQ(flash_kv_splits(1, 1024, 256, 1, h.sms), 8);
  EXPECT_EQ(flash_kv_splits(1, 1023, 256, 1, h.sms), 1);
  EXPECT_EQ(flash_kv_splits(2, 2051, 64, 1, h.sms), 4);  // 66 blocks
  EXPECT_EQ(flash_kv_splits(1, 65536, 8, 1, h.sms), 1);  // 1024 query tiles fill the device
  EXPECT_EQ(flash_kv_splits(4096, 1, 32, 1, h.sms), 1);
  EXPECT_EQ(flash_kv_splits(1, 1 << 30, 32, 1, h.sms), 1);
  EXPECT_EQ(workspace_bytes(FlashProblem{264, 4096, 32, 1}, h), 0u);
  EXPECT_EQ(workspace_bytes(FlashProblem{1, 4096, 32, 1}, DeviceCaps{}), 0u);  // sms unknown
  // Within the bounds the launcher relies on: at most 16 splits, fewer than 4 sms blocks.
  for (int64_t n : {1, 2, 7, 100})
    for (int64_t len : {1, 64, 65, 1000, 4096, 20000})
      for (int64_t hd : {1, 32, 64, 65, 128, 200, 256})
        for (int64_t heads : {1, 3}) {
          const int s = flash_kv_splits(n, len, hd, heads, h.sms);
          const int64_t q_tiles = (len + 63) / 64, bn = hd <= 64 ? 64 : hd <= 128 ? 32 : 16;
          EXPECT_GE(s, 1);
          EXPECT_LE(s, 16);
          if (s > 1) {
            EXPECT_LT(n * heads * q_tiles * s, 4 * h.sms);
            EXPECT_GE((len + bn - 1) / bn, 2 * s);
            EXPECT_GE(len, 1024);
          }
          EXPECT_EQ(workspace_bytes(FlashProblem{n, len, hd, (int)heads}, h) > 0, s > 1);
        }
}

#if !defined(FASTAXIAL_NO_RANDOM123)

// ---- attention dropout ---------------------------------------------------------------------------

struct DropoutCase {
  Case c;
  DropoutSpec s;
};

void PrintTo(const DropoutCase& dc, std::ostream* os) { *os << case_name(dc.c) << "_" << dropout_name(dc.s); }

class FlashAttentionDropout : public ::testing::TestWithParam<DropoutCase> {};

// The mask of the case's pass, drawn from seed and offset in device memory
// (the struct's own seed and offset are other values), against the float64
// reference with dropout_keep's mask; lse bitwise that of the kernel
// without dropout; a second call bitwise equal.
TEST_P(FlashAttentionDropout, MatchesDoubleReference) {
  const DropoutCase dc = GetParam();
  const Case& c = dc.c;
  DeviceCaps dev;
  std::string why;
  if (!device_for(c.hd, &dev, &why)) GTEST_SKIP() << why;
  const Problem pr = make_problem(c);
  const DropoutParams d = dropout_params(pr.p, dc.s, pr.pass);
  ASSERT_NE(d.threshold, 0u);
  const DropoutParams given = kernel_dropout(d);
  const uint64_t pair[2] = {d.seed, d.offset};
  Result r, again, plain;
  run_gpu(pr, c.misalign, dev, &r, &given, pair);
  if (HasFatalFailure()) return;
  expect_matches_reference(pr, r, [&](int64_t n, int64_t h) { return dropout_multipliers(d, pr.pass, n, h, pr.L); });

  run_gpu(pr, c.misalign, dev, &plain);
  if (HasFatalFailure()) return;
  const size_t lse_n = (size_t)(2 * pr.N * pr.heads * pr.L);  // hi, lo
  EXPECT_EQ(std::memcmp(r.lse.data(), plain.lse.data(), lse_n * sizeof(float)), 0) << "lse changed by dropout";
  EXPECT_GT(rows_differing(pr, r, plain), 0) << "dropout changed no output row";

  run_gpu(pr, c.misalign, dev, &again, &given, pair);
  if (HasFatalFailure()) return;
  EXPECT_EQ(rows_differing(pr, r, again), 0) << "rows differ between two calls";
  EXPECT_EQ(std::memcmp(r.lse.data(), again.lse.data(), lse_n * sizeof(float)), 0) << "lse differs between two calls";

  if (takes_other_kernel(pr, dev)) {  // the mma.sync kernel draws the same mask
    Result m;
    run_gpu(pr, c.misalign, dev, &m, &given, pair, false, true);
    if (HasFatalFailure()) return;
    expect_matches_reference(pr, m, [&](int64_t n, int64_t h) { return dropout_multipliers(d, pr.pass, n, h, pr.L); });
  }
}

// Both passes (the column view's mask has base[1] = the row pass's element
// count, and here H != W); p = 0.1, 0.5 and 1; L across multiples of 4 and
// not (runs of four elements that start inside a Philox block: two draws a
// lane), across the query and key tiles; head dims across the padded
// sizes (8 .. 256), odd ones and misaligned qkv on the 4-byte copies; a
// 64-bit seed and offset; bases that put element indices past 2^32 (and
// off multiples of 4); a view that leaves sequences out.
const DropoutCase kDropoutCases[] = {
    {Case{7, 8, 3, false, 2, 5, 0, 0}, DropoutSpec{0.5f, 1, 0, 0}},
    {Case{65, 24, 2, true, 2, 9, 0, 0}, DropoutSpec{0.1f, 0x1234, 7, 0}},
    {Case{130, 64, 2, false, 1, 3, 0, 1}, DropoutSpec{0.5f, 42, 3, 0}},
    {Case{300, 128, 1, true, 1, 3, 0, 0}, DropoutSpec{0.1f, 7, 1000, 0}},
    {Case{50, 32, 2, false, 2, 3, 0, 0}, DropoutSpec{1.0f, 5, 5, 0}},
    {Case{97, 16, 4, true, 1, 5, 0, 0}, DropoutSpec{0.5f, 0xfedcba9876543210ull, 0x0123456789abcdefull, 0}},
    {Case{70, 8, 2, false, 2, 2, 0, 0}, DropoutSpec{0.5f, 99, 1, (uint64_t{1} << 32) - 5003}},
    {Case{64, 256, 2, true, 1, 4, 0, 0}, DropoutSpec{0.5f, 3, 0, 0}},
    {Case{33, 3, 2, false, 1, 4, 0, 2}, DropoutSpec{0.1f, 11, 2, 0}},
    {Case{200, 96, 1, true, 2, 2, 0, 0}, DropoutSpec{0.5f, 0x8000000000000001ull, 9, (uint64_t{1} << 33) + 2}},
    {Case{129, 48, 3, false, 1, 2, 1, 0}, DropoutSpec{0.1f, 13, 0xffffffff00000000ull, 0}},
    {Case{40, 192, 1, false, 1, 3, 0, 0}, DropoutSpec{0.5f, 17, 4, 0}},
    {Case{256, 64, 2, true, 1, 2, 0, 0}, DropoutSpec{1.0f, 1, 2, 0}},
    {Case{1, 40, 2, true, 2, 7, 0, 1}, DropoutSpec{0.5f, 23, 0, 1}},
    {Case{1, 64, 3, false, 3, 200, 0, 0}, DropoutSpec{0.5f, 41, 8, 0}},
    {Case{5, 96, 2, false, 2, 40, 0, 0}, DropoutSpec{0.5f, 77, 3, 0}},
    {Case{16, 24, 4, true, 2, 8, 0, 0}, DropoutSpec{0.1f, 31, 4, 0}},
    {Case{30, 32, 2, false, 2, 5, 0, 0}, DropoutSpec{0.5f, 19, 6, 0}},
    {Case{4, 24, 3, true, 2, 30, 0, 0}, DropoutSpec{0.5f, 55, 2, 0}},
    {Case{16, 32, 1, true, 3, 10, 0, 1}, DropoutSpec{0.1f, 91, 0, 0}},
    {Case{32, 128, 2, false, 1, 3, 0, 0}, DropoutSpec{0.5f, 31, 6, 0}},
    {Case{48, 48, 2, true, 1, 4, 0, 0}, DropoutSpec{0.1f, 5, 2, 0}},
    {Case{27, 256, 1, true, 1, 3, 0, 0}, DropoutSpec{0.5f, 8, 3, 0}},
    {Case{300, 32, 2, false, 1, 3, 0, 0}, DropoutSpec{0.1f, 19, 5, 0}},
    {Case{129, 20, 2, true, 2, 3, 0, 1}, DropoutSpec{0.5f, 29, 1, (uint64_t{1} << 32) - 7}},
    {Case{130, 24, 4, false, 2, 40, 0, 0}, DropoutSpec{0.1f, 37, 3, 0}},  // 160 units
};

INSTANTIATE_TEST_SUITE_P(Shapes, FlashAttentionDropout, ::testing::ValuesIn(kDropoutCases),
                         [](const auto& info) { return case_name(info.param.c) + "_" + dropout_name(info.param.s); });

// threshold 0 is no dropout, bitwise, whatever else the dropout fields hold
// (a seed, a pass, philox given or not).
TEST(FlashAttentionDropoutOff, ThresholdZeroBitwiseNoDropout) {
  for (const Case& c : {Case{65, 24, 2, true, 2, 9, 0, 0}, Case{130, 64, 2, false, 1, 3, 0, 1}}) {
    DeviceCaps dev;
    std::string why;
    if (!device_for(c.hd, &dev, &why)) GTEST_SKIP() << why;
    const Problem pr = make_problem(c);
    DropoutParams d = dropout_params(pr.p, DropoutSpec{0.5f, 77, 88, 0}, pr.pass);  // a mask, switched off
    d.threshold = 0;
    const uint64_t pair[2] = {77, 88};
    Result plain, off, off_philox;
    run_gpu(pr, c.misalign, dev, &plain);
    if (HasFatalFailure()) return;
    run_gpu(pr, c.misalign, dev, &off, &d);
    if (HasFatalFailure()) return;
    run_gpu(pr, c.misalign, dev, &off_philox, &d, pair);
    if (HasFatalFailure()) return;
    for (const Result* r : {&off, &off_philox}) {
      EXPECT_EQ(rows_differing(pr, plain, *r), 0) << case_name(c);
      EXPECT_EQ(std::memcmp(plain.lse.data(), r->lse.data(), plain.lse.size() * sizeof(float)), 0) << case_name(c);
    }
  }
}

// The quad's sharing of draws in the kernel's score tiles (rows queries,
// columns keys; dropout.h's dropout_run_rows, dropout_share16<1>,
// dropout_bit_rows), replayed on the host: every lane's four bits are
// dropout_keep's, for runs inside and across Philox blocks and indices
// past 2^32. Without a device.
TEST(FlashAttentionRules, DropoutTilesDrawTheMask) {
  DropoutParams d;
  d.seed = 0x0123456789abcdefull, d.offset = 0xfedcba9876543210ull;
  d.threshold = dropout_threshold(0.5f), d.scale = dropout_scale(0.5f);
  for (uint64_t L : {1u, 7u, 8u, 64u, 65u, 130u, 301u})
    for (uint64_t e_tile : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{1} << 32,
                            (uint64_t{1} << 32) - 3, uint64_t{0x123456789abcull}})
      EXPECT_EQ(fragment_mismatches(d, L, true, e_tile), 0) << "L " << L << ", e_tile " << e_tile;
}

// Dropout's arguments where threshold != 0: a null philox, a pass other
// than 0 and 1, a mask numbered for another L or head count. Checked
// before anything else, so without a device (and also for an empty
// problem); a valid set on an empty problem launches nothing.
TEST(FlashAttentionRules, RejectsDropoutArguments) {
  DeviceCaps dev;  // not reached: the checks come before any CUDA call
  // Host memory: never read, as nothing launches.
  const uint64_t pair[2] = {1, 2};
  cuda::FlashArgs a;
  a.pos = {0, 4, 1, 4, 1, 4};  // no sequences
  a.D = 8, a.heads = 2;
  a.dropout.threshold = dropout_threshold(0.5f), a.dropout.scale = dropout_scale(0.5f);
  a.dropout.heads = 2, a.dropout.len[0] = 4, a.dropout.len[1] = 6;
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);  // philox null
  a.philox = pair;
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaSuccess);
  a.pass = 1;  // len[1] = 6 != L
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
  a.dropout.len[1] = 4;
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaSuccess);
  a.pass = 2;
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
  a.pass = 0, a.dropout.heads = 1;
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
  a.dropout.heads = 2, a.dropout.threshold = 0, a.philox = nullptr, a.pass = 5;  // no dropout: the fields unread
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaSuccess);
}

#endif  // FASTAXIAL_NO_RANDOM123

// The host-side rules, without a device.
TEST(FlashAttentionRules, SupportedHeadDims) {
  EXPECT_FALSE(can_run(FlashProblem{1, 64, 0, 1}, h200()));
  EXPECT_FALSE(can_run(FlashProblem{1, 64, 257, 1}, h200()));
  EXPECT_EQ(cuda::flash_attention_smem_bytes(0), 0u);
  EXPECT_EQ(cuda::flash_attention_smem_bytes(257), 0u);
  for (int64_t hd = 1; hd <= 256; ++hd) {
    ASSERT_TRUE(can_run(FlashProblem{1, 64, hd, 1}, h200())) << hd;
    const size_t bytes = cuda::flash_attention_smem_bytes(hd);
    EXPECT_GT(bytes, 0u) << hd;
    EXPECT_LE(bytes, 163u * 1024u) << hd;  // an A100 block's opt-in limit (the H100/H200's: 227 KB)
  }
}

TEST(FlashAttentionRules, RejectsSizesItDoesNotServe) {
  DeviceCaps dev;  // not reached: the checks come before any CUDA call
  cuda::FlashArgs a;
  a.pos = {1, 4, 1, 4, 1, 4};
  a.D = 12, a.heads = 5;  // heads do not divide D
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
  a.D = 257 * 2, a.heads = 2;  // head_dim 257
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
  a.D = 8, a.heads = 0;
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaErrorInvalidValue);
  a.D = 8, a.heads = 1, a.pos.num_seq = 0;  // nothing to do: no launch
  EXPECT_EQ(cuda::flash_attention(a, dev, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace fastaxial::test
