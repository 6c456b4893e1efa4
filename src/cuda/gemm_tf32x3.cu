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
// Accuracy: the three products (lo*hi, hi*lo, hi*hi) of two 8-deep steps go
// into a fresh accumulator T, which is then added to C in fp32 (the tensor
// core truncates its own adds; a long chain drifts, while runs of two steps
// stay at an fp32 FMA chain's error: docs/perf-notes.md). Two T sets
// alternate, so one run's products go on while the other's T is added.
#include "gemm_tf32x3.h"

#include <cstdint>

#include "async_copy.cuh"
#include "wgmma.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int BM = 128, BN = 128, BK = 32, kStages = 3;
constexpr int kThreads = 256;                   // two warpgroups
constexpr int kTileBytes = 128 * BK * 4;        // one plane of a 128-row tile: 16 KB
constexpr int kStageBytes = 4 * kTileBytes;     // A hi, A lo, W hi, W lo
constexpr size_t kSmemBytes = (size_t)kStages * kStageBytes + 1024;  // + room to align to 1024

#if FASTAXIAL_SM90A_DEVICE
// 128 rows x BK columns of one plane of a (rows, K) matrix into the swizzled
// tile at shared address s: a row's 8 pieces of 16 bytes, piece c at c ^ (r % 8).
__device__ __forceinline__ void load_tile(uint32_t s, const float* g, int64_t row0, int64_t rows, int k0, int K) {
  const int piece = threadIdx.x % 8, k = k0 + 4 * piece;
#pragma unroll
  for (int u = 0; u < 128 * 8 / kThreads; ++u) {
    const int r = threadIdx.x / 8 + u * (kThreads / 8);
    const bool valid = k < K && row0 + r < rows;
    copy_async16(s + r * 128 + ((piece ^ (r % 8)) * 16), valid ? g + (row0 + r) * K + k : g, valid ? 16 : 0);
  }
}

__device__ __forceinline__ void add_to(float (&c)[64], float (&t)[64]) {
  fence_regs(t);  // after the wait that completed t
#pragma unroll
  for (int i = 0; i < 64; ++i) c[i] += t[i];
}

// The three products of steps ks and ks + 1 of the stage at s into t (fresh),
// one commit group.
__device__ __forceinline__ void run_products(float (&t)[64], uint32_t s, int wg, int ks) {
  fence_regs(t);
  wgmma_fence();
#pragma unroll
  for (int k = ks; k < ks + 2; ++k) {
    const uint32_t a_hi = s + wg * 64 * 128 + k * 32, a_lo = a_hi + kTileBytes;
    const uint32_t w_hi = s + 2 * kTileBytes + k * 32, w_lo = w_hi + kTileBytes;
    wgmma_m64n128k8_ss(t, desc_sw128(a_lo), desc_sw128(w_hi), k == ks ? 0 : 1);
    wgmma_m64n128k8_ss(t, desc_sw128(a_hi), desc_sw128(w_lo), 1);
    wgmma_m64n128k8_ss(t, desc_sw128(a_hi), desc_sw128(w_hi), 1);
  }
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
    copy_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    copy_async_wait<kStages - 2>();
    // cp.async wrote the tile through the generic proxy; wgmma reads it through the async one.
    fence_async_smem();
    __syncthreads();  // tile kt is in for all; every product of tile kt - 1 has completed

    const uint32_t s = base + (kt % kStages) * kStageBytes;
    run_products(t0, s, wg, 0);
    // The refill of tile kt - 1's stage goes out while the products run.
    if (kt + kStages - 1 < ktiles) load_stage(kt + kStages - 1);
    copy_async_commit();
    run_products(t1, s, wg, 2);
    wgmma_wait<1>();
    add_to(c, t0);
    wgmma_wait<0>();  // before the next barrier lets this stage be refilled
    add_to(c, t1);
  }
  copy_async_wait<0>();

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
