// Micro-benchmark (docs/cpu-blas.md, perf notes v106): the CPU attention's products, one thread, on
// torch's MKL (one thread a call, as torch_binding/ops_cpu.cpp sets it) against gemm.cpp's register
// tiles with k and v read from a copy transposed once a block (attention_product, transpose_part).
// n queries by L keys at head dim hd, the operands where the kernels find them (rows of a (L, 3D)
// qkv block, D = 4 hd):
//   scores  s = q k^T          (n, L), k = hd          dP  = dO v^T   (n, L), k = hd
//   P v     o = s v            (n, hd), k = L          dV^T = dO^T P  (hd, L), k = n
// GFLOP/s (2 n L hd over the best of 3 x 20 calls). The MKL column calls sgemm itself, also for the
// short sequences' products (a (sequence, head)'s whole (L, L) scores), which gemm() would keep on the
// tiles (kSmallProduct). Usage: TORCH_CPU_LIB=<torch>/lib/libtorch_cpu.so attention_products.
// Build: see docs/cpu-blas.md, Commands.
#include "benchmarks/cpu_blas/torch_mkl.h"

using namespace fastaxial;
using namespace fastaxial::cpu;

int main() {
  const CpuSgemm mkl = bench::load_torch_mkl();
  if (mkl == nullptr) return 1;
  struct Shape {
    int64_t hd, L, n;
  };
  for (const Shape c : {Shape{16, 1024, 64}, Shape{32, 1024, 64}, Shape{64, 1024, 64}, Shape{128, 1024, 64},
                        Shape{16, 512, 256}, Shape{32, 512, 256}, Shape{64, 512, 256}, Shape{128, 512, 256},
                        Shape{16, 32, 32}, Shape{24, 16, 16}, Shape{32, 48, 48}, Shape{32, 80, 80}}) {
    const int64_t hd = c.hd, L = c.L, n = c.n, D = 4 * hd;
    Mat qkv = Mat::Random(L, 3 * D), s = Mat::Random(n, L), o(n, hd), dv_t(hd, L), dO = Mat::Random(n, D);
    const auto q = qkv.block(0, 0, n, hd), k = qkv.block(0, D, L, hd), v = qkv.block(0, 2 * D, L, hd);
    const auto g = dO.block(0, 0, n, hd);
    const Mat k_t = k.transpose(), v_t = v.transpose();
    const auto blas = [&](auto& c, const Operand& a, const Operand& b) { bench::blas_product(mkl, c, a, b); };
    const auto rate = [&](const char* name, const auto& f) {
      double gflops[2];
      bench::rates(mkl, 2.0 * n * L * hd, f, gflops);
      std::printf("hd %3ld L %5ld n %4ld %-14s GFLOP/s  MKL %6.1f  tiles %6.1f\n", (long)hd, (long)L, (long)n, name,
                  gflops[0], gflops[1]);
    };
    rate("q k^T", [&](bool tiles) { tiles ? gemm(s, in(q), in(k_t), 0.0f, true) : blas(s, in(q), tr(k)); });
    rate("dO v^T", [&](bool tiles) { tiles ? gemm(s, in(g), in(v_t), 0.0f, true) : blas(s, in(g), tr(v)); });
    rate("P v", [&](bool tiles) { tiles ? gemm(o, in(s), in(v), 0.0f, true) : blas(o, in(s), in(v)); });
    rate("dO^T P", [&](bool tiles) { tiles ? gemm(dv_t, tr(g), in(s), 0.0f, true) : blas(dv_t, tr(g), in(s)); });
  }
}
