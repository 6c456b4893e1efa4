// The fused forward kernel's block (fused/forward.cu): its arguments
// (FusedArgs), its shared memory and thread indices (FusedBlock, what every
// step reads), and the tile helpers that both product variants' steps share
// (fused/steps_mma.cuh, fused/steps_wgmma.cuh): a sequence's arrival by
// cp.async, its LayerNorm, and the attention of one item on mma.sync.
//
// Terms. An item is one warp's share of a product, the warps taking items in
// turn (warp w: items w, w + NWARPS, ...): a (16 MI-row, 8 NI-column) output
// tile of a projection on mma.sync, or a (head, 16-query tile) of the
// attention. Split pairs: an fp32 value stored as its TF32 hi and lo parts
// side by side (detail/tf32x3.cuh), so that a fragment's split values come in
// 16-byte loads. Planes: an operand's hi parts and its lo parts as two
// separate arrays, each in the layout wgmma reads (WgOperand below).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/axis.h"
#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/warp_ops.cuh"
#include "../detail/wgmma.cuh"

namespace fastaxial::cuda::fused {

// Warps of a block: 8 for the mma.sync products, 12 (three warpgroups) for
// the wgmma ones (fused/steps_wgmma.cuh).
template <bool kWg>
constexpr int kWarps = kWg ? 12 : 8;

// The kernel's arguments, by value.
struct FusedArgs {
  AxisView view;
  int D, heads;
  float eps, q_scale;  // q_scale = log2(e) / sqrt(head_dim)
  AxisWeights w;
  const float* src;
  float* dst;
};

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
__device__ void load_tile(float* x, int ld, const FusedArgs& a, int64_t base, int L) {
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
__device__ void prefetch_weights_l2(const FusedArgs& a) {
  const int64_t D = a.D, lines_qkv = 3 * D * D / 32, lines = lines_qkv + D * D / 32;  // 128-byte lines
  for (int64_t i = (int64_t)blockIdx.x * NT + threadIdx.x; i < lines; i += (int64_t)gridDim.x * NT) {
    const float* p = i < lines_qkv ? a.w.qkv_weight + 32 * i : a.w.out_weight + 32 * (i - lines_qkv);
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
  }
}

// params (3 D) = [LayerNorm weight | LayerNorm bias | output bias], by cp.async,
// committed with the first tile.
template <int NT>
__device__ void load_params(float* params, const FusedArgs& a) {
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
// kPieces pieces stay in registers between the two reductions (mean, then
// variance) and the store (one read of shared memory, loops unrolled); longer
// rows are read again for each.
template <int LP, int NT, class Store>
__device__ void layer_norm_tile(const float* x, int ldq, const float* params, const FusedArgs& a, int L, Store store) {
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

// xs, later o, as wgmma's B operand: LP rows of 64 values in two planes (hi,
// then lo), each two 32-value chunks of LP 128-byte rows in the 128-byte
// swizzled layout (detail/wgmma.cuh). Inside each group of 8 the values are
// permuted as k is everywhere in this kernel (detail/tf32x3.cuh): slot t holds
// element 2t, slot t + 4 element 2t + 1, so that a thread's A operand of the
// same k comes in 8-byte loads of W (fused/steps_wgmma.cuh: WgRows).
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

// ---- The kernel's steps -----------------------------------------------------
// The kernel (fused/forward.cu) is one sequence of steps for both product variants: load the
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

  const FusedArgs& a;
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

  __device__ __forceinline__ explicit FusedBlock(const FusedArgs& a_) : a(a_), D(a_.D), L((int)a_.view.len), lay(LP, D) {
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

}  // namespace fastaxial::cuda::fused
