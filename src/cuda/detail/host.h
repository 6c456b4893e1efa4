// Host-side helpers of every launcher: CUDA errors as a Status, and the
// shared-memory opt-in of a kernel.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <type_traits>

#include "../../common/plan.h"  // DeviceCaps
#include "../../common/dispatch.h"  // with_int, with_padded_head_dim, with_bools
#include "fastaxial/fastaxial.h"

namespace fastaxial::cuda {

// e as a Status, `what` naming the call that failed.
inline Status cuda_error(cudaError_t e, const char* what) {
  return {StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(e)};
}

// Lets `kernel` use all the shared memory a block may opt in to on the
// device, once per kernel and device (the call costs microseconds of host
// time). Always the same value, so concurrent first calls cannot undo each other.
template <auto kernel>
cudaError_t allow_max_smem(const DeviceCaps& dev) {
  const int device = dev.device;
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];  // one array per kernel
  if (device >= 0 && device < kMaxDevices && done[device].load(std::memory_order_acquire)) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dev.smem_optin);
  if (e == cudaSuccess && device >= 0 && device < kMaxDevices) done[device].store(true, std::memory_order_release);
  return e;
}


}  // namespace fastaxial::cuda
