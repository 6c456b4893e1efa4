// CUDA entry points of the core API: forward_cuda runs the row pass into the
// workspace and the column pass into the output, each pass on the kernel
// family common/dispatch.h picks for its shape and the device, or on the generic kernel
// where the device or the pointers rule that one out (axis_kernels.h).
#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "../common/dispatch.h"
#include "axis_kernels.h"

namespace fastaxial {
namespace {

using cuda::DeviceInfo;

// Multiprocessor count, shared-memory limit and compute capability of the
// current device, read once per device: the attribute queries cost
// microseconds per forward.
Status current_device(DeviceInfo* info) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms[kMaxDevices], smem[kMaxDevices], major[kMaxDevices];  // 0 until read
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cuda::cuda_error(e, "cudaGetDevice");
  info->device = device;
  if (device < kMaxDevices && sms[device].load() > 0) {
    info->sms = sms[device].load();
    info->smem_optin = smem[device].load();
    info->cc_major = major[device].load();
    return Status::Ok();
  }
  const std::pair<int*, cudaDeviceAttr> attrs[] = {{&info->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
                                                   {&info->cc_major, cudaDevAttrComputeCapabilityMajor},
                                                   {&info->sms, cudaDevAttrMultiProcessorCount}};
  for (const auto& [value, attr] : attrs)
    if (cudaError_t e = cudaDeviceGetAttribute(value, attr, device); e != cudaSuccess)
      return cuda::cuda_error(e, "cudaDeviceGetAttribute");
  if (device < kMaxDevices) {
    smem[device].store(info->smem_optin);
    major[device].store(info->cc_major);
    sms[device].store(info->sms);  // last: a reader that sees sms > 0 sees the others too
  }
  return Status::Ok();
}

// dst = src + attention pass of `view`; `staged` is the staged path's scratch.
Status launch_axis(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                   float* staged, const DeviceInfo& dev, cudaStream_t stream) {
  if (view.num_seq == 0 || view.len == 0) return Status::Ok();
  switch (axis_path(view.len, p.dim, p.heads, view.num_seq, dev.sms)) {
    case AxisPath::kFused:
      if (cuda::tensor_core_fits(view, p, w, src, dst, dev))
        return cuda::launch_axis_tensor_core(view, p, w, src, dst, dev, stream);
      break;
    case AxisPath::kStaged:
      if (cuda::staged_fits(view, p, w, src, dst, dev))
        return cuda::launch_axis_staged(view, p, w, src, dst, staged, dev, stream);
      // No staged path on this device (it needs sm_90a code and a compute
      // capability 9.0 GPU): the fused kernel where it holds the sequence.
      if (cuda::tensor_core_fits(view, p, w, src, dst, dev))
        return cuda::launch_axis_tensor_core(view, p, w, src, dst, dev, stream);
      break;
    case AxisPath::kGeneric:
      break;
  }
  return cuda::launch_axis_generic(view, p, w, src, dst, dev, stream);
}

}  // namespace

bool cuda_compiled() { return true; }

Status forward_cuda(const AxialParams& p, void* workspace, CUstream_st* stream) {
  if (Status s = validate(p); !s.ok()) return s;
  if (p.batch * p.height * p.width == 0) return Status::Ok();
  if (workspace == nullptr) return {StatusCode::kInvalidArgument, "workspace is null"};
  DeviceInfo dev;
  if (Status s = current_device(&dev); !s.ok()) return s;
  // (B, H, W, D) after the row pass, then the staged path's scratch (if either pass takes it)
  float* x1 = static_cast<float*>(workspace);
  float* staged = x1 + p.batch * p.height * p.width * p.dim;
  if (Status s = launch_axis(row_view(p), p, p.row, p.x, x1, staged, dev, stream); !s.ok()) return s;
  return launch_axis(col_view(p), p, p.col, x1, p.out, staged, dev, stream);
}

}  // namespace fastaxial
