// Autocast kernels of fastaxial::axial_attention (CPU and CUDA): what
// torch.autocast does to the reference module's ops, done to the operator.
//
// Under autocast, the reference runs LayerNorm and softmax in fp32 and its
// Linear layers and attention products in the autocast dtype; its output is
// the residual sum, x's dtype promoted with the autocast dtype (bfloat16 x
// under bfloat16 autocast: bfloat16; float32 x: float32). Here every 16-bit
// input is widened to float32, the operator runs below autocast (its fp32
// kernels: the products in 3xTF32 on CUDA, more accurate than the autocast
// dtype's), and its output is narrowed to that promoted dtype. The casts are
// ATen ops above the autograd kernel, so gradients flow through them and
// reach each input in its own dtype. float64 is left as it is: autocast does
// not cast it, and the operator names it in its error.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "op_handles.h"
#include "ops.h"

namespace fastaxial::torch_binding {
namespace {

at::Tensor widen(const at::Tensor& t) { return low_precision(t.scalar_type()) ? t.to(at::kFloat) : t; }

template <c10::DeviceType kDevice, c10::DispatchKey kAutocastKey>
at::Tensor axial_attention_autocast(const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                                    const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                                    const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                                    const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads, double eps,
                                    double dropout, const std::optional<at::Tensor>& rng_state) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  const at::Tensor out = op().call(widen(x), widen(rnw), widen(rnb), widen(rqkv), widen(rout), widen(rob), widen(cnw),
                                   widen(cnb), widen(cqkv), widen(cout), widen(cob), num_heads, eps, dropout, rng_state);
  const at::ScalarType s = x.scalar_type();
  if (s != at::kFloat && !low_precision(s)) return out;  // (autocast leaves x as it is)
  return out.to(at::promote_types(s, at::autocast::get_autocast_dtype(kDevice)));
}

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, AutocastCPU, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_autocast<c10::DeviceType::CPU,
                                                                                c10::DispatchKey::AutocastCPU>);
}

TORCH_LIBRARY_IMPL(fastaxial, AutocastCUDA, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_autocast<c10::DeviceType::CUDA,
                                                                                c10::DispatchKey::AutocastCUDA>);
}
