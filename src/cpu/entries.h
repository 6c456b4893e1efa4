// The entry points of one copy of the CPU kernels (axial_cpu.cpp, backward_cpu.cpp, gemm.cpp), each
// copy in a namespace of its own: fastaxial::cpu::single where they are compiled once, cpu::baseline
// and cpu::avx2 where they are compiled twice and dispatch.cpp picks one when the process first
// calls them (cpu_common.h: FASTAXIAL_CPU_COPY). The public forward_cpu, backward_cpu,
// saved_o_floats and saved_p_floats (fastaxial.h) are dispatch.cpp's, and call the picked copy's.
#pragma once

#include <cstdint>

#include "fastaxial/fastaxial.h"

// Declares the entry points of copy `name` in fastaxial::cpu::name.
#define FASTAXIAL_CPU_ENTRIES(name)                                  \
  namespace fastaxial::cpu::name {                                   \
  Status forward(const AxialParams& p);                              \
  Status backward(const AxialParams& p, const AxialGrads& g);        \
  int64_t saved_o_floats(const AxialParams& p);                      \
  int64_t saved_p_floats(const AxialParams& p);                      \
  }
