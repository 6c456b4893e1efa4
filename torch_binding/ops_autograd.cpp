// Autograd kernel of fastaxial::axial_attention, in C++ so that no Python
// runs per call: under no_grad, or where nothing requires grad, it calls the
// device kernel straight away; in grad mode it records one node that saves
// x and the ten weights, and, where axial_attention_training runs instead of
// the forward, its `saved`:
//  - with dropout (CPU and CUDA): `saved` holds the mask's seed and offset,
//    which the backward needs to draw the forward's mask again;
//  - on the CPU: `saved` holds the row pass's output and both passes' q, k,
//    v, attention output or probabilities too, so that the backward runs
//    neither the row pass, the QKV products, p v nor the short passes'
//    softmax again (AxialParams::row_out, saved_qkv, saved_o, saved_p);
//  - on CUDA: `saved` holds the forward's intermediates, so that the
//    backward recomputes only the probabilities. (The training forward's
//    launches replay as one CUDA graph once a call repeats, fastaxial.h, so
//    its host time stays small for small problems too.)
// The backward: the operator axial_attention_backward (its fused CPU and
// CUDA kernels); on devices or head dims those do not serve (CUDA head dims
// above kCudaBackwardMaxHeadDim, other devices), the forward recomputed with
// the reference math in ATen ops (python/fastaxial/reference.py, the same
// function) and differentiated. A second-order gradient is refused.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <cmath>
#include <vector>

#include "op_handles.h"
#include "ops.h"

namespace fastaxial::torch_binding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kTensors = 11;  // x and the ten weights, in the schema's order

// One axis of the reference: x is (N, L, D); returns the attention branch
// (no residual). w: norm weight, norm bias, qkv weight, out weight, out bias.
at::Tensor axis_branch(const at::Tensor& x, const at::Tensor* w, int64_t heads, double eps) {
  const int64_t N = x.size(0), L = x.size(1), D = x.size(2), hd = D / heads;
  const at::Tensor y = at::layer_norm(x, {D}, w[0], w[1], eps);
  const at::Tensor qkv = at::linear(y, w[2]).view({N, L, 3, heads, hd}).permute({2, 0, 3, 1, 4});
  const at::Tensor q = qkv[0], k = qkv[1], v = qkv[2];  // each (N, heads, L, hd)
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  const at::Tensor o = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({N, L, D});
  return at::linear(o, w[3], w[4]);
}

// Rows then columns of x (B, H, W, D), each with its residual.
at::Tensor reference_forward(const variable_list& t, int64_t heads, double eps) {
  const at::Tensor& x = t[0];
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), D = x.size(3);
  const at::Tensor x1 = x + axis_branch(x.reshape({B * H, W, D}), &t[1], heads, eps).reshape({B, H, W, D});
  const at::Tensor xc = x1.permute({0, 2, 1, 3}).reshape({B * W, H, D});
  return x1 + axis_branch(xc, &t[6], heads, eps).reshape({B, W, H, D}).permute({0, 2, 1, 3});
}

// Whether the fused CUDA training path (axial_attention_training, then axial_attention_backward with its
// `saved`) serves x: its head dim, and x's GPU (compute capability 8.0 or newer, plan_backward_cuda);
// else grad mode runs the plain forward and the backward differentiates the reference math.
bool cuda_training(const at::Tensor& x, int64_t heads) {
  // (heads < 1: the kernels' checks say what is wrong)
  if (!(x.is_cuda() && cuda_compiled() && x.dim() == 4 && heads >= 1 && x.size(3) / heads <= kCudaBackwardMaxHeadDim))
    return false;
  const c10::DeviceGuard guard(x.device());
  AxialParams p;
  p.batch = x.size(0), p.height = x.size(1), p.width = x.size(2), p.dim = x.size(3), p.heads = heads;
  CudaBackwardPlan plan;
  // Other refusals (sizes) are the kernels' to report.
  return plan_backward_cuda(p, &plan).code != StatusCode::kUnsupported;
}

// The operator's kernels below autograd (CPU, CUDA, fake).
at::Tensor call_below_autograd(const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                               const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                               const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                               const at::Tensor& cout, const at::Tensor& cob, int64_t heads, double eps,
                               double dropout, const std::optional<at::Tensor>& rng_state,
                               std::optional<at::ScalarType> products) {
  const at::AutoDispatchBelowADInplaceOrView below;
  return op().call(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, heads, eps, dropout, rng_state,
                   products);
}

class AxialAttentionFunction : public torch::autograd::Function<AxialAttentionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                            const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                            const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                            const at::Tensor& cout, const at::Tensor& cob, int64_t heads, double eps,
                            double dropout, const std::optional<at::Tensor>& rng_state,
                            std::optional<at::ScalarType> products) {
    // `products` goes on to the training operators (ops_cuda.cpp: training_plan), the backward's
    // as the forward's, which laid out `saved` for them.
    ctx->saved_data["products"] = products ? static_cast<int64_t>(*products) : int64_t{-1};
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["dropout"] = dropout;
    if (dropout > 0 || x.is_cpu() || cuda_training(x, heads)) {
      // The training forward: the output, and what its backward reads (the intermediates on CUDA,
      // the row pass's output, q, k, v and o on the CPU, the dropout mask's seed and offset).
      const at::AutoDispatchBelowADInplaceOrView below;
      auto [out, saved] =
          training_op().call(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, heads, eps, dropout, rng_state,
                             products);
      ctx->save_for_backward({x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, saved});
      return out;
    }
    ctx->save_for_backward({x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob});
    return call_below_autograd(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, heads, eps, 0.0, std::nullopt,
                               at::kFloat);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t heads = ctx->saved_data["heads"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    const double dropout = ctx->saved_data["dropout"].toDouble();
    const int64_t products_code = ctx->saved_data["products"].toInt();
    const std::optional<at::ScalarType> products =
        products_code < 0 ? std::nullopt : std::optional<at::ScalarType>(static_cast<at::ScalarType>(products_code));
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "fastaxial::axial_attention: double backward (create_graph=True) is not supported");
    // The fused backward: on the CPU, or on CUDA where its kernels serve the head dim (from the
    // training forward's `saved`, or running that forward first); else the reference math,
    // differentiated.
    if (saved[0].is_cpu() || saved.size() > kTensors || cuda_training(saved[0], heads)) {
      std::array<bool, kTensors> mask;
      for (int i = 0; i < kTensors; ++i) mask[i] = ctx->needs_input_grad(i);
      const std::optional<at::Tensor> kept =
          saved.size() > kTensors ? std::optional<at::Tensor>(saved[kTensors]) : std::nullopt;
      const std::vector<at::Tensor> grads =
          backward_op().call(grad_outputs[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6],
                             saved[7], saved[8], saved[9], saved[10], heads, eps, mask, kept, dropout, products);
      variable_list result(kTensors + 5);  // undefined: no gradient (none for heads, eps, dropout, rng_state, products)
      for (int i = 0, j = 0; i < kTensors; ++i)
        if (mask[i]) result[i] = grads[j++];
      return result;
    }
    variable_list leaves, wanted;
    for (int i = 0; i < kTensors; ++i) {  // (saved holds x and the ten weights alone here)
      leaves.push_back(saved[i].detach().requires_grad_(ctx->needs_input_grad(i)));
      if (ctx->needs_input_grad(i)) wanted.push_back(leaves.back());
    }
    variable_list grads;
    if (!wanted.empty()) {
      const at::AutoGradMode grad_mode(true);
      const at::Tensor out = reference_forward(leaves, heads, eps);
      grads = torch::autograd::grad({out}, wanted, {grad_outputs[0]});
    }
    variable_list result(kTensors + 5);  // undefined: no gradient (none for heads, eps, dropout, rng_state, products)
    for (int i = 0, j = 0; i < kTensors; ++i)
      if (ctx->needs_input_grad(i)) result[i] = grads[j++];
    return result;
  }
};

at::Tensor axial_attention_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                                    const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                                    const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                                    const at::Tensor& cout, const at::Tensor& cob, int64_t heads, double eps,
                                    double dropout, const std::optional<at::Tensor>& rng_state,
                                    std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.axial_attention");  // (a call with grad does not reach the kernels' check)
  const bool record = at::GradMode::is_enabled() &&
                      (x.requires_grad() || rnw.requires_grad() || rnb.requires_grad() || rqkv.requires_grad() ||
                       rout.requires_grad() || rob.requires_grad() || cnw.requires_grad() || cnb.requires_grad() ||
                       cqkv.requires_grad() || cout.requires_grad() || cob.requires_grad());
  if (!record)  // straight to the device kernel, with the dispatch keys already computed
    return op().redispatch(keys & c10::after_autograd_keyset, x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout,
                           cob, heads, eps, dropout, rng_state, products);
  return AxialAttentionFunction::apply(x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, heads, eps, dropout,
                                       rng_state, products);
}

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, Autograd, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_autograd);
}
