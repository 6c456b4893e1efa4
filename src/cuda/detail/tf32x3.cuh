// Warp-level fp32 matrix products on the tensor cores, with fp32 accuracy.
//
// A TF32 number keeps 10 of fp32's 23 mantissa bits, so a plain TF32 product
// is about 1e-3 off. Each fp32 operand is split as a = hi + lo (hi = a rounded
// to TF32, lo = the rest, of which the tensor core reads TF32's worth: together
// 21+ bits), and a*b is taken as lo*hi + hi*lo + hi*hi with fp32 accumulation
// (the lo*lo term is below fp32 rounding). Three tensor-core products per
// fp32 product, still several times the FFMA rate.
//
// Fragments follow PTX's mma.m16n8k8 .tf32 layout: with g = lane / 4 and
// t = lane % 4, A (16 x 8, row-major) holds (g, t), (g+8, t), (g, t+4),
// (g+8, t+4); B (8 x 8, k x n) holds (t, g), (t+4, g); C (16 x 8) holds
// (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
//
// At the bottom, Tf32x3: the element traits of fp32 on these products, for
// the mainloops on mma.sync and on wgmma (detail/wgmma.cuh's instructions).
#pragma once

#include <cstdint>

#include "wgmma.cuh"  // the wgmma instructions of Tf32x3's wgmma members

namespace fastaxial::cuda {

struct FragA {  // a 16 x 8 operand, split
  uint32_t hi[4], lo[4];
};
struct FragB {  // an 8 x 8 operand, split
  uint32_t hi[2], lo[2];
};

// x rounded to TF32, ties away from zero: the value of cvt.rna.tf32.f32 for
// every finite x and the infinities, in two integer instructions (sm_90
// expands cvt.rna to four). A NaN may come out as another value, but then
// lo = x - hi below is NaN, so a product with it still is.
__device__ __forceinline__ uint32_t to_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x rounded to TF32, ties to even, NaN kept: one F2FP instruction on sm_90
// (cvt.rn.tf32.f32), cvt.rna before it. Conversions issue at a fraction of
// the integer rate, so hi above stays on to_tf32.
__device__ __forceinline__ uint32_t to_tf32_rn(float x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
#else
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
#endif
  return r;
}

// hi = x rounded to TF32; lo = x - hi, exact in fp32 and left there: the
// tensor core reads only the top 10 mantissa bits of a TF32 operand, so it
// truncates lo, up to 2^-22 of x off (a rounded lo: 2^-23). In a long product
// that averages out (scripts/emulate_tf32x3.py); in short chains of short
// products (a few positions, small dims) it left gradients outside the
// accuracy rule (docs/perf-notes.md, v59). Three instructions per
// element: the form for splits on a mainloop's critical path.
// kRoundLo: lo rounded to TF32 as well (to_tf32_rn), four instructions, for
// operands split once and read by many products (the weight planes, the
// projection products' A fragments, the weight gradients' operands), where
// the conversion is off the tensor cores' critical path. NaN stays NaN in lo.
template <bool kRoundLo = false>
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  const float rest = x - __uint_as_float(hi);
  lo = kRoundLo ? to_tf32_rn(rest) : __float_as_uint(rest);
}

template <bool kRoundLo = false>
__device__ __forceinline__ FragA make_a(float a0, float a1, float a2, float a3) {
  FragA f;
  split<kRoundLo>(a0, f.hi[0], f.lo[0]);
  split<kRoundLo>(a1, f.hi[1], f.lo[1]);
  split<kRoundLo>(a2, f.hi[2], f.lo[2]);
  split<kRoundLo>(a3, f.hi[3], f.lo[3]);
  return f;
}

__device__ __forceinline__ FragB make_b(float b0, float b1) {
  FragB f;
  split(b0, f.hi[0], f.lo[0]);
  split(b1, f.hi[1], f.lo[1]);
  return f;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d = a * b into a fresh accumulator: C is the constant zero, so no
// registers are cleared first.
__device__ __forceinline__ void mma_tf32_first(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f));
}

// The small terms of a * b, lo * hi then hi * lo, into t: into a fresh accumulator (kFresh: C is
// zero) or on top of t's running value.
template <bool kFresh>
__device__ __forceinline__ void small_terms(float (&t)[4], const FragA& a, const FragB& b) {
  if constexpr (kFresh) {
    mma_tf32_first(t, a.lo, b.hi);
  } else {
    mma_tf32(t, a.lo, b.hi);
  }
  mma_tf32(t, a.hi, b.lo);
}

// The three products of a * b into t, the small terms first, then hi * hi.
template <bool kFresh>
__device__ __forceinline__ void three_products(float (&t)[4], const FragA& a, const FragB& b) {
  small_terms<kFresh>(t, a, b);
  mma_tf32(t, a.hi, b.hi);
}

// The six products of a run of two 8-deep steps, a0 * b0 + a1 * b1, into t, both steps' small
// terms first, then both hi * hi. The tensor core truncates each add toward zero, relative to the
// running value: in this order only the two hi * hi adds truncate at the run's full magnitude
// (step after step, four do). A truncation error has the sign of the sum, so where the products'
// results are summed over many positions (the backward's: a LayerNorm bias's gradient sums d_xn
// over every position) what is left of it adds up; the backward takes this order.
template <bool kFresh>
__device__ __forceinline__ void products_x2(float (&t)[4], const FragA& a0, const FragB& b0, const FragA& a1,
                                            const FragB& b1) {
  small_terms<kFresh>(t, a0, b0);
  small_terms<false>(t, a1, b1);
  mma_tf32(t, a0.hi, b0.hi);
  mma_tf32(t, a1.hi, b1.hi);
}

// c += a * b, fp32-accurate: the three products in a fresh accumulator, then
// one rounded fp32 add per element.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const FragA& a, const FragB& b) {
  float t[4];
  three_products<true>(t, a, b);
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] += t[e];
}

// c += a0 * b0 + a1 * b1 (two 8-deep steps), fp32-accurate: both steps'
// products in one fresh accumulator, then one fp32 add per element. Runs of
// two steps stay at an fp32 FMA chain's error (scripts/emulate_tf32x3.py);
// longer runs do not. kSmallFirst: products_x2's order (the backward), else
// step after step (fewer registers live: the forward's kernels).
template <bool kSmallFirst = false>
__device__ __forceinline__ void mma_3xtf32_x2(float (&c)[4], const FragA& a0, const FragB& b0, const FragA& a1,
                                              const FragB& b1) {
  float t[4];
  if constexpr (kSmallFirst) {
    products_x2<true>(t, a0, b0, a1, b1);
  } else {
    three_products<true>(t, a0, b0);
    three_products<false>(t, a1, b1);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] += t[e];
}

// ---- Permuted k -------------------------------------------------------------
// A product sums over k, so one permutation of k applied to both operands
// changes nothing. Inside each group of 8, the fragments below let k index t
// stand for element 2t and t + 4 for element 2t + 1: a thread's two k values
// of a row are then adjacent, one 8-byte load from fp32 rows.

// A = rows 0..15, elements 0..7 of fp32 rows at p (row stride ld), k permuted.
__device__ __forceinline__ FragA load_a_perm(const float* p, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const float2 r0 = *reinterpret_cast<const float2*>(p + g * ld + 2 * t);
  const float2 r1 = *reinterpret_cast<const float2*>(p + (g + 8) * ld + 2 * t);
  return make_a(r0.x, r1.x, r0.y, r1.y);
}

// B[k][n] = M[n][k] for fp32 rows of M at p: rows (n) 0..7, elements (k) 0..7, k permuted.
__device__ __forceinline__ FragB load_bt_perm(const float* p, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const float2 r = *reinterpret_cast<const float2*>(p + g * ld + 2 * t);
  return make_b(r.x, r.y);
}

// ---- Split operands in memory ------------------------------------------------
// An operand that many warps read is split once, where it is produced: in
// global memory as two planes (hi, then lo), or in shared memory as pairs,
// element i of a row the words (hi_i, lo_i) at 2i, 2i + 1. Fragments then
// need no conversion, and from pairs a thread's two k values of a fragment
// come in one 16-byte load, k permuted as above.

template <bool kRoundLo = false>
__device__ __forceinline__ float2 split_pair(float x) {
  uint32_t hi, lo;
  split<kRoundLo>(x, hi, lo);
  return make_float2(__uint_as_float(hi), __uint_as_float(lo));
}

// Two elements as (hi, lo, hi, lo), for one 16-byte store.
__device__ __forceinline__ float4 split_pairs(float x, float y) {
  const float2 a = split_pair(x), b = split_pair(y);
  return make_float4(a.x, a.y, b.x, b.y);
}

// B[k][n] = M[n][k] for split rows of M at p: rows (n) 0..7, elements (k) 0..7,
// k permuted as above.
__device__ __forceinline__ FragB load_bt_split(const float* p, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const uint4 r = *reinterpret_cast<const uint4*>(p + g * ld + 4 * t);
  FragB f;
  f.hi[0] = r.x, f.lo[0] = r.y, f.hi[1] = r.z, f.lo[1] = r.w;
  return f;
}

// A = rows 0..15, elements 0..7 of split rows at p (row stride ld words), k permuted.
__device__ __forceinline__ FragA load_a_split(const float* p, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const uint4 r0 = *reinterpret_cast<const uint4*>(p + g * ld + 4 * t);
  const uint4 r1 = *reinterpret_cast<const uint4*>(p + (g + 8) * ld + 4 * t);
  FragA f;
  f.hi[0] = r0.x, f.lo[0] = r0.y, f.hi[2] = r0.z, f.lo[2] = r0.w;
  f.hi[1] = r1.x, f.lo[1] = r1.y, f.hi[3] = r1.z, f.lo[3] = r1.w;
  return f;
}

// ---- The element traits -------------------------------------------------------
// What the mainloops need of their element type, on both instruction families.
// Tf32x3 is fp32 in memory on the 3xTF32 products of this file (mma.sync) and
// of detail/wgmma.cuh's TF32 instructions (wgmma); a 16-bit type brings traits
// with the same members: its own fragments and instruction shapes, one plane
// for a B operand in shared memory, and no split.
//   mma.sync (attention/mainloop_mma.cuh): FragA, FragB, a, b, step,
//     load_a_perm, load_bt_perm, run;
//   wgmma (attention/mainloop_wgmma.cuh, the wide flash kernel, the GEMM, the
//     weight gradient, the fused kernel's steps): FragA, a, kPlanes,
//     wgmma_run, wgmma_step, fence.
struct Tf32x3 {
  using Element = float;
  using FragA = cuda::FragA;
  using FragB = cuda::FragB;
  // A B operand in shared or global memory for wgmma: planes of TF32 words,
  // hi then lo, at a kernel's plane stride (detail/split_planes.cuh).
  static constexpr int kPlanes = 2;
  // The A fragment of one 8-deep step from fp32 values, split (layout: this
  // file's header for mma.sync, detail/wgmma.cuh's for wgmma, the same per
  // warp). kRoundLo: lo rounded as well, for fragments that many products read (split).
  template <bool kRoundLo = false>
  __device__ static __forceinline__ FragA a(float a0, float a1, float a2, float a3) {
    return make_a<kRoundLo>(a0, a1, a2, a3);
  }
  __device__ static __forceinline__ FragB b(float b0, float b1) { return make_b(b0, b1); }
  // t = a b (kFresh) or t += a b, one 8-deep step, in t's accumulator.
  template <bool kFresh>
  __device__ static __forceinline__ void step(float (&t)[4], const FragA& a, const FragB& b) {
    three_products<kFresh>(t, a, b);
  }
  // A = rows 0..15, B^T = rows 0..7 of fp32 rows at p (row stride ld), 8 elements from p, k permuted.
  __device__ static __forceinline__ FragA load_a_perm(const float* p, int ld) { return cuda::load_a_perm(p, ld); }
  __device__ static __forceinline__ FragB load_bt_perm(const float* p, int ld) { return cuda::load_bt_perm(p, ld); }
  // c += a0 b0 + a1 b1: a run of two steps in a fresh accumulator, added to c in fp32.
  // kSmallFirst: products_x2's order of the terms (the backward's), else step after step.
  template <bool kSmallFirst = false>
  __device__ static __forceinline__ void run(float (&c)[4], const FragA& a0, const FragB& b0, const FragA& a1,
                                             const FragB& b1) {
    mma_3xtf32_x2<kSmallFirst>(c, a0, b0, a1, b1);
  }
  // t = a0 b0 + a1 b1: a run of two steps started in t itself, in products_x2's order (the
  // backward's first run of a product).
  __device__ static __forceinline__ void run_fresh(float (&t)[4], const FragA& a0, const FragB& b0, const FragA& a1,
                                                   const FragB& b1) {
    products_x2<true>(t, a0, b0, a1, b1);
  }

#if FASTAXIAL_SM90A_DEVICE
  // Keeps A fragments in place (the compiler must not reuse their registers)
  // until the wgmma products that read them complete.
  __device__ static __forceinline__ void fence(FragA& f) { fence_regs(f.hi), fence_regs(f.lo); }
  template <int N>
  __device__ static __forceinline__ void fence(FragA (&f)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) fence(f[i]);
  }

  // A run of two 8-deep steps on wgmma, 64 x N, into the fresh accumulator
  // t: lo*hi, hi*lo, hi*hi a step, or with kSmallFirst both steps' lo*hi
  // and hi*lo, then both hi*hi (products_x2's order, the backward's); one
  // commit group. A from the split fragments f of the two steps; b: the
  // descriptors of the steps' B hi planes, each step's lo plane lo 16-byte
  // units after its hi one. f and t stay untouched until the wait that
  // completes the group (then fence(f)).
  template <int N, bool kSmallFirst = false>
  __device__ static __forceinline__ void wgmma_run(float (&t)[N / 2], FragA (&f)[2], const uint64_t (&b)[2],
                                                   uint64_t lo) {
    fence_regs(t);
    fence(f);
    wgmma_fence();
    if constexpr (kSmallFirst) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        wgmma_m64k8_rs<N>(t, f[k].lo, b[k], k);
        wgmma_m64k8_rs<N>(t, f[k].hi, b[k] + lo, 1);
      }
#pragma unroll
      for (int k = 0; k < 2; ++k) wgmma_m64k8_rs<N>(t, f[k].hi, b[k], 1);
    } else {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        wgmma_m64k8_rs<N>(t, f[k].lo, b[k], k);
        wgmma_m64k8_rs<N>(t, f[k].hi, b[k] + lo, 1);
        wgmma_m64k8_rs<N>(t, f[k].hi, b[k], 1);
      }
    }
    wgmma_commit();
  }

  // One 8-deep step on wgmma into the fresh accumulator t (lo*hi, hi*lo,
  // hi*hi), one commit group: a run of one step, for products whose runs'
  // truncation errors would add up (mma_3xtf32_x2). A from the split
  // fragment f; b: the descriptor of the step's B hi plane, its lo plane lo
  // 16-byte units after it.
  template <int N>
  __device__ static __forceinline__ void wgmma_step(float (&t)[N / 2], FragA& f, uint64_t b, uint64_t lo) {
    fence_regs(t);
    fence(f);
    wgmma_fence();
    wgmma_m64k8_rs<N>(t, f.lo, b, 0);
    wgmma_m64k8_rs<N>(t, f.hi, b + lo, 1);
    wgmma_m64k8_rs<N>(t, f.hi, b, 1);
    wgmma_commit();
  }
#endif  // FASTAXIAL_SM90A_DEVICE
};

}  // namespace fastaxial::cuda
