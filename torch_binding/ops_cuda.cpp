// CUDA kernels of the fastaxial operators (forward and backward): on x's
// device and PyTorch's current stream, with the workspace the plan asks for
// from PyTorch's caching allocator. No host synchronisation.
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "ops.h"

namespace fastaxial::torch_binding {
namespace {

at::Tensor axial_attention_cuda(const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                                const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                                const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                                const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads, double eps) {
  const Call c = check_call(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, num_heads, eps);
  const c10::cuda::CUDAGuard guard(c.x.device());
  at::Tensor out = at::empty_like(c.x, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const AxialParams p = c.params(out);
  CudaPlan plan;
  Status s = plan_cuda(p, &plan);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention (CUDA): ", s.message);
  // Straight from the caching allocator (no tensor around it): returned to
  // the cache at the end of this call, reusable by work queued after it on
  // this stream, as a temporary tensor's memory would be.
  const c10::DataPtr workspace = c10::cuda::CUDACachingAllocator::get()->allocate(plan.workspace_bytes);
  s = forward_cuda(p, plan, workspace.get(), plan.workspace_bytes, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention (CUDA): ", s.message);
  return out;
}

// The gradients output_mask asks for, from backward_cuda with the workspace its plan asks for.
std::vector<at::Tensor> axial_attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
    const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob, const at::Tensor& cnw,
    const at::Tensor& cnb, const at::Tensor& cqkv, const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads,
    double eps, std::array<bool, 11> output_mask) {
  const Call c = check_call(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, num_heads, eps);
  const c10::cuda::CUDAGuard guard(c.x.device());
  BackwardCall b = prepare_backward(c, grad_out, output_mask);
  const AxialParams p = c.params();
  CudaBackwardPlan plan;
  Status s = plan_backward_cuda(p, &plan);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_backward (CUDA): ", s.message);
  const bool empty = c.x.numel() == 0;  // an empty problem needs no workspace (its weight gradients are zeros)
  const c10::DataPtr workspace = c10::cuda::CUDACachingAllocator::get()->allocate(empty ? 0 : plan.workspace_bytes);
  s = backward_cuda(p, b.grads, plan, workspace.get(), empty ? 0 : plan.workspace_bytes,
                    c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_backward (CUDA): ", s.message);
  return b.outputs;
}

// The plan of a forward of x with num_heads heads on x's device, assuming
// 16-byte aligned weights (as PyTorch allocates them).
std::string describe_cuda_plan(const at::Tensor& x, int64_t num_heads) {
  TORCH_CHECK_VALUE(x.dim() == 4, "fastaxial.describe_cuda_plan: x must have 4 dimensions (B, H, W, D), got ",
                    x.dim());
  const c10::cuda::CUDAGuard guard(x.device());
  AxialParams p;
  p.batch = x.size(0), p.height = x.size(1), p.width = x.size(2), p.dim = x.size(3), p.heads = num_heads;
  CudaPlan plan;
  const Status s = plan_cuda(p, &plan);
  TORCH_CHECK(s.ok(), "fastaxial.describe_cuda_plan: ", s.message);
  return plan.describe();
}

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, CUDA, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_cuda);
  m.impl("axial_attention_backward", &fastaxial::torch_binding::axial_attention_backward_cuda);
  m.impl("describe_cuda_plan", &fastaxial::torch_binding::describe_cuda_plan);
}
