// Shared by the micro-benchmarks that set torch's MKL against gemm.cpp's register tiles
// (attention_products.cpp, projection_products.cpp): MKL's sgemm loaded from TORCH_CPU_LIB at one
// thread a call (as torch_binding/ops_cpu.cpp sets it), a product on it whatever its size, and the
// rate of a product, MKL's and the tiles', on hot operands.
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "src/cpu/gemm.h"

namespace fastaxial::bench {

// torch's sgemm_ from the library TORCH_CPU_LIB names, MKL set to one thread; null (with a message) if
// it is not there.
inline CpuSgemm load_torch_mkl() {
  const char* lib = std::getenv("TORCH_CPU_LIB");
  void* torch_cpu = lib != nullptr ? dlopen(lib, RTLD_NOW | RTLD_GLOBAL) : nullptr;
  if (torch_cpu == nullptr) {
    std::printf("set TORCH_CPU_LIB to torch's libtorch_cpu.so (%s)\n", lib != nullptr ? dlerror() : "unset");
    return nullptr;
  }
  const auto mkl = reinterpret_cast<CpuSgemm>(dlsym(torch_cpu, "sgemm_"));
  const auto one_thread = reinterpret_cast<int (*)(int)>(dlsym(torch_cpu, "MKL_Set_Num_Threads_Local"));
  if (mkl == nullptr || one_thread == nullptr) {
    std::printf("libtorch_cpu.so exports no sgemm_ or MKL_Set_Num_Threads_Local\n");
    return nullptr;
  }
  one_thread(1);
  return mkl;
}

// c = op(a) op(b) on sgemm whatever its size: row-major c is column-major c^T = op(b)^T op(a)^T (as gemm()).
template <class C>
void blas_product(CpuSgemm sgemm, C& c, const cpu::Operand& a, const cpu::Operand& b) {
  const char ta = b.trans ? 'T' : 'N', tb = a.trans ? 'T' : 'N';
  const int M = (int)b.op_cols(), N = (int)a.op_rows(), K = (int)a.op_cols(), lda = (int)b.ld, ldb = (int)a.ld,
            ldc = (int)c.outerStride();
  const float one = 1.0f, zero = 0.0f;
  sgemm(&ta, &tb, &M, &N, &K, &one, b.data, &lda, a.data, &ldb, &zero, c.data(), &ldc);
}

// GFLOP/s of f(on_tiles) for MKL (false) and the tiles (true): flops over the best of `rounds` x 20
// calls after 10, with gemm()'s BLAS set to sgemm for the MKL side (and none for the tiles').
template <class F>
void rates(CpuSgemm sgemm, double flops, const F& f, double gflops[2], int rounds = 3) {
  for (const bool tiles : {false, true}) {
    set_cpu_sgemm(tiles ? nullptr : sgemm);
    for (int i = 0; i < 10; ++i) f(tiles);
    double best = 1e9;
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 20; ++i) f(tiles);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 20);
    }
    gflops[tiles] = flops / best * 1e-9;
  }
  set_cpu_sgemm(nullptr);
}

}  // namespace fastaxial::bench
