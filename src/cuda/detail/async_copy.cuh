// Asynchronous global -> shared copies (cp.async, sm_80 and later): a copy
// is issued and the thread goes on; commit() closes a group of copies and
// wait<N>() blocks until at most N groups are still in flight. The kernels
// use them to keep whole tiles in flight while they compute.
#pragma once

#include <cstdint>
#include <type_traits>

namespace fastaxial::cuda {

// p (in shared memory) as a shared-space address, as cp.async and wgmma's descriptors take it.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// The first 1024-byte boundary at or after a shared-space address: where swizzled tiles (wgmma's
// operands) start in a kernel's dynamic shared memory.
__device__ __forceinline__ uint32_t align_1024(uint32_t smem) { return (smem + 1023) & ~1023u; }

// The block's dynamic shared memory from its first 1024-byte boundary (the
// swizzled planes' alignment; the kernels ask for 1024 bytes more): returns
// it as a pointer, and base, its address in the shared window.
__device__ __forceinline__ char* aligned_smem(uint32_t& base) {
  extern __shared__ float4 smem4[];
  const uint32_t raw = smem_addr(smem4);
  base = align_1024(raw);
  return reinterpret_cast<char*>(smem4) + (base - raw);
}

// 4 bytes from global memory at src to shared memory at dst (a shared-space
// address); with src_bytes = 0 nothing is read and the word is zeroed.
__device__ __forceinline__ void copy_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// 16 bytes from global memory at src to shared memory at dst (a shared-space
// address); with src_bytes < 16 only that many are read and the rest zeroed.
__device__ __forceinline__ void copy_async16(uint32_t dst, const void* src, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void copy_async16(float* dst, const float* src) {
  copy_async16((uint32_t)__cvta_generic_to_shared(dst), src);
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared-memory words of a row-major tile of LD floats a row.
template <int LD>
struct RowMajor {
  __device__ __forceinline__ int operator()(int r, int c) const { return r * LD + c; }
};

// Positions p0 .. p0 + rows - 1 of one head's slice into shared memory, the
// attention kernels' tile copy: position l's columns 0 .. hd - 1 (of HDP),
// from global address at(l, c) on, go to float word(r, c) from dst (a float*
// into shared memory, or a shared-space address), r = l - p0; positions >= L as zeros (the copies' zero fill, which names
// `fill`, any address in bounds). kVec: 16-byte copies (hd % 4 == 0 and rows
// 16-byte aligned: chunks lie wholly inside or outside hd), else 4-byte ones.
// Thread tid of `threads` takes every threads-th piece; kUnroll: the loop's
// unroll.
template <int HDP, bool kVec, int kUnroll, class Dst, class Word, class At>
__device__ __forceinline__ void copy_head_rows(Dst dst, Word word, At at, int p0, int rows, int L, int hd,
                                               const float* fill, int tid, int threads) {
  constexpr int W = kVec ? 4 : 1;  // floats a copy
  constexpr int C = HDP / W;       // copies a row
#pragma unroll kUnroll
  for (int e = tid; e < rows * C; e += threads) {
    const int r = e / C, c = W * (e % C);
    if (c >= hd) continue;
    const int l = p0 + r;
    const bool valid = l < L;
    const float* from = valid ? at(l, c) : fill;
    uint32_t to;
    if constexpr (std::is_pointer_v<Dst>)
      to = smem_addr(dst + word(r, c));
    else
      to = dst + 4u * (uint32_t)word(r, c);
    if constexpr (kVec)
      copy_async16(to, from, valid ? 16 : 0);
    else
      copy_async4(to, from, valid ? 4 : 0);
  }
}

}  // namespace fastaxial::cuda
