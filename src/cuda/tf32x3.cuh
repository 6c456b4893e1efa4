// Warp-level fp32 matrix products on the tensor cores, with fp32 accuracy.
//
// A TF32 number keeps 10 of fp32's 23 mantissa bits, so a plain TF32 product
// is about 1e-3 off. Each fp32 operand is split as a = hi + lo with hi and lo
// both TF32 (hi = a rounded to TF32, lo = the rest rounded to TF32, together
// 21+ bits), and a*b is taken as lo*hi + hi*lo + hi*hi with fp32 accumulation
// (the lo*lo term is below fp32 rounding). Three tensor-core products per
// fp32 product, still several times the FFMA rate.
//
// Fragments follow PTX's mma.m16n8k8 .tf32 layout: with g = lane / 4 and
// t = lane % 4, A (16 x 8, row-major) holds (g, t), (g+8, t), (g, t+4),
// (g+8, t+4); B (8 x 8, k x n) holds (t, g), (t+4, g); C (16 x 8) holds
// (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
#pragma once

#include <cstdint>

namespace fastaxial::cuda {

struct FragA {  // a 16 x 8 operand, split
  uint32_t hi[4], lo[4];
};
struct FragB {  // an 8 x 8 operand, split
  uint32_t hi[2], lo[2];
};

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));  // exact in fp32, then rounded to TF32
}

__device__ __forceinline__ FragA make_a(float a0, float a1, float a2, float a3) {
  FragA f;
  split(a0, f.hi[0], f.lo[0]);
  split(a1, f.hi[1], f.lo[1]);
  split(a2, f.hi[2], f.lo[2]);
  split(a3, f.hi[3], f.lo[3]);
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

// c += a * b, fp32-accurate: the small terms first, then the large one, in a
// fresh accumulator; then one rounded fp32 add per element.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const FragA& a, const FragB& b) {
  float t[4];
  mma_tf32_first(t, a.lo, b.hi);
  mma_tf32(t, a.hi, b.lo);
  mma_tf32(t, a.hi, b.hi);
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] += t[e];
}

// A = rows 0..15, columns 0..7 of a row-major matrix at p with row stride ld.
__device__ __forceinline__ FragA load_a(const float* p, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  return make_a(p[g * ld + t], p[(g + 8) * ld + t], p[g * ld + t + 4], p[(g + 8) * ld + t + 4]);
}

// B[k][n] = M[n][k]: M is row-major with row stride ld (a weight matrix
// (out, in), or keys (position, feature)); rows 0..7, columns 0..7.
__device__ __forceinline__ FragB load_bt(const float* p, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  return make_b(p[g * ld + t], p[g * ld + t + 4]);
}

// ---- Split operands in memory ------------------------------------------------
// An operand that many warps read is split once, where it is produced: in
// global memory as two planes (hi, then lo), or in shared memory as pairs,
// element i of a row the words (hi_i, lo_i) at 2i, 2i + 1. Fragments then
// need no conversion, and from pairs a thread's two k values of a fragment
// come in one 16-byte load: inside each group of 8, the product's k
// index t stands for element 2t and t + 4 for element 2t + 1 (a product sums
// over k, so one permutation applied to both operands changes nothing).

__device__ __forceinline__ float2 split_pair(float x) {
  uint32_t hi, lo;
  split(x, hi, lo);
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

}  // namespace fastaxial::cuda
