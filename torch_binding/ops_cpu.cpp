// CPU kernel of fastaxial::axial_attention.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

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

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, CPU, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_cpu);
}
