// CUDA kernel of fastaxial::axial_attention: on x's device and PyTorch's
// current stream, with the workspace from PyTorch's caching allocator.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

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
  AxialParams p = c.params(out);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(cuda_workspace_bytes(p))}, c.x.options().dtype(at::kByte));
  const Status s = forward_cuda(p, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention (CUDA): ", s.message);
  return out;
}

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, CUDA, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_cuda);
}
