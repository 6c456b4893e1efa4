// Element traits for 16-bit products on mma.sync (any sm_80+ GPU): bf16 or
// fp16 operands, fp32 accumulation. The same members as detail/tf32x3.cuh's
// Tf32x3 on mma.sync (FragA, FragB, a, b, step, load_a_perm, load_bt_perm,
// run), so that attention/mainloop_mma.cuh runs on them unchanged; there is
// no split: one product per step where 3xTF32 takes three.
//
// The mainloops hand over values in Tf32x3's permuted-k order: a(a0, a1, a2,
// a3) is (g, k 2t), (g + 8, k 2t), (g, k 2t + 1), (g + 8, k 2t + 1) of an
// 8-deep step, and b(b0, b1) is (k 2t, g), (k 2t + 1, g). PTX's m16n8k8
// 16-bit layout holds exactly those: A's register 0 is row g, k 2t and 2t + 1
// (the lower k in the lower half), register 1 row g + 8; B's one register is
// k 2t and 2t + 1 of column g. A run of two 8-deep steps is one m16n8k16:
// its A registers are step 0's then step 1's, its B registers the same.
//
// Values are rounded to the 16-bit type (round to nearest even) as the
// fragments are made: from fp32 in shared memory, or from the scores in
// registers for p v. This is the products' precision under autocast (the
// reference's Linear layers and attention products in bf16 or fp16, fp32
// accumulation); the softmax and its statistics stay fp32 in the mainloop.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "round16.cuh"

namespace fastaxial::cuda {

// lo and hi rounded to T (detail/round16.cuh) in one register, lo in the lower half.
template <class T>
__device__ __forceinline__ uint32_t pack16(float lo, float hi) {
  const Pair16<T> v = round16x2<T>(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Four 8 x 8 matrices of 16-bit values from shared memory into each thread's four registers
// (ldmatrix.x4): lanes 8m .. 8m + 7 give the row addresses (16 bytes each) of matrix m, and register m
// of lane l gets matrix m's row l / 4, values 2 (l % 4) and 2 (l % 4) + 1: mma.m16n8k16's A fragment
// where matrices 0 .. 3 are rows 0-7 and 8-15 at k 0-7, then the same at k 8-15.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The PTX type name of each, spliced into the instructions below.
#define FASTAXIAL_MMA16_K8(TYPE)                                                                              \
  "mma.sync.aligned.m16n8k8.row.col.f32." TYPE "." TYPE ".f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
#define FASTAXIAL_MMA16_K8_FIRST(TYPE)                                                                         \
  "mma.sync.aligned.m16n8k8.row.col.f32." TYPE "." TYPE ".f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};\n"
#define FASTAXIAL_MMA16_K16(TYPE)                                                                              \
  "mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                                      \
  ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"

template <class T>
struct Mma16 {
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  struct FragA {  // a 16 x 8 operand: rows g and g + 8, k 2t and 2t + 1
    uint32_t r[2];
  };
  struct FragB {  // an 8 x 8 operand: k 2t and 2t + 1 of column g
    uint32_t r;
  };

  // kRoundLo is Tf32x3's (lo rounded too); with no split it has nothing to do.
  template <bool kRoundLo = false>
  __device__ static __forceinline__ FragA a(float a0, float a1, float a2, float a3) {
    return {{pack16<T>(a0, a2), pack16<T>(a1, a3)}};
  }
  __device__ static __forceinline__ FragB b(float b0, float b1) { return {pack16<T>(b0, b1)}; }
  // The A fragment of values stored in T already (rounded once, where they were made): their bits
  // as they are, the same fragment as a() of the fp32 values they were rounded from.
  __device__ static __forceinline__ FragA a_stored(T a0, T a1, T a2, T a3) { return {{bits(a0, a2), bits(a1, a3)}}; }
  __device__ static __forceinline__ uint32_t bits(T lo, T hi) {
    return uint32_t{*reinterpret_cast<const unsigned short*>(&lo)} |
           uint32_t{*reinterpret_cast<const unsigned short*>(&hi)} << 16;
  }

  // t = a b (kFresh) or t += a b, one 8-deep step.
  template <bool kFresh>
  __device__ static __forceinline__ void step(float (&t)[4], const FragA& a, const FragB& b) {
    if constexpr (kFresh) {
      if constexpr (kBf16)
        asm volatile(FASTAXIAL_MMA16_K8_FIRST("bf16")
                     : "=f"(t[0]), "=f"(t[1]), "=f"(t[2]), "=f"(t[3])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(b.r), "f"(0.0f));
      else
        asm volatile(FASTAXIAL_MMA16_K8_FIRST("f16")
                     : "=f"(t[0]), "=f"(t[1]), "=f"(t[2]), "=f"(t[3])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(b.r), "f"(0.0f));
    } else {
      if constexpr (kBf16)
        asm volatile(FASTAXIAL_MMA16_K8("bf16")
                     : "+f"(t[0]), "+f"(t[1]), "+f"(t[2]), "+f"(t[3])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(b.r));
      else
        asm volatile(FASTAXIAL_MMA16_K8("f16")
                     : "+f"(t[0]), "+f"(t[1]), "+f"(t[2]), "+f"(t[3])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(b.r));
    }
  }

  // A = rows 0..15, B^T = rows 0..7 of fp32 rows at p (row stride ld), 8 elements from p, in the
  // order above: a thread's k 2t and 2t + 1 of a row are one 8-byte load.
  __device__ static __forceinline__ FragA load_a_perm(const float* p, int ld) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const float2 r0 = *reinterpret_cast<const float2*>(p + g * ld + 2 * t);
    const float2 r1 = *reinterpret_cast<const float2*>(p + (g + 8) * ld + 2 * t);
    return a(r0.x, r1.x, r0.y, r1.y);
  }
  __device__ static __forceinline__ FragB load_bt_perm(const float* p, int ld) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const float2 r = *reinterpret_cast<const float2*>(p + g * ld + 2 * t);
    return b(r.x, r.y);
  }

  // c += a0 b0 + a1 b1: one m16n8k16 straight into c. The tensor core accumulates in fp32; with
  // 16-bit operands the products' rounding is far above an fp32 add's, so no fresh accumulator.
  // (kSmallFirst orders Tf32x3's split terms; one instruction has none to order.)
  template <bool kSmallFirst = false>
  __device__ static __forceinline__ void run(float (&c)[4], const FragA& a0, const FragB& b0, const FragA& a1,
                                             const FragB& b1) {
    if constexpr (kBf16)
      asm volatile(FASTAXIAL_MMA16_K16("bf16")
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a0.r[0]), "r"(a0.r[1]), "r"(a1.r[0]), "r"(a1.r[1]), "r"(b0.r), "r"(b1.r));
    else
      asm volatile(FASTAXIAL_MMA16_K16("f16")
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a0.r[0]), "r"(a0.r[1]), "r"(a1.r[0]), "r"(a1.r[1]), "r"(b0.r), "r"(b1.r));
  }
  // t = a0 b0 + a1 b1, t's earlier values dropped.
  __device__ static __forceinline__ void run_fresh(float (&t)[4], const FragA& a0, const FragB& b0, const FragA& a1,
                                                   const FragB& b1) {
#pragma unroll
    for (int e = 0; e < 4; ++e) t[e] = 0.0f;
    run(t, a0, b0, a1, b1);
  }
};

#undef FASTAXIAL_MMA16_K8
#undef FASTAXIAL_MMA16_K8_FIRST
#undef FASTAXIAL_MMA16_K16

using Bf16Mma = Mma16<__nv_bfloat16>;
using Fp16Mma = Mma16<__half>;

}  // namespace fastaxial::cuda
