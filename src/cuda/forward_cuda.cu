// CUDA entry points of the core API: forward_cuda runs the row pass into the
// workspace and the column pass into the output, each as one kernel launch,
// picking per pass the tensor-core kernel where it applies and the generic
// one elsewhere (axis_kernels.h).
#include <cuda_runtime.h>

#include <atomic>

#include "axis_kernels.h"

namespace fastaxial {
namespace {

using cuda::DeviceInfo;

// Multiprocessor count and shared-memory limit of the current device, read
// once per device: the attribute queries cost microseconds per forward.
Status current_device(DeviceInfo* info) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms[kMaxDevices], smem[kMaxDevices];  // 0 until read
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return cuda::cuda_error(e, "cudaGetDevice");
  info->device = device;
  if (device < kMaxDevices && sms[device].load() > 0) {
    info->sms = sms[device].load();
    info->smem_optin = smem[device].load();
    return Status::Ok();
  }
  if (cudaError_t e = cudaDeviceGetAttribute(&info->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      e != cudaSuccess)
    return cuda::cuda_error(e, "cudaDeviceGetAttribute");
  if (cudaError_t e = cudaDeviceGetAttribute(&info->sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess)
    return cuda::cuda_error(e, "cudaDeviceGetAttribute");
  if (device < kMaxDevices) {
    smem[device].store(info->smem_optin);
    sms[device].store(info->sms);  // last: a reader that sees sms > 0 sees smem too
  }
  return Status::Ok();
}

Status launch_axis(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                   const DeviceInfo& dev, cudaStream_t stream) {
  if (view.num_seq == 0 || view.len == 0) return Status::Ok();
  if (cuda::tensor_core_supported(view, p, src, dst, dev))
    return cuda::launch_axis_tensor_core(view, p, w, src, dst, dev, stream);
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
  float* x1 = static_cast<float*>(workspace);  // (B, H, W, D) after the row pass
  if (Status s = launch_axis(row_view(p), p, p.row, p.x, x1, dev, stream); !s.ok()) return s;
  return launch_axis(col_view(p), p, p.col, x1, p.out, dev, stream);
}

}  // namespace fastaxial
