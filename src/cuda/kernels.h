// The CUDA kernels of one attention pass, as forward_cuda.cu dispatches them
// (common/dispatch.h picks the family from the shape; the *_fits checks below
// add what the device and the pointers allow).
//
// Each launch computes, for every sequence of the axis (see common/axis.h):
//   dst = src + Attention(LayerNorm(src)) @ Wout^T + bout
// - axis_tensor_core.cu (fused): one thread block per whole sequence, every
//   product on the tensor cores with the 3xTF32 split (the projections on
//   wgmma at dim 64 with two heads or more, L <= 64, on sm_90a); L <= 128.
// - axis_staged.cu: LayerNorm, the QKV product, attention and the output
//   product as tensor-core kernels over all positions, intermediates in the
//   workspace; long sequences and wide dims.
// - axis_generic.cu: any shape; tiles of queries, online softmax over key
//   tiles, FFMA products.
// Every launch is a programmatic dependent of the one before it (launch.cuh).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "../common/axis.h"
#include "fastaxial/fastaxial.h"

namespace fastaxial::cuda {

struct DeviceInfo {
  int device = 0;      // ordinal
  int sms = 0;         // multiprocessors
  int smem_optin = 0;  // bytes of shared memory a block may opt in to
  int cc_major = 0;    // compute capability
};

inline Status cuda_error(cudaError_t e, const char* what) {
  return {StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(e)};
}

// 16-byte alignment of what the tensor-core kernels read and write in vectors.
inline bool pass_aligned(const AxisWeights& w, const float* src, const float* dst) {
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return aligned(src) && aligned(dst) && aligned(w.norm_weight) && aligned(w.norm_bias) && aligned(w.qkv_weight) &&
         aligned(w.out_weight) && aligned(w.out_bias);
}

// True when the fused kernel's shared memory fits the device and the pointers are aligned.
bool tensor_core_fits(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                      const float* dst, const DeviceInfo& dev);

Status launch_axis_tensor_core(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                               float* dst, const DeviceInfo& dev, cudaStream_t stream);

// The same for the staged path.
bool staged_fits(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                 const float* dst, const DeviceInfo& dev);

// A staged pass's weights as (hi, lo) planes in the workspace: Wqkv (3D, D)
// hi then lo, Wout (D, D) hi then lo.
struct StagedWeights {
  float* qkv = nullptr;
  float* out = nullptr;
};

// Weights a staged pass splits in its first launch, beside its LayerNorm:
// the first staged pass of a forward splits those of every staged pass.
struct WeightSplits {
  const AxisWeights* from[2] = {};
  StagedWeights to[2];
  int count = 0;
};

// `scratch` holds 4 T D floats (T = the pass's positions); `split` holds
// the pass's weights as planes, written by `split_now` in this launch or by
// an earlier pass's.
Status launch_axis_staged(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                          float* dst, float* scratch, const StagedWeights& split, const WeightSplits& split_now,
                          const DeviceInfo& dev, cudaStream_t stream);

Status launch_axis_generic(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                           float* dst, const DeviceInfo& dev, cudaStream_t stream);

// Lets `kernel` use all the shared memory a block may opt in to on the
// device, once per kernel and device (the call costs microseconds of host
// time). Always the same value, so concurrent first calls cannot undo each other.
template <auto kernel>
cudaError_t allow_max_smem(const DeviceInfo& dev) {
  const int device = dev.device;
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];  // one array per kernel
  if (device >= 0 && device < kMaxDevices && done[device].load(std::memory_order_acquire)) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dev.smem_optin);
  if (e == cudaSuccess && device >= 0 && device < kMaxDevices) done[device].store(true, std::memory_order_release);
  return e;
}

}  // namespace fastaxial::cuda
