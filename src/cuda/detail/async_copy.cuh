// Asynchronous global -> shared copies (cp.async, sm_80 and later): a copy
// is issued and the thread goes on; commit() closes a group of copies and
// wait<N>() blocks until at most N groups are still in flight. The kernels
// use them to keep whole tiles in flight while they compute.
#pragma once

#include <cstdint>

namespace fastaxial::cuda {

// p (in shared memory) as a shared-space address, as cp.async and wgmma's descriptors take it.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

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

}  // namespace fastaxial::cuda
