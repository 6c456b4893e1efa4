// C (M, N) = A (M, K) @ W (N, K)^T (+ bias) (+ residual), every product on
// the tensor cores with the 3xTF32 split, both operands already split in
// global memory (pairs of TF32 words, tf32x3.cuh) so the inner loop is loads
// and mma.sync only.
//
// Shape: a block computes a 128 x 64 tile of C with 4 warps (2 x 2), each a
// 64 x 32 piece (4 x 4 fragments of 16 x 8, 64 accumulators a thread). K
// advances 16 at a time through a 3-stage cp.async ring in shared memory, so
// two tiles of A and W are in flight while one is multiplied. Two blocks fit
// an SM (registers and 111 KB of shared memory each): one block's pipeline
// fill and epilogue overlap the other's products. Shared rows
// are 48 words (32 of pairs, 16 of pad): a fragment's 16-byte loads then hit
// distinct banks. Rows of A or W past M or N, and k past K, arrive as zeros.
//
// Accuracy: each 8-deep step's three products go into a zeroed accumulator
// and are then added to the running sum in fp32 (the tensor core truncates
// its own adds; a long chain of them drifts, see docs/perf-notes.md).
#include "gemm_tf32x3.h"

#include <cstdint>

#include "tf32x3.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int BM = 128, BN = 64, BK = 16, kStages = 3;
constexpr int kLd = 2 * BK + 16;  // words per shared row
constexpr int kThreads = 128;
constexpr int kStageWords = (BM + BN) * kLd;
constexpr size_t kSmemBytes = (size_t)kStages * kStageWords * sizeof(float);

__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}

// R rows x BK elements of a split (rows, K) matrix into shared memory; a
// row's 2 BK words are 8 pieces of 16 bytes. A thread always copies the same
// piece, of rows r, r + 16, ...
template <int R>
__device__ __forceinline__ void load_tile(float* s, const float* g, int64_t row0, int64_t rows, int k0, int K) {
  constexpr int kRowStep = kThreads / 8;
  const int r = threadIdx.x / 8, piece = threadIdx.x % 8, k = k0 + 2 * piece;
  const float* src = g + ((row0 + r) * K + k) * 2;
  const int64_t step = (int64_t)kRowStep * K * 2;
  float* dst = s + r * kLd + 4 * piece;
#pragma unroll
  for (int u = 0; u < R / kRowStep; ++u) {
    const bool valid = k < K && row0 + r + u * kRowStep < rows;
    cp_async16(dst + u * kRowStep * kLd, valid ? src + u * step : g, valid);
  }
}

__global__ void __launch_bounds__(kThreads, 2) gemm_tf32x3_kernel(const GemmArgs p) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);  // kStages x [A (BM, kLd) | W (BN, kLd)]
  // Blocks that share a row tile of A are neighbours in launch order, so A
  // comes from DRAM about once and from L2 for the other column tiles.
  const int ntiles = (p.N + BN - 1) / BN;
  const int64_t m0 = (int64_t)(blockIdx.x / ntiles) * BM;
  const int n0 = (int)(blockIdx.x % ntiles) * BN;
  const int warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int ktiles = (p.K + BK - 1) / BK;

  auto load_stage = [&](int kt) {
    float* s = smem + (kt % kStages) * kStageWords;
    load_tile<BM>(s, p.a, m0, p.M, kt * BK, p.K);
    load_tile<BN>(s + BM * kLd, p.w, n0, p.N, kt * BK, p.K);
  };

  float c[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    __syncthreads();  // tile kt is in for every thread; the stage read at kt - 1 is free
    if (kt + kStages - 1 < ktiles) load_stage(kt + kStages - 1);
    asm volatile("cp.async.commit_group;\n" ::: "memory");

    const float* sa = smem + (kt % kStages) * kStageWords + (wm * 64) * kLd;
    const float* sw = smem + (kt % kStages) * kStageWords + (BM + wn * 32) * kLd;
#pragma unroll
    for (int ks = 0; ks < BK / 8; ++ks) {
      FragB b[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = load_bt_split(sw + 8 * j * kLd + 16 * ks, kLd);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // one A fragment live at a time: registers for two blocks an SM
        const FragA a = load_a_split(sa + 16 * i * kLd + 16 * ks, kLd);
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_3xtf32(c[i][j], a, b[j]);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");

  // C fragments: rows g and g + 8, columns 2t and 2t + 1 of each 16 x 8 piece.
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = n0 + wn * 32 + 8 * j + 2 * t;
    if (col >= p.N) continue;
    const float2 bias = p.bias ? *reinterpret_cast<const float2*>(p.bias + col) : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = m0 + wm * 64 + 16 * i + g + 8 * half;
        if (row >= p.M) continue;
        float2 v = make_float2(c[i][j][2 * half] + bias.x, c[i][j][2 * half + 1] + bias.y);
        if (p.residual) {
          const float2 r = *reinterpret_cast<const float2*>(p.residual + row * p.N + col);
          v.x += r.x;
          v.y += r.y;
        }
        *reinterpret_cast<float2*>(p.c + row * p.N + col) = v;
      }
  }
}

}  // namespace

cudaError_t gemm_tf32x3(const GemmArgs& g, const DeviceInfo& dev, cudaStream_t stream) {
  if (g.M == 0 || g.N == 0) return cudaSuccess;
  if ((size_t)dev.smem_optin < kSmemBytes) return cudaErrorInvalidConfiguration;
  if (cudaError_t e = allow_max_smem<gemm_tf32x3_kernel>(dev); e != cudaSuccess) return e;
  const int64_t blocks = (g.M + BM - 1) / BM * ((g.N + BN - 1) / BN);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  gemm_tf32x3_kernel<<<(unsigned)blocks, kThreads, kSmemBytes, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace fastaxial::cuda
