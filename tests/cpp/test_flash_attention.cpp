// The staged path's flash attention kernel (src/cuda/staged/flash_attention.cu)
// on its own: o = softmax(q k^T / sqrt(hd)) v and the log-sum-exp of each
// query's scaled scores, per (sequence, head), against float64 on the host.
// Views as the row and column passes give them (strides in rows of the
// (T, 3D) qkv and (T, D) o matrices), sequence lengths across the kernel's
// query and key tile edges, head dims across its padded sizes, aligned and
// misaligned qkv (its 16-byte and 4-byte copies). Skipped without a device.
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

#include "../../src/common/axis.h"
#include "../../src/common/plan.h"
#include "../../src/cuda/staged/flash_attention.h"
#include "cuda_test_util.h"

namespace fastaxial::test {
namespace {

constexpr uint32_t kPoison = 0xffffffffu;  // a NaN: cudaMemset(0xff)
constexpr int64_t kGuardRows = 3;          // rows of o past the T the views address
constexpr int64_t kGuardLse = 67;          // lse elements past (num_seq, heads, L)

bool is_poison(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u == kPoison;
}

struct Case {
  int L, hd, heads;
  bool col;      // the column pass's view of a (B, L, other) grid, else the row pass's of (B, other, L)
  int B, other;  // batch, and the grid's extent along the other axis
  int used;      // sequences the view covers (0: all of B * other); the other rows must stay untouched
  int misalign;  // qkv passed this many floats past a 16-byte boundary (the kernel's 4-byte copies)
};

std::string case_name(const Case& c) {
  return "L" + std::to_string(c.L) + "_hd" + std::to_string(c.hd) + "_heads" + std::to_string(c.heads) +
         (c.col ? "_col" : "_row") + "_B" + std::to_string(c.B) + "x" + std::to_string(c.other) +
         (c.used ? "_used" + std::to_string(c.used) : "") + (c.misalign ? "_misalign" + std::to_string(c.misalign) : "");
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

// max |x - ref| over a row, NaN counting as infinite.
double worst_abs(double worst, float x, double ref) {
  const double e = std::isnan(x) ? std::numeric_limits<double>::infinity() : std::fabs((double)x - ref);
  return std::max(worst, e);
}

class FlashAttention : public ::testing::TestWithParam<Case> {};

TEST_P(FlashAttention, MatchesDoubleReference) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
  DeviceCaps dev;
  ASSERT_TRUE(read_device_caps(&dev));
  if (HasFatalFailure()) return;
  if (dev.cc_major < 8) GTEST_SKIP() << "needs compute capability 8.0 or later (mma.sync tf32)";
  const Case c = GetParam();
  ASSERT_TRUE(cuda::flash_attention_supports(c.hd));
  if (cuda::flash_attention_smem_bytes(c.hd) > (size_t)dev.smem_optin)
    GTEST_SKIP() << "head_dim " << c.hd << " needs more shared memory than this device gives a block";

  // The pass's view, in floats (common/axis.h), then in rows of D, as the
  // staged path's row_indices gives it to the kernel.
  const int64_t D = (int64_t)c.hd * c.heads;
  AxialParams p;
  p.batch = c.B, p.dim = D, p.heads = c.heads;
  p.height = c.col ? c.L : c.other;
  p.width = c.col ? c.other : c.L;
  const AxisView fv = c.col ? col_view(p) : row_view(p);
  ASSERT_EQ(fv.len, c.L);
  const AxisView view = {c.used ? c.used : fv.num_seq, fv.len,           fv.inner,
                         fv.seq_stride / D,            fv.pos_stride / D, fv.batch_stride / D};
  ASSERT_LE(view.num_seq, fv.num_seq);
  const int64_t T = p.batch * p.height * p.width, N = view.num_seq, L = c.L, hd = c.hd;

  std::mt19937 rng(1234567u + 7919u * (uint32_t)(c.L * 3 + c.hd * 5 + c.heads * 7 + c.B * 11 + c.other * 13));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> qkv((size_t)(T * 3 * D));
  for (float& x : qkv) x = normal(rng);

  const DevicePtr dqkv = device_alloc(qkv.size() + c.misalign), dout = device_alloc((size_t)((T + kGuardRows) * D)),
                  dlse = device_alloc((size_t)(N * c.heads * L + kGuardLse));
  ASSERT_TRUE(dqkv && dout && dlse);
  float* qkv_at = dqkv.get() + c.misalign;
  ASSERT_EQ(cudaMemcpy(qkv_at, qkv.data(), qkv.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dout.get(), 0xff, (size_t)((T + kGuardRows) * D) * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemset(dlse.get(), 0xff, (size_t)(N * c.heads * L + kGuardLse) * sizeof(float)), cudaSuccess);

  cuda::FlashArgs a;
  a.pos = view, a.qkv = qkv_at, a.o = dout.get(), a.lse = dlse.get(), a.D = (int)D, a.heads = c.heads;
  ASSERT_EQ(cuda::flash_attention(a, dev, nullptr), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> out((size_t)((T + kGuardRows) * D)), lse((size_t)(N * c.heads * L + kGuardLse));
  ASSERT_EQ(cudaMemcpy(out.data(), dout.get(), out.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(lse.data(), dlse.get(), lse.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);

  // Every valid element against float64, beside the same formula in plain
  // fp32 on the host: the kernel's error may be at most twice the fp32
  // evaluation's, plus a floor for what 3xTF32 adds where fp32 happens to be
  // exact (L = 1: o = v). The tensor core reads 10 of lo's 13 bits, so a
  // product is off by up to 2^-21 relative: o (a convex combination of v) by
  // up to 2^-21 max|v|, a score by 2^-21 sum_i |q_i k_i|; the floor is about
  // twice that. Plain TF32 anywhere would be ~1e-3 off.
  const double scale = 1.0 / std::sqrt((double)hd);
  const float scale32 = 1.0f / std::sqrt((float)hd);
  double worst_o = 0.0, worst_o32 = 0.0, worst_lse = 0.0, worst_lse32 = 0.0, vmax = 0.0, mag_max = 0.0;
  std::vector<char> touched((size_t)(T + kGuardRows), 0);
  std::vector<double> kd((size_t)(L * hd)), vd((size_t)(L * hd)), s64((size_t)L), o64((size_t)hd);
  std::vector<float> kf((size_t)(L * hd)), vf((size_t)(L * hd)), s32((size_t)L), o32((size_t)hd);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < c.heads; ++h) {
      const auto row = [&](int64_t l) { return view.offset(n, l); };  // in rows
      for (int64_t l = 0; l < L; ++l) {
        const float* r = qkv.data() + row(l) * 3 * D + h * hd;
        for (int64_t i = 0; i < hd; ++i) {
          kf[l * hd + i] = r[D + i], vf[l * hd + i] = r[2 * D + i];
          kd[l * hd + i] = r[D + i], vd[l * hd + i] = r[2 * D + i];
          vmax = std::max(vmax, std::fabs((double)r[2 * D + i]));
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
          const double p64 = std::exp(s64[k] - m64);
          const float p32 = std::exp(s32[k] - m32);
          sum64 += p64, sum32 += p32;
          for (int64_t i = 0; i < hd; ++i) o64[i] += p64 * vd[k * hd + i], o32[i] += p32 * vf[k * hd + i];
        }
        const float* got = out.data() + orow * D + h * hd;
        for (int64_t i = 0; i < hd; ++i) {
          const double ref = o64[i] / sum64;
          worst_o = worst_abs(worst_o, got[i], ref);
          worst_o32 = worst_abs(worst_o32, o32[i] / sum32, ref);
        }
        const double lse64 = m64 + std::log(sum64);
        worst_lse = worst_abs(worst_lse, lse[(size_t)((n * c.heads + h) * L + l)], lse64);
        worst_lse32 = worst_abs(worst_lse32, m32 + std::log(sum32), lse64);
      }
    }
  const double bound_o = 2.0 * worst_o32 + 1e-6 * vmax;
  const double bound_lse = 2.0 * worst_lse32 + 1e-6 * (1.0 + mag_max);
  EXPECT_LE(worst_o, bound_o) << "o: fp32 host error " << worst_o32 << ", max |v| " << vmax;
  EXPECT_LE(worst_lse, bound_lse) << "lse: fp32 host error " << worst_lse32 << ", max scaled sum |q k| " << mag_max;

  // Rows the view does not address (and the guard rows past T) untouched;
  // lse past (N, heads, L) untouched.
  int64_t written = 0;
  for (int64_t r = 0; r < T + kGuardRows; ++r) {
    if (touched[(size_t)r]) continue;
    for (int64_t i = 0; i < D; ++i) written += !is_poison(out[(size_t)(r * D + i)]);
  }
  EXPECT_EQ(written, 0) << "elements of rows outside the view written";
  int64_t lse_written = 0;
  for (size_t i = (size_t)(N * c.heads * L); i < lse.size(); ++i) lse_written += !is_poison(lse[i]);
  EXPECT_EQ(lse_written, 0) << "lse written past (num_seq, heads, L)";
}

// L across the 64-query tiles and the key tiles (64 keys up to head_dim 64,
// 32 up to 128, 16 beyond); head_dim across the padded sizes (8, 16, 32, 48,
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
                      Case{1024, 256, 1, false, 1, 1, 0, 0}, Case{1, 256, 4, false, 2, 100, 0, 0},
                      Case{2051, 3, 4, true, 1, 2, 0, 0}, Case{200, 128, 4, false, 1, 4, 3, 0},
                      Case{1024, 16, 4, false, 1, 3, 0, 0}, Case{7, 256, 1, true, 3, 5, 0, 1},
                      Case{64, 1, 1, true, 2, 100, 0, 0}, Case{200, 8, 2, false, 1, 6, 0, 2},
                      Case{1024, 48, 2, true, 1, 1, 0, 3}, Case{65, 80, 3, false, 2, 5, 0, 0},
                      Case{200, 160, 1, true, 2, 3, 0, 0}, Case{64, 24, 4, true, 1, 8, 0, 0},
                      Case{7, 40, 1, false, 10, 30, 0, 0}, Case{200, 1, 3, true, 1, 12, 0, 0},
                      Case{65, 256, 2, true, 1, 6, 5, 0}, Case{200, 64, 4, false, 2, 4, 0, 0}),
    [](const auto& info) { return case_name(info.param); });

// The host-side rules, without a device.
TEST(FlashAttentionRules, SupportedHeadDims) {
  EXPECT_FALSE(cuda::flash_attention_supports(0));
  EXPECT_FALSE(cuda::flash_attention_supports(257));
  EXPECT_EQ(cuda::flash_attention_smem_bytes(0), 0u);
  EXPECT_EQ(cuda::flash_attention_smem_bytes(257), 0u);
  for (int64_t hd = 1; hd <= 256; ++hd) {
    ASSERT_TRUE(cuda::flash_attention_supports(hd)) << hd;
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
