// The two copies of the CPU kernels in a build that picks one at run time (FASTAXIAL_CPU_DISPATCH;
// src/cpu/dispatch.cpp): the copy for any x86-64 (cpu::baseline) and the one with AVX2 and FMA
// (cpu::avx2), each called directly. Each within the accuracy rule of the float64 reference, the
// two within fp32 rounding of each other, and not the same bits: the AVX2 copy's packets are 8
// floats wide, not 4, and its multiply-adds fused, so equal bits everywhere would mean that one
// copy's code ran for both (the linker merged their functions). Then which copy forward_cpu and
// backward_cpu call: the one FASTAXIAL_CPU_CAPABILITY asks for (CTest runs this suite under
// baseline, avx2, auto, unset and a wrong value), else avx2 where the CPU has AVX2 and FMA.
// (cmake/cpu_copy_link.cmake checks the same from the objects' symbols: CTest cpu_copies_private.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "src/cpu/entries.h"
#include "util/backward_util.h"
#include "util/dropout_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

FASTAXIAL_CPU_ENTRIES(baseline)
FASTAXIAL_CPU_ENTRIES(avx2)
extern "C" const char* fastaxial_cpu_copy();

namespace fastaxial::test {
namespace {

struct Copy {
  const char* name;
  Status (*forward)(const AxialParams&);
  Status (*backward)(const AxialParams&, const AxialGrads&);
};
const Copy kBaseline{"baseline", &cpu::baseline::forward, &cpu::baseline::backward};
const Copy kAvx2{"avx2", &cpu::avx2::forward, &cpu::avx2::backward};

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// The copies this CPU can run.
std::vector<Copy> runnable() {
  std::vector<Copy> c{kBaseline};
  if (cpu_has_avx2_fma()) c.push_back(kAvx2);
  return c;
}

// The forward of p by one copy.
std::vector<float> forward_by(const Copy& c, const Problem& p) {
  std::vector<float> out(p.x.size(), std::numeric_limits<float>::quiet_NaN());
  const Status s = c.forward(params(p, out.data()));
  EXPECT_TRUE(s.ok()) << c.name << ": " << s.message;
  return out;
}

// ||a - b|| / ||b||.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

// The problems: the block path (many short sequences), one long row (the few-sequences path, keys
// in blocks of 512 with the online softmax, as (1, 1, 1024, 32, 1)), a long column with dropout.
std::vector<std::pair<std::string, Problem>> problems() {
  return {{"block_path", random_problem({2, 8, 8, 64, 4}, 11)},
          {"long_row", random_problem({1, 1, 1030, 32, 1}, 12)},
          {"long_column_dropout", with_dropout(random_problem({1, 600, 3, 24, 2}, 13), 0.25f, 7, 3)}};
}

// Both copies' forwards: each within the accuracy rule, the two within fp32 rounding of each other
// (1e-5 norm-relative: the rule's margin for other summation orders), and not the same bits.
TEST(CpuCopies, ForwardEachAccurateTheTwoApartByRoundingOnly) {
  if (!cpu_has_avx2_fma()) GTEST_SKIP() << "this CPU has no AVX2 and FMA: the avx2 copy cannot run here";
  int differ = 0;
  for (const auto& [name, p] : problems()) {
    const std::vector<float> base = forward_by(kBaseline, p), avx2 = forward_by(kAvx2, p);
    expect_forward_within_rule(p, base, name + " (baseline)");
    expect_forward_within_rule(p, avx2, name + " (avx2)");
    const double d = rel_diff(avx2, base);
    EXPECT_LE(d, 1e-5) << name;
    differ += !same_bits(avx2, base);
    char note[64];
    std::snprintf(note, sizeof note, "%.2e%s", d, same_bits(avx2, base) ? " (same bits)" : "");
    ::testing::Test::RecordProperty(name + " avx2 vs baseline", note);
  }
  EXPECT_GT(differ, 0) << "the two copies gave the same bits on every problem: one copy's code ran for both";
}

// Both copies' backwards (from the forward's kept activations, and without them, where the
// backward runs the row pass again): each within the rule, the two within 1e-5 of each other.
TEST(CpuCopies, BackwardEachAccurateTheTwoApartByRoundingOnly) {
  if (!cpu_has_avx2_fma()) GTEST_SKIP() << "this CPU has no AVX2 and FMA: the avx2 copy cannot run here";
  for (const auto& [name, p] : problems()) {
    const std::vector<double> gout = random_grad(static_cast<int64_t>(p.x.size()), 99);
    const std::vector<float> gout_f(gout.begin(), gout.end());
    RefGrads<double> ref = reference_backward(p, gout);
    RefGrads<float> ref32 = reference_backward_as<float>(p, gout);
    std::vector<std::vector<float>> by_copy;
    for (const Copy& c : {kBaseline, kAvx2}) {
      Grads got(p.shape);
      AxialGrads g = got.view();
      g.grad_out = gout_f.data();
      const Status s = c.backward(params(p, nullptr), g);
      ASSERT_TRUE(s.ok()) << c.name << ": " << s.message;
      SCOPED_TRACE(name + " (" + c.name + ")");
      expect_grads_match(got, ref, ref32);
      std::vector<float> all;
      for (auto& [buf, what] : got.all()) all.insert(all.end(), buf->begin(), buf->end());
      by_copy.push_back(all);
    }
    EXPECT_LE(rel_diff(by_copy[1], by_copy[0]), 1e-5) << name;
  }
}

// The copy the environment asks for: FASTAXIAL_CPU_CAPABILITY baseline or avx2 (avx2 only where the
// CPU has it), else (unset, auto, empty or a wrong value) avx2 where the CPU has AVX2 and FMA.
const Copy& expected_copy() {
  const char* want = std::getenv("FASTAXIAL_CPU_CAPABILITY");
  if (want != nullptr && std::strcmp(want, "baseline") == 0) return kBaseline;
  return cpu_has_avx2_fma() ? kAvx2 : kBaseline;
}

TEST(CpuCopies, PickedAsTheEnvironmentAsks) {
  const char* want = std::getenv("FASTAXIAL_CPU_CAPABILITY");
  RecordProperty("FASTAXIAL_CPU_CAPABILITY", want ? want : "(unset)");
  EXPECT_STREQ(fastaxial_cpu_copy(), expected_copy().name) << "FASTAXIAL_CPU_CAPABILITY=" << (want ? want : "(unset)");
}

// forward_cpu and backward_cpu run that copy: the same bits as calling it directly, and (where
// both can run) other bits than the other copy's.
TEST(CpuCopies, PublicEntriesCallThePickedCopy) {
  const Copy& picked = expected_copy();
  const Problem p = random_problem({1, 1, 1030, 32, 1}, 12);
  std::vector<float> out(p.x.size());
  ASSERT_TRUE(forward_cpu(params(p, out.data())).ok());
  EXPECT_TRUE(same_bits(out, forward_by(picked, p))) << "forward_cpu is not " << picked.name << "'s forward";
  for (const Copy& other : runnable())
    if (std::strcmp(other.name, picked.name) != 0)
      EXPECT_FALSE(same_bits(out, forward_by(other, p))) << "forward_cpu gave " << other.name << "'s bits too";

  const std::vector<double> gout = random_grad(static_cast<int64_t>(p.x.size()), 5);
  const std::vector<float> gout_f(gout.begin(), gout.end());
  std::vector<float> gx(p.x.size()), gx_direct(p.x.size());
  AxialGrads g{};
  g.grad_out = gout_f.data();
  g.grad_x = gx.data();
  ASSERT_TRUE(backward_cpu(params(p, nullptr), g).ok());
  g.grad_x = gx_direct.data();
  ASSERT_TRUE(picked.backward(params(p, nullptr), g).ok());
  EXPECT_TRUE(same_bits(gx, gx_direct)) << "backward_cpu is not " << picked.name << "'s backward";
}

}  // namespace
}  // namespace fastaxial::test
