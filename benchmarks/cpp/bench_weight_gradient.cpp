// Timing of the backward's weight-gradient product (src/cuda/gemm/weight_gradient.cu):
// C (N, K) = A^T B over T rows, on the kernel weight_gradient picks (wgmma on sm_90a), on the
// mma.sync kernel (WeightGradientArgs::mma_sync), and on cuBLAS fp32 (cublasSgemm, default math:
// no TF32), for the shapes of docs/perf-notes.md's v32 table or those given as arguments
// (T N K triples). Each time is the mean of `reps` calls, each after the L2 is flushed (a
// 256 MB memset), between CUDA events around the call alone (the product and, where the rows are
// split, the partials' total). Also prints the largest difference of each result from cuBLAS's,
// relative to the largest |C| (a sanity check; test_weight_gradient holds the accuracy bounds).
// Not a test: built on request (ninja bench_weight_gradient), run on a GPU.
//   build/benchmarks/cpp/bench_weight_gradient [reps] [T N K]...
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "src/common/plan.h"
#include "src/cuda/gemm/weight_gradient.h"
#include "bench_util.h"
#include "util/cuda_test_util.h"

namespace {

using fastaxial::DeviceCaps;
namespace cuda = fastaxial::cuda;

struct Shape {
  int64_t T;
  int N, K;
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 10;
  std::vector<Shape> shapes;
  if (argc > 1) reps = std::max(1, std::atoi(argv[1]));
  for (int i = 2; i + 2 < argc; i += 3) shapes.push_back({std::atoll(argv[i]), std::atoi(argv[i + 1]), std::atoi(argv[i + 2])});
  if (shapes.empty())
    shapes = {{4096, 64, 64},     {4096, 192, 64},    {32768, 128, 128}, {32768, 384, 128},
              {32768, 256, 256},  {32768, 768, 256},  {65536, 128, 128}, {65536, 384, 128},
              {131072, 768, 256}, {32768, 1536, 512}};
  const DeviceCaps dev = fastaxial::test::bench_device(reps);
  cublasHandle_t blas;
  BENCH_CHECK(cublasCreate(&blas));
  BENCH_CHECK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  fastaxial::test::ColdTimer timer;

  std::printf("%8s %5s %5s | %-26s | %-26s | %-18s | %s\n", "T", "N", "K", "weight_gradient (kernel, S)",
              "mma.sync forced (S)", "cuBLAS fp32", "max diff / max |C| (wg, mma)");
  for (const Shape& s : shapes) {
    const int64_t T = s.T, N = s.N, K = s.K;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> ha(T * N), hb(T * K);
    for (float& x : ha) x = normal(rng);
    for (float& x : hb) x = normal(rng);
    float *a, *b, *c[3], *partials = nullptr;
    BENCH_CHECK(cudaMalloc(&a, ha.size() * 4));
    BENCH_CHECK(cudaMalloc(&b, hb.size() * 4));
    for (float*& ci : c) BENCH_CHECK(cudaMalloc(&ci, N * K * 4));
    BENCH_CHECK(cudaMemcpy(a, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice));
    BENCH_CHECK(cudaMemcpy(b, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
    const size_t pfloats = fastaxial::weight_gradient_partials_floats(T, N, K, dev);
    if (pfloats > 0) BENCH_CHECK(cudaMalloc(&partials, pfloats * 4));

    cuda::WeightGradientArgs g;
    g.a = a, g.b = b, g.T = T, g.lda = N, g.ldb = K, g.ldc = K, g.N = s.N, g.K = s.K;
    // variant 0: as picked; 1: mma.sync; 2: cuBLAS. Returns the mean time in ms.
    const auto time = [&](int variant) {
      return timer.mean_ms(reps, [&] {
        if (variant < 2) {
          cuda::WeightGradientArgs gv = g;
          gv.c = c[variant], gv.mma_sync = variant == 1;
          BENCH_CHECK(cuda::weight_gradient(gv, partials, pfloats * 4, dev, nullptr));
        } else {
          const float one = 1.0f, zero = 0.0f;  // column-major: C^T (K, N) = B^T (K, T) A (T, N)
          BENCH_CHECK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, s.K, s.N, (int)T, &one, b, s.K, a, s.N, &zero, c[2],
                            s.K));
        }
      });
    };
    double ms[3];
    for (int v = 0; v < 3; ++v) ms[v] = time(v);
    std::vector<float> out[3];
    for (int v = 0; v < 3; ++v) {
      out[v].resize(N * K);
      BENCH_CHECK(cudaMemcpy(out[v].data(), c[v], N * K * 4, cudaMemcpyDeviceToHost));
    }
    double cmax = 0.0, diff[2] = {0.0, 0.0};
    for (int64_t e = 0; e < N * K; ++e) {
      cmax = std::max(cmax, (double)std::fabs(out[2][e]));
      for (int v = 0; v < 2; ++v) diff[v] = std::max(diff[v], (double)std::fabs(out[v][e] - out[2][e]));
    }
    const double flop = 2.0 * T * N * K;
    const bool wgmma = cuda::weight_gradient_wgmma(g, dev);
    const auto splits = [&](bool w) {
      return fastaxial::weight_gradient_split(T, N, K, dev,
                                              w ? fastaxial::WeightGradKernel::kWgmma
                                                : fastaxial::WeightGradKernel::kMmaSync)
          .splits;
    };
    std::printf("%8lld %5d %5d | %8.1f us %5.1f TF %-5s %3lld | %8.1f us %5.1f TF %4lld | %8.1f us %5.1f TF | %.1e, %.1e\n",
                (long long)T, s.N, s.K, 1e3 * ms[0], flop / ms[0] * 1e-9, wgmma ? "wgmma" : "mma", (long long)splits(wgmma),
                1e3 * ms[1], flop / ms[1] * 1e-9, (long long)splits(false), 1e3 * ms[2], flop / ms[2] * 1e-9,
                diff[0] / cmax, diff[1] / cmax);
    BENCH_CHECK(cudaFree(a));
    BENCH_CHECK(cudaFree(b));
    for (float* ci : c) BENCH_CHECK(cudaFree(ci));
    if (partials) BENCH_CHECK(cudaFree(partials));
  }
  BENCH_CHECK(cublasDestroy(blas));
  return 0;
}
