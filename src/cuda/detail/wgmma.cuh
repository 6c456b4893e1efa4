// Hopper's warpgroup matrix instructions (wgmma, sm_90a only): the
// shared-memory matrix descriptors (128- and 64-byte swizzles), the products
// with a TF32 A operand from registers and B from shared memory (64 x N x 8,
// by N), the same on 16-bit operands (64 x N x 16: the 16-bit flash kernels,
// attention/flash_attention_wgmma16.cu and _qkv16.cu), with B read transposed
// (MN-major descriptors) and with A from shared memory too (_qkv16.cu), the
// fences around them, and
// wgmma_add_runs4 (two runs in flight). An element type's run of
// products over a K slice is its traits' (detail/tf32x3.cuh: Tf32x3's
// wgmma_run, the 3xTF32 products on these TF32 instructions); the parts
// built on them: attention/mainloop_wgmma.cuh, the wide flash kernel
// (attention/flash_attention_wgmma_wide.cu), gemm/gemm.cu,
// gemm/weight_gradient_parts.cuh and fused/steps_wgmma.cuh.
// Its functions exist only in device code compiled for sm_90a
// (FASTAXIAL_SM90A_DEVICE); use them under that macro.
//
// A warpgroup is 4 consecutive warps (128 threads, starting at a warp index
// divisible by 4). The 64 x N f32 accumulator of a product is spread as in
// mma.m16n8k8's C: warp w holds rows 16 w + g and 16 w + g + 8 (g = lane / 4),
// and d[4 j .. 4 j + 3] are columns 8 j + 2t, 8 j + 2t + 1 of those rows
// (t = lane % 4). A register A operand (64 x 8) is mma.m16n8k8's A fragment
// of the same rows: a[0..3] = (16 w + g, t), (16 w + g + 8, t),
// (16 w + g, t + 4), (16 w + g + 8, t + 4).
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FASTAXIAL_SM90A_DEVICE 1
#else
#define FASTAXIAL_SM90A_DEVICE 0
#endif

#if FASTAXIAL_SM90A_DEVICE
namespace fastaxial::cuda {

// K-major operand in the 128-byte swizzled layout: rows of 128 bytes (32
// TF32 values), 16-byte piece c of row r stored at piece c ^ (r % 8), 8-row
// groups 1024 bytes apart; the tile starts on a 1024-byte boundary.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

// K-major operand in the 64-byte swizzled layout: rows of 64 bytes (32 16-bit values), 16-byte
// piece c of row r stored at piece c ^ (r / 2 % 4), 8-row groups 512 bytes apart; the tile starts
// on a 512-byte boundary.
__device__ __forceinline__ uint64_t desc_sw64(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(512 >> 4) << 32) |
         ((uint64_t)2 << 62);
}

// MN-major operand in the 128-byte swizzled layout (a 16-bit B read transposed: wgmma's tnsp-b):
// rows of 128 bytes, each 64 values of N for one k, 16-byte pieces swizzled as desc_sw128's; 8-k
// groups 1024 bytes apart; the next 64 values of N `n_stride` bytes on. The tile starts on a
// 1024-byte boundary.
__device__ __forceinline__ uint64_t desc_sw128_mn(uint32_t addr, uint32_t n_stride) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((n_stride >> 4) & 0x3FFF) << 16) |
         ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// The same in the 64-byte swizzle (desc_sw64's pieces): rows of 64 bytes, each 32 values of N for
// one k; 8-k groups 512 bytes apart; one 32-value chunk of N (N = 32: the leading offset unused).
__device__ __forceinline__ uint64_t desc_sw64_mn(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(512 >> 4) << 32) | ((uint64_t)2 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by ordinary stores (or cp.async) that wgmma reads next.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving accesses of r across asynchronous products
// (accumulators, and A fragments, which must hold until their product completes).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// c += t, after the wait that completed the product into t.
template <int N>
__device__ __forceinline__ void add_to(float (&c)[N], float (&t)[N]) {
  fence_regs(t);
#pragma unroll
  for (int i = 0; i < N; ++i) c[i] += t[i];
}

// wgmma_m64k8_rs<N>: d (64 x N) = or += A (64 x 8) @ B (8 x N), A from registers (the
// mma.m16n8k8 A fragment of the warp's 16 rows), B in shared memory. One specialization a width:
//   128 and 96: the attention kernels' and the GEMM's wide tiles;
//   64: the weight gradients' narrow tiles (gemm/weight_gradient.cu, K <= 64) and the attention
//       kernels' scores (64 keys);
//   48: half of a 96-column tile (gemm/gemm.cu, three warpgroups);
//   8 to 32: the fused kernel's (fused/steps_wgmma.cuh), whose N is a sequence's positions, 8 to
//       32 a warpgroup, and the attention kernels' products over keys (N = head dim 32).
// Any other N fails to compile. The asm operands: d's N / 2 accumulators (%0 ..), then a's four
// registers, b and accumulate, which sets the predicate p (0: d = A B; 1: d += A B).
template <int N>
__device__ __forceinline__ void wgmma_m64k8_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  static_assert(N != N, "wgmma_m64k8_rs: N is 8, 16, 24, 32, 48, 64, 96 or 128");
}
#define FASTAXIAL_WGMMA_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define FASTAXIAL_WGMMA_ACC8(i) FASTAXIAL_WGMMA_ACC4(i), FASTAXIAL_WGMMA_ACC4(i + 4)
// A width's asm operands, for both families: the accumulator list "{%0, ..}", then "{a's
// operands}, b's operand", the predicate's operand number, and the accumulator operands.
#define FASTAXIAL_WGMMA_OPS_128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", "{%64, %65, %66, %67}, %68", 69, \
    FASTAXIAL_WGMMA_ACC8(0), FASTAXIAL_WGMMA_ACC8(8), FASTAXIAL_WGMMA_ACC8(16), FASTAXIAL_WGMMA_ACC8(24), FASTAXIAL_WGMMA_ACC8(32), FASTAXIAL_WGMMA_ACC8(40), FASTAXIAL_WGMMA_ACC8(48), FASTAXIAL_WGMMA_ACC8(56)
#define FASTAXIAL_WGMMA_OPS_96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}", "{%48, %49, %50, %51}, %52", 53, \
    FASTAXIAL_WGMMA_ACC8(0), FASTAXIAL_WGMMA_ACC8(8), FASTAXIAL_WGMMA_ACC8(16), FASTAXIAL_WGMMA_ACC8(24), FASTAXIAL_WGMMA_ACC8(32), FASTAXIAL_WGMMA_ACC8(40)
#define FASTAXIAL_WGMMA_OPS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", "{%32, %33, %34, %35}, %36", 37, \
    FASTAXIAL_WGMMA_ACC8(0), FASTAXIAL_WGMMA_ACC8(8), FASTAXIAL_WGMMA_ACC8(16), FASTAXIAL_WGMMA_ACC8(24)
#define FASTAXIAL_WGMMA_OPS_48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}", "{%24, %25, %26, %27}, %28", 29, \
    FASTAXIAL_WGMMA_ACC8(0), FASTAXIAL_WGMMA_ACC8(8), FASTAXIAL_WGMMA_ACC8(16)
#define FASTAXIAL_WGMMA_OPS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}", "{%16, %17, %18, %19}, %20", 21, \
    FASTAXIAL_WGMMA_ACC8(0), FASTAXIAL_WGMMA_ACC8(8)
#define FASTAXIAL_WGMMA_OPS_24 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}", "{%12, %13, %14, %15}, %16", 17, \
    FASTAXIAL_WGMMA_ACC8(0), FASTAXIAL_WGMMA_ACC4(8)
#define FASTAXIAL_WGMMA_OPS_16 "{%0, %1, %2, %3, %4, %5, %6, %7}", "{%8, %9, %10, %11}, %12", 13, \
    FASTAXIAL_WGMMA_ACC8(0)
#define FASTAXIAL_WGMMA_OPS_8 "{%0, %1, %2, %3}", "{%4, %5, %6, %7}, %8", 9, \
    FASTAXIAL_WGMMA_ACC4(0)
#define FASTAXIAL_WGMMA_UNPAREN(...) __VA_ARGS__
// One specialization: FUNC<ARGS> (ARGS in parentheses), N, the instruction up to its operands and
// the immediates after the predicate; then a width's operands (FASTAXIAL_WGMMA_OPS_N, expanded
// into separate arguments by the outer macro).
#define FASTAXIAL_WGMMA_RS_BODY(FUNC, ARGS, N, INSTR, IMM, acc, ab, pred, ...)                                  \
  template <>                                                                                                     \
  __device__ __forceinline__ void FUNC<FASTAXIAL_WGMMA_UNPAREN ARGS>(float(&d)[N / 2], const uint32_t(&a)[4],     \
                                                                    uint64_t b, int accumulate) {                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #pred ", 0;\n" INSTR " " acc ", " ab ", p, " IMM ";\n}\n"    \
                 : __VA_ARGS__                                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                     \
  }
#define FASTAXIAL_WGMMA_RS(...) FASTAXIAL_WGMMA_RS_BODY(__VA_ARGS__)
#define FASTAXIAL_WGMMA_TF32_RS(N) \
  FASTAXIAL_WGMMA_RS(wgmma_m64k8_rs, (N), N, "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32", "1, 1", \
                     FASTAXIAL_WGMMA_OPS_##N)

FASTAXIAL_WGMMA_TF32_RS(128)
FASTAXIAL_WGMMA_TF32_RS(96)
FASTAXIAL_WGMMA_TF32_RS(64)
FASTAXIAL_WGMMA_TF32_RS(48)
FASTAXIAL_WGMMA_TF32_RS(32)
FASTAXIAL_WGMMA_TF32_RS(24)
FASTAXIAL_WGMMA_TF32_RS(16)
FASTAXIAL_WGMMA_TF32_RS(8)

// wgmma_m64k16_rs<kBf16, N>: d (64 x N) = or += A (64 x 16) @ B (16 x N) on 16-bit operands (bf16,
// else fp16) with fp32 accumulation; A from registers, the mma.m16n8k16 A fragment of the warp's
// 16 rows (a[0]: row g, k 2t and 2t + 1; a[1]: row g + 8; a[2], a[3]: the same at k + 8, the lower
// k in the lower half), B K-major in shared memory (desc_sw128: a 128-byte row is 64 values of k;
// desc_sw64: 32). Widths 32, 64 and 128: the 16-bit flash kernel's scores (64 keys) and its o
// (head dims 32 and 128).
template <bool kBf16, int N>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,
                                                int accumulate) {
  static_assert(N != N, "wgmma_m64k16_rs: N is 32, 64 or 128");
}
// wgmma_m64k16_rs_tb<kBf16, N>: as wgmma_m64k16_rs with B MN-major (desc_sw128_mn, desc_sw64_mn: B's
// rows are its k, the values of n contiguous), the 16-bit product's transposed B (tnsp-b). Widths
// 32, 64 and 128: the o of flash_attention_qkv16.cu (v's rows as they are stored).
template <bool kBf16, int N>
__device__ __forceinline__ void wgmma_m64k16_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,
                                                   int accumulate) {
  static_assert(N != N, "wgmma_m64k16_rs_tb: N is 32, 64 or 128");
}
// FUNC<true, N> (bf16) and FUNC<false, N> (fp16); IMM: scale-a, scale-b, tnsp-b.
#define FASTAXIAL_WGMMA_16_RS(FUNC, N, IMM)                                                                      \
  FASTAXIAL_WGMMA_RS(FUNC, (true, N), N, "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16", IMM,          \
                     FASTAXIAL_WGMMA_OPS_##N)                                                                    \
  FASTAXIAL_WGMMA_RS(FUNC, (false, N), N, "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16", IMM,           \
                     FASTAXIAL_WGMMA_OPS_##N)

FASTAXIAL_WGMMA_16_RS(wgmma_m64k16_rs, 128, "1, 1, 0")
FASTAXIAL_WGMMA_16_RS(wgmma_m64k16_rs, 64, "1, 1, 0")
FASTAXIAL_WGMMA_16_RS(wgmma_m64k16_rs, 32, "1, 1, 0")
FASTAXIAL_WGMMA_16_RS(wgmma_m64k16_rs_tb, 128, "1, 1, 1")
FASTAXIAL_WGMMA_16_RS(wgmma_m64k16_rs_tb, 64, "1, 1, 1")
FASTAXIAL_WGMMA_16_RS(wgmma_m64k16_rs_tb, 32, "1, 1, 1")

// wgmma_m64n64k16_ss<kBf16>: d (64 x 64) = or += A (64 x 16) @ B (16 x 64), both K-major in shared
// memory (desc_sw128 or desc_sw64), 16-bit operands, fp32 accumulation: the scores of
// flash_attention_qkv16.cu (q's rows and k's rows as they are stored).
#define FASTAXIAL_WGMMA_SS64(TYPE)                                                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE  \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "   \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"              \
               : FASTAXIAL_WGMMA_ACC8(0), FASTAXIAL_WGMMA_ACC8(8), FASTAXIAL_WGMMA_ACC8(16), FASTAXIAL_WGMMA_ACC8(24) \
               : "l"(a), "l"(b), "r"(accumulate))
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (kBf16)
    FASTAXIAL_WGMMA_SS64("bf16");
  else
    FASTAXIAL_WGMMA_SS64("f16");
}
#undef FASTAXIAL_WGMMA_SS64

#undef FASTAXIAL_WGMMA_16_RS
#undef FASTAXIAL_WGMMA_TF32_RS
#undef FASTAXIAL_WGMMA_RS
#undef FASTAXIAL_WGMMA_RS_BODY
#undef FASTAXIAL_WGMMA_UNPAREN
#undef FASTAXIAL_WGMMA_OPS_128
#undef FASTAXIAL_WGMMA_OPS_96
#undef FASTAXIAL_WGMMA_OPS_64
#undef FASTAXIAL_WGMMA_OPS_48
#undef FASTAXIAL_WGMMA_OPS_32
#undef FASTAXIAL_WGMMA_OPS_24
#undef FASTAXIAL_WGMMA_OPS_16
#undef FASTAXIAL_WGMMA_OPS_8
#undef FASTAXIAL_WGMMA_ACC8
#undef FASTAXIAL_WGMMA_ACC4

// acc (N floats) += the totals of four runs, run(t, f, r) issuing run r into
// fresh accumulator t with Elem's A fragments f (Elem::wgmma_run): two runs
// in flight on the accumulators t0 and t1 in turn, so that one run's
// products go on while the other's total is added.
template <class Elem, int N, class Run>
__device__ __forceinline__ void wgmma_add_runs4(float (&acc)[N], float (&t0)[N], float (&t1)[N], Run&& run) {
  typename Elem::FragA f0[2], f1[2];
  run(t0, f0, 0);
  run(t1, f1, 1);
  wgmma_wait<1>();
  Elem::fence(f0);
  add_to(acc, t0);
  run(t0, f0, 2);
  wgmma_wait<1>();
  Elem::fence(f1);
  add_to(acc, t1);
  run(t1, f1, 3);
  wgmma_wait<1>();
  Elem::fence(f0);
  add_to(acc, t0);
  wgmma_wait<0>();
  Elem::fence(f1);
  add_to(acc, t1);
}

}  // namespace fastaxial::cuda
#endif  // FASTAXIAL_SM90A_DEVICE
