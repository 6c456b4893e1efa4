// The CPU softmax's exponential (src/cpu/cpu_common.h: pexp_nonpositive, exp_and_sum) against
// std::exp in double: within 2 ulp where the result is a normal float, no more than 1.2e-38 below
// that, NaN kept; the row's sum equal to the double sum of what it wrote within n ulp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "src/cpu/cpu_common.h"

namespace fastaxial::test {
namespace {

// exp((row - max) * scale) through exp_and_sum for one value x = row - max (scale 1), the rest of
// the row zeros so that the packet and the scalar tail both see it.
float exp_at(float x, int64_t n, int64_t at) {
  std::vector<float> row(n, 0.0f);
  row[at] = x;
  cpu::exp_and_sum(row.data(), n, 0.0f, 1.0f);
  return row[at];
}

double ulps(float got, double want) {
  const double ulp = std::nextafter((float)want, std::numeric_limits<float>::infinity()) - (float)want;
  return std::abs(got - want) / ulp;
}

TEST(SoftmaxExp, WithinTwoUlpOverTheNormalRange) {
  // Every 1/4096 from -87 to 0 (356,353 values), in a packet (position 0 of 64) and in the scalar
  // tail (position 64 of 65).
  double worst = 0.0, worst_tail = 0.0;
  std::vector<float> row(64), tail(65);
  for (int64_t i = 0; i <= 87 * 4096; i += 64) {
    for (int64_t j = 0; j < 64; ++j) row[j] = -(float)(i + j) / 4096.0f;
    std::vector<float> xs(row);
    cpu::exp_and_sum(row.data(), 64, 0.0f, 1.0f);
    for (int64_t j = 0; j < 64; ++j) worst = std::max(worst, ulps(row[j], std::exp((double)xs[j])));
  }
  for (float x : {0.0f, -1e-7f, -0.5f, -1.0f, -10.3f, -50.0f, -87.0f})
    worst_tail = std::max(worst_tail, ulps(exp_at(x, 65, 64), std::exp((double)x)));
  EXPECT_LE(worst, 2.0);
  EXPECT_LE(worst_tail, 1.0);  // std::exp
}

TEST(SoftmaxExp, BelowTheNormalRangeAtMostTheSmallestNormal) {
  for (float x : {-87.5f, -88.0f, -100.0f, -1e30f, -std::numeric_limits<float>::infinity()}) {
    const float got = exp_at(x, 64, 3);
    EXPECT_GE(got, 0.0f) << x;
    EXPECT_LE(got, 1.2e-38f) << x;
  }
}

TEST(SoftmaxExp, NanStaysNan) {
  EXPECT_TRUE(std::isnan(exp_at(std::numeric_limits<float>::quiet_NaN(), 64, 5)));
  EXPECT_TRUE(std::isnan(exp_at(std::numeric_limits<float>::quiet_NaN(), 65, 64)));
}

TEST(SoftmaxExp, RowAndSum) {
  // Rows of every length from 1 to 70 (packets, pairs of them, tails), max-subtracted and scaled:
  // each element within 2 ulp of exp((x - max) scale) in double, the sum within n ulp of the
  // double sum of the written elements.
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (int64_t n = 1; n <= 70; ++n) {
    std::vector<float> row(n);
    for (float& v : row) v = dist(rng);
    const float max = *std::max_element(row.begin(), row.end()), scale = 0.35f;
    const std::vector<float> x(row);
    const float sum = cpu::exp_and_sum(row.data(), n, max, scale);
    double exact = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_LE(ulps(row[j], std::exp((double)((x[j] - max) * scale))), 2.0) << "n " << n << " j " << j;
      exact += row[j];
    }
    EXPECT_LE(ulps(sum, exact), (double)n) << "n " << n;
  }
}

}  // namespace
}  // namespace fastaxial::test
