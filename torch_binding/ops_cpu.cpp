// CPU kernels of fastaxial::axial_attention and its backward.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <array>
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
    double eps, std::array<bool, 11> output_mask) {
  const Call c = check_call(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, num_heads, eps);
  TORCH_CHECK_VALUE(grad_out.sizes() == x.sizes(), "fastaxial.axial_attention_backward: grad_out must have x's shape ",
                    x.sizes(), ", got ", grad_out.sizes());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == at::kFloat, "fastaxial.axial_attention_backward: grad_out must be "
                   "float32, got ", grad_out.scalar_type());
  TORCH_CHECK(grad_out.device() == x.device(), "fastaxial.axial_attention_backward: grad_out is on ",
              grad_out.device(), " but x is on ", x.device());
  const at::Tensor go = grad_out.contiguous();
  AxialGrads g;
  g.grad_out = go.data_ptr<float>();
  float** slots[11] = {&g.grad_x,          &g.row.norm_weight, &g.row.norm_bias, &g.row.qkv_weight,
                       &g.row.out_weight,  &g.row.out_bias,    &g.col.norm_weight, &g.col.norm_bias,
                       &g.col.qkv_weight,  &g.col.out_weight,  &g.col.out_bias};
  const auto inputs = c.inputs();
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 11; ++i)
    if (output_mask[i]) {
      grads.push_back(at::empty_like(*inputs[i], at::MemoryFormat::Contiguous));
      *slots[i] = grads.back().data_ptr<float>();
    }
  const Status s = backward_cpu(c.params(), g);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_backward (CPU): ", s.message);
  return grads;
}

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, CPU, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_cpu);
  m.impl("axial_attention_backward", &fastaxial::torch_binding::axial_attention_backward_cpu);
}
