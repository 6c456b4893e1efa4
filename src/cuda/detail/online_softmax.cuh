// The flash forward kernels' per-row softmax, shared by the mma.sync kernel
// (attention/flash_attention.cu) and the two wgmma kernels
// (attention/flash_attention_wgmma*.cu). All three hold a score tile and the
// output rows in the accumulator layout that mma.sync's m16n8 C fragments
// and wgmma's 64xN tiles share: a warp's rows g and g + 8 (g = lane / 4),
// element e of column group jn at column 8 jn + 2t + (e & 1) of row
// g + 8 (e >> 1) (t = lane % 4). The kernels keep a tile as float[4 * groups]
// or as float[groups][4]; the functions here take an accessor, x(jn, e) ->
// float&, so that both stay in registers.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../common/dropout.h"
#include "lse.cuh"
#include "round16.cuh"

namespace fastaxial::cuda {

// A split launch's unnormalised output (flash_attention.h's partials layout:
// smem_layout.h's flash_partials_bytes): o (splits, rows, hd), then m and l
// (splits, rows) each, merged by the combine kernel.
struct FlashPartials {
  float* partials;
  int64_t rows;  // num_seq heads L
  int splits;    // S >= 1
};

// An output value as the element type Out stores it: float as it is, bf16 or fp16 rounded (round16).
template <class Out>
__device__ __forceinline__ Out output_value(float v) {
  if constexpr (std::is_same_v<Out, float>)
    return v;
  else
    return round16<Out>(v);
}

// o's rows g and g + 8 (times inv0 and inv1 unless kRaw) into p0[c] and
// p1[c] where in0 and in1, for this thread's columns c = 8 f + 2 t + e < hd
// of o's NF column groups (Out: float, or a 16-bit type the values are rounded to).
template <int NF, bool kRaw, class O, class Out>
__device__ __forceinline__ void store_columns(O&& o, Out* p0, Out* p1, bool in0, bool in1, float inv0, float inv1,
                                              int hd, int t) {
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = 8 * f + 2 * t + e;
      if (c >= hd) continue;
      if (in0) p0[c] = output_value<Out>(kRaw ? o(f, e) : o(f, e) * inv0);
      if (in1) p1[c] = output_value<Out>(kRaw ? o(f, 2 + e) : o(f, 2 + e) * inv1);
    }
}

// Rows g and g + 8's running maxima (base-2 scaled scores) and sums of
// 2^(s - m) over this thread's columns.
struct RowSoftmax {
  float m0 = -INFINITY, m1 = -INFINITY;
  float l0 = 0.0f, l1 = 0.0f;

  // One key tile of NT column groups (keys key0 ..): s (unscaled q . k) in,
  // p = 2^(s scale_log2 - m) out, keys >= L at 0; m, l and o's NF groups
  // rescaled to the new maxima.
  template <int NT, int NF, class S, class O>
  __device__ __forceinline__ void step(S&& s, O&& o, float scale_log2, int key0, int L, int t) {
    const bool partial = key0 + 8 * NT > L;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int jn = 0; jn < NT; ++jn)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x0 = s(jn, e) * scale_log2, x1 = s(jn, 2 + e) * scale_log2;
        if (partial && key0 + 8 * jn + 2 * t + e >= L) x0 = x1 = -INFINITY;
        s(jn, e) = x0, s(jn, 2 + e) = x1;
        mx0 = fmaxf(mx0, x0), mx1 = fmaxf(mx1, x1);
      }
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {  // a row's columns are spread over the 4 lanes of a quad
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, m));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, m));
    }
    // Key key0 < L is in every tile, so the new maxima are finite;
    // 2^(-inf - finite) = 0 rescales the empty start.
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
    m0 = mn0, m1 = mn1;
    l0 *= c0, l1 *= c1;
#pragma unroll
    for (int f = 0; f < NF; ++f) o(f, 0) *= c0, o(f, 1) *= c0, o(f, 2) *= c1, o(f, 3) *= c1;
#pragma unroll
    for (int jn = 0; jn < NT; ++jn)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s(jn, e) = exp2f(s(jn, e) - m0);  // 2^-inf = 0 for masked keys
        s(jn, 2 + e) = exp2f(s(jn, 2 + e) - m1);
        l0 += s(jn, e), l1 += s(jn, 2 + e);
      }
  }

  // l over the quad: the rows' whole sums, once after a unit's last tile.
  __device__ __forceinline__ void sum_rows() {
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, m);
      l1 += __shfl_xor_sync(0xffffffffu, l1, m);
    }
  }

  // o / l (times num: dropout's 1 / (1 - p), else 1) into a head's rows r0 =
  // the warp's row g and r0 + 8, positions >= L skipped: row r at out + r
  // row_stride (elements of Out: float, or a 16-bit type the values are
  // rounded to), its columns 0 .. hd - 1. With lse, the rows' lse2
  // (detail/lse.cuh) at lse_row0 + r, planes lse_rows apart.
  template <int NF, class O, class Out>
  __device__ __forceinline__ void store_rows(O&& o, float num, Out* out, int64_t row_stride, int r0, int L, int hd,
                                             int t, float* lse, int64_t lse_rows, int64_t lse_row0) const {
    const int r1 = r0 + 8;
    const bool in0 = r0 < L, in1 = r1 < L;
    const float inv0 = num / l0, inv1 = num / l1;
    Out* o0 = in0 ? out + r0 * row_stride : nullptr;
    Out* o1 = in1 ? out + r1 * row_stride : nullptr;
    store_columns<NF, false>(o, o0, o1, in0, in1, inv0, inv1, hd, t);
    if (lse && t == 0) {
      if (in0) store_lse2(lse, lse_rows, lse_row0 + r0, m0, l0);
      if (in1) store_lse2(lse, lse_rows, lse_row0 + r1, m1, l1);
    }
  }

  // Split `split`'s unnormalised o, m and l of rows r0 and r0 + 8 (positions
  // >= L skipped) of item `item` into sp.partials.
  template <int NF, class O>
  __device__ __forceinline__ void store_partials(O&& o, const FlashPartials& sp, int split, int64_t item, int r0,
                                                 int L, int hd, int t) const {
    const int r1 = r0 + 8;
    const bool in0 = r0 < L, in1 = r1 < L;
    float* po = sp.partials + ((int64_t)split * sp.rows + item * L) * hd;
    store_columns<NF, true>(o, po + (int64_t)r0 * hd, po + (int64_t)r1 * hd, in0, in1, 1.0f, 1.0f, hd, t);
    if (t == 0) {
      float* pm = sp.partials + (int64_t)sp.splits * sp.rows * hd + (int64_t)split * sp.rows + item * L;
      float* pl = pm + (int64_t)sp.splits * sp.rows;
      if (in0) pm[r0] = m0, pl[r0] = l0;
      if (in1) pm[r1] = m1, pl[r1] = l1;
    }
  }
};

// Dropout on a tile of p, after the row sums (the kept ones' scale comes at
// the end, in store_rows' num): keep bits of column groups jn, jn + 1 in
// keep[jn / 2], 16 each, element k's at dropout_bit_rows (common/dropout.h).
template <int NT, class S>
__device__ __forceinline__ void drop_probs(S&& s, const uint32_t (&keep)[NT / 2], int t) {
#pragma unroll
  for (int jn = 0; jn < NT; ++jn) {
    const uint32_t bits = keep[jn / 2] >> (16 * (jn & 1));
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (!((bits >> dropout_bit_rows(t, k)) & 1u)) s(jn, k) = 0.0f;
  }
}

}  // namespace fastaxial::cuda
