// (docs/cpu-blas.md) Times fastaxial::forward_cpu at the three configurations: median (and min) of 15 runs after 3 warm-ups; prints a
// hash of the output's bits to compare runs and builds.
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <omp.h>
#include "fastaxial/fastaxial.h"
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
static void fill(std::vector<float>& v, unsigned seed, float scale) {
  unsigned s = seed * 2654435761u + 1;
  for (auto& x : v) { s = s * 1664525u + 1013904223u; x = (((s >> 8) * (1.0f / 16777216.0f)) - 0.5f) * scale; }
}
int main(int argc, char** argv) {
  const char* tag = argc > 1 ? argv[1] : "?";
  if (openblas_set_num_threads) openblas_set_num_threads(1);
  struct Cfg { int64_t B, H, W, D, heads; } cfgs[] = {{1, 4, 512, 128, 1}, {1, 1, 1024, 32, 1}, {2, 32, 32, 384, 3}};
  for (auto c : cfgs) {
    const int64_t n = c.B * c.H * c.W * c.D, D = c.D;
    std::vector<float> x(n), out(n), w[2][5];
    fill(x, 7, 2.0f);
    for (int a = 0; a < 2; ++a) {
      w[a][0].assign(D, 1.0f); w[a][1].assign(D, 0.0f);
      w[a][2].resize(3 * D * D); fill(w[a][2], 11 + a, 2.0f / std::sqrt((float)D));
      w[a][3].resize(D * D); fill(w[a][3], 21 + a, 2.0f / std::sqrt((float)D));
      w[a][4].resize(D); fill(w[a][4], 31 + a, 0.1f);
    }
    fastaxial::AxialParams p;
    p.batch = c.B; p.height = c.H; p.width = c.W; p.dim = D; p.heads = c.heads;
    p.x = x.data(); p.out = out.data();
    fastaxial::AxisWeights* aw[2] = {&p.row, &p.col};
    for (int a = 0; a < 2; ++a) {
      aw[a]->norm_weight = w[a][0].data(); aw[a]->norm_bias = w[a][1].data(); aw[a]->qkv_weight = w[a][2].data();
      aw[a]->out_weight = w[a][3].data(); aw[a]->out_bias = w[a][4].data();
    }
    std::vector<double> ts;
    uint64_t h0 = 0; bool same = true;
    for (int r = 0; r < 18; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      auto st = fastaxial::forward_cpu(p);
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!st.ok()) { printf("error\n"); return 1; }
      uint64_t h = 1469598103934665603ull;
      for (int64_t i = 0; i < n; ++i) { uint32_t b; memcpy(&b, &out[i], 4); h = (h ^ b) * 1099511628211ull; }
      if (r == 0) h0 = h; else same &= (h == h0);
      if (r == 0 && getenv("DUMP")) {
        char fn[256]; snprintf(fn, sizeof fn, "dumps/%s_T%d_D%ld.bin", tag, omp_get_max_threads(), (long)D);
        FILE* f = fopen(fn, "wb"); fwrite(out.data(), 4, n, f); fclose(f);
      }
      if (r > 0 && h != h0 && getenv("DUMP")) {
        char fn[256]; snprintf(fn, sizeof fn, "dumps/%s_T%d_D%ld_run%d.bin", tag, omp_get_max_threads(), (long)D, r);
        FILE* f = fopen(fn, "wb"); fwrite(out.data(), 4, n, f); fclose(f);
      }
      if (r >= 3) ts.push_back(t);
    }
    std::sort(ts.begin(), ts.end());
    printf("%s\tT=%d\t(%ld,%ld,%ld,%ld,%ld)\tmedian %.3f ms\tmin %.3f ms\thash %016llx\tall 18 runs same bits: %s\n", tag,
           omp_get_max_threads(), (long)c.B, (long)c.H, (long)c.W, (long)c.D, (long)c.heads, ts[ts.size() / 2] * 1e3,
           ts[0] * 1e3, (unsigned long long)h0, same ? "yes" : "NO");
    fflush(stdout);
  }
}
