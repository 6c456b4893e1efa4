// (docs/cpu-blas.md) Peak fp32 FMA throughput of one core: independent FMA chains in zmm (AVX-512) and ymm (AVX2) registers.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <class V, V (*FMA)(V, V, V), V (*SET)(float)>
double run(int lanes) {
  V a[12];
  for (int i = 0; i < 12; ++i) a[i] = SET(1.0f + i * 1e-7f);
  V b = SET(0.999999f), c = SET(1e-7f);
  const long iters = 100000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], b, c);
  }
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float s = 0; for (int i = 0; i < 12; ++i) { alignas(64) float f[16]; _mm_storeu_ps(f, _mm_set1_ps(0)); (void)f; }
  volatile V sink = a[0]; for (int i = 1; i < 12; ++i) sink = a[i]; (void)s;
  return 2.0 * lanes * 12 * iters / t * 1e-9;
}
int main() {
  for (int r = 0; r < 3; ++r)
    printf("avx512 zmm: %.1f GFLOP/s   avx2 ymm: %.1f GFLOP/s\n",
           run<__m512, _mm512_fmadd_ps, _mm512_set1_ps>(16), run<__m256, _mm256_fmadd_ps, _mm256_set1_ps>(8));
}
