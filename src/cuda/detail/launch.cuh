// Kernel launches chained by programmatic dependent launch (PDL, Hopper,
// sm_90): a forward is 2 to 8 kernels in a row on one stream, and between two
// plain launches the GPU sits idle for the next grid's launch and block start
// (measured in docs/perf-notes.md). Launched with programmatic stream
// serialization, the next kernel is set up while the current one runs and
// its blocks take the multiprocessors as the current one's leave.
//
// The rule every kernel of this library keeps: nothing read or written in
// global memory before grid_dependency_wait() (an L2 prefetch hint aside),
// which returns once the previous kernel on the stream has finished and its
// writes are visible; so each kernel sees the whole of the one before it, and
// by induction everything launched earlier. allow_dependent_launch() right
// after it lets the next kernel be launched; that one waits in turn.
// Code compiled for an architecture below sm_90 has neither (both are empty
// there), and launch_kernel() launches such code plainly.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// True when `kernel` runs on this device as code that has the wait of
// grid_dependency_wait(): code compiled from PTX of compute_90 or later. With
// the default architectures (sm_90a machine code, compute_80 PTX) every GPU
// but a compute-capability 9.0 one (9.x, 10.x, 12.x) runs the driver's
// compilation of the compute_80 PTX, where the wait is empty: launched as a
// programmatic dependent, such a kernel would read its predecessor's output
// while that still runs. Asked once per kernel and device (the query costs
// microseconds of host time); the answer never changes, so concurrent first
// calls store the same value.
template <auto kernel>
cudaError_t has_dependency_wait(const DeviceCaps& dev, bool* waits) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];  // one array per kernel: 0 not asked yet, 1 no wait, 2 a wait
  const int device = dev.device;
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached) {
    if (const int k = known[device].load(std::memory_order_relaxed); k != 0) {
      *waits = k == 2;
      return cudaSuccess;
    }
  }
  cudaFuncAttributes attr = {};
  if (cudaError_t e = cudaFuncGetAttributes(&attr, kernel); e != cudaSuccess) return e;
  *waits = attr.ptxVersion >= 90;
  if (cached) known[device].store(*waits ? 2 : 1, std::memory_order_relaxed);
  return cudaSuccess;
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic
// dependent of the stream's previous kernel where the kernel's code waits
// for that one (has_dependency_wait); returns the launch's error.
template <auto kernel, typename... Args>
cudaError_t launch_kernel(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const DeviceCaps& dev,
                          Args&&... args) {
  bool dependent = false;
  if (dev.cc_major >= 9)
    if (cudaError_t e = has_dependency_wait<kernel>(dev, &dependent); e != cudaSuccess) return e;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fastaxial::cuda
