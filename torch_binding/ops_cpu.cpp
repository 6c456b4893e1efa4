// CPU kernels of fastaxial::axial_attention and its backward.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <vector>

#include "ops.h"

namespace fastaxial::torch_binding {
namespace {

at::Tensor axial_attention_cpu(const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                               const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                               const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                               const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads, double eps) {
  const Call c = check_call(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, num_heads, eps);
  at::Tensor out = at::empty_like(c.x, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const Status s = forward_cpu(c.params(out));
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention (CPU): ", s.message);
  return out;
}

// The gradients output_mask asks for, each a fresh tensor shaped like its input.
std::vector<at::Tensor> axial_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
    const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob, const at::Tensor& cnw,
    const at::Tensor& cnb, const at::Tensor& cqkv, const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads,
    double eps, std::array<bool, 11> output_mask, const std::optional<at::Tensor>& saved) {
  const Call c = check_call(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, num_heads, eps);
  TORCH_CHECK_VALUE(!saved.has_value(), "fastaxial.axial_attention_backward (CPU): `saved` is the CUDA training "
                    "forward's; the CPU backward recomputes what it needs");
  BackwardCall b = prepare_backward(c, grad_out, output_mask);
  const Status s = backward_cpu(c.params(), b.grads);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_backward (CPU): ", s.message);
  return b.outputs;
}

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, CPU, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_cpu);
  m.impl("axial_attention_backward", &fastaxial::torch_binding::axial_attention_backward_cpu);
}
