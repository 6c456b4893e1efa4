// The fused kernel's steps on wgmma (fused/forward.cu; sm_90a), used at dim
// 64 with head_dim below 64 and L <= 64. There a sequence's projections are
// [q | k | v]^T (192, LP) = Wqkv (192, 64) @ xs^T and
// (o @ Wout^T)^T (64, LP) = Wout (64, 64) @ o^T: the weights are wgmma's A
// operand (64-row tiles, from registers, split there) and the sequence its B
// operand in planes (block.cuh: WgOperand), N = positions. A warpgroup's
// product is then 24 asynchronous instructions rather than each warp's chain
// of mma.sync, fragment loads and splits, whose latency bounds the mma.sync
// products. Three warpgroups a block: each takes units (64-row tiles of
// [q | k | v]^T for a range of positions), and two of them half the
// positions each of the output product. The products are element type
// Elem's (wg_run, wg_product; WgmmaSteps::Elem = Tf32x3, 3xTF32).
#pragma once

#include <cstdint>

#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"
#include "block.cuh"

namespace fastaxial::cuda::fused {

// A thread's rows r and r + 8 of a 64-row weight tile (row stride 64; W
// points at row r), raw fp32: elements 8s + 2t and 8s + 2t + 1 of each 8-wide
// step s, its warp's A operand of the step with k permuted as in the B operand
// (block.cuh: WgOperand).
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
// The run of steps s0 and s0 + 1 into t (fresh), A from R made into Elem's
// fragments f (Elem::a), one commit group (Elem::wgmma_run). b: the B
// operand's first-plane descriptor (detail/wgmma.cuh) at the warpgroup's
// first row; lo: bytes to its next plane; chunk: bytes to the next 32 values.
template <class Elem, int NW>
__device__ __forceinline__ void wg_run(float (&t)[NW / 2], typename Elem::FragA (&f)[2], const WgRows& R, int s0,
                                       uint64_t b, uint32_t lo, uint32_t chunk) {
  uint64_t d[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int s = s0 + k;
    const float2 r0 = R.w[s][0], r1 = R.w[s][1];
    f[k] = Elem::a(r0.x, r1.x, r0.y, r1.y);
    d[k] = b + ((s / 4 * chunk + s % 4 * 32) >> 4);  // the address field counts 16 bytes
  }
  Elem::template wgmma_run<NW>(t, f, d, lo >> 4);
}
#endif

// c (64, NW) = W (64, 64) @ B^T for one warpgroup: R its rows of W, B NW rows
// of the operand at descriptor b. Four runs of two steps into fresh
// accumulators, two alternating (wgmma_add_runs4), so one run's products go
// on while the other's are added; the block's other warpgroups hide the
// waits. c and the fresh accumulators t0, t1 start at zero.
template <class Elem, int NW>
__device__ __forceinline__ void wg_product(float (&c)[NW / 2], const WgRows& R, uint64_t b, uint32_t lo,
                                           uint32_t chunk) {
#if FASTAXIAL_SM90A_DEVICE
  float t0[NW / 2], t1[NW / 2];
#pragma unroll
  for (int i = 0; i < NW / 2; ++i) c[i] = t0[i] = t1[i] = 0.0f;
  wgmma_add_runs4<Elem>(c, t0, t1, [&](float(&t)[NW / 2], typename Elem::FragA(&f)[2], int r) {
    wg_run<Elem, NW>(t, f, R, 2 * r, b, lo, chunk);
  });
#else
  (void)c, (void)R, (void)b, (void)lo, (void)chunk;
  __trap();  // built without sm_90a: launch_fused launches no wgmma variant
#endif
}

// The steps on wgmma (three warpgroups): the weights are the A operand, xs
// and later o the B operand (WgOperand); the attention as on mma.sync.
template <int MT, int HD>
struct WgmmaSteps {
  using Elem = Tf32x3;  // fp32 on the 3xTF32 products (detail/tf32x3.cuh); block.cuh's WgOperand holds its planes
  using Block = FusedBlock<MT, true>;
  static constexpr int NWARPS = Block::NWARPS, LP = Block::LP;
  // The QKV product in units, a warpgroup's share: (64-row tile, NQ positions), three units
  // (L <= 32) or six (accumulators for 64 positions would not fit), dealt
  // round robin to the three warpgroups; the output product by two
  // warpgroups of NO positions each.
  static constexpr int NQ = LP <= 32 ? LP : LP / 2, kUnits = 3 * (LP / NQ), NO = LP / 2;
  static_assert(MT <= 4, "wgmma products take N <= 32");
  // Zeroed where they are declared: the warpgroup without an output product
  // would otherwise carry them undefined through the sequence loop, and the
  // register allocator then keeps more values live around them and spills.
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
      wg_product<Elem, NQ>(c, wq[i], b.desc(n0), b.wg_lo, b.wg_chunk);
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
    wg_product<Elem, NO>(c, wo, b.desc(o0), b.wg_lo, b.wg_chunk);
    const float bias[2] = {b.params[2 * b.D + f], b.params[2 * b.D + f + 8]};
#pragma unroll
    for (int i = 0; i < NO / 2; ++i) {
      const int p = o0 + 8 * (i / 4) + 2 * b.t + i % 2, half = i % 4 / 2;
      if (p < b.L) b.a.dst[base + p * b.a.view.pos_stride + f + 8 * half] = wres[i] + c[i] + bias[half];
    }
  }
};

}  // namespace fastaxial::cuda::fused
