// Shared-memory barriers (mbarrier, sm_90) for kernels whose warps hand
// buffers to each other without stopping the whole block: a producer fills
// a stage and the stage's "full" barrier completes a phase when every copy
// has landed; consumers wait on that phase, use the stage and arrive on its
// "empty" barrier, which the producer waits on before it refills the stage.
// A barrier's phases alternate in parity: the k-th use of a stage waits for
// phase parity k % 2. gemm/gemm.cu uses them.
#pragma once

#include <cstdint>

namespace fastaxial::cuda {

// The barrier at shared address bar expects `count` arrivals a phase.
// Initialised by one thread, then mbarrier_init_fence() and a __syncthreads
// before any other thread uses it.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival (release: this thread's earlier accesses happen before the phase completes).
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival made when every cp.async this thread issued before it has
// landed; it counts as one of the phase's expected arrivals (.noinc).
__device__ __forceinline__ void copy_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Blocks until the phase of parity `parity` has completed (acquire: what the
// arrivals released is visible after it).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "retry:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra retry;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

}  // namespace fastaxial::cuda
