// The weight gradients of the backward (weight_gradient.h): C (N, K) = A^T B,
// A (T, N) and B (T, K) row-major, summed over the T rows, on the tensor
// cores with the 3xTF32 split of detail/tf32x3.cuh.
//
//   C[n][k] = sum over t < T of A[t][n] B[t][k]
//   d_Wo   (D, D)  = dy^T o       A = dy (T, D),    B = o (T, D)
//   d_Wqkv (3D, D) = dqkv^T xn    A = dqkv (T, 3D), B = xn (T, D)
//
// Why a kernel of its own: T is every position of the grid (up to millions),
// N and K are D or 3D, so the product is a long reduction into a small
// output. cuBLAS runs it in fp32 on the FFMA units (its TF32 modes lose
// precision), about a third of a large backward on an H200. 3xTF32 on
// mma.sync does the same sums at fp32 accuracy; it was expected at twice the
// FFMA rate and measures at cuBLAS's (perf notes, v32), but it keeps the
// backward off cuBLAS, so that a training call can be replayed as a CUDA
// graph (graph_replay.h).
//
// Shape. A block owns a 128 x 64 tile of C (kWeightGradTileN x
// kWeightGradTileK: rows over N, columns over K) and one chunk of rows
// (positions); grid (tiles, S), blockIdx.x the tile, blockIdx.y the chunk,
// so the blocks that share a chunk's rows run together and read them from L2.
// 256 threads, 8 warps as 4 (rows) x 2 (columns), each warp a 32 x 32 piece:
// 2 x 4 mma tiles of 16 x 8, 32 accumulators a thread, 32 more for the fresh
// accumulator of a run (below), 32 for one step's split fragments; so 128
// registers hold it and two blocks fit an SM (__launch_bounds__(256, 2)), the
// second hiding the first's barrier waits (ptxas, CUDA 13.0, sm_90a and
// sm_80: 126 to 128 registers, no spills, with a stage's two runs in a loop
// rather than unrolled). Why 128 x 64: each row of a chunk is read once per
// tile, so the loads per product fall as the tile grows (192 floats a row for
// 8192 outputs, against 128 for 4096 at 64 x 64: a quarter less L2 traffic),
// and N (D or 3D) is the larger side of d_Wqkv; 128 x 128 would need 16 warps
// at these registers, one block an SM, and half as many tiles to fill the
// device with. Larger warp pieces (64 x 32) would cut the splits and fragment
// loads per mma but need 64 more registers than two blocks allow. Small N or
// K waste no tensor-core time on empty rows: a warp whose piece starts past N
// or K only copies.
//
// Rows reach shared memory through a ring of 3 stages of 32 rows (cp.async,
// two stages in flight while one is computed): a stage is A (32, 128) and
// B (32, 64), each row padded by 8 floats (row strides 136 and 72 words, 8 mod
// 32), 26 KB; 78 KB for the ring (kWeightGradSmemBytes). 16-byte copies where
// A and B are 16-byte aligned with row strides a multiple of 4 floats; else
// 4-byte copies (any stride or offset). Rows past the chunk and columns past N
// or K are zero-filled by the copies (zero products), never read.
//
// The mma operands, reducing over rows: mma.m16n8k8's A operand is 16 x 8
// (m x k) = rows m of C, 8 positions, read from the A tile stored [k][m]; its
// B operand is 8 x 8 (k x n) read from the B tile stored [k][n]. The m and n
// indices are permuted within a warp's piece (a product is the same under any
// relabelling of C's rows and columns, undone at the store): lane (g, t),
// g = lane / 4, t = lane % 4, reads rows t and t + 4 of each tile and, of
// each, the 4 consecutive floats at 4g of the warp's 32 columns, one 16-byte
// load, which feed both its m tiles (fragment rows g, g + 8 of m tile i are
// C rows 4g + 2i, 4g + 2i + 1) or all four of its n tiles (fragment column g
// of n tile j is C column 4g + j). With the strides 8 mod 32 a quarter warp's
// 16-byte loads (t = 0..3, g = 2q, 2q + 1) cover the 32 banks once. In the C
// fragments a lane then holds rows 4g .. 4g + 3 and columns 8t .. 8t + 7 of
// the piece: two 16-byte stores a row.
//
// Accuracy (tf32x3.cuh): each element is split in registers as it is loaded
// (hi + lo); per run of two 8-row steps the products lo*hi, hi*lo, hi*hi go
// into a fresh accumulator, which is then added in fp32 to the running sum:
// the tensor core truncates its own adds, so its chains stay short, and a
// position's terms are summed as an fp32 dot product would (the sum of the
// chunk's runs in order). Error: the split's (at most about 3 2^-22 of each
// term, typically far less) plus that of fp32 sums of T / 16 runs, against T
// terms for a plain fp32 loop (test_weight_gradient.cpp bounds it by that
// loop's error plus the split's).
//
// Split over rows, for the device's sake and determinism: with few tiles
// (D 64: one tile for d_Wo, two for d_Wqkv) one block a tile would leave the
// device idle, so the rows are cut into S chunks, S from (T, N, K, SMs,
// shared memory) alone (plan.h's weight_gradient_split: tiles x S about two
// waves of the resident blocks, chunks of at least 256 rows). S = 1: the
// blocks store C. S > 1: each stores its partial tile into partials [S][N][K]
// and a second kernel adds each element's S partials: 8 lanes, lane l adding
// chunks l, l + 8, ... in order, then the lanes' sums in lane order. Every
// sum has an order fixed by S, no atomics: the same bits on every call.
#include "weight_gradient.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/tf32x3.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int BM = kWeightGradTileN, BN = kWeightGradTileK;  // a block's tile of C: 128 x 64
constexpr int BK = kWeightGradStageRows, kStages = kWeightGradStages;
constexpr int LDA = kWeightGradLdA, LDB = kWeightGradLdB;  // shared-memory row strides, 8 mod 32
constexpr int kWarpsN = 2, kThreads = 256;                  // warps 4 (rows) x 2 (columns)
constexpr int WM = 32, WN = 32;                             // a warp's piece of the tile
constexpr int kStageFloats = BK * (LDA + LDB);              // A (BK, LDA), then B (BK, LDB)
static_assert(BM == 4 * WM && BN == kWarpsN * WN && kThreads == 32 * 4 * kWarpsN, "8 warps of 32 x 32");
static_assert(LDA % 32 == 8 && LDB % 32 == 8, "fragment loads on distinct banks");
static_assert(BK % 16 == 0, "stages of whole runs of two 8-row steps");
static_assert((size_t)kStages * kStageFloats * sizeof(float) == kWeightGradSmemBytes, "plan.h's size");

constexpr int kSumCols = 32, kSumLanes = 8;  // the partials' total: a block of 32 elements x 8 lanes

struct Product {
  const float* a;  // (T, N)
  const float* b;  // (T, K)
  float* out;      // C (S = 1, stride ldc) or partials (S > 1, [S][N][K])
  int64_t lda, ldb, ld_out;
  int64_t T, rows;  // rows summed; rows a chunk (a multiple of BK)
  int N, K, tiles_k;
  bool vec_out;  // out 16-byte aligned with ld_out a multiple of 4: 16-byte stores
};

__device__ __forceinline__ uint32_t smem_addr(const float* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 4 bytes from global memory at src to shared memory at dst (a shared-space address); with
// src_bytes = 0 nothing is read and the word is zeroed.
__device__ __forceinline__ void copy_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// COLS columns from col0 of rows row .. row + BK - 1 of m (stride ld) into s (BK, LD): rows
// from `end` on and columns from `width` on zero-filled, never read. kVec: 16-byte copies (m and
// ld 16-byte aligned), else 4-byte ones. A thread copies one column (or 16-byte piece) of every
// kRowStep-th row, so its column, bounds and addresses are worked out once a stage.
template <int COLS, int LD, bool kVec>
__device__ __forceinline__ void copy_tile(float* s, const float* m, int64_t ld, int row, int end, int col0,
                                          int width) {
  constexpr int kFloats = kVec ? 4 : 1;         // floats a copy
  constexpr int kPerRow = COLS / kFloats;       // copies a row
  constexpr int kRowStep = kThreads / kPerRow;  // rows between a thread's copies
  static_assert(kThreads % kPerRow == 0 && BK % kRowStep == 0, "whole rows a pass of the block");
  const int r = threadIdx.x / kPerRow, c = threadIdx.x % kPerRow * kFloats;
  const int left = width - col0 - c;  // floats of the row from the thread's column on
  const int bytes = left <= 0 ? 0 : 4 * min(kFloats, left);
  const int rows = min(end - row, BK) - r;  // the thread's rows before `end`, from r
  const float* src = m + (int64_t)(row + r) * ld + col0 + c;
  const uint32_t dst = smem_addr(s + r * LD + c);
#pragma unroll
  for (int i = 0; i < BK / kRowStep; ++i) {
    const bool in = bytes > 0 && i * kRowStep < rows;
    const float* from = in ? src + i * kRowStep * ld : m;  // a valid address where nothing is read
    if constexpr (kVec)
      copy_async16(dst + i * kRowStep * LD * 4, from, in ? bytes : 0);
    else
      copy_async4(dst + i * kRowStep * LD * 4, from, in ? 4 : 0);
  }
}

// acc += the stage's products for the warp's piece: rows (positions) 0 .. BK - 1 of sa (BK, LDA)
// and sb (BK, LDB), the piece's columns from wm and wn, in runs of two 8-row steps, each run's
// products in a fresh accumulator then added in fp32. The three products of tf32x3.cuh's
// three_products (lo*hi, hi*lo, then hi*hi, the same order per element) issued across the 8 mma
// tiles in turn, so that consecutive mma are independent.
__device__ __forceinline__ void stage_products(float (&acc)[2][4][4], const float* sa, const float* sb, int wm,
                                               int wn, int g, int t) {
  // Not unrolled: unrolled, the compiler moved the second run's loads ahead and spilled.
#pragma unroll 1
  for (int run = 0; run < BK / 16; ++run) {
    float part[2][4][4];
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const int k = 16 * run + 8 * step;
      // Rows k + t and k + t + 4; 4 consecutive columns at 4g of the piece (the permutation above).
      const float4 a0 = *reinterpret_cast<const float4*>(sa + (k + t) * LDA + wm + 4 * g);
      const float4 a1 = *reinterpret_cast<const float4*>(sa + (k + t + 4) * LDA + wm + 4 * g);
      const float4 b0 = *reinterpret_cast<const float4*>(sb + (k + t) * LDB + wn + 4 * g);
      const float4 b1 = *reinterpret_cast<const float4*>(sb + (k + t + 4) * LDB + wn + 4 * g);
      // m tile i: fragment rows g, g + 8 = C rows 4g + 2i, 4g + 2i + 1 (k = t, then t + 4).
      const FragA fa[2] = {make_a(a0.x, a0.y, a1.x, a1.y), make_a(a0.z, a0.w, a1.z, a1.w)};
      // n tile j: fragment column g = C column 4g + j.
      const FragB fb[4] = {make_b(b0.x, b1.x), make_b(b0.y, b1.y), make_b(b0.z, b1.z), make_b(b0.w, b1.w)};
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (step == 0)
            mma_tf32_first(part[i][j], fa[i].lo, fb[j].hi);
          else
            mma_tf32(part[i][j], fa[i].lo, fb[j].hi);
        }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_tf32(part[i][j], fa[i].hi, fb[j].lo);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_tf32(part[i][j], fa[i].hi, fb[j].hi);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += part[i][j][e];
  }
}

// The block's tile of C (blockIdx.x) over its chunk of rows (blockIdx.y), into p.out: C itself
// (one chunk) or the chunk's partial tile. kVec: 16-byte copies.
template <bool kVec>
__global__ void __launch_bounds__(kThreads, 2) chunk_product_kernel(const Product p) {
  extern __shared__ float4 smem4[];
  float* const sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  // Warp w: rows 32 (w / 2), columns 32 (w % 2). Where N <= 64 the working warps are 0..3, one
  // on each of the SM's sub-partitions (warp w on w % 4), not two on each of two.
  const int wm = warp / kWarpsN * WM, wn = warp % kWarpsN * WN;
  const int m0 = (int)(blockIdx.x / (unsigned)p.tiles_k) * BM, n0 = (int)(blockIdx.x % (unsigned)p.tiles_k) * BN;
  // The chunk: rows r0 .. r0 + rows - 1 (rows <= kWeightGradMaxChunkRows: int from here on).
  const int64_t r0 = (int64_t)blockIdx.y * p.rows;
  const int rows = (int)max((int64_t)0, min(p.T - r0, p.rows)), steps = (rows + BK - 1) / BK;
  const float* const a = p.a + r0 * p.lda;
  const float* const b = p.b + r0 * p.ldb;
  const bool active = m0 + wm < p.N && n0 + wn < p.K;  // else the warp's piece is all padding

  grid_dependency_wait();
  allow_dependent_launch();

  const auto copy_stage = [&](int stage, int step) {
    float* sa = sm + stage * kStageFloats;
    copy_tile<BM, LDA, kVec>(sa, a, p.lda, step * BK, rows, m0, p.N);
    copy_tile<BN, LDB, kVec>(sa + BK * LDA, b, p.ldb, step * BK, rows, n0, p.K);
  };
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // The ring: stages 0 .. kStages - 2 in flight first; a group committed every step, empty or
  // not, so that wait<kStages - 2> always means "this step's copies are in".
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) copy_stage(s, s);
    copy_async_commit();
  }
  int read = 0, write = kStages - 1;
  for (int i = 0; i < steps; ++i) {
    copy_async_wait<kStages - 2>();  // this thread's copies of step i
    // Every thread's copies of step i are in, and every warp is done with step i - 1, whose
    // stage is copied into next.
    __syncthreads();
    if (i + kStages - 1 < steps) copy_stage(write, i + kStages - 1);
    copy_async_commit();
    if (active) {
      const float* sa = sm + read * kStageFloats;
      stage_products(acc, sa, sa + BK * LDA, wm, wn, g, t);
    }
    read = read == kStages - 1 ? 0 : read + 1;
    write = write == kStages - 1 ? 0 : write + 1;
  }

  if (!active) return;
  // C rows 4g + 2i + h (fragment rows g, g + 8 of m tile i), columns 8t + j + 4e' (fragment
  // columns 2t, 2t + 1 of n tile j): 8 consecutive columns a row.
  float* const out = p.out + (int64_t)blockIdx.y * p.N * p.K;  // chunk 0: also C itself
  const int col = n0 + wn + 8 * t;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + wm + 4 * g + 2 * i + h;
      if (row >= p.N) continue;
      float v[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = acc[i][j][2 * h], v[j + 4] = acc[i][j][2 * h + 1];
      float* dst = out + row * p.ld_out + col;
      if (p.vec_out && col + 8 <= p.K) {
        *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
      } else {
#pragma unroll
        for (int c = 0; c < 8; ++c)
          if (col + c < p.K) dst[c] = v[c];
      }
    }
}

// c (N, K, stride ldc) = the sum of the `splits` partial tiles [splits][N][K]. Element e (of N K,
// row-major) by threadIdx.x of a block of 32 elements, lane threadIdx.y adding partials y,
// y + 8, ... in order, then lane 0 the 8 lanes' sums in order. Lanes rather than one thread an
// element: with a small C (D 64: 4096 elements) and hundreds of chunks, one thread would wait
// out a memory latency for every few chunks.
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    split_total_kernel(const float* __restrict__ partials, int64_t splits, int N, int K, float* __restrict__ c,
                       int64_t ldc) {
  grid_dependency_wait();
  allow_dependent_launch();
  __shared__ float lane_sums[kSumLanes][kSumCols];
  const int64_t nk = (int64_t)N * K, e = (int64_t)blockIdx.x * kSumCols + threadIdx.x;
  float sum = 0.0f;
  if (e < nk) {
#pragma unroll 4
    for (int64_t s = threadIdx.y; s < splits; s += kSumLanes) sum += partials[s * nk + e];
  }
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || e >= nk) return;
  float total = 0.0f;
#pragma unroll
  for (int l = 0; l < kSumLanes; ++l) total += lane_sums[l][threadIdx.x];
  c[e / K * ldc + e % K] = total;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <bool kVec>
cudaError_t launch_chunks(const Product& p, unsigned tiles, unsigned splits, const DeviceCaps& dev,
                          cudaStream_t stream) {
  constexpr auto kernel = chunk_product_kernel<kVec>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;  // 78 KB: past the default 48
  return launch_kernel<kernel>(dim3(tiles, splits), dim3(kThreads), kWeightGradSmemBytes, stream, dev, p);
}

}  // namespace

bool weight_gradient_available(const DeviceCaps& dev) { return weight_gradient_fits(dev); }

cudaError_t weight_gradient(const WeightGradientArgs& g, float* partials, size_t partials_bytes, const DeviceCaps& dev,
                            cudaStream_t stream) {
  if (g.T < 0 || g.N < 0 || g.K < 0 || g.ldc < g.K) return cudaErrorInvalidValue;
  if (g.N == 0 || g.K == 0) return cudaSuccess;
  if (g.c == nullptr) return cudaErrorInvalidValue;
  if (g.T > 0 && (g.a == nullptr || g.b == nullptr || g.lda < g.N || g.ldb < g.K)) return cudaErrorInvalidValue;
  const WeightGradSplit split = weight_gradient_split(g.T, g.N, g.K, dev);
  if (split.splits > 1 &&
      (partials == nullptr || partials_bytes / sizeof(float) / (size_t)g.N / (size_t)g.K < (size_t)split.splits))
    return cudaErrorInvalidValue;
  const int64_t tiles_k = (g.K + BN - 1) / BN, tiles = (g.N + BM - 1) / BM * tiles_k;
  if (tiles > INT_MAX) return cudaErrorInvalidValue;  // grid.x

  Product p;
  p.a = g.a, p.b = g.b, p.lda = g.lda, p.ldb = g.ldb;
  p.T = g.T, p.rows = split.rows, p.N = g.N, p.K = g.K, p.tiles_k = (int)tiles_k;
  p.out = split.splits > 1 ? partials : g.c;
  p.ld_out = split.splits > 1 ? g.K : g.ldc;
  p.vec_out = aligned16(p.out) && p.ld_out % 4 == 0;
  const bool vec = aligned16(g.a) && aligned16(g.b) && g.lda % 4 == 0 && g.ldb % 4 == 0;
  if (cudaError_t e = vec ? launch_chunks<true>(p, (unsigned)tiles, (unsigned)split.splits, dev, stream)
                          : launch_chunks<false>(p, (unsigned)tiles, (unsigned)split.splits, dev, stream);
      e != cudaSuccess)
    return e;
  if (split.splits == 1) return cudaSuccess;
  const int64_t blocks = ((int64_t)g.N * g.K + kSumCols - 1) / kSumCols;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;  // not reached: S > 1 only for small products
  return launch_kernel<split_total_kernel>(dim3((unsigned)blocks), dim3(kSumCols, kSumLanes), 0, stream, dev,
                                           static_cast<const float*>(partials), split.splits, g.N, g.K, g.c, g.ldc);
}

}  // namespace fastaxial::cuda
