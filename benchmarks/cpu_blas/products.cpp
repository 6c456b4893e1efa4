// Micro-benchmark (docs/cpu-blas.md) of the Eigen products fastaxial's CPU forward (src/cpu/axial_cpu.cpp) runs, at the
// shapes of the three measured configurations, single-threaded, with the exact Eigen expressions:
//   qkv.noalias()  = y * Wqkv^T          y (rows,D) row-major, Wqkv ConstMap (3D,D) row-major
//   s.noalias()    = q * k^T             q = qkv.block(i0, h hd, rows, hd), k = qkv.block(0, D+h hd, L, hd)
//   ob.noalias()   = s * v               ob = o.block(i0, h hd, rows, hd), v = qkv.block(0, 2D+h hd, L, hd)
//   x.noalias()   += o * Wout^T          Wout ConstMap (D,D)
// Built once with Eigen's own GEMM and once with -DEIGEN_USE_BLAS linked to each BLAS.
// Usage: bench [time|det|thr] ...
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <Eigen/Core>
#include <omp.h>

extern "C" {
// Optional thread controls / identification, resolved if the linked BLAS has them.
void openblas_set_num_threads(int) __attribute__((weak));
int openblas_get_num_threads(void) __attribute__((weak));
char* openblas_get_config(void) __attribute__((weak));
char* openblas_get_corename(void) __attribute__((weak));
int openblas_get_parallel(void) __attribute__((weak));
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // C interface (the lowercase export is Fortran: int*)
int MKL_Get_Max_Threads(void) __attribute__((weak));
void MKL_Get_Version_String(char*, int) __attribute__((weak));
int mkl_serv_cbwr_get(int) __attribute__((weak));
int mkl_serv_cbwr_set(int) __attribute__((weak));
void bli_thread_set_num_threads(long) __attribute__((weak));
long bli_thread_get_num_threads(void) __attribute__((weak));
const char* bli_info_get_version_str(void) __attribute__((weak));
int bli_arch_query_id(void) __attribute__((weak));
const char* bli_arch_string(int) __attribute__((weak));
}

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const Mat>;
using MatMap = Eigen::Map<Mat>;

// A buffer of n floats starting `off` floats past a 64-byte boundary.
struct Buf {
  std::vector<float> raw;
  float* p;
  Buf(size_t n, int off) : raw(n + 64) {
    uintptr_t u = reinterpret_cast<uintptr_t>(raw.data());
    u = (u + 63) & ~uintptr_t(63);
    p = reinterpret_cast<float*>(u) + off;
  }
};

static void fill(float* p, size_t n, unsigned seed) {
  unsigned s = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    p[i] = ((s >> 8) * (1.0f / 16777216.0f)) - 0.5f;
  }
}

enum Kind { QKV, SCORES, PV, OUT };
static const char* kind_name[] = {"qkv  y*Wqkv^T", "score q*k^T", "pv   s*v", "out  x+=o*Wout^T"};

struct Case {
  const char* cfg;  // which configuration / pass
  Kind kind;
  int64_t m, k, n;   // product (m,k) x (k,n)
  int64_t D, L;      // model width (qkv row stride 3D), sequence length (for blocks)
  int calls;         // how many such products one forward runs (both passes), for the weighted sum
};

// One instance of a case's operands at a given alignment offset.
struct Inst {
  const Case& c;
  Buf a, b, out;
  int64_t hd;
  Inst(const Case& c_, int off)
      : c(c_),
        a(asize(c_), off),
        b(bsize(c_), off),
        out(osize(c_), off),
        hd(c_.kind == QKV || c_.kind == OUT ? 0 : (c_.kind == SCORES ? c_.k : c_.n)) {
    fill(a.p, asize(c), 1);
    fill(b.p, bsize(c), 2);
    fill(out.p, osize(c), 3);
  }
  // QKV: a = y (m,k), b = Wqkv (n,k); out (m,n).  OUT: a = o (m,k), b = Wout (n,k), out = x (m,n).
  // SCORES: a = qkv (L rows, 3D) holding q and k at head 0 (columns 0 and D); out s (m,L).
  // PV: a = s (m,L), b = qkv (L,3D) with v at column 2D; out = o (m, D) at head 0.
  static size_t asize(const Case& c) {
    if (c.kind == SCORES) return size_t(std::max(c.m, c.L)) * 3 * c.D;
    return size_t(c.m) * c.k;
  }
  static size_t bsize(const Case& c) {
    if (c.kind == PV) return size_t(c.L) * 3 * c.D;
    if (c.kind == SCORES) return 1;
    return size_t(c.n) * c.k;
  }
  static size_t osize(const Case& c) {
    if (c.kind == PV) return size_t(c.m) * c.D;
    return size_t(c.m) * c.n;
  }
  void run() {
    switch (c.kind) {
      case QKV: {
        ConstMap y(a.p, c.m, c.k), w(b.p, c.n, c.k);
        MatMap o(out.p, c.m, c.n);
        o.noalias() = y * w.transpose();
        break;
      }
      case OUT: {
        ConstMap oo(a.p, c.m, c.k), w(b.p, c.n, c.k);
        MatMap x(out.p, c.m, c.n);
        x.noalias() += oo * w.transpose();
        break;
      }
      case SCORES: {
        MatMap qkv(a.p, std::max(c.m, c.L), 3 * c.D);
        const auto q = qkv.block(0, 0, c.m, c.k);
        const auto k = qkv.block(0, c.D, c.L, c.k);
        MatMap s(out.p, c.m, c.n);
        s.noalias() = q * k.transpose();
        break;
      }
      case PV: {
        ConstMap s(a.p, c.m, c.k);
        MatMap qkv(b.p, c.L, 3 * c.D);
        const auto v = qkv.block(0, 2 * c.D, c.L, c.n);
        MatMap o(out.p, c.m, c.D);
        auto ob = o.block(0, 0, c.m, c.n);
        ob.noalias() = s * v;
        break;
      }
    }
  }
  size_t outn() const { return osize(c); }
};

// The products of fastaxial's CPU forward at the three configurations (see README.md for the derivation).
static std::vector<Case> cases() {
  std::vector<Case> v;
  // A: (B,H,W,D,heads) = (1,4,512,128,1). Row pass: 4 sequences of 512, one per block (1 and 2 threads).
  v.push_back({"A row (L=512, rows=512)", QKV, 512, 128, 384, 128, 512, 4});
  v.push_back({"A row", SCORES, 512, 128, 512, 128, 512, 4});
  v.push_back({"A row", PV, 512, 512, 128, 128, 512, 4});
  v.push_back({"A row", OUT, 512, 128, 128, 128, 512, 4});
  // Column pass: 512 sequences of 4, 32 per block (rows 128), 16 blocks.
  v.push_back({"A col (L=4, rows=128)", QKV, 128, 128, 384, 128, 4, 16});
  v.push_back({"A col", SCORES, 4, 128, 4, 128, 4, 512});
  v.push_back({"A col", PV, 4, 4, 128, 128, 4, 512});
  v.push_back({"A col", OUT, 128, 128, 128, 128, 4, 16});
  // B: (1,1,1024,32,1). Row pass at 1 thread: one block of 1024 rows.
  v.push_back({"B row T=1 (L=1024, rows=1024)", QKV, 1024, 32, 96, 32, 1024, 1});
  v.push_back({"B row T=1", SCORES, 1024, 32, 1024, 32, 1024, 1});
  v.push_back({"B row T=1", PV, 1024, 1024, 32, 32, 1024, 1});
  v.push_back({"B row T=1", OUT, 1024, 32, 32, 32, 1024, 1});
  // Row pass at 2 threads: few_sequences_pass, 64-row tiles (16 of each).
  v.push_back({"B row T=2 (tiles of 64)", QKV, 64, 32, 96, 32, 1024, 16});
  v.push_back({"B row T=2", SCORES, 64, 32, 1024, 32, 1024, 16});
  v.push_back({"B row T=2", PV, 64, 1024, 32, 32, 1024, 16});
  v.push_back({"B row T=2", OUT, 64, 32, 32, 32, 1024, 16});
  // Column pass: 1024 sequences of 1, 128 per block, 8 blocks.
  v.push_back({"B col (L=1, rows=128)", QKV, 128, 32, 96, 32, 1, 8});
  v.push_back({"B col", SCORES, 1, 32, 1, 32, 1, 1024});
  v.push_back({"B col", PV, 1, 1, 32, 32, 1, 1024});
  v.push_back({"B col", OUT, 128, 32, 32, 32, 1, 8});
  // C: (2,32,32,384,3), hd 128. Both passes: 64 sequences of 32, 4 per block (rows 128), 16 blocks a pass.
  v.push_back({"C row+col (L=32, rows=128)", QKV, 128, 384, 1152, 384, 32, 32});
  v.push_back({"C row+col", SCORES, 32, 128, 32, 384, 32, 384});
  v.push_back({"C row+col", PV, 32, 32, 128, 384, 32, 384});
  v.push_back({"C row+col", OUT, 128, 384, 384, 384, 32, 32});
  return v;
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void pin_blas_one_thread() {
  if (openblas_set_num_threads) openblas_set_num_threads(1);
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(1);
  if (bli_thread_set_num_threads) bli_thread_set_num_threads(1);
}

static void info(const char* lib) {
  printf("# lib=%s", lib);
  if (openblas_get_config) printf(" openblas config='%s' core=%s parallel=%d threads=%d", openblas_get_config(),
                                  openblas_get_corename ? openblas_get_corename() : "?",
                                  openblas_get_parallel ? openblas_get_parallel() : -1,
                                  openblas_get_num_threads ? openblas_get_num_threads() : -1);
  if (MKL_Get_Version_String) {
    char s[256];
    MKL_Get_Version_String(s, sizeof s);
    printf(" mkl='%s' max_threads=%d", s, MKL_Get_Max_Threads ? MKL_Get_Max_Threads() : -1);
    if (mkl_serv_cbwr_get) printf(" cbwr(branch)=%d", mkl_serv_cbwr_get(1));
  }
  if (bli_info_get_version_str)
    printf(" blis=%s arch=%s threads=%ld", bli_info_get_version_str(),
           (bli_arch_query_id && bli_arch_string) ? bli_arch_string(bli_arch_query_id()) : "?",
           bli_thread_get_num_threads ? bli_thread_get_num_threads() : -1);
  printf("\n");
}

int main(int argc, char** argv) {
  const char* lib = getenv("LIBNAME") ? getenv("LIBNAME") : "?";
  std::string mode = argc > 1 ? argv[1] : "time";
  if (!getenv("NOPIN")) pin_blas_one_thread();
  info(lib);
  auto cs = cases();
  if (mode == "time") {
    const int samples = 11;
    double fwd = 0;
    for (auto& c : cs) {
      Inst in(c, 0);
      const double flops = 2.0 * c.m * c.k * c.n;
      // calibrate: ~4 ms a sample
      int iters = 1;
      for (;;) {
        double t0 = now();
        for (int i = 0; i < iters; ++i) in.run();
        double t = now() - t0;
        if (t > 4e-3) break;
        iters *= 2;
      }
      std::vector<double> ts;
      for (int s = 0; s < samples; ++s) {
        double t0 = now();
        for (int i = 0; i < iters; ++i) in.run();
        ts.push_back((now() - t0) / iters);
      }
      std::sort(ts.begin(), ts.end());
      double med = ts[samples / 2];
      fwd += med * c.calls;
      printf("%s\t%-30s\t%s\t%ldx%ldx%ld\t%.3f us\t%.1f GFLOP/s\tx%d\n", lib, c.cfg, kind_name[c.kind], (long)c.m,
             (long)c.k, (long)c.n, med * 1e6, flops / med * 1e-9, (long)c.calls);
      fflush(stdout);
    }
  } else if (mode == "det") {
    // Bitwise reproducibility: same inputs at 64-byte-aligned vs 16-byte (offset 4 floats) and 4-byte
    // (offset 1 float) aligned buffers, and the same call repeated.
    int bad = 0;
    for (auto& c : cs) {
      Inst i0(c, 0), i0b(c, 0), i4(c, 4), i1(c, 1), i8(c, 8);
      i0.run(); i0b.run(); i4.run(); i1.run(); i8.run();
      auto cmp = [&](Inst& x) {
        int diff = 0; double mx = 0;
        for (size_t j = 0; j < i0.outn(); ++j) {
          if (memcmp(&i0.out.p[j], &x.out.p[j], 4)) { ++diff; mx = std::max(mx, (double)std::fabs(i0.out.p[j] - x.out.p[j])); }
        }
        return std::make_pair(diff, mx);
      };
      auto r0 = cmp(i0b), r8 = cmp(i8), r4 = cmp(i4), r1 = cmp(i1);
      bad += (r0.first || r4.first || r1.first || r8.first);
      printf("%s\t%-30s\t%s\t%ldx%ldx%ld\trepeat:%d\toff32B:%d\toff16B:%d (max %.2g)\toff4B:%d (max %.2g)\n", lib, c.cfg,
             kind_name[c.kind], (long)c.m, (long)c.k, (long)c.n, r0.first, r8.first, r4.first, r4.second, r1.first,
             r1.second);
    }
    printf("%s\tcases differing: %d\n", lib, bad);
  } else if (mode == "thr") {
    // Threading: the same product from the main thread (outside any parallel region) and from each thread of a
    // 2-thread OpenMP parallel region; outputs compared bitwise with the pinned 1-thread result.
    for (auto& c : cs) {
      if (c.kind == OUT) continue;  // += accumulates: skip
      if (2.0 * c.m * c.k * c.n < 1e7) continue;
      pin_blas_one_thread();
      Inst ref(c, 0);
      ref.run();
      if (openblas_set_num_threads) openblas_set_num_threads(2);
      if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(0);  // back to the global default
      if (bli_thread_set_num_threads) bli_thread_set_num_threads(2);
      Inst out(c, 0);
      out.run();  // as called outside a parallel region with the current thread setting
      Inst p0(c, 0), p1(c, 0);
#pragma omp parallel num_threads(2)
      {
        if (omp_get_thread_num() == 0) p0.run(); else p1.run();
      }
      auto same = [&](Inst& x) { return memcmp(ref.out.p, x.out.p, 4 * ref.outn()) == 0; };
      printf("%s\t%-30s\t%s\t%ldx%ldx%ld\toutside==pinned:%d\tinside-t0==pinned:%d\tinside-t1==pinned:%d\n", lib,
             c.cfg, kind_name[c.kind], (long)c.m, (long)c.k, (long)c.n, same(out), same(p0), same(p1));
    }
  }
  return 0;
}
