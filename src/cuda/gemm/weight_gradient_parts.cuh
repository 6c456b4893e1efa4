// The parts the weight-gradient kernels of weight_gradient.cu are built from (that file's header
// describes the whole), as the attention kernels are from theirs (docs/architecture.md, "How a
// kernel is built"):
//   - the scheduler: which tile of C and which chunk of rows a block takes;
//   - the mainloops, per instruction family: a stage's products for a warp's 32 x 32 piece on
//     mma.sync, a run's for a warpgroup's 64 rows on wgmma (WgRows<Elem, BN>, on the element
//     traits of detail/tf32x3.cuh);
//   - the epilogues: a warp's piece or a warpgroup's rows into C, or into a split's partial tile;
//   - ASums: A's column sums over the block's chunk, where the call asks for them.
// What stays in weight_gradient.cu is the kernels' own: their tile shapes, shared-memory layouts,
// copies and pipelines, and the order in which they call these parts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"
#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"

namespace fastaxial::cuda::weight_gradient_detail {

constexpr int BK = kWeightGradStageRows;                    // rows (positions) a stage, both kernels
constexpr int LDA = kWeightGradLdA, LDB = kWeightGradLdB;  // shared-memory row strides, 8 mod 32

// The kernels' argument: C (N, K) = A^T B over the T rows, in chunks of `rows`.
struct Product {
  const float* a;  // (T, N)
  const float* b;  // (T, K)
  float* out;      // C (S = 1, stride ldc) or partials (S > 1, [S][N][K])
  int64_t lda, ldb, ld_out;
  int64_t T, rows;  // rows summed; rows a chunk (a multiple of BK)
  int N, K, tiles_k;
  bool vec_out;     // out 16-byte aligned with ld_out a multiple of 4: 16-byte stores
  double* a_sums;   // [S][N]: A's column sums over each chunk (the kernels' kSums instances), else null
};

// ---- The scheduler ----------------------------------------------------------
// A block takes one tile of C, kBM x kBN from row m0 and column n0 (blockIdx.x, the tiles
// row-major), over one chunk of rows, r0 .. r0 + rows - 1 (blockIdx.y; rows <=
// kWeightGradMaxChunkRows: int from here on), in `steps` stages of BK rows; a and b point at the
// chunk's first row. The grid's x is the fastest, so the blocks of a chunk run together and read
// its rows from L2.
struct ChunkTile {
  int m0, n0, rows, steps;
  const float* a;
  const float* b;
};
template <int kBM, int kBN>
__device__ __forceinline__ ChunkTile chunk_tile(const Product& p) {
  ChunkTile x;
  x.m0 = (int)(blockIdx.x / (unsigned)p.tiles_k) * kBM, x.n0 = (int)(blockIdx.x % (unsigned)p.tiles_k) * kBN;
  const int64_t r0 = (int64_t)blockIdx.y * p.rows;
  x.rows = (int)max((int64_t)0, min(p.T - r0, p.rows)), x.steps = (x.rows + BK - 1) / BK;
  x.a = p.a + r0 * p.lda;
  x.b = p.b + r0 * p.ldb;
  return x;
}

// ---- mma.sync: a warp's 32 x 32 piece -----------------------------------------
// acc (2 x 4 mma tiles of 16 x 8) to zero.
__device__ __forceinline__ void zero_piece(float (&acc)[2][4][4]) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
}

// The mainloop: acc += the stage's products for the warp's piece: rows (positions) 0 .. BK - 1
// of sa (BK, LDA) and sb (BK, LDB), the piece's columns from wm and wn, in runs of two 8-row
// steps, each run's products in a fresh accumulator then added in fp32. The three products of tf32x3.cuh's
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
      // Rows k + t and k + t + 4; 4 consecutive columns at 4g of the piece (the permutation of
      // weight_gradient.cu).
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

// 8 consecutive values of a row of the output into dst, its columns col .. col + 7 (of K): two
// 16-byte stores where the output allows them (vec) and all 8 lie inside K, else one store an
// element inside K.
__device__ __forceinline__ void store_row(float* dst, const float (&v)[8], int col, int K, bool vec) {
  if (vec && col + 8 <= K) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int c = 0; c < 8; ++c)
      if (col + c < K) dst[c] = v[c];
  }
}

// The epilogue: the warp's piece (acc, as stage_products leaves it) from row row0 and column col0
// of C into the block's output: C itself (one chunk) or the chunk's partial tile. Lane (g, t)
// holds C rows 4g + 2i + h (fragment rows g, g + 8 of m tile i), columns 8t + j + 4e' (fragment
// columns 2t, 2t + 1 of n tile j): 8 consecutive columns a row, two 16-byte stores where the
// output allows them.
__device__ __forceinline__ void store_piece(const float (&acc)[2][4][4], const Product& p, int row0, int col0, int g,
                                            int t) {
  float* const out = p.out + (int64_t)blockIdx.y * p.N * p.K;  // chunk 0: also C itself
  const int col = col0 + 8 * t;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 4 * g + 2 * i + h;
      if (row >= p.N) continue;
      float v[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = acc[i][j][2 * h], v[j + 4] = acc[i][j][2 * h + 1];
      store_row(out + row * p.ld_out + col, v, col, p.K, p.vec_out);
    }
}

// ---- A's column sums ---------------------------------------------------------
// A layer's bias gradient is the column sums of its output gradient, the A of its weight's
// gradient: the blocks of a chunk's first tile column (n0 = 0) take them from the A tiles they
// stream through shared memory anyway, rather than a kernel of their own reading A again. In
// fp64, as column_sums.cu (a sum over every position). Thread x takes column x % 128 of the tile
// and the rows of each stage of parity x / 128, in order; the two parities are then added, even
// first, into a_sums[chunk][m0 + column]. Both kernels hold a stage's A as (BK, LDA) floats,
// columns m0 .. m0 + 127 (zeros past N and past the chunk).
struct ASums {
  static_assert(kWeightGradTileN == 128 && kWeightGradWgmmaTileN == 128, "256 threads: two a column");
  double sum = 0.0;
  // The stage's A tile sa (BK, LDA).
  __device__ __forceinline__ void add(const float* sa) {
    const float* col = sa + threadIdx.x / 128 * LDA + threadIdx.x % 128;
#pragma unroll
    for (int i = 0; i < BK / 2; ++i) sum += (double)col[2 * i * LDA];
  }
  // After the last stage, by every thread of the block: scratch, 128 doubles of shared memory that
  // nothing reads any more once every thread is here.
  __device__ __forceinline__ void store(const Product& p, const ChunkTile& tile, double* scratch) const {
    const int c = threadIdx.x % 128;
    __syncthreads();
    if (threadIdx.x >= 128) scratch[c] = sum;
    __syncthreads();
    if (threadIdx.x < 128 && tile.m0 + c < p.N) p.a_sums[(int64_t)blockIdx.y * p.N + tile.m0 + c] = sum + scratch[c];
  }
};

#if FASTAXIAL_SM90A_DEVICE
// ---- wgmma: a warpgroup's 64 rows ---------------------------------------------
// In element type Elem's products (detail/tf32x3.cuh's traits: Tf32x3 for fp32, 3xTF32).
// This thread's A fragments (detail/wgmma.cuh) of k-steps ks and ks + 1 of the A tile at sa (BK
// rows of LDA floats, [position][row of C]), made with lo rounded (Elem::a<true>: many products
// read them): fragment rows g and g + 8 are the tile's rows a_row = 64 wg + 16 w + 2 g and
// a_row + 1, one 8-byte load a position.
template <class Elem>
__device__ __forceinline__ void load_a_frags(typename Elem::FragA (&f)[2], const float* sa, int a_row, int ks) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float* p = sa + (8 * (ks + k) + t) * LDA + a_row;
    const float2 r0 = *reinterpret_cast<const float2*>(p);            // position 8 (ks + k) + t
    const float2 r1 = *reinterpret_cast<const float2*>(p + 4 * LDA);  // and t + 4
    f[k] = Elem::template a<true>(r0.x, r0.y, r1.x, r1.y);
  }
}

// A warpgroup's rows of the tile through a block's steps: the running sum c, the fresh accumulator
// t of a run, both zeroed here, and the A fragments of a step's two runs (fa: k-steps 0-1,
// fb: 2-3), each loaded a run ahead. The mainloop: load() a run's fragments, issue() its
// products, add() them to c once they have completed; the epilogue: store(). a_row: the thread's
// fragment rows g, g + 8 are the tile's rows a_row, a_row + 1 (the permutation of
// weight_gradient.cu).
template <class Elem, int BN>
struct WgRows {
  using FragA = typename Elem::FragA;
  static constexpr uint32_t kBPlane = BN * BK * 4;  // bytes: a plane of a B stage (Elem::kPlanes of them)
  float c[BN / 2], t[BN / 2];                       // accumulators (m64nBNk8)
  FragA fa[2], fb[2];
  __device__ __forceinline__ WgRows() {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) c[i] = t[i] = 0.0f;
  }
  // f: the fragments of k-steps ks and ks + 1 of the A tile at sa (load_a_frags).
  __device__ __forceinline__ void load(FragA (&f)[2], const float* sa, int a_row, int ks) const {
    load_a_frags<Elem>(f, sa, a_row, ks);
  }
  // The run of k-steps ks and ks + 1 of the B stage at shared address stage into t (fresh), A
  // from the fragments f of those steps, in the backward's order (kSmallFirst); one commit group.
  __device__ __forceinline__ void issue(FragA (&f)[2], uint32_t stage, int ks) {
    const uint64_t b[2] = {desc_sw128(stage + ks * 32), desc_sw128(stage + ks * 32 + 32)};
    Elem::template wgmma_run<BN, true>(t, f, b, kBPlane >> 4);
  }
  // c += t once the run on fragments f has completed: f and t free again.
  __device__ __forceinline__ void add(FragA (&f)[2]) {
    wgmma_wait<0>();
    Elem::fence(f);
    add_to(c, t);
  }
  // The epilogue: c into the block's output, as store_piece. Accumulator d[4 j .. 4 j + 3]
  // (wgmma.cuh): fragment rows g, g + 8, i.e. tile rows a_row and a_row + 1, columns 8 j + 2 t
  // and 8 j + 2 t + 1.
  __device__ __forceinline__ void store(const Product& p, const ChunkTile& tile, int a_row) const {
    float* const out = p.out + (int64_t)blockIdx.y * p.N * p.K;  // chunk 0: also C itself
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = tile.n0 + 8 * j + 2 * (threadIdx.x % 4);
      if (col >= p.K) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = tile.m0 + a_row + h;
        if (row >= p.N) continue;
        const float x = c[4 * j + 2 * h], y = c[4 * j + 2 * h + 1];
        float* const dst = out + row * p.ld_out + col;
        if (p.vec_out && col + 2 <= p.K) {
          *reinterpret_cast<float2*>(dst) = make_float2(x, y);
        } else {
          dst[0] = x;
          if (col + 1 < p.K) dst[1] = y;
        }
      }
    }
  }
};
#endif  // FASTAXIAL_SM90A_DEVICE

}  // namespace fastaxial::cuda::weight_gradient_detail
