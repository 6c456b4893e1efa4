// Helpers of the CUDA test suites: checked calls, device memory that frees
// itself (also when an assertion returns early), and the device as the
// library's plan sees it.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "src/common/plan.h"
#include "util/devices.h"  // h200(): the kernels' rules on an H200, without a device

namespace fastaxial::test {

#define CUDA_OK(call)                                                        \
  do {                                                                       \
    const cudaError_t e_ = (call);                                           \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_);   \
  } while (0)

// A float's bits, and back (for TF32 roundings and bitwise checks).
inline uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

struct CudaFree {
  void operator()(float* p) const { cudaFree(p); }
};
using DevicePtr = std::unique_ptr<float, CudaFree>;

// count floats of device memory; null where allocation fails.
inline DevicePtr device_alloc(size_t count) {
  float* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(float)) != cudaSuccess) return nullptr;
  return DevicePtr(p);
}

// The buffers' device pointers.
inline std::vector<float*> raw(const std::vector<DevicePtr>& bufs) {
  std::vector<float*> ptr;
  for (const DevicePtr& b : bufs) ptr.push_back(b.get());
  return ptr;
}

// The current device's attributes as src/cuda/entry.cu reads them; sm90a is
// compute capability 9.0 (whether the build has sm_90a code, the library's
// FASTAXIAL_WGMMA, is cuda::gemm_tf32x3_can_run's to add). False when a
// query fails.
inline bool read_device_caps(DeviceCaps* dev) {
  if (cudaGetDevice(&dev->device) != cudaSuccess) return false;
  const std::pair<int*, cudaDeviceAttr> attrs[] = {{&dev->sms, cudaDevAttrMultiProcessorCount},
                                                   {&dev->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
                                                   {&dev->cc_major, cudaDevAttrComputeCapabilityMajor},
                                                   {&dev->cc_minor, cudaDevAttrComputeCapabilityMinor}};
  for (const auto& [value, attr] : attrs)
    if (cudaDeviceGetAttribute(value, attr, dev->device) != cudaSuccess) return false;
  dev->sm90a = dev->cc_major == 9 && dev->cc_minor == 0;
  return true;
}

}  // namespace fastaxial::test
