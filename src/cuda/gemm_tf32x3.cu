// C (M, N) = A (M, K) @ W (N, K)^T (+ bias) (+ residual) in fp32 accuracy on
// Hopper's warpgroup tensor-core instructions (wgmma, sm_90a), the 3xTF32
// split with both operands already split in global memory: each is two
// planes, hi then lo, of TF32 values (tf32x3.cuh), so the kernel only copies
// and multiplies.
//
// Shape: a block of two warpgroups computes a 128 x 128 tile of C, each
// warpgroup 64 rows (64 accumulators a thread). K advances 32 at a time
// through a 3-stage cp.async ring; a stage holds the hi and lo planes of the
// A and W tiles, each row 128 bytes in the 128-byte swizzled layout wgmma
// reads (16-byte piece c of row r stored at piece c ^ (r % 8)), so the
// copies and the tensor cores both meet distinct banks.
//
// Accuracy: each 8-deep step's three products (lo*hi, hi*lo, hi*hi) go into a
// fresh accumulator T, which is then added to C in fp32 (the tensor core
// truncates its own adds; a long chain drifts: docs/perf-notes.md). Two T
// sets alternate, so one step's products run while the previous step's T is
// added.
#include "gemm_tf32x3.h"

#include <cstdint>

// wgmma exists in sm_90a device code only; the other device passes (the
// compute_80 PTX) compile a stub that nothing launches.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FASTAXIAL_SM90A_DEVICE 1
#else
#define FASTAXIAL_SM90A_DEVICE 0
#endif

namespace fastaxial::cuda {
namespace {

constexpr int BM = 128, BN = 128, BK = 32, kStages = 3;
constexpr int kThreads = 256;                   // two warpgroups
constexpr int kTileBytes = 128 * BK * 4;        // one plane of a 128-row tile: 16 KB
constexpr int kStageBytes = 4 * kTileBytes;     // A hi, A lo, W hi, W lo
constexpr size_t kSmemBytes = (size_t)kStages * kStageBytes + 1024;  // + room to align to 1024

#if FASTAXIAL_SM90A_DEVICE
__device__ __forceinline__ void cp_async16(uint32_t dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// 128 rows x BK columns of one plane of a (rows, K) matrix into the swizzled
// tile at shared address s: a row's 8 pieces of 16 bytes, piece c at c ^ (r % 8).
__device__ __forceinline__ void load_tile(uint32_t s, const float* g, int64_t row0, int64_t rows, int k0, int K) {
  const int piece = threadIdx.x % 8, k = k0 + 4 * piece;
#pragma unroll
  for (int u = 0; u < 128 * 8 / kThreads; ++u) {
    const int r = threadIdx.x / 8 + u * (kThreads / 8);
    const bool valid = k < K && row0 + r < rows;
    cp_async16(s + r * 128 + ((piece ^ (r % 8)) * 16), valid ? g + (row0 + r) * K + k : g, valid);
  }
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups
// 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

// d (64 x 128, f32) = or += A (64 x 8) @ B (8 x 128), both from shared memory.
template <int kAccumulate>
__device__ __forceinline__ void wgmma_m64n128k8(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(kAccumulate));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of r across the asynchronous products.
__device__ __forceinline__ void fence_regs(float (&r)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

__device__ __forceinline__ void add_to(float (&c)[64], float (&t)[64]) {
  fence_regs(t);
#pragma unroll
  for (int i = 0; i < 64; ++i) c[i] += t[i];
}

// The three products of step ks of the stage at s into t (fresh).
__device__ __forceinline__ void step_products(float (&t)[64], uint32_t s, int wg, int ks) {
  const uint32_t a_hi = s + wg * 64 * 128 + ks * 32, a_lo = a_hi + kTileBytes;
  const uint32_t w_hi = s + 2 * kTileBytes + ks * 32, w_lo = w_hi + kTileBytes;
  fence_regs(t);
  wgmma_fence();
  wgmma_m64n128k8<0>(t, smem_desc(a_lo), smem_desc(w_hi));
  wgmma_m64n128k8<1>(t, smem_desc(a_hi), smem_desc(w_lo));
  wgmma_m64n128k8<1>(t, smem_desc(a_hi), smem_desc(w_hi));
  wgmma_commit();
}

#endif  // FASTAXIAL_SM90A_DEVICE

__global__ void __launch_bounds__(kThreads, 1) gemm_tf32x3_kernel(const GemmArgs p) {
#if FASTAXIAL_SM90A_DEVICE
  extern __shared__ float4 smem4[];
  // Swizzled tiles must start on 1024-byte boundaries.
  const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem4) + 1023) & ~1023u;
  // Blocks that share a row tile of A are neighbours in launch order: A comes
  // from DRAM about once and from L2 for the other column tiles.
  const int ntiles = (p.N + BN - 1) / BN;
  const int64_t m0 = (int64_t)(blockIdx.x / ntiles) * BM;
  const int n0 = (int)(blockIdx.x % ntiles) * BN;
  const int wg = threadIdx.x / 128;
  const int ktiles = (p.K + BK - 1) / BK;
  const float* a_lo = p.a + p.M * p.K;
  const float* w_lo = p.w + (int64_t)p.N * p.K;

  auto load_stage = [&](int kt) {
    const uint32_t s = base + (kt % kStages) * kStageBytes;
    load_tile(s, p.a, m0, p.M, kt * BK, p.K);
    load_tile(s + kTileBytes, a_lo, m0, p.M, kt * BK, p.K);
    load_tile(s + 2 * kTileBytes, p.w, n0, p.N, kt * BK, p.K);
    load_tile(s + 3 * kTileBytes, w_lo, n0, p.N, kt * BK, p.K);
  };

  float c[64], t0[64], t1[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) c[i] = t0[i] = t1[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    // cp.async wrote the tile through the generic proxy; wgmma reads it through the async one.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // tile kt is in for all; every product of tile kt - 1 has completed
    if (kt + kStages - 1 < ktiles) load_stage(kt + kStages - 1);
    asm volatile("cp.async.commit_group;\n" ::: "memory");

    const uint32_t s = base + (kt % kStages) * kStageBytes;
    step_products(t0, s, wg, 0);
    step_products(t1, s, wg, 1);
    wgmma_wait<1>();
    add_to(c, t0);
    step_products(t0, s, wg, 2);
    wgmma_wait<1>();
    add_to(c, t1);
    step_products(t1, s, wg, 3);
    wgmma_wait<1>();
    add_to(c, t0);
    wgmma_wait<0>();  // before the next barrier lets this stage be refilled
    add_to(c, t1);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  // Accumulator layout: warp w of the warpgroup holds rows 16 w + g and
  // 16 w + g + 8; c[4 j .. 4 j + 3] are columns 8 j + 2t, 8 j + 2t + 1 of each.
  const int warp = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = n0 + 8 * j + 2 * tq;
    if (col >= p.N) continue;
    const float2 bias = p.bias ? *reinterpret_cast<const float2*>(p.bias + col) : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + wg * 64 + warp * 16 + g + 8 * half;
      if (row >= p.M) continue;
      float2 v = make_float2(c[4 * j + 2 * half] + bias.x, c[4 * j + 2 * half + 1] + bias.y);
      if (p.residual) {
        const float2 r = *reinterpret_cast<const float2*>(p.residual + row * p.N + col);
        v.x += r.x;
        v.y += r.y;
      }
      *reinterpret_cast<float2*>(p.c + row * p.N + col) = v;
    }
  }
#else
  (void)p;
  __trap();  // built without sm_90a: gemm_tf32x3_available() is false and nothing launches this
#endif
}

}  // namespace

bool gemm_tf32x3_available(const DeviceInfo& dev) {
#if defined(FASTAXIAL_WGMMA)
  return dev.cc_major == 9 && (size_t)dev.smem_optin >= kSmemBytes;
#else
  (void)dev;
  return false;
#endif
}

cudaError_t gemm_tf32x3(const GemmArgs& g, const DeviceInfo& dev, cudaStream_t stream) {
  if (g.M == 0 || g.N == 0) return cudaSuccess;
  if (!gemm_tf32x3_available(dev)) return cudaErrorInvalidDeviceFunction;
  if (cudaError_t e = allow_max_smem<gemm_tf32x3_kernel>(dev); e != cudaSuccess) return e;
  const int64_t blocks = (g.M + BM - 1) / BM * ((g.N + BN - 1) / BN);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  gemm_tf32x3_kernel<<<(unsigned)blocks, kThreads, kSmemBytes, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace fastaxial::cuda
