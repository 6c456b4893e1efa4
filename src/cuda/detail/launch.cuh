// Kernel launches chained by programmatic dependent launch (Hopper, sm_90):
// a forward is 2 to 8 kernels in a row on one stream, and between two plain
// launches the GPU sits idle for the next grid's launch and block start
// (about 1.5 us each on the H200). Launched with programmatic stream
// serialization, the next kernel is set up while the current one runs and
// its blocks take the multiprocessors as the current one's leave.
//
// The rule every kernel of this library keeps: nothing read or written in
// global memory before grid_dependency_wait() (an L2 prefetch hint aside),
// which returns once the previous kernel on the stream has finished and its
// writes are visible; so each kernel sees the whole of the one before it, and
// by induction everything launched earlier. allow_dependent_launch() right
// after it lets the next kernel be launched; that one waits in turn.
// Before sm_90 both are no-ops and launch_kernel() launches plainly.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "axis_kernels.h"

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

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic
// dependent of the stream's previous kernel where the device has it
// (compute capability 9.0 and up); returns the launch's error.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          const DeviceInfo& dev, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = dev.cc_major >= 9 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fastaxial::cuda
