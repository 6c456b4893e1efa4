// Micro-benchmark (docs/cpu-blas.md, perf notes v119): the CPU projections' products, one thread, on
// torch's MKL (one thread a call) against gemm.cpp's register tiles reading the weights as
// Projections lays them out (transposed once a pass for the forward's two):
//   y Wqkv^T  (m, 3D), k = D     the QKV product (Projections::qkv_product)
//   o Wout^T  (m, D),  k = D     the output product (out_residual, without the residual)
//   a Wqkv    (m, D),  k = 3D    the backward's product by the weights (by_qkv)
// for m rows of a block at dims D. GFLOP/s over the best of 5 x 20 calls. The MKL column calls sgemm
// itself at every size; the tiles' column runs tile_gemm whatever the size, which projections_on_tiles()
// decides per dim. Usage: TORCH_CPU_LIB=<torch>/lib/libtorch_cpu.so projection_products [D m ...]
// (pairs of a dim and rows; default: dims 48 to 192 by 16 to 256 rows).
// Build: as attention_products.cpp (docs/cpu-blas.md, Commands).
#include <utility>
#include <vector>

#include "benchmarks/cpu_blas/torch_mkl.h"

using namespace fastaxial;
using namespace fastaxial::cpu;

int main(int argc, char** argv) {
  const CpuSgemm mkl = bench::load_torch_mkl();
  if (mkl == nullptr) return 1;
  std::vector<std::pair<int64_t, int64_t>> sizes;  // (D, m)
  for (int i = 1; i + 1 < argc; i += 2) sizes.emplace_back(std::atoll(argv[i]), std::atoll(argv[i + 1]));
  if (sizes.empty())
    for (const int64_t D : {48, 64, 96, 128, 192})
      for (const int64_t m : {16, 32, 64, 128, 256}) sizes.emplace_back(D, m);
  for (const auto& [D, m] : sizes) {
    {
      // y and o are (m, D), a (m, 3D); the weights as the module keeps them, Wqkv (3D, D) and Wout (D, D).
      const Mat y = Mat::Random(m, D), a = Mat::Random(m, 3 * D), wq = Mat::Random(3 * D, D), wo = Mat::Random(D, D);
      const Mat wq_t = wq.transpose(), wo_t = wo.transpose();
      Mat c3(m, 3 * D), c1(m, D);
      const auto blas = [&](auto& c, const Operand& l, const Operand& r) { bench::blas_product(mkl, c, l, r); };
      const auto rate = [&](const char* name, double flops, const auto& f) {
        double gflops[2];
        bench::rates(mkl, flops, f, gflops, 5);
        std::printf("D %3ld m %4ld %-9s GFLOP/s  MKL %6.1f  tiles %6.1f  tiles / MKL %.2f\n", (long)D, (long)m, name,
                    gflops[0], gflops[1], gflops[1] / gflops[0]);
      };
      rate("y Wqkv^T", 6.0 * m * D * D, [&](bool t) { t ? gemm(c3, in(y), in(wq_t), 0.0f, true) : blas(c3, in(y), tr(wq)); });
      rate("o Wout^T", 2.0 * m * D * D, [&](bool t) { t ? gemm(c1, in(y), in(wo_t), 0.0f, true) : blas(c1, in(y), tr(wo)); });
      rate("a Wqkv", 6.0 * m * D * D, [&](bool t) { t ? gemm(c1, in(a), in(wq), 0.0f, true) : blas(c1, in(a), in(wq)); });
    }
  }
}
