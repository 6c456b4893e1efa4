// CUDA entry points of the core API: forward_cuda runs the row pass into the
// workspace and the column pass into the output, each pass on the kernel
// family common/dispatch.h picks for its shape and the device, or on the generic kernel
// where the device or the pointers rule that one out (axis_kernels.h). The
// workspace's layout is common/dispatch.h's staged_layout.
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

// The kernel family that serves a pass: the dispatch's choice, narrowed to
// what the device and the pointers allow.
AxisPath family(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                const float* dst, const DeviceInfo& dev) {
  switch (axis_path(view.len, p.dim, p.heads, view.num_seq, dev.sms)) {
    case AxisPath::kFused:
      if (cuda::tensor_core_fits(view, p, w, src, dst, dev)) return AxisPath::kFused;
      break;
    case AxisPath::kStaged:
      if (cuda::staged_fits(view, p, w, src, dst, dev)) return AxisPath::kStaged;
      // No staged path on this device (it needs sm_90a code and a compute
      // capability 9.0 GPU): the fused kernel where it holds the sequence.
      if (cuda::tensor_core_fits(view, p, w, src, dst, dev)) return AxisPath::kFused;
      break;
    case AxisPath::kGeneric:
      break;
  }
  return AxisPath::kGeneric;
}

}  // namespace

bool cuda_compiled() { return true; }

Status forward_cuda(const AxialParams& p, void* workspace, CUstream_st* stream) {
  if (Status s = validate(p); !s.ok()) return s;
  if (p.batch * p.height * p.width == 0) return Status::Ok();
  if (workspace == nullptr) return {StatusCode::kInvalidArgument, "workspace is null"};
  DeviceInfo dev;
  if (Status s = current_device(&dev); !s.ok()) return s;
  float* ws = static_cast<float*>(workspace);
  float* x1 = ws;  // (B, H, W, D) after the row pass
  const AxisView rows = row_view(p), cols = col_view(p);
  const AxisPath row_path = family(rows, p, p.row, p.x, x1, dev), col_path = family(cols, p, p.col, x1, p.out, dev);

  // A staged pass's scratch and split weights: reserved wherever the pass
  // may be staged (a pass axis_path stages is one staged_possible allows:
  // test_dispatch); the first staged pass splits the weights of both.
  const StagedLayout lay = staged_layout(p);
  float* scratch = lay.scratch >= 0 ? ws + lay.scratch : nullptr;
  const cuda::StagedWeights row_split = {lay.row_weights >= 0 ? ws + lay.row_weights : nullptr,
                                         lay.row_weights >= 0 ? ws + lay.row_weights + 6 * p.dim * p.dim : nullptr};
  const cuda::StagedWeights col_split = {lay.col_weights >= 0 ? ws + lay.col_weights : nullptr,
                                         lay.col_weights >= 0 ? ws + lay.col_weights + 6 * p.dim * p.dim : nullptr};
  cuda::WeightSplits splits;
  if (row_path == AxisPath::kStaged) splits.from[splits.count] = &p.row, splits.to[splits.count++] = row_split;
  if (col_path == AxisPath::kStaged) splits.from[splits.count] = &p.col, splits.to[splits.count++] = col_split;

  const auto pass = [&](AxisPath path, const AxisView& view, const AxisWeights& w, const float* src, float* dst,
                        const cuda::StagedWeights& split) -> Status {
    switch (path) {
      case AxisPath::kFused:
        return cuda::launch_axis_tensor_core(view, p, w, src, dst, dev, stream);
      case AxisPath::kStaged: {
        const Status s = cuda::launch_axis_staged(view, p, w, src, dst, scratch, split, splits, dev, stream);
        splits.count = 0;  // split once, by the first staged pass
        return s;
      }
      case AxisPath::kGeneric:
        break;
    }
    return cuda::launch_axis_generic(view, p, w, src, dst, dev, stream);
  };
  if (Status s = pass(row_path, rows, p.row, p.x, x1, row_split); !s.ok()) return s;
  return pass(col_path, cols, p.col, x1, p.out, col_split);
}

}  // namespace fastaxial
