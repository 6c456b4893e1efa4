// The CPU products (src/cpu/gemm.h): every transposition, beta 0, 1 and another, strided operands,
// on the small products' register tiles, on Eigen's GEMM and through a BLAS set with set_cpu_sgemm;
// then the CPU forward and backward with that BLAS against the float64 reference.
//
// The BLAS here is a plain column-major sgemm of the Fortran interface, summing in double: a
// stand-in for MKL or OpenBLAS that checks what gemm() hands a BLAS (operands swapped, each
// transposed where it is used as stored, leading dimensions), not a BLAS's speed.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "src/cpu/gemm.h"
#include "util/backward_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial::test {
namespace {

std::atomic<int> blas_calls{0};

// C = alpha op(A) op(B) + beta C, column-major; C is not read where beta is 0 (as BLAS defines it).
void column_major_sgemm(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                        const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                        const float* beta, float* c, const int* ldc) {
  ++blas_calls;
  const bool ta = *transa == 'T', tb = *transb == 'T';
  for (int j = 0; j < *n; ++j)
    for (int i = 0; i < *m; ++i) {
      double s = 0;
      for (int l = 0; l < *k; ++l) {
        const float av = ta ? a[l + i * *lda] : a[i + l * *lda];
        const float bv = tb ? b[j + l * *ldb] : b[l + j * *ldb];
        s += static_cast<double>(av) * bv;
      }
      float& cij = c[i + j * *ldc];
      cij = static_cast<float>(*alpha * s + (*beta == 0.0f ? 0.0 : static_cast<double>(*beta) * cij));
    }
}

// Sets the stand-in BLAS for the test's scope, and Eigen again after it.
struct WithBlas {
  explicit WithBlas(CpuSgemm f) { set_cpu_sgemm(f); }
  ~WithBlas() { set_cpu_sgemm(nullptr); }
};

struct Case {
  int64_t m, n, k;
  bool ta, tb;
  float beta;
};

// A row-major (rows, cols) operand inside a wider buffer (row stride cols + 3) at an odd offset,
// with random values; pad elements are NaN, so a product that reads past its operand shows it.
struct Stored {
  std::vector<float> buf;
  cpu::Operand op;
  Stored(int64_t rows, int64_t cols, bool trans, std::mt19937& rng) {
    const int64_t ld = cols + 3, off = 5;
    buf.assign(off + rows * ld + 8, std::numeric_limits<float>::quiet_NaN());
    std::normal_distribution<float> dist;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) buf[off + r * ld + c] = dist(rng);
    op = {buf.data() + off, rows, cols, ld, trans};
  }
  double at(int64_t i, int64_t j) const {  // of op(stored)
    return op.trans ? op.data[j * op.ld + i] : op.data[i * op.ld + j];
  }
};

// gemm(a, b, beta, c) against the product in double: each element within 4 k ulps of sum |a b|.
void expect_product(const Case& t) {
  std::mt19937 rng(static_cast<uint32_t>(t.m * 131 + t.n * 17 + t.k * 3 + t.ta * 2 + t.tb));
  const Stored a(t.ta ? t.k : t.m, t.ta ? t.m : t.k, t.ta, rng), b(t.tb ? t.n : t.k, t.tb ? t.k : t.n, t.tb, rng);
  const int64_t ldc = t.n + 2;
  std::vector<float> c(t.m * ldc);
  std::normal_distribution<float> dist;
  for (float& v : c) v = dist(rng);
  // beta 0: c's old values must not be read, so NaN; its pad columns must stay as they were.
  if (t.beta == 0.0f)
    for (int64_t i = 0; i < t.m; ++i)
      for (int64_t j = 0; j < t.n; ++j) c[i * ldc + j] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> c0 = c;
  cpu::gemm(a.op, b.op, t.beta, c.data(), ldc);
  for (int64_t i = 0; i < t.m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      if (j >= t.n) {  // the pad between rows: untouched
        ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]) << "pad written at " << i << ", " << j;
        continue;
      }
      double want = t.beta == 0.0f ? 0.0 : static_cast<double>(t.beta) * c0[i * ldc + j], mag = std::fabs(want);
      for (int64_t l = 0; l < t.k; ++l) {
        want += a.at(i, l) * b.at(l, j);
        mag += std::fabs(a.at(i, l) * b.at(l, j));
      }
      ASSERT_NEAR(c[i * ldc + j], want, 4.0 * (t.k + 1) * std::numeric_limits<float>::epsilon() * mag + 1e-30)
          << "m " << t.m << " n " << t.n << " k " << t.k << " ta " << t.ta << " tb " << t.tb << " beta " << t.beta
          << " at " << i << ", " << j;
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // Small ones (kSmallProduct: partial row and column tiles, several column tiles; a partial column
  // tile over k of several blocks, {9, 44, 130}, which reads back its first block's sums) and two larger.
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 5, 3}, {33, 17, 64}, {64, 96, 9},
                                {1, 40, 12}, {40, 1, 12}, {13, 150, 20}, {5, 6, 0}, {9, 44, 130}, {128, 72, 64},
                                {70, 100, 80}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f, 0.5f}) out.push_back({m, n, k, ta, tb, beta});
  return out;
}

TEST(CpuGemm, EigenMatchesDouble) {
  ASSERT_EQ(cpu_sgemm(), nullptr);
  for (const Case& t : cases()) expect_product(t);
}

// A long sum on the register tiles (a weight gradient's positions: k in the hundreds or thousands,
// m n k within kSmallProduct) rounds like a blocked one: k in blocks whose sums are added into c,
// as a BLAS does. Terms all positive, so that each partial sum grows and one sequential chain over
// all k terms rounds at the full sum's magnitude every step. Measured, the worst relative error of
// these outputs: 2.4 to 2.8 ulps in blocks of 64, 14 to 21 in one chain. The bound, 6 ulps, for
// op(a) and op(b) in each layout.
TEST(CpuGemm, LongSumsOnTheRegisterTilesRoundAsBlockedSums) {
  ASSERT_EQ(cpu_sgemm(), nullptr);
  const int64_t m = 2, n = 64, k = 4096;
  ASSERT_LE(m * n * k, cpu::kSmallProduct);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      std::mt19937 rng(11u + 2u * ta + tb);
      std::uniform_real_distribution<float> dist(0.0f, 1.0f);
      std::vector<float> a(m * k), b(k * n), c(m * n, std::numeric_limits<float>::quiet_NaN());
      for (float& v : a) v = dist(rng);
      for (float& v : b) v = dist(rng);
      // op(a) (m, k) and op(b) (k, n), stored transposed where ta, tb.
      const cpu::Operand ao{a.data(), ta ? k : m, ta ? m : k, ta ? m : k, ta};
      const cpu::Operand bo{b.data(), tb ? n : k, tb ? k : n, tb ? k : n, tb};
      cpu::gemm(ao, bo, 0.0f, c.data(), n);
      double worst = 0.0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double want = 0.0;
          for (int64_t l = 0; l < k; ++l)
            want += static_cast<double>(ta ? a[l * m + i] : a[i * k + l]) * (tb ? b[j * k + l] : b[l * n + j]);
          worst = std::max(worst, std::fabs(c[i * n + j] - want) / want);
        }
      EXPECT_LE(worst, 6.0 * std::numeric_limits<float>::epsilon()) << "ta " << ta << " tb " << tb;
    }
}

// tile_gemm (the projections of narrow dims): products past kSmallProduct on the register tiles,
// within the rule against double, with or without a BLAS set (it calls none), and each row's bits
// the same whether the rows come in one call or in tiles of 7 (the backward's row tiles, the
// forward's blocks): an element's sum depends on k and its inputs alone.
TEST(CpuGemm, TileProductsOfAnySizeOnTheTilesWhateverTheRows) {
  const WithBlas blas(&column_major_sgemm);
  blas_calls = 0;
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{128, 192, 64}, {80, 288, 96}, {100, 96, 288}})
    for (const bool tb : {false, true}) {
      ASSERT_GT(m * n * k, cpu::kSmallProduct);
      std::mt19937 rng(static_cast<uint32_t>(m + n + k + tb));
      std::normal_distribution<float> dist;
      std::vector<float> a(m * k), b(k * n), whole(m * n), tiled(m * n);
      for (float& v : a) v = dist(rng);
      for (float& v : b) v = dist(rng);
      const cpu::Operand bo{b.data(), tb ? n : k, tb ? k : n, tb ? k : n, tb};
      cpu::tile_gemm(cpu::Operand{a.data(), m, k, k, false}, bo, 0.0f, whole.data(), n);
      for (int64_t r0 = 0; r0 < m; r0 += 7) {
        const int64_t rows = std::min<int64_t>(7, m - r0);
        cpu::tile_gemm(cpu::Operand{a.data() + r0 * k, rows, k, k, false}, bo, 0.0f, tiled.data() + r0 * n, n);
      }
      EXPECT_EQ(0, std::memcmp(whole.data(), tiled.data(), whole.size() * sizeof(float))) << m << " " << n << " " << k;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double want = 0.0, mag = 0.0;
          for (int64_t l = 0; l < k; ++l) {
            const double t = static_cast<double>(a[i * k + l]) * (tb ? b[j * k + l] : b[l * n + j]);
            want += t;
            mag += std::fabs(t);
          }
          ASSERT_NEAR(whole[i * n + j], want, 4.0 * (k + 1) * std::numeric_limits<float>::epsilon() * mag);
        }
    }
  EXPECT_EQ(blas_calls.load(), 0);
}

// attention_product takes the BLAS past kSmallProduct where attention_on_blas() says so (a BLAS set;
// FASTAXIAL_CPU_ATTENTION=blas, or where the variable is unset an Intel CPU or tiles narrower than
// AVX-512's) and the register tiles otherwise, within the rule against double either way. CTest runs
// this with the variable unset, blas and tiles.
TEST(CpuGemm, AttentionProductsFollowTheRule) {
  const char* env = std::getenv("FASTAXIAL_CPU_ATTENTION");
  const std::string want = env != nullptr ? env : "";
  bool on_blas = want == "blas";
  if (want != "blas" && want != "tiles") {  // unset (or not a rule): by the CPU
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    on_blas = __builtin_cpu_is("intel") || cpu::tile_packet_floats() < 16;
#endif
  }
  EXPECT_FALSE(cpu::attention_on_blas()) << "no BLAS set";
  const WithBlas blas(&column_major_sgemm);
  EXPECT_EQ(cpu::attention_on_blas(), on_blas) << "FASTAXIAL_CPU_ATTENTION=" << want;
  const int64_t m = 256, n = 512, k = 16;  // the scores of 256 queries, 512 keys, head dim 16
  ASSERT_GT(m * n * k, cpu::kSmallProduct);
  std::mt19937 rng(5u);
  std::normal_distribution<float> dist;
  cpu::Mat a(m, k), b(k, n), c(m, n);
  for (int64_t i = 0; i < a.size(); ++i) a.data()[i] = dist(rng);
  for (int64_t i = 0; i < b.size(); ++i) b.data()[i] = dist(rng);
  c.setConstant(std::numeric_limits<float>::quiet_NaN());
  blas_calls = 0;
  cpu::attention_product(c, cpu::in(a), cpu::in(b));
  EXPECT_EQ(blas_calls.load(), on_blas ? 1 : 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double want_ij = 0.0, mag = 0.0;
      for (int64_t l = 0; l < k; ++l) {
        const double t = static_cast<double>(a(i, l)) * b(l, j);
        want_ij += t;
        mag += std::fabs(t);
      }
      ASSERT_NEAR(c(i, j), want_ij, 4.0 * (k + 1) * std::numeric_limits<float>::epsilon() * mag) << i << " " << j;
    }
}

// The projections take the register tiles where projections_on_tiles() says so: with no BLAS set at
// dims up to kTileProjectionMaxDim; with one, on x86, at those dims where the tiles are AVX-512's and
// up to kAvx2TileProjectionMaxDim where they are AVX2's on a CPU that is not Intel's. A QKV product
// of 512 rows (past kSmallProduct at every dim here) calls the BLAS exactly where the rule says not
// the tiles, within the rule against double either way.
TEST(CpuGemm, ProjectionsFollowTheRule) {
  for (const int64_t D : {24, 64, 96, 128, 160}) {
    SCOPED_TRACE("D " + std::to_string(D));
    EXPECT_EQ(cpu::projections_on_tiles(D), D <= cpu::kTileProjectionMaxDim) << "no BLAS set";
    const WithBlas blas(&column_major_sgemm);
    bool tiles = D <= cpu::kTileProjectionMaxDim;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const int64_t packet = cpu::tile_packet_floats();
    const bool avx2_not_intel = packet == 8 && !__builtin_cpu_is("intel");
    tiles = tiles && (packet >= 16 || (avx2_not_intel && D <= cpu::kAvx2TileProjectionMaxDim));
#endif
    EXPECT_EQ(cpu::projections_on_tiles(D), tiles);
    const int64_t rows = 512;
    ASSERT_GT(rows * 3 * D * D, cpu::kSmallProduct);
    std::mt19937 rng(static_cast<uint32_t>(D));
    std::normal_distribution<float> dist;
    std::vector<float> w(3 * D * D), wo(D * D);
    for (float& v : w) v = dist(rng);
    for (float& v : wo) v = dist(rng);
    cpu::Mat y(rows, D), c(rows, 3 * D);
    for (int64_t i = 0; i < y.size(); ++i) y.data()[i] = dist(rng);
    c.setConstant(std::numeric_limits<float>::quiet_NaN());
    const cpu::Projections proj(w.data(), wo.data(), D);
    EXPECT_EQ(proj.on_tiles, tiles);
    blas_calls = 0;
    proj.qkv_product(c, y);
    EXPECT_EQ(blas_calls.load() > 0, !tiles);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < 3 * D; ++j) {
        double want = 0.0, mag = 0.0;
        for (int64_t l = 0; l < D; ++l) {
          const double t = static_cast<double>(y(i, l)) * w[j * D + l];
          want += t;
          mag += std::fabs(t);
        }
        ASSERT_NEAR(c(i, j), want, 4.0 * (D + 1) * std::numeric_limits<float>::epsilon() * mag) << i << " " << j;
      }
  }
}

// tile_gemm_residual (the output projection with its residual and bias): bitwise tile_gemm with beta 1
// onto a copy of x and the bias added after, over k of one and of several blocks of 64, partial
// column tiles (n of no whole packets: 44, 100), x apart from c (strided) and x in c; the columns of c's
// rows past n untouched.
TEST(CpuGemm, TileResidualIsTheProductOntoXThenTheBias) {
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{37, 64, 64}, {13, 96, 160}, {9, 40, 24}, {9, 44, 24},
                                {13, 100, 160}})
    for (const bool in_place : {false, true}) {
      std::mt19937 rng(static_cast<uint32_t>(m + n + k + in_place));
      std::normal_distribution<float> dist;
      const int64_t ldx = n + 5;
      std::vector<float> a(m * k), b(k * n), x(m * ldx), bias(n), want(m * n), got(m * ldx);
      for (auto* v : {&a, &b, &x, &bias})
        for (float& e : *v) e = dist(rng);
      for (int64_t i = 0; i < m; ++i) std::copy_n(x.data() + i * ldx, n, want.data() + i * n);
      const cpu::Operand ao{a.data(), m, k, k, false}, bo{b.data(), k, n, n, false};
      cpu::tile_gemm(ao, bo, 1.0f, want.data(), n);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) want[i * n + j] += bias[j];
      if (in_place) got = x;
      else std::fill(got.begin(), got.end(), -7.0f);
      const std::vector<float> before = got;
      cpu::tile_gemm_residual(ao, bo, in_place ? got.data() : x.data(), ldx, bias.data(), got.data(), ldx);
      for (int64_t i = 0; i < m; ++i) {
        EXPECT_EQ(0, std::memcmp(want.data() + i * n, got.data() + i * ldx, n * sizeof(float)))
            << m << " " << n << " " << k << " " << i;
        EXPECT_EQ(0, std::memcmp(before.data() + i * ldx + n, got.data() + i * ldx + n, (ldx - n) * sizeof(float)))
            << "past column " << n << " of row " << i;
      }
    }
}

TEST(CpuGemm, BlasGetsTheRowMajorProduct) {
  const WithBlas blas(&column_major_sgemm);
  ASSERT_EQ(cpu_sgemm(), &column_major_sgemm);
  blas_calls = 0;
  int large = 0;
  for (const Case& t : cases()) {
    expect_product(t);
    large += t.m * t.n * t.k > cpu::kSmallProduct;
  }
  ASSERT_GT(large, 0);
  EXPECT_EQ(blas_calls.load(), large);  // every product past the small ones went to the BLAS
}

// The forward and backward on the BLAS within the accuracy rule: all of their products go through gemm()
// (the attention's on the BLAS or the tiles as attention_on_blas() says, the projections as
// projections_on_tiles() says, the last shape's, past kTileProjectionMaxDim, and weight gradients on
// the BLAS). CTest runs it again with the attention on the BLAS (FASTAXIAL_CPU_ATTENTION=blas).
void expect_accurate_on_blas() {
  for (const Shape s : {Shape{2, 5, 9, 64, 8}, Shape{1, 1, 300, 32, 2}, Shape{1, 200, 1, 16, 2}, Shape{1, 2, 260, 160, 2}}) {
    const Problem p = random_problem(s, 77u + static_cast<uint32_t>(s.W));
    blas_calls = 0;
    std::vector<float> out(p.x.size(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(forward_cpu(params(p, out.data())).ok());
    expect_forward_within_rule(p, out, shape_name(s));
    if (s.D > cpu::kTileProjectionMaxDim) EXPECT_GT(blas_calls.load(), 0);
#ifdef _OPENMP
    const bool one_thread = omp_get_max_threads() == 1;
#else
    const bool one_thread = true;
#endif
    // One row of 300 on one thread: its scores and P v, a tile of 256 queries (or all 300) by 300
    // keys, pass kSmallProduct, and so do its projections (300 x 96 x 32): the forward calls the BLAS
    // exactly where the attention's products or the projections go there.
    if (s.H == 1 && s.W == 300 && one_thread)
      EXPECT_EQ(blas_calls.load() > 0, cpu::attention_on_blas() || !cpu::projections_on_tiles(s.D));
    expect_cpu_backward_matches_reference(p, random_grad(static_cast<int64_t>(p.x.size()), 5u));
    expect_cpu_backward_matches_reference(p, random_grad(static_cast<int64_t>(p.x.size()), 6u), true, true);
  }
}

// At 1 thread and at 3 (the stand-in then runs from several threads at once).
TEST(CpuGemm, ForwardAndBackwardOnTheBlas) {
  const WithBlas blas(&column_major_sgemm);
#ifdef _OPENMP
  const int before = omp_get_max_threads();
  for (const int threads : {1, 3}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    omp_set_num_threads(threads);
    expect_accurate_on_blas();
  }
  omp_set_num_threads(before);
#else
  expect_accurate_on_blas();
#endif
}

}  // namespace
}  // namespace fastaxial::test
