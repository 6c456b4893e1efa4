// CUDA entry points of the core API's forward. plan_cuda reads the current
// device's capabilities (once per device) and hands them to the host-side
// plan (common/plan.h); forward_cuda checks the plan and the workspace
// against the call, then runs the row pass into the workspace and the column
// pass into the output, each on the family the plan chose (kernels.h). The
// training entry points are in training.cu.
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "../common/plan.h"
#include "gemm/blas.h"
#include "kernels.h"
#include "staged/pass.h"  // launch_staged_16bit

namespace fastaxial {
namespace cuda {

Status current_device(DeviceCaps* caps) {
  constexpr int kMaxDevices = 64;
  struct Cached {
    std::atomic<bool> ready{false};
    DeviceCaps caps;
  };
  static Cached cache[kMaxDevices];
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    return {StatusCode::kUnsupported, std::string("no usable CUDA device: ") + cudaGetErrorString(e)};
  if (device < kMaxDevices && cache[device].ready.load(std::memory_order_acquire)) {
    *caps = cache[device].caps;
    return Status::Ok();
  }
  DeviceCaps c;
  c.device = device;
  const std::pair<int*, cudaDeviceAttr> attrs[] = {{&c.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
                                                   {&c.cc_major, cudaDevAttrComputeCapabilityMajor},
                                                   {&c.cc_minor, cudaDevAttrComputeCapabilityMinor},
                                                   {&c.sms, cudaDevAttrMultiProcessorCount}};
  for (const auto& [value, attr] : attrs)
    if (cudaError_t e = cudaDeviceGetAttribute(value, attr, device); e != cudaSuccess)
      return cuda::cuda_error(e, "cudaDeviceGetAttribute");
#if defined(FASTAXIAL_WGMMA)
  // sm_90a machine code runs on compute capability 9.0 alone.
  c.sm90a = c.cc_major == 9 && c.cc_minor == 0;
#endif
  if (device < kMaxDevices) {
    // Concurrent first calls write the same values; a reader sees them once ready is set.
    cache[device].caps = c;
    cache[device].ready.store(true, std::memory_order_release);
  }
  *caps = c;
  return Status::Ok();
}

}  // namespace cuda

namespace {

using cuda::current_device;

}  // namespace

bool cuda_compiled() { return true; }

Status plan_cuda(const AxialParams& p, CudaPlan* plan, bool caller_blas) {
  if (Status s = validate_sizes(p); !s.ok()) return s;
  PlanOptions options;
  if (Status s = env_plan_options(&options); !s.ok()) return s;
  DeviceCaps dev;
  if (Status s = current_device(&dev); !s.ok()) return s;
  return make_plan(p, dev, options, plan, caller_blas);
}

Status cuda_workspace_bytes(const AxialParams& p, size_t* bytes) {
  CudaPlan plan;
  if (Status s = plan_cuda(p, &plan); !s.ok()) return s;
  *bytes = plan.workspace_bytes;
  return Status::Ok();
}

Status forward_cuda(const AxialParams& p, const CudaPlan& plan, void* workspace, size_t workspace_bytes,
                    CUstream_st* stream, void* blas_handle) {
  if (Status s = validate(p); !s.ok()) return s;
  DeviceCaps dev;
  if (Status s = current_device(&dev); !s.ok()) return s;
  if (Status s = check_plan_matches(p, plan, dev.device, "the plan"); !s.ok()) return s;
  if (plan.products != p.products)
    return {StatusCode::kInvalidArgument, "the plan was made for other products (AxialParams::products): " + plan.describe()};
  if (p.dropout > 0)
    return {StatusCode::kUnsupported,
            "forward_cuda has no attention dropout: forward_cuda_training applies it (and keeps what its backward needs)"};
  if (p.batch * p.height * p.width == 0) return Status::Ok();
  if (workspace == nullptr) return {StatusCode::kInvalidArgument, "workspace is null"};
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return {StatusCode::kInvalidArgument, "workspace must be 256-byte aligned"};
  if (workspace_bytes < plan.workspace_bytes)
    return {StatusCode::kInvalidArgument, "workspace holds " + std::to_string(workspace_bytes) +
                                              " bytes; the plan needs " + std::to_string(plan.workspace_bytes)};

  char* ws = static_cast<char*>(workspace);
  const auto region = [&](size_t offset) {
    return offset == CudaPlan::kNone ? nullptr : reinterpret_cast<float*>(ws + offset);
  };
  float* x1 = region(plan.row_output);  // (B, H, W, D) after the row pass
  float* scratch = region(plan.staged_scratch);
  const int64_t qkv_planes = 6 * p.dim * p.dim;  // Wqkv's hi and lo, then Wout's
  const auto planes = [&](size_t offset) {
    float* w = region(offset);
    return cuda::StagedWeights{w, w ? w + qkv_planes : nullptr};
  };
  const cuda::StagedWeights row_split = planes(plan.row_weight_planes), col_split = planes(plan.col_weight_planes);
  // The first staged pass on fp32 products splits the weights of every such pass, beside its LayerNorm.
  const auto staged32 = [](const PassPlan& pp) {
    return pp.family == KernelFamily::kStaged && pp.products == Products::kFp32;
  };
  cuda::PlaneJobs splits;
  if (staged32(plan.row)) cuda::add_weight_splits(&splits, p.row, row_split, (int)p.dim);
  if (staged32(plan.col)) cuda::add_weight_splits(&splits, p.col, col_split, (int)p.dim);
  // Passes on 16-bit products: the library's cuBLAS handle on the plan's workspace, and the
  // rounded weights, the row pass's first.
  const bool any16 = plan.row.products != Products::kFp32 || plan.col.products != Products::kFp32;
  if (any16 && plan.caller_blas != (blas_handle != nullptr))
    return {StatusCode::kInvalidArgument, plan.caller_blas
                                              ? "the plan was made for the caller's cuBLAS handle, and none was given"
                                              : "a cuBLAS handle was given to a plan made without caller_blas"};
  cublasHandle_t blas = nullptr;
  cuda::CallerBlas caller;  // the caller's handle bound to this stream, its math mode back at the end
  if (any16 && blas_handle != nullptr) {
    blas = static_cast<cublasHandle_t>(blas_handle);
    if (Status s = caller.bind(blas, stream); !s.ok()) return s;
  } else if (any16) {
    if (Status s = cuda::blas_handle(stream, ws + plan.blas, plan.blas_bytes, &blas); !s.ok()) return s;
  }
  char* weights16 = plan.weights16 == CudaPlan::kNone ? nullptr : ws + plan.weights16;
  const size_t pass_weights16 = 4 * (size_t)p.dim * (size_t)p.dim * 2;  // bytes

  const auto pass = [&](const PassPlan& pp, const AxisView& view, const AxisWeights& w, const float* src, float* dst,
                        const cuda::StagedWeights& split) -> Status {
    switch (pp.family) {
      case KernelFamily::kFused:
        return cuda::launch_fused(view, p, w, src, dst, pp.wgmma, dev, stream);
      case KernelFamily::kStaged: {
        if (pp.products != Products::kFp32) {
          void* w16 = weights16;
          weights16 += pass_weights16;
          return cuda::launch_staged_16bit(view, p, w, src, dst, scratch, ws + plan.operand16, w16, blas, pp.products,
                                           dev, stream);
        }
        const Status s = cuda::launch_staged(view, p, w, src, dst, scratch, split, splits, pp.flash,
                                             region(plan.flash_partials), plan.flash_partials_bytes, dev, stream);
        splits.count = 0;  // split once, by the first staged pass
        return s;
      }
      case KernelFamily::kGeneric:
        break;
    }
    return cuda::launch_generic(view, p, w, src, dst, dev, stream);
  };
  if (Status s = pass(plan.row, row_view(p), p.row, p.x, x1, row_split); !s.ok()) return s;
  return pass(plan.col, col_view(p), p.col, x1, p.out, col_split);
}

Status forward_cuda(const AxialParams& p, void* workspace, size_t workspace_bytes, CUstream_st* stream) {
  CudaPlan plan;
  if (Status s = plan_cuda(p, &plan); !s.ok()) return s;
  return forward_cuda(p, plan, workspace, workspace_bytes, stream);
}

}  // namespace fastaxial
