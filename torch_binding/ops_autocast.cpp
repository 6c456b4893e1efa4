// Autocast kernels of fastaxial::axial_attention (CPU and CUDA): what
// torch.autocast does to the reference module's ops, done to the operator.
//
// Under autocast, the reference runs LayerNorm and softmax in fp32 and its
// Linear layers and attention products in the autocast dtype; its output is
// the residual sum, x's dtype promoted with the autocast dtype (bfloat16 x
// under bfloat16 autocast: bfloat16; float32 x: float32). Here every 16-bit
// input is widened to float32 and the operator runs below autocast with
// `products` = the autocast dtype (unless the call names its own): the
// products in that dtype with fp32 accumulation where the operator serves and
// gains from them (CUDA calls without grad of 2^21 elements or more,
// ops_cuda.cpp), 3xTF32 elsewhere, more accurate than the autocast dtype's.
// LayerNorm, softmax and the residual stay fp32, as the reference's. The
// output is narrowed to that promoted dtype. The casts are ATen ops above the
// autograd kernel, so gradients flow through them and reach each input in its
// own dtype. float64 is left as it is: autocast does not cast it, and the
// operator names it in its error.
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
                                    double dropout, const std::optional<at::Tensor>& rng_state,
                                    std::optional<at::ScalarType> products) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  const at::ScalarType autocast_dtype = at::autocast::get_autocast_dtype(kDevice);
  const at::Tensor out = op().call(widen(x), widen(rnw), widen(rnb), widen(rqkv), widen(rout), widen(rob), widen(cnw),
                                   widen(cnb), widen(cqkv), widen(cout), widen(cob), num_heads, eps, dropout, rng_state,
                                   products.value_or(autocast_dtype));
  const at::ScalarType s = x.scalar_type();
  if (s != at::kFloat && !low_precision(s)) return out;  // (autocast leaves x as it is)
  return out.to(at::promote_types(s, autocast_dtype));
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
