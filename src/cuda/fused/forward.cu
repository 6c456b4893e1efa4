// One attention pass with a thread block per whole sequence, every product on
// the tensor cores (3xTF32 split for fp32 accuracy: detail/tf32x3.cuh): mma.sync, or
// at dim 64 with two heads or more and L <= 64 the projections on wgmma
// (sm_90a; below).
//
// For sequence n of the axis, x is its (L, D) positions (strided in the grid):
//   xs  = LayerNorm(x)                  (LP, D) split pairs, LP = 16*MT >= L
//   q, k, v = xs @ Wqkv^T               (LP, D) each; v stored transposed
//   o_h = softmax(q_h k_h^T * scale) v_h  per head, into xs's space (split pairs)
//   dst = x + o @ Wout^T + bout
// Why this shape: axial sequences are short (tens to a hundred positions), so
// a whole sequence's q, k and v fit one block's shared memory. Keys are then
// projected once per sequence, and each attention row is complete in one
// warp's registers: an exact softmax, no online rescaling, no block barrier
// inside the attention. Four barriers per sequence in all.
//
// A block runs one sequence per SM at a time with 8 warps (12 with wgmma), so
// its time is the latency of that chain: the instructions per warp and the
// waits between them are what count (docs/perf-notes.md). Hence:
// - xs and o, which every warp reads whole, are split once where they are
//   written: into (hi, lo) pairs whose fragments come in 16-byte loads, or
//   for wgmma into hi and lo planes in its swizzled layout;
// - q, k and v, read by few warps, stay fp32, in layouts whose fragments are
//   8-byte loads (k permuted inside each 8, detail/tf32x3.cuh); q carries the softmax
//   scale times log2(e), so scores come out in base 2;
// - weights are read from global memory (L2) as fragments and split in
//   registers: for mma.sync a group of four 8-deep steps ahead of the
//   products, for wgmma a warpgroup's 64-row tile at a time; the first are
//   issued before the barrier in front of the product, and each block first
//   asks DRAM for a slice of them, so that they are all in L2 by then;
// - each run of two 8-deep steps goes into a fresh accumulator (detail/tf32x3.cuh);
// - the norm weights and output bias sit in shared memory; a block's next
//   sequence arrives during the current one's output product.
//
// Work split (mma.sync, 8 warps): the projections go by (16-row, 8-column)
// tiles of the output, register-blocked MI x NI per warp. With wgmma (three
// warpgroups) the weights are the A operand: each warpgroup computes 64-row
// tiles of [q | k | v]^T for a range of positions, and two of them the output
// product. Either way the attention goes by (head, 16-query tile), on
// mma.sync: scores (16, LP) live in registers, P is fed to the P @ V product
// straight from the score registers (the key order inside each group of 8
// keys is permuted to match the A-fragment layout, and V is read in the same
// order), and o_h goes to shared memory.
//
// Padded rows (L <= i < LP) are zero in xs, so their q, k, v are zero;
// padded keys are masked out of the softmax; padded queries are never stored.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../common/plan.h"
#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/launch.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/warp_ops.cuh"
#include "../detail/wgmma.cuh"
#include "../kernels.h"

namespace fastaxial::cuda {
namespace {

// Warps of a block: 8 for the mma.sync products, 12 (three warpgroups) for
// the wgmma ones (below).
template <bool kWg>
constexpr int kWarps = kWg ? 12 : 8;
constexpr float kLog2e = 1.4426950408889634f;

struct TcArgs {
  AxisView view;
  int D, heads;
  float eps, q_scale;  // q_scale = log2(e) / sqrt(head_dim)
  AxisWeights w;
  const float* src;
  float* dst;
};

// B fragments of one warp for four 8-deep steps k0 .. k0 + 32 of its NI
// 8-column tiles: elements (8j + g, k + 2t) and (8j + g, k + 2t + 1) of W
// (row stride K), raw fp32, split at use. Steps past K are not loaded.
template <int NI>
struct WeightGroup {
  float2 w[4][NI];
};

template <int NI>
__device__ __forceinline__ void load_weights(WeightGroup<NI>& G, const float* __restrict__ W, int K, int k0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int j = 0; j < NI; ++j)
      if (k0 + 8 * s < K)
        G.w[s][j] = __ldg(reinterpret_cast<const float2*>(W + (int64_t)(8 * j + g) * K + k0 + 8 * s + 2 * t));
}

// c (16 MI x 8 NI) = A[0:16 MI, 0:K] @ W[0:8 NI, 0:K]^T for one warp. A is
// split pairs in shared memory (row stride lda words), W in global memory
// (row stride K); K is a multiple of 8. G holds W's first group on entry; the
// next group is loaded while one is multiplied, and the last step loads the
// first group of `next_W` (the warp's next item; nullptr: none) into G.
template <int MI, int NI>
__device__ void warp_gemm(float (&c)[MI][NI][4], const float* A, int lda, const float* __restrict__ W, int K,
                          WeightGroup<NI>& G, const float* __restrict__ next_W) {
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += 32) {
    const WeightGroup<NI> cur = G;
    if (k0 + 32 < K) load_weights(G, W, K, k0 + 32);
    else if (next_W != nullptr) load_weights(G, next_W, K, 0);
#pragma unroll
    for (int s = 0; s < 4; s += 2) {  // runs of two steps per fresh accumulator (detail/tf32x3.cuh)
      const int k = k0 + 8 * s;
      if (k >= K) break;
      FragA a[MI], a2[MI];
#pragma unroll
      for (int i = 0; i < MI; ++i) a[i] = load_a_split(A + 16 * i * lda + 2 * k, lda);
      if (k + 8 < K) {
#pragma unroll
        for (int i = 0; i < MI; ++i) a2[i] = load_a_split(A + 16 * i * lda + 2 * (k + 8), lda);
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const FragB b = make_b(cur.w[s][j].x, cur.w[s][j].y);
          const FragB b2 = make_b(cur.w[s + 1][j].x, cur.w[s + 1][j].y);
#pragma unroll
          for (int i = 0; i < MI; ++i) mma_3xtf32_x2(c[i][j], a[i], b, a2[i], b2);
        }
      } else {
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const FragB b = make_b(cur.w[s][j].x, cur.w[s][j].y);
#pragma unroll
          for (int i = 0; i < MI; ++i) mma_3xtf32(c[i][j], a[i], b);
        }
      }
    }
  }
}

// Offset of sequence n's first position, as AxisView::offset but dividing
// in 32 bits (the plan keeps the sequence count below 2^31): the
// 64-bit division is a called subroutine, and each block's first tile
// waits on it.
__device__ __forceinline__ int64_t seq_offset(const AxisView& v, int64_t n) {
  const uint32_t inner = (uint32_t)v.inner, b = (uint32_t)n / inner, i = (uint32_t)n - b * inner;
  return b * v.batch_stride + i * v.seq_stride;
}

// Rows 0..L of sequence n into x (row stride ld) by cp.async, every 16-byte
// piece its own copy so the whole tile is in flight at once. Not waited for.
// Piece (row r, columns 4c..4c+3) advances by NT (the block's threads) pieces
// without dividing.
template <int NT>
__device__ void load_tile(float* x, int ld, const TcArgs& a, int64_t base, int L) {
  const int per_row = a.D / 4, dr = NT / per_row, dc = NT % per_row;
  for (int r = threadIdx.x / per_row, c = threadIdx.x % per_row; r < L;) {
    copy_async16(x + r * ld + 4 * c, a.src + base + r * a.view.pos_stride + 4 * c);
    r += dr, c += dc;
    if (c >= per_row) c -= per_row, ++r;
  }
  copy_async_commit();
}

// Every block reads the pass's weights, and the benchmark (like a model's
// forward) finds them outside L2: each block asks DRAM for a slice of them at
// once, so that later weight loads, which depend on the products, hit L2.
template <int NT>
__device__ void prefetch_weights_l2(const TcArgs& a) {
  const int64_t D = a.D, lines_qkv = 3 * D * D / 32, lines = lines_qkv + D * D / 32;  // 128-byte lines
  for (int64_t i = (int64_t)blockIdx.x * NT + threadIdx.x; i < lines; i += (int64_t)gridDim.x * NT) {
    const float* p = i < lines_qkv ? a.w.qkv_weight + 32 * i : a.w.out_weight + 32 * (i - lines_qkv);
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
  }
}

// params (3 D) = [LayerNorm weight | LayerNorm bias | output bias], by cp.async,
// committed with the first tile.
template <int NT>
__device__ void load_params(float* params, const TcArgs& a) {
  const int per_vec = a.D / 4;
  for (int e = threadIdx.x; e < 3 * per_vec; e += NT) {
    const int which = e / per_vec, c = 4 * (e % per_vec);
    const float* src = which == 0 ? a.w.norm_weight : which == 1 ? a.w.norm_bias : a.w.out_bias;
    copy_async16(params + which * a.D + c, src + c);
  }
}

// LayerNorm of x's rows 0..L (fp32, stride ldq) with the weight and bias in
// params, rows L..LP zero: store(r, c, y) takes piece c (elements 4c..4c+3)
// of row r. Eight lanes per row (float4 pieces), so a warp normalises four
// rows at once with three-step reductions (detail/warp_ops.cuh). Rows of up to 8
// kPieces pieces stay in registers between the two passes and the store (one
// read of shared memory, loops unrolled); longer rows are read again in each.
template <int LP, int NT, class Store>
__device__ void layer_norm_tile(const float* x, int ldq, const float* params, const TcArgs& a, int L, Store store) {
  constexpr int kPieces = 4;  // a lane's float4 pieces held in registers: dims up to 128
  const int part = threadIdx.x % 8, chunks = a.D / 4;
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4* gamma = reinterpret_cast<const float4*>(params);
  const float4* beta = reinterpret_cast<const float4*>(params + a.D);
  const auto normed = [&](float4 v, int c, float mean, float rstd) {
    const float4 gm = gamma[c], bt = beta[c];
    return make_float4((v.x - mean) * rstd * gm.x + bt.x, (v.y - mean) * rstd * gm.y + bt.y,
                       (v.z - mean) * rstd * gm.z + bt.z, (v.w - mean) * rstd * gm.w + bt.w);
  };
  for (int r = threadIdx.x / 8; r < LP; r += NT / 8) {  // the same trip count for a whole warp
    const bool valid = r < L;
    const float4* row = reinterpret_cast<const float4*>(x + r * ldq);
    if (chunks <= 8 * kPieces) {
      float4 v[kPieces];
#pragma unroll
      for (int i = 0; i < kPieces; ++i) v[i] = valid && part + 8 * i < chunks ? row[part + 8 * i] : zero;
      const float2 stats = row_mean_rstd<8>(a.D, a.eps, [&](auto f) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kPieces; ++i)
          if (part + 8 * i < chunks) sum += (f(v[i].x) + f(v[i].y)) + (f(v[i].z) + f(v[i].w));
        return sum;
      });
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int c = part + 8 * i;
        if (c >= chunks) break;
        store(r, c, valid ? normed(v[i], c, stats.x, stats.y) : zero);
      }
      continue;
    }
    const float2 stats = row_mean_rstd<8>(a.D, a.eps, [&](auto f) {
      float sum = 0.0f;
      for (int c = part; c < chunks; c += 8) {
        const float4 v = valid ? row[c] : zero;
        sum += (f(v.x) + f(v.y)) + (f(v.z) + f(v.w));
      }
      return sum;
    });
    for (int c = part; c < chunks; c += 8) {
      store(r, c, valid ? normed(row[c], c, stats.x, stats.y) : zero);
    }
  }
}

// o_h for (head h, query tile mt) = softmax(q_h k_h^T * scale) v_h: columns
// h*HD.. of o, through store(r, c, x, y), which takes elements c (even) and
// c + 1 of row r. One warp; L valid keys of LP. q (scaled, base 2) and k:
// stride ldq; vt: (D, ldv).
template <int MT, int HD, class Store>
__device__ void attend_tile(const float* q, const float* k, int ldq, const float* vt, int ldv, int h, int mt, int L,
                            Store store) {
  constexpr int NT = 2 * MT;  // 8-key groups
  constexpr int KS = HD / 8;  // 8-feature steps of a head
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int hc = h * HD, r0 = 16 * mt;

  // s (16, LP) = q_h[r0 : r0+16] k_h^T in base 2; this thread holds rows g
  // and g+8, keys 8j + 2t and 8j + 2t + 1 of each group j.
  FragA qa[KS];
#pragma unroll
  for (int s = 0; s < KS; ++s) qa[s] = load_a_perm(q + r0 * ldq + hc + 8 * s, ldq);
  float s[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
    const float* kj = k + 8 * j * ldq + hc;
    if constexpr (KS == 1) {
      mma_3xtf32(s[j], qa[0], load_bt_perm(kj, ldq));
    } else {
#pragma unroll
      for (int ks = 0; ks < KS; ks += 2)
        mma_3xtf32_x2(s[j], qa[ks], load_bt_perm(kj + 8 * ks, ldq), qa[ks + 1], load_bt_perm(kj + 8 * ks + 8, ldq));
    }
  }

  // Exact softmax per row: a row's LP scores are spread over the 4 lanes of a
  // quad (same g), so max and sum reduce over lanes xor 1 and 2.
  if (L < 16 * MT) {  // padded keys
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (8 * j + 2 * t + e >= L) s[j][e] = s[j][2 + e] = -INFINITY;
  }
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
    mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
  }
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, m));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, m));
  }
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[j][e] = exp2f(s[j][e] - mx0);  // 0 for masked keys
      s[j][2 + e] = exp2f(s[j][2 + e] - mx1);
      sum0 += s[j][e];
      sum1 += s[j][2 + e];
    }
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, m);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, m);
  }

  // o_h (16, HD) = p v_h. The k index of the product is the key; inside group
  // j, A-column t stands for key 8j + 2t and column t + 4 for key 8j + 2t + 1,
  // so this thread's score registers are its A fragment as they are, and the
  // B fragment is keys 8j + 2t, 8j + 2t + 1 of the transposed values' row g.
  float acc[KS][4];
#pragma unroll
  for (int n = 0; n < KS; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
#pragma unroll
  for (int j = 0; j < NT; j += 2) {  // NT is even: runs of two key groups
    const FragA pa = make_a(s[j][0], s[j][2], s[j][1], s[j][3]);
    const FragA pb = make_a(s[j + 1][0], s[j + 1][2], s[j + 1][1], s[j + 1][3]);
#pragma unroll
    for (int n = 0; n < KS; ++n) {
      const float* vn = vt + (hc + 8 * n) * ldv + 8 * j;
      mma_3xtf32_x2(acc[n], pa, load_bt_perm(vn, ldv), pb, load_bt_perm(vn + 8, ldv));
    }
  }
  const float inv0 = 1.0f / sum0, inv1 = 1.0f / sum1;
#pragma unroll
  for (int n = 0; n < KS; ++n) {
    const int c = hc + 8 * n + 2 * t;
    store(r0 + g, c, acc[n][0] * inv0, acc[n][1] * inv0);
    store(r0 + g + 8, c, acc[n][2] * inv1, acc[n][3] * inv1);
  }
}

// ---- Products on wgmma (sm_90a; dim 64, head_dim below 64, L <= 64) ---------
// At dim 64 a sequence's projections are [q | k | v]^T (192, LP) =
// Wqkv (192, 64) @ xs^T and (o @ Wout^T)^T (64, LP) = Wout (64, 64) @ o^T:
// the weights are wgmma's A operand (64-row tiles, from registers, split
// there) and the sequence its B operand, N = positions. A warpgroup's product
// is then 24 asynchronous instructions instead of each warp's chain of
// mma.sync, fragment loads and splits, whose latency bounded the mma.sync
// products (docs/perf-notes.md). Three warpgroups a block: each takes
// 64-row tiles of [q | k | v]^T, and two of them half the positions each of
// the output product.

// xs, later o, as wgmma's B operand: LP rows of 64 values in two planes (hi,
// then lo), each two 32-value chunks of LP 128-byte rows in the 128-byte
// swizzled layout (detail/wgmma.cuh). Inside each group of 8 the values are permuted
// as in the rest of this file (detail/tf32x3.cuh): slot t holds element 2t, slot
// t + 4 element 2t + 1, so a thread's A operand comes in 8-byte loads of W.
struct WgOperand {
  float* hi;  // the lo plane follows
  int lp;
  __device__ __forceinline__ int plane() const { return lp * 64; }
  // Word of element e of row n.
  __device__ __forceinline__ int at(int n, int e) const {
    const int k = (e & ~7) | ((e & 7) >> 1) | ((e & 1) << 2);  // the slot
    return (k >> 5) * lp * 32 + n * 32 + ((((k >> 2) & 7) ^ (n & 7)) << 2) + (k & 3);
  }
  __device__ __forceinline__ void put(int i, float x) const {
    uint32_t h, l;
    split(x, h, l);
    hi[i] = __uint_as_float(h), hi[plane() + i] = __uint_as_float(l);
  }
  // Elements 4c..4c+3 of row n: slots of 4c and 4c + 2 are adjacent, as are
  // those of 4c + 1 and 4c + 3.
  __device__ __forceinline__ void put_piece(int n, int c, float4 y) const {
    const int i0 = at(n, 4 * c), i1 = at(n, 4 * c + 1);
    uint32_t h[4], l[4];
    split(y.x, h[0], l[0]), split(y.y, h[1], l[1]), split(y.z, h[2], l[2]), split(y.w, h[3], l[3]);
    *reinterpret_cast<uint2*>(hi + i0) = make_uint2(h[0], h[2]);
    *reinterpret_cast<uint2*>(hi + i1) = make_uint2(h[1], h[3]);
    *reinterpret_cast<uint2*>(hi + plane() + i0) = make_uint2(l[0], l[2]);
    *reinterpret_cast<uint2*>(hi + plane() + i1) = make_uint2(l[1], l[3]);
  }
};

// A thread's rows r and r + 8 of a 64-row weight tile (row stride 64; W
// points at row r), raw fp32: elements 8s + 2t and 8s + 2t + 1 of each 8-wide
// step s, its warp's A operand of the step with k permuted as above.
struct WgRows {
  float2 w[8][2];
};

__device__ __forceinline__ void load_rows(WgRows& R, const float* __restrict__ W) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    R.w[s][0] = __ldg(reinterpret_cast<const float2*>(W + 8 * s + 2 * t));
    R.w[s][1] = __ldg(reinterpret_cast<const float2*>(W + 8 * 64 + 8 * s + 2 * t));
  }
}

#if FASTAXIAL_SM90A_DEVICE
// The three products of steps s0 and s0 + 1 into t (fresh), A from R split
// into f, one commit group. b: the B operand's hi-plane descriptor
// (detail/wgmma.cuh) at the warpgroup's first row; lo: bytes to the lo plane;
// chunk: bytes to the next 32 values.
template <int NW>
__device__ __forceinline__ void wg_run(float (&t)[NW / 2], FragA (&f)[2], const WgRows& R, int s0, uint64_t b,
                                       uint32_t lo, uint32_t chunk) {
  uint64_t d[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int s = s0 + k;
    const float2 r0 = R.w[s][0], r1 = R.w[s][1];
    f[k] = make_a(r0.x, r1.x, r0.y, r1.y);
    d[k] = b + ((s / 4 * chunk + s % 4 * 32) >> 4);  // the address field counts 16 bytes
  }
  wgmma_3xtf32_run<NW>(t, f, d, lo >> 4);
}
#endif

// c (64, NW) = W (64, 64) @ B^T for one warpgroup: R its rows of W, B NW rows
// of the operand at descriptor b. Runs of two steps go into fresh
// accumulators (detail/tf32x3.cuh), two alternating, so one run's products go on
// while the other's are added; the block's other warpgroups hide the waits.
template <int NW>
__device__ __forceinline__ void wg_product(float (&c)[NW / 2], const WgRows& R, uint64_t b, uint32_t lo,
                                           uint32_t chunk) {
#if FASTAXIAL_SM90A_DEVICE
  float t0[NW / 2], t1[NW / 2];
  FragA f0[2], f1[2];
#pragma unroll
  for (int i = 0; i < NW / 2; ++i) c[i] = t0[i] = t1[i] = 0.0f;
  wg_run<NW>(t0, f0, R, 0, b, lo, chunk);
  wg_run<NW>(t1, f1, R, 2, b, lo, chunk);
  wgmma_wait<1>();
  fence_frags(f0);
  add_to(c, t0);
  wg_run<NW>(t0, f0, R, 4, b, lo, chunk);
  wgmma_wait<1>();
  fence_frags(f1);
  add_to(c, t1);
  wg_run<NW>(t1, f1, R, 6, b, lo, chunk);
  wgmma_wait<1>();
  fence_frags(f0);
  add_to(c, t0);
  wgmma_wait<0>();
  fence_frags(f1);
  add_to(c, t1);
#else
  (void)c, (void)R, (void)b, (void)lo, (void)chunk;
  __trap();  // built without sm_90a: launch_fused launches no wgmma variant
#endif
}

// ---- The kernel's steps -----------------------------------------------------
// The kernel is one sequence of steps for both product variants: load the
// tile, layer_norm, project_qkv, attend, project_out (which stores dst).
// FusedBlock holds what every step reads, computed once at the kernel's top
// and passed to each step; MmaSteps and WgmmaSteps are the two variants of
// the steps, holding only the registers that one sequence carries from step
// to step (weights and residual rows in flight). The two stay apart: arrays
// indexed in unrolled loops keep the object holding them in memory until the
// loops are unrolled, and with it any scalar beside them, whose offsets
// would then be computed in 64 bits and away from where they are used.

// The block's dynamic shared memory; the wgmma variant's swizzled B operand
// starts on a 1024-byte boundary (the launch adds the room).
template <bool kWg>
__device__ __forceinline__ float* fused_smem() {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  if constexpr (kWg) {
    const uint32_t raw = smem_addr(smem4), aligned = (raw + 1023u) & ~1023u;
    smem += (aligned - raw) / sizeof(float);
  }
  return smem;
}

// kWg: the projections on wgmma (dim 64, HD < 64, MT <= 4; sm_90a), else on mma.sync.
template <int MT, bool kWg>
struct FusedBlock {
  static constexpr int NWARPS = kWarps<kWg>;
  static constexpr int LP = 16 * MT;
  static constexpr int MI = MT % 2 == 0 ? 2 : 1;  // 16-row tiles per warp in the mma.sync projections
  static constexpr int kQkvNI = 3, kOutNI = 1;    // 8-column tiles per warp item (3D / 8 is a multiple of 3)

  const TcArgs& a;
  int D, L;
  FusedLayout lay;
  float* xs;      // (LP, ldx) LayerNorm(x), then o: split pairs, or kWg's B operand
  float* q;       // (LP, ldq) x as it arrives, then queries (all heads)
  float* k;       // (LP, ldq) keys
  float* vt;      // (D, ldv) values, transposed
  float* params;  // LayerNorm weight, bias; output bias
  int warp, g, t;
  int row_tiles, qkv_items, out_items;  // mma.sync: warp items of the two products
  // kWg: this thread's rows f, f + 8 of each 64-row weight tile; B rows
  // from position p0 on have the descriptor desc(p0).
  int wg, f;
  WgOperand xo;
  uint32_t wg_lo, wg_chunk;

  __device__ __forceinline__ explicit FusedBlock(const TcArgs& a_) : a(a_), D(a_.D), L((int)a_.view.len), lay(LP, D) {
    float* smem = fused_smem<kWg>();
    xs = smem;
    q = smem + lay.q_offset();
    k = smem + lay.k_offset();
    vt = smem + lay.vt_offset();
    params = smem + lay.params_offset();
    warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    row_tiles = MT / MI;
    qkv_items = row_tiles * (3 * D / (8 * kQkvNI)), out_items = row_tiles * (D / (8 * kOutNI));
    wg = warp / 4, f = 16 * (warp % 4) + g;
    xo = WgOperand{xs, LP};
    wg_lo = 256 * LP, wg_chunk = 128 * LP;
  }

  __device__ __forceinline__ const float* qkv_w(int item) const {
    return a.w.qkv_weight + (int64_t)(8 * kQkvNI * (item / row_tiles)) * D;
  }
  __device__ __forceinline__ const float* out_w(int item) const {
    return a.w.out_weight + (int64_t)(8 * kOutNI * (item / row_tiles)) * D;
  }
  // Output item: rows m0.. of 16 * MI, this thread's columns col, col + 1.
  __device__ __forceinline__ int item_m0(int item) const { return 16 * MI * (item % row_tiles); }
  __device__ __forceinline__ int item_col(int item) const { return 8 * kOutNI * (item / row_tiles) + 2 * t; }
  __device__ __forceinline__ uint64_t desc(int p0) const {
#if FASTAXIAL_SM90A_DEVICE
    return desc_sw128(smem_addr(xs) + 128 * p0);
#else
    (void)p0;
    return uint64_t{0};  // never launched (launch_fused)
#endif
  }
};

// The steps on mma.sync (8 warps): both projections go by (16 MI-row,
// 8 NI-column) tiles of the output, a warp item each, the warps taking items
// in turn; the attention by (head, 16-query tile) items.
template <int MT, int HD>
struct MmaSteps {
  using Block = FusedBlock<MT, false>;
  static constexpr int NWARPS = Block::NWARPS, LP = Block::LP, MI = Block::MI;
  static constexpr int kQkvNI = Block::kQkvNI, kOutNI = Block::kOutNI;
  // go and res are zeroed where they are declared: a warp without an output
  // item would otherwise carry them undefined through the sequence loop, and
  // the register allocator kept more values live around them (it spilled).
  WeightGroup<kQkvNI> gq;       // this warp's first QKV weights, in flight during the LayerNorm
  WeightGroup<kOutNI> go = {};  // this warp's first output weights
  float2 res[MI][2] = {};       // residual rows g, g + 8 of each 16-row tile, this thread's 2 columns

  __device__ __forceinline__ void load_qkv_weights(const Block& b) {
    if (b.warp < b.qkv_items) load_weights(gq, b.qkv_w(b.warp), b.D, 0);
  }

  // xs = LayerNorm(x) as split pairs.
  template <int NT>
  __device__ __forceinline__ void layer_norm(const Block& b) {
    layer_norm_tile<LP, NT>(b.q, b.lay.ldq, b.params, b.a, b.L, [&](int r, int c, float4 y) {
      float4* out = reinterpret_cast<float4*>(b.xs + r * b.lay.ldx);
      out[2 * c] = split_pairs(y.x, y.y);
      out[2 * c + 1] = split_pairs(y.z, y.w);
    });
  }

  // [q | k | v] = xs @ Wqkv^T: tiles of 16 MI rows x 24 columns.
  __device__ __forceinline__ void project_qkv(const Block& b) {
    for (int item = b.warp; item < b.qkv_items; item += NWARPS) {
      const int m0 = 16 * MI * (item % b.row_tiles), c0 = 8 * kQkvNI * (item / b.row_tiles);
      float c[MI][kQkvNI][4];
      warp_gemm<MI, kQkvNI>(c, b.xs + m0 * b.lay.ldx, b.lay.ldx, b.qkv_w(item), b.D, gq,
                            item + NWARPS < b.qkv_items ? b.qkv_w(item + NWARPS) : nullptr);
      store_qkv(b, c, m0, c0);
    }
  }

  // A warp item's tile (rows m0.., columns c0..) into q (scaled), k or vt;
  // each 8-column part lies in one of q, k, v since 8 | D.
  __device__ __forceinline__ void store_qkv(const Block& b, const float (&c)[MI][kQkvNI][4], int m0, int c0) const {
    const int D = b.D, g = b.g;
#pragma unroll
    for (int j = 0; j < kQkvNI; ++j) {
      const int col = c0 + 8 * j + 2 * b.t;  // this thread's 2 columns, in one of q, k, v
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = m0 + 16 * i + g + 8 * half;
          const float c0v = c[i][j][2 * half], c1v = c[i][j][2 * half + 1];
          if (col < D) {
            *reinterpret_cast<float2*>(b.q + r * b.lay.ldq + col) = make_float2(c0v * b.a.q_scale, c1v * b.a.q_scale);
          } else if (col < 2 * D) {
            *reinterpret_cast<float2*>(b.k + r * b.lay.ldq + col - D) = make_float2(c0v, c1v);
          } else {
            b.vt[(col - 2 * D) * b.lay.ldv + r] = c0v;
            b.vt[(col - 2 * D + 1) * b.lay.ldv + r] = c1v;
          }
        }
    }
  }

  // The residual rows of output item `item` into res.
  __device__ __forceinline__ void load_residual(const Block& b, int64_t base, int item) {
    const int m0 = b.item_m0(item), col = b.item_col(item);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + 16 * i + b.g + 8 * half;
        res[i][half] = r < b.L ? *reinterpret_cast<const float2*>(b.a.src + base + r * b.a.view.pos_stride + col)
                               : make_float2(0.0f, 0.0f);
      }
  }

  // The warp's first output weights and residual rows.
  __device__ __forceinline__ void load_out(const Block& b, int64_t base) {
    if (b.warp < b.out_items) {
      load_weights(go, b.out_w(b.warp), b.D, 0);
      load_residual(b, base, b.warp);
    }
  }

  // o = softmax(q_h k_h^T * scale) v_h per (head, query tile) into xs as split pairs.
  __device__ __forceinline__ void attend(const Block& b) const {
    for (int item = b.warp; item < b.a.heads * MT; item += NWARPS) {
      attend_tile<MT, HD>(b.q, b.k, b.lay.ldq, b.vt, b.lay.ldv, item / MT, item % MT, b.L,
                          [&](int r, int c, float x, float y) {
                            *reinterpret_cast<float4*>(b.xs + r * b.lay.ldx + 2 * c) = split_pairs(x, y);
                          });
    }
  }

  // dst = src + o @ Wout^T + bout, rows < L only: tiles of 16 MI rows x 8 columns.
  __device__ __forceinline__ void project_out(const Block& b, int64_t base) {
    for (int item = b.warp; item < b.out_items; item += NWARPS) {
      const int m0 = b.item_m0(item), col = b.item_col(item);
      if (item != b.warp) load_residual(b, base, item);  // overlaps the product
      float c[MI][kOutNI][4];
      warp_gemm<MI, kOutNI>(c, b.xs + m0 * b.lay.ldx, b.lay.ldx, b.out_w(item), b.D, go,
                            item + NWARPS < b.out_items ? b.out_w(item + NWARPS) : nullptr);
      store_out(b, base, c, m0, col);
    }
  }

  // Rows m0.. (those below L) of dst = res + c + bout, this thread's columns col, col + 1.
  __device__ __forceinline__ void store_out(const Block& b, int64_t base, const float (&c)[MI][kOutNI][4], int m0, int col) const {
    const float2 bias = *reinterpret_cast<const float2*>(b.params + 2 * b.D + col);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = m0 + 16 * i + b.g + 8 * half;
        if (r >= b.L) continue;
        *reinterpret_cast<float2*>(b.a.dst + base + r * b.a.view.pos_stride + col) = make_float2(
            res[i][half].x + c[i][0][2 * half] + bias.x, res[i][half].y + c[i][0][2 * half + 1] + bias.y);
      }
  }
};

// The steps on wgmma (three warpgroups): the weights are the A operand, xs
// and later o the B operand (WgOperand); the attention as on mma.sync.
template <int MT, int HD>
struct WgmmaSteps {
  using Block = FusedBlock<MT, true>;
  static constexpr int NWARPS = Block::NWARPS, LP = Block::LP;
  // The QKV product in units of (64-row tile, NQ positions), three units
  // (L <= 32) or six (accumulators for 64 positions would not fit), dealt
  // round robin to the three warpgroups; the output product by two
  // warpgroups of NO positions each.
  static constexpr int NQ = LP <= 32 ? LP : LP / 2, kUnits = 3 * (LP / NQ), NO = LP / 2;
  static_assert(MT <= 4, "wgmma products take N <= 32");
  // Zeroed where they are declared: the warpgroup without an output product
  // would otherwise carry them undefined through the sequence loop, and the
  // register allocator kept more values live around them (it spilled more).
  WgRows wq[2] = {};        // this thread's rows of its units' tiles, the first loaded before the LayerNorm
  WgRows wo = {};           // this thread's rows of Wout (warpgroups 0 and 1)
  float wres[NO / 2] = {};  // the residual at the output accumulator's places

  // QKV unit u: 64-row tile u / (LP / NQ), positions from NQ * (u % (LP / NQ)).
  static __device__ __forceinline__ const float* unit_rows(const Block& b, int u) {
    return b.a.w.qkv_weight + (64 * (u / (LP / NQ)) + b.f) * 64;
  }

  // Makes the generic-proxy stores into xs visible to wgmma, which reads them next.
  static __device__ __forceinline__ void fence() {
#if FASTAXIAL_SM90A_DEVICE
    fence_async_smem();
#endif
  }

  __device__ __forceinline__ void load_qkv_weights(const Block& b) { load_rows(wq[0], unit_rows(b, b.wg)); }

  // xs = LayerNorm(x) as the B operand.
  template <int NT>
  __device__ __forceinline__ void layer_norm(const Block& b) {
    layer_norm_tile<LP, NT>(b.q, b.lay.ldq, b.params, b.a, b.L,
                                          [&](int r, int c, float4 y) { b.xo.put_piece(r, c, y); });
    fence();
  }

  // [q | k | v]^T = Wqkv @ xs^T by units; a second unit's rows load during the first product.
  __device__ __forceinline__ void project_qkv(const Block& b) {
#pragma unroll
    for (int i = 0; i < kUnits / 3; ++i) {
      const int u = b.wg + 3 * i, m = u / (LP / NQ), n0 = NQ * (u % (LP / NQ));
      if (i + 1 < kUnits / 3) load_rows(wq[i + 1], unit_rows(b, u + 3));
      float c[NQ / 2];
      wg_product<NQ>(c, wq[i], b.desc(n0), b.wg_lo, b.wg_chunk);
      store_qkv(b, c, m, n0);
    }
  }

  // A unit's product (features f, f + 8 of tile m, positions n0..) into q (scaled), k or vt.
  __device__ __forceinline__ void store_qkv(const Block& b, const float (&c)[NQ / 2], int m, int n0) const {
    const int f = b.f;
    // c[4j ..]: features f, f + 8 at positions p, p + 1 (accumulator layout, detail/wgmma.cuh).
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j) {
      const int p = n0 + 8 * j + 2 * b.t;
      if (m == 2) {
        *reinterpret_cast<float2*>(b.vt + f * b.lay.ldv + p) = make_float2(c[4 * j], c[4 * j + 1]);
        *reinterpret_cast<float2*>(b.vt + (f + 8) * b.lay.ldv + p) = make_float2(c[4 * j + 2], c[4 * j + 3]);
      } else {
        float* dst = m == 0 ? b.q : b.k;
        const float s = m == 0 ? b.a.q_scale : 1.0f;
        dst[p * b.lay.ldq + f] = c[4 * j] * s;
        dst[(p + 1) * b.lay.ldq + f] = c[4 * j + 1] * s;
        dst[p * b.lay.ldq + f + 8] = c[4 * j + 2] * s;
        dst[(p + 1) * b.lay.ldq + f + 8] = c[4 * j + 3] * s;
      }
    }
  }

  // This thread's rows of Wout and its residual (warpgroups 0 and 1).
  __device__ __forceinline__ void load_out(const Block& b, int64_t base) {
    if (b.wg >= 2) return;
    const int o0 = NO * b.wg;  // the warpgroup's first output position
    load_rows(wo, b.a.w.out_weight + b.f * 64);
#pragma unroll
    for (int i = 0; i < NO / 2; ++i) {
      const int p = o0 + 8 * (i / 4) + 2 * b.t + i % 2, feature = b.f + 8 * (i % 4 / 2);
      wres[i] = p < b.L ? b.a.src[base + p * b.a.view.pos_stride + feature] : 0.0f;
    }
  }

  // o = softmax(q_h k_h^T * scale) v_h per (head, query tile) into xs as the B operand.
  __device__ __forceinline__ void attend(const Block& b) const {
    for (int item = b.warp; item < b.a.heads * MT; item += NWARPS) {
      attend_tile<MT, HD>(b.q, b.k, b.lay.ldq, b.vt, b.lay.ldv, item / MT, item % MT, b.L,
                          [&](int r, int c, float x, float y) {
                            b.xo.put(b.xo.at(r, c), x);
                            b.xo.put(b.xo.at(r, c + 1), y);
                          });
    }
    fence();
  }

  // dst = src + (Wout @ o^T)^T + bout, positions < L only: NO positions a warpgroup.
  __device__ __forceinline__ void project_out(const Block& b, int64_t base) {
    if (b.wg >= 2) return;
    const int f = b.f, o0 = NO * b.wg;
    float c[NO / 2];
    wg_product<NO>(c, wo, b.desc(o0), b.wg_lo, b.wg_chunk);
    const float bias[2] = {b.params[2 * b.D + f], b.params[2 * b.D + f + 8]};
#pragma unroll
    for (int i = 0; i < NO / 2; ++i) {
      const int p = o0 + 8 * (i / 4) + 2 * b.t + i % 2, half = i % 4 / 2;
      if (p < b.L) b.a.dst[base + p * b.a.view.pos_stride + f + 8 * half] = wres[i] + c[i] + bias[half];
    }
  }
};

template <int MT, int HD, bool kWg>
using FusedSteps = std::conditional_t<kWg, WgmmaSteps<MT, HD>, MmaSteps<MT, HD>>;

template <int MT, int HD, bool kWg>
__global__ void __launch_bounds__(32 * kWarps<kWg>, 1) fused_forward_kernel(const TcArgs a) {
  constexpr int NT = 32 * kWarps<kWg>;
  // The warp's first output weights and residual rows: in flight during the
  // attention where registers allow (the score tile grows with HD * MT),
  // else loaded after it.
  constexpr bool kEarlyOut = HD * MT <= 128;
  const FusedBlock<MT, kWg> b(a);

  prefetch_weights_l2<NT>(a);  // a hint, safe before the wait (detail/launch.cuh)
  grid_dependency_wait();
  allow_dependent_launch();
  if (blockIdx.x < a.view.num_seq) {
    load_params<NT>(b.params, a);
    load_tile<NT>(b.q, b.lay.ldq, a, seq_offset(a.view, blockIdx.x), b.L);
  }
  for (int64_t n = blockIdx.x; n < a.view.num_seq; n += gridDim.x) {
    const int64_t base = seq_offset(a.view, n);
    FusedSteps<MT, HD, kWg> step;  // registers carried from step to step
    step.load_qkv_weights(b);      // in flight during the LayerNorm
    copy_async_wait<0>();
    __syncthreads();
    step.template layer_norm<NT>(b);
    __syncthreads();
    step.project_qkv(b);
    if (kEarlyOut) step.load_out(b, base);
    __syncthreads();
    step.attend(b);
    if (!kEarlyOut) step.load_out(b, base);
    __syncthreads();
    // q is free from here on: the block's next sequence arrives there during
    // this one's output product.
    if (n + gridDim.x < a.view.num_seq) load_tile<NT>(b.q, b.lay.ldq, a, seq_offset(a.view, n + gridDim.x), b.L);
    step.project_out(b, base);
    // No barrier here: the next sequence's LayerNorm writes xs after the
    // barrier that follows its tile's arrival, which every warp reaches after
    // its output product.
  }
}

template <int MT, int HD, bool kWg>
cudaError_t launch(const TcArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  constexpr auto kernel = fused_forward_kernel<MT, HD, kWg>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const size_t smem = fused_smem_bytes(a.view.len, a.D) + (kWg ? kFusedWgmmaSmemExtra : 0);  // FusedLayout of 16 MT rows
  if (smem > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  // As many blocks as run at once, each looping over sequences: a block's
  // next sequence arrives during its current one's output product, and the
  // start (norm parameters, weight prefetch) is paid once per block rather
  // than once per sequence.
  int per_sm = 0;
  constexpr int kThreads = 32 * kWarps<kWg>;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
      e != cudaSuccess)
    return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;  // the plan checked the shared memory
  const int64_t grid = std::min<int64_t>(a.view.num_seq, (int64_t)dev.sms * per_sm);
  return launch_kernel<kernel>((unsigned)grid, kThreads, smem, stream, dev, a);
}

template <int HD>
cudaError_t launch_tiles(const TcArgs& a, int mt, bool wgmma, const DeviceCaps& dev, cudaStream_t stream) {
  // wgmma below head_dim 64 only: one head of 64 keeps more attention state
  // than the 168 registers a thread of three warpgroups has, and ran slower
  // so (docs/perf-notes.md).
  if constexpr (HD < 64) {
    if (wgmma) {
      switch (mt) {
        case 1: return launch<1, HD, true>(a, dev, stream);
        case 2: return launch<2, HD, true>(a, dev, stream);
        case 3: return launch<3, HD, true>(a, dev, stream);
        case 4: return launch<4, HD, true>(a, dev, stream);
      }
      return cudaErrorInvalidValue;
    }
  }
  if (wgmma) return cudaErrorInvalidValue;
  switch (mt) {
    case 1: return launch<1, HD, false>(a, dev, stream);
    case 2: return launch<2, HD, false>(a, dev, stream);
    case 3: return launch<3, HD, false>(a, dev, stream);
    case 4: return launch<4, HD, false>(a, dev, stream);
    case 5: return launch<5, HD, false>(a, dev, stream);
    case 6: return launch<6, HD, false>(a, dev, stream);
    case 8: return launch<8, HD, false>(a, dev, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

Status launch_fused(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                    bool wgmma, const DeviceCaps& dev, cudaStream_t stream) {
#if !defined(FASTAXIAL_WGMMA)
  if (wgmma) return {StatusCode::kUnsupported, "the fused kernel's wgmma variant needs a build with sm_90a"};
#endif
  TcArgs a;
  a.view = view;
  a.D = (int)p.dim;
  a.heads = (int)p.heads;
  a.eps = p.eps;
  const int hd = (int)(p.dim / p.heads);
  a.q_scale = kLog2e / sqrtf((float)hd);
  a.w = w;
  a.src = src;
  a.dst = dst;
  const int mt = fused_tile_count(view.len);
  cudaError_t e = cudaErrorInvalidValue;
  switch (hd) {
    case 8: e = launch_tiles<8>(a, mt, wgmma, dev, stream); break;
    case 16: e = launch_tiles<16>(a, mt, wgmma, dev, stream); break;
    case 32: e = launch_tiles<32>(a, mt, wgmma, dev, stream); break;
    case 64: e = launch_tiles<64>(a, mt, wgmma, dev, stream); break;
  }
  if (e != cudaSuccess) return cuda_error(e, "fused_forward_kernel launch");
  return Status::Ok();
}

}  // namespace fastaxial::cuda
