// Timing of the staged path's activation product (src/cuda/gemm/gemm.cu):
// C (M, N) = A (M, K) @ W (N, K)^T + bias + residual, on gemm_tf32x3 and on cuBLAS fp32
// (cublasSgemm, default math: no TF32; bias and residual not applied there), for the QKV and
// output products of the projection-bound shapes in docs/benchmarks.md and of the two large
// training steps (perf notes v46), or for the M N K triples given as arguments. Each time is the
// mean of `reps` calls, each after the L2 is flushed (a 256 MB memset), between CUDA events
// around the call alone. TFLOP/s count 2 M N K (the fp32 product; gemm_tf32x3 issues three
// TF32 products for each). Also prints the largest difference of gemm_tf32x3's C minus bias
// and residual from cuBLAS's C, relative to the largest |C| (a sanity check; test_gemm_tf32x3
// holds the accuracy bounds against float64). And the 16-bit products (gemm_16bit: bf16
// operands, fp32 accumulation and C, on cuBLAS), with the time of rounding an fp32 A to bf16
// (round_to_16bit), which a 16-bit product on fp32 activations pays once; W is rounded once,
// outside the timing, as weights are a call.
// Not a test: built on request (ninja bench_gemm), run on a GPU.
//   build/benchmarks/cpp/bench_gemm [reps] [M N K]...
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "src/common/plan.h"
#include "src/cuda/gemm/blas.h"
#include "src/cuda/gemm/gemm.h"
#include "bench_util.h"

namespace {

namespace cuda = fastaxial::cuda;

struct Shape {
  int64_t M;
  int N, K;
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  std::vector<Shape> shapes;
  if (argc > 1) reps = std::max(1, std::atoi(argv[1]));
  for (int i = 2; i + 2 < argc; i += 3) shapes.push_back({std::atoll(argv[i]), std::atoi(argv[i + 1]), std::atoi(argv[i + 2])});
  if (shapes.empty())  // (B, H, W, D, heads) -> M = B H W: the QKV (N = 3D) and output (N = D) products, K = D
    shapes = {{8192, 1536, 512},  {8192, 512, 512},   // (2, 64, 64, 512, 4)
              {8192, 1152, 384},  {8192, 384, 384},   // (2, 64, 64, 384, 4)
              {9216, 480, 160},   {9216, 160, 160},   // (4, 48, 48, 160, 4)
              {32768, 768, 256},  {32768, 256, 256},  // (2, 128, 128, 256, 8)
              {65536, 384, 128},  {65536, 128, 128}}; // (1, 256, 256, 128, 4)
  const fastaxial::DeviceCaps dev = fastaxial::test::bench_device(reps);
  if (!cuda::gemm_tf32x3_can_run(dev)) {
    std::fprintf(stderr, "gemm_tf32x3 needs compute capability 9.0 and an sm_90a build\n");
    return 1;
  }
  cublasHandle_t blas;
  BENCH_CHECK(cublasCreate(&blas));
  BENCH_CHECK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  fastaxial::test::ColdTimer timer;

  std::printf("%6s %5s %5s | %-22s | %-22s | %-18s | %-26s | %s\n", "M", "N", "K", "gemm_tf32x3 (tiling)",
              "cuBLAS fp32", "max diff / max |C|", "bf16 products (diff)", "A to bf16");
  for (const Shape& s : shapes) {
    const int64_t M = s.M, N = s.N, K = s.K;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> ha(M * K), hw(N * K), hbias(N), hres(M * N);
    for (auto* v : {&ha, &hw, &hbias, &hres})
      for (float& x : *v) x = normal(rng);
    // W as gemm_tf32x3 takes it: hi then lo planes (the lo plane's TF32 rounding is the tensor core's).
    std::vector<float> wsplit(2 * N * K);
    for (int64_t e = 0; e < N * K; ++e) {
      uint32_t u;
      std::memcpy(&u, &hw[e], 4);
      u = (u + 0x1000u) & 0xFFFFE000u;
      float hi;
      std::memcpy(&hi, &u, 4);
      wsplit[e] = hi, wsplit[N * K + e] = hw[e] - hi;
    }
    float *a, *w, *wf, *bias, *res, *c, *cb, *c16;
    void *a16, *w16;
    BENCH_CHECK(cudaMalloc(&a, M * K * 4));
    BENCH_CHECK(cudaMalloc(&w, 2 * N * K * 4));
    BENCH_CHECK(cudaMalloc(&wf, N * K * 4));
    BENCH_CHECK(cudaMalloc(&bias, N * 4));
    BENCH_CHECK(cudaMalloc(&res, M * N * 4));
    BENCH_CHECK(cudaMalloc(&c, M * N * 4));
    BENCH_CHECK(cudaMalloc(&cb, M * N * 4));
    BENCH_CHECK(cudaMalloc(&c16, M * N * 4));
    BENCH_CHECK(cudaMalloc(&a16, M * K * 2));
    BENCH_CHECK(cudaMalloc(&w16, N * K * 2));
    BENCH_CHECK(cudaMemcpy(a, ha.data(), M * K * 4, cudaMemcpyHostToDevice));
    BENCH_CHECK(cudaMemcpy(w, wsplit.data(), 2 * N * K * 4, cudaMemcpyHostToDevice));
    BENCH_CHECK(cudaMemcpy(wf, hw.data(), N * K * 4, cudaMemcpyHostToDevice));
    BENCH_CHECK(cudaMemcpy(bias, hbias.data(), N * 4, cudaMemcpyHostToDevice));
    BENCH_CHECK(cudaMemcpy(res, hres.data(), M * N * 4, cudaMemcpyHostToDevice));

    cuda::GemmArgs g;
    g.a = a, g.w = w, g.bias = bias, g.residual = res, g.c = c, g.M = M, g.N = s.N, g.K = s.K;
    const double ms = timer.mean_ms(reps, [&] { BENCH_CHECK(cuda::gemm_tf32x3(g, dev, nullptr)); });
    const double ms_blas = timer.mean_ms(reps, [&] {
      const float one = 1.0f, zero = 0.0f;  // column-major: C^T (N, M) = W (K, N)^T A^T (K, M)
      BENCH_CHECK(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, s.N, (int)M, s.K, &one, wf, s.K, a, s.K, &zero, cb, s.N));
    });
    BENCH_CHECK(cuda::round_to_16bit(wf, w16, N * K, fastaxial::Products::kBf16, dev, nullptr));
    const double ms_round = timer.mean_ms(reps, [&] {
      BENCH_CHECK(cuda::round_to_16bit(a, a16, M * K, fastaxial::Products::kBf16, dev, nullptr));
    });
    const double ms_16 = timer.mean_ms(reps, [&] {
      const fastaxial::Status st = cuda::gemm_16bit(blas, fastaxial::Products::kBf16, false, true, M, N, K, a16, K, w16,
                                                    K, 0.0f, c16, N, "bench product");
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.message.c_str());
        std::exit(1);
      }
    });
    std::vector<float> out(M * N), ref(M * N), out16(M * N);
    BENCH_CHECK(cudaMemcpy(out16.data(), c16, M * N * 4, cudaMemcpyDeviceToHost));
    BENCH_CHECK(cudaMemcpy(out.data(), c, M * N * 4, cudaMemcpyDeviceToHost));
    BENCH_CHECK(cudaMemcpy(ref.data(), cb, M * N * 4, cudaMemcpyDeviceToHost));
    double cmax = 0.0, diff = 0.0, diff16 = 0.0;
    for (int64_t e = 0; e < M * N; ++e) {
      cmax = std::max(cmax, (double)std::fabs(ref[e]));
      diff = std::max(diff, std::fabs((double)out[e] - hbias[e % N] - hres[e] - ref[e]));
      diff16 = std::max(diff16, std::fabs((double)out16[e] - ref[e]));
    }
    const fastaxial::GemmTiling t = fastaxial::gemm_tiling(M, N, dev.sms);
    const double flop = 2.0 * M * N * K;
    std::printf("%6lld %5d %5d | %7.1f us %5.1f TF %3dx%-3d | %7.1f us %5.1f TF | %.1e            | %7.1f us %6.1f TF %.1e | %7.1f us\n",
                (long long)M, s.N, s.K, 1e3 * ms, flop / ms * 1e-9, t.rows, t.cols, 1e3 * ms_blas, flop / ms_blas * 1e-9,
                diff / cmax, 1e3 * ms_16, flop / ms_16 * 1e-9, diff16 / cmax, 1e3 * ms_round);
    for (float* p : {a, w, wf, bias, res, c, cb, c16}) BENCH_CHECK(cudaFree(p));
    for (void* p : {a16, w16}) BENCH_CHECK(cudaFree(p));
  }
  BENCH_CHECK(cublasDestroy(blas));
  return 0;
}
