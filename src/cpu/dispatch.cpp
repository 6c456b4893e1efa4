// The public CPU entry points (fastaxial.h: forward_cpu, backward_cpu, saved_o_floats,
// saved_p_floats) and the BLAS the CPU products run on (set_cpu_sgemm), compiled once, for any x86-64
// (or whatever the build targets), whichever copy of the kernels runs.
//
// The kernels (axial_cpu.cpp, backward_cpu.cpp, gemm.cpp) are compiled once in a development build
// (-march=native: namespace cpu::single), or twice where the build is to run on CPUs it does not
// know (FASTAXIAL_CPU_DISPATCH, a wheel's default): cpu::baseline for any x86-64 (SSE2) and cpu::avx2
// with AVX2 and FMA. The products run on the BLAS either way (MKL picks its own code at run time);
// the softmax's exp-max-sum passes, LayerNorm and the gathers are Eigen's packet code, which the
// compiler fixes at build time. Here the process picks a copy once, at its first call: avx2 where
// the CPU (and the OS, which must save the YMM registers) has AVX2 and FMA, else baseline.
// FASTAXIAL_CPU_CAPABILITY=baseline or avx2 asks for one (tests run both); avx2 on a CPU without it
// falls back to baseline with a warning, never SIGILL. In a build of one copy the variable is ignored.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "entries.h"
#include "fastaxial/fastaxial.h"

#ifdef FASTAXIAL_CPU_DISPATCH
FASTAXIAL_CPU_ENTRIES(baseline)
FASTAXIAL_CPU_ENTRIES(avx2)
#else
FASTAXIAL_CPU_ENTRIES(single)
#endif

namespace fastaxial {
namespace {

std::atomic<CpuSgemm> g_sgemm{nullptr};

// One copy's entry points.
struct Copy {
  const char* name;
  Status (*forward)(const AxialParams&);
  Status (*backward)(const AxialParams&, const AxialGrads&);
  int64_t (*saved_o_floats)(const AxialParams&);
  int64_t (*saved_p_floats)(const AxialParams&);
};

#ifdef FASTAXIAL_CPU_DISPATCH
constexpr Copy kBaseline{"baseline", &cpu::baseline::forward, &cpu::baseline::backward,
                         &cpu::baseline::saved_o_floats, &cpu::baseline::saved_p_floats};
constexpr Copy kAvx2{"avx2", &cpu::avx2::forward, &cpu::avx2::backward, &cpu::avx2::saved_o_floats,
                     &cpu::avx2::saved_p_floats};

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();  // (safe to call again; needed where this runs before libgcc's constructor)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

const Copy& pick() {
  const bool avx2 = cpu_has_avx2_fma();
  const char* want = std::getenv("FASTAXIAL_CPU_CAPABILITY");
  if (want != nullptr && *want != '\0' && std::strcmp(want, "auto") != 0) {
    if (std::strcmp(want, "baseline") == 0) return kBaseline;
    if (std::strcmp(want, "avx2") == 0) {
      if (avx2) return kAvx2;
      std::fprintf(stderr, "fastaxial: FASTAXIAL_CPU_CAPABILITY=avx2, but this CPU lacks AVX2 or FMA: "
                           "running the baseline CPU kernels\n");
      return kBaseline;
    }
    std::fprintf(stderr, "fastaxial: FASTAXIAL_CPU_CAPABILITY=%s is none of baseline, avx2, auto: ignored\n", want);
  }
  return avx2 ? kAvx2 : kBaseline;
}
#else
constexpr Copy kSingle{"single", &cpu::single::forward, &cpu::single::backward, &cpu::single::saved_o_floats,
                       &cpu::single::saved_p_floats};
const Copy& pick() { return kSingle; }
#endif

// The copy this process runs, picked at the first call (thread-safe: a function's static).
const Copy& chosen() {
  static const Copy& copy = pick();
  return copy;
}

}  // namespace

void set_cpu_sgemm(CpuSgemm sgemm) { g_sgemm.store(sgemm, std::memory_order_release); }
CpuSgemm cpu_sgemm() { return g_sgemm.load(std::memory_order_acquire); }

Status forward_cpu(const AxialParams& p) { return chosen().forward(p); }
Status backward_cpu(const AxialParams& p, const AxialGrads& g) { return chosen().backward(p, g); }
int64_t saved_o_floats(const AxialParams& p) { return chosen().saved_o_floats(p); }
int64_t saved_p_floats(const AxialParams& p) { return chosen().saved_p_floats(p); }

}  // namespace fastaxial

// Which copy of the CPU kernels this process runs: "baseline" or "avx2" in a build of two, "single"
// in a build of one. Not in fastaxial.h: for tests (tests/cpp/cpu/test_cpu_copies.cpp, and
// tests/python through ctypes on _C.so) and for a person asking what runs.
extern "C" __attribute__((visibility("default"))) const char* fastaxial_cpu_copy() {
  return fastaxial::chosen().name;
}
