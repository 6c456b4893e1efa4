// The fused kernel's steps on mma.sync (fused/forward.cu; 8 warps): the
// projections as warp products of split-pair activations in shared memory
// with weights read from global memory and split in registers.
#pragma once

#include <cstdint>

#include "../detail/tf32x3.cuh"
#include "block.cuh"

namespace fastaxial::cuda::fused {

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
  // the register allocator then keeps more values live around them and spills.
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

}  // namespace fastaxial::cuda::fused
