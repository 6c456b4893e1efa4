// CUDA kernels of the fastaxial operators (forward and backward): on x's
// device and PyTorch's current stream, with the workspace the plan asks for
// from PyTorch's caching allocator. No host synchronisation. Dropout's seed
// and offset come from PyTorch's default CUDA generator of x's device, as
// PyTorch's own fused attention takes them: under CUDA graph capture as
// pointers the kernels read at replay (AxialParams::seed_device); or from the
// call's own `rng_state` tensor, read by the kernels the same way.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace fastaxial::torch_binding {
namespace {

// The dropout mask's seed and offset for one call: read by the kernels from rng_state where given,
// else from the default generator of x's device, which advances its offset past them. Where
// dropout is off, nothing is drawn.
void draw_dropout_state(AxialParams* p, const at::Device& device, const std::optional<at::Tensor>& rng_state) {
  if (!(p->dropout > 0.0f)) return;
  if (rng_state.has_value()) {  // on x's device (check_rng_state): seed = r[0], offset = r[1] + 0
    const auto* r = reinterpret_cast<const uint64_t*>(rng_state->data_ptr<int64_t>());
    p->seed_device = r, p->offset_device = r + 1;
    p->seed = 0, p->offset = 0;
    return;
  }
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device.index()));
  at::PhiloxCudaState state;
  {
    const std::lock_guard<std::mutex> lock(gen->mutex_);
    // The offset is the high half of the mask's Philox counter (common/dropout.h): one step
    // apart, two calls' masks share no counter. 4: the generator's increments are multiples of 4.
    state = gen->philox_cuda_state(4);
  }
  if (state.captured_) {  // read at replay: seed = *seed, offset = *offset + offset_intragraph
    p->seed_device = reinterpret_cast<const uint64_t*>(state.seed_.ptr);
    p->offset_device = reinterpret_cast<const uint64_t*>(state.offset_.ptr);
    p->seed = 0, p->offset = state.offset_intragraph_;
  } else {
    p->seed = state.seed_.val, p->offset = state.offset_.val;
  }
}

// The products a call without grad runs on (AxialParams::products), for the dtype it asks for (the
// `products` argument, else x's): that 16-bit dtype's where the problem is large enough for the
// 16-bit path to win, else fp32; with grad (training_plan) from the same size. Below 2^21 elements
// the 16-bit path's launches and unsplit attention cost more than its products save: without grad
// measured in perf notes v89, with grad in v98 (a bf16 step of 2^21 elements 0.62-0.72 ms on
// 16-bit products against 0.88-0.91 on fp32 copies; at 2^20 neither wins at every shape).
constexpr int64_t kMin16BitElements = int64_t{1} << 21;
// FASTAXIAL_16BIT_MIN_ELEMENTS (a count >= 0, read once per process) overrides it, for benchmarks
// that sweep it; anything else there is an error.
int64_t min_16bit_elements() {
  static const int64_t value = [] {
    const char* s = std::getenv("FASTAXIAL_16BIT_MIN_ELEMENTS");
    if (s == nullptr) return kMin16BitElements;
    char* end = nullptr;
    const long long v = std::strtoll(s, &end, 10);
    TORCH_CHECK_VALUE(end != s && *end == '\0' && v >= 0, "FASTAXIAL_16BIT_MIN_ELEMENTS='", s,
                      "': expected a count of elements, 0 or more");
    return (int64_t)v;
  }();
  return value;
}
Products products_for(at::ScalarType dtype, int64_t elements) {
  if (elements < min_16bit_elements()) return Products::kFp32;
  return dtype == at::kBFloat16 ? Products::kBf16 : dtype == at::kHalf ? Products::kFp16 : Products::kFp32;
}

CudaBackwardPlan training_plan(const AxialParams& p);

// A training call's plan, and its products in *p, by the same rule from x's dtype (its two
// operators decide alike, so the backward plans the forward's): 16-bit where the rule says so and
// the backward serves them on this device (else plan_backward_cuda refuses them: kUnsupported,
// the tensor-core attention backward), else fp32. `products` as the forward's argument (None: x's
// dtype; the autograd kernel passes autocast's on).
CudaBackwardPlan training_plan(const Call& c, AxialParams* p, std::optional<at::ScalarType> products) {
  p->products = products_for(products.value_or(c.dtype), c.x.numel());
  if (p->products != Products::kFp32) {
    CudaBackwardPlan plan;  // (training_plan's, on 16-bit products: the library's cuBLAS handle)
    const Status s = plan_backward_cuda(*p, &plan, /*caller_blas=*/false);
    if (s.code != StatusCode::kUnsupported) {
      TORCH_CHECK(s.ok(), "fastaxial.axial_attention_training (CUDA): ", s.message);
      return plan;
    }
    p->products = Products::kFp32;
  }
  return training_plan(*p);
}
void run_training_forward(const AxialParams& p, const CudaBackwardPlan& plan, const at::Tensor& saved);
at::Tensor empty_saved(const CudaBackwardPlan& plan, const at::Tensor& x);

at::Tensor axial_attention_cuda(const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                                const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                                const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                                const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads, double eps,
                                double dropout, const std::optional<at::Tensor>& rng_state,
                                std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.axial_attention");
  Call c = check_call("fastaxial.axial_attention", x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, num_heads,
                      eps, dropout, rng_state);
  const c10::cuda::CUDAGuard guard(c.x.device());
  at::Tensor out = at::empty_like(c.x, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out.to(c.dtype);
  AxialParams p = c.params(out);
  if (dropout > 0) {  // dropout runs in the training forward's kernels; what it keeps is dropped here
    const CudaBackwardPlan plan = training_plan(p);  // first: a call it refuses draws nothing
    draw_dropout_state(&p, c.x.device(), rng_state);
    run_training_forward(p, plan, empty_saved(plan, c.x));
    return out.to(c.dtype);
  }
  p.products = products_for(products.value_or(c.dtype), c.x.numel());
  // 16-bit products run on PyTorch's cuBLAS handle for this stream (capture-safe, its workspace
  // PyTorch's), as the training calls' products do.
  const bool blas16 = p.products != Products::kFp32;
  CudaPlan plan;
  Status s = plan_cuda(p, &plan, blas16);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention (CUDA): ", s.message);
  // Straight from the caching allocator (no tensor around it): returned to
  // the cache at the end of this call, reusable by work queued after it on
  // this stream, as a temporary tensor's memory would be.
  const c10::DataPtr workspace = c10::cuda::CUDACachingAllocator::get()->allocate(plan.workspace_bytes);
  s = forward_cuda(p, plan, workspace.get(), plan.workspace_bytes, c10::cuda::getCurrentCUDAStream().stream(),
                   blas16 ? at::cuda::getCurrentCUDABlasHandle() : nullptr);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention (CUDA): ", s.message);
  return out.to(c.dtype);  // (out itself where the call is float32)
}

CudaBackwardPlan training_plan(const AxialParams& p) {
  CudaBackwardPlan plan;
  // fp32 products: cuBLAS (the fallbacks) on PyTorch's handle for the current stream, with PyTorch's
  // workspace (kept across calls, as for PyTorch's own products), rather than a workspace region of
  // each call's own. 16-bit products: the library's handle on the plan's region, which the training
  // calls' graph replays can capture (training.cu: capture_blas); PyTorch's is bound to its stream.
  const Status s = plan_backward_cuda(p, &plan, /*caller_blas=*/p.products == Products::kFp32);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_training (CUDA): ", s.message);
  return plan;
}

// The workspace of a plan, straight from the caching allocator (returned to it when the call ends).
c10::DataPtr training_workspace(const CudaBackwardPlan& plan) {
  return c10::cuda::CUDACachingAllocator::get()->allocate(plan.workspace_bytes);
}

// out and saved from forward_cuda_training: saved is a float32 vector of the plan's saved bytes.
void run_training_forward(const AxialParams& p, const CudaBackwardPlan& plan, const at::Tensor& saved) {
  const c10::DataPtr workspace = training_workspace(plan);
  const Status s = forward_cuda_training(p, plan, saved.data_ptr(), saved.numel() * sizeof(float), workspace.get(),
                                         plan.workspace_bytes, c10::cuda::getCurrentCUDAStream().stream(),
                                         plan.caller_blas ? at::cuda::getCurrentCUDABlasHandle() : nullptr);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_training (CUDA): ", s.message);
}

at::Tensor empty_saved(const CudaBackwardPlan& plan, const at::Tensor& x) {
  return at::empty({(int64_t)((plan.saved_bytes + sizeof(float) - 1) / sizeof(float))},
                   x.options().memory_format(at::MemoryFormat::Contiguous));
}

std::tuple<at::Tensor, at::Tensor> axial_attention_training_cuda(
    const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb, const at::Tensor& rqkv, const at::Tensor& rout,
    const at::Tensor& rob, const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
    const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads, double eps, double dropout,
    const std::optional<at::Tensor>& rng_state, std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.axial_attention_training");
  Call c = check_call("fastaxial.axial_attention_training", x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob,
                      num_heads, eps, dropout, rng_state);
  const c10::cuda::CUDAGuard guard(c.x.device());
  at::Tensor out = at::empty_like(c.x, at::MemoryFormat::Contiguous);
  AxialParams p = c.params(out);
  const CudaBackwardPlan plan = training_plan(c, &p, products);
  at::Tensor saved = empty_saved(plan, c.x);
  if (out.numel() != 0) {
    draw_dropout_state(&p, c.x.device(), rng_state);
    run_training_forward(p, plan, saved);
  } else {
    saved.zero_();  // no launch wrote it; an empty problem keeps zeros (no mask drawn)
  }
  return {out.to(c.dtype), saved};
}

// The gradients output_mask asks for, from backward_cuda with `saved` (the training forward's,
// or made here by running it) and the workspace the plan asks for.
std::vector<at::Tensor> axial_attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
    const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob, const at::Tensor& cnw,
    const at::Tensor& cnb, const at::Tensor& cqkv, const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads,
    double eps, std::array<bool, 11> output_mask, const std::optional<at::Tensor>& saved_arg, double dropout,
    std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.axial_attention_backward");
  Call c = check_call("fastaxial.axial_attention_backward", x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob,
                      num_heads, eps, dropout);
  TORCH_CHECK_VALUE(dropout == 0 || saved_arg.has_value() || c.x.numel() == 0,
                    "fastaxial.axial_attention_backward: with dropout > 0, `saved` (from axial_attention_training) "
                    "is required: it holds the forward's dropout seed and offset");
  const c10::cuda::CUDAGuard guard(c.x.device());
  BackwardCall b = prepare_backward(c, grad_out, output_mask);
  AxialParams p = c.params();
  const CudaBackwardPlan plan = training_plan(c, &p, products);  // the forward's (its `saved` is laid out for them)
  const bool empty = c.x.numel() == 0;
  at::Tensor saved;
  if (saved_arg.has_value()) {
    saved = *saved_arg;
    TORCH_CHECK_VALUE(saved.scalar_type() == at::kFloat && saved.is_contiguous() && saved.device() == c.x.device() &&
                          saved.numel() * sizeof(float) >= plan.saved_bytes,
                      "fastaxial.axial_attention_backward (CUDA): `saved` must be axial_attention_training's for "
                      "these inputs (a contiguous float32 tensor of at least ", plan.saved_bytes, " bytes on ",
                      c.x.device(), ")");
  } else if (!empty) {  // nothing kept: the training forward first, into a scratch output
    saved = empty_saved(plan, c.x);
    at::Tensor scratch_out = at::empty_like(c.x, at::MemoryFormat::Contiguous);
    AxialParams forward = c.params(scratch_out);
    forward.products = p.products;
    run_training_forward(forward, plan, saved);
  }
  const c10::DataPtr workspace = c10::cuda::CUDACachingAllocator::get()->allocate(empty ? 0 : plan.workspace_bytes);
  const Status s = backward_cuda(p, b.grads, plan, empty ? nullptr : saved.data_ptr(),
                                 empty ? 0 : saved.numel() * sizeof(float), workspace.get(),
                                 empty ? 0 : plan.workspace_bytes, c10::cuda::getCurrentCUDAStream().stream(),
                                 empty || !plan.caller_blas ? nullptr : at::cuda::getCurrentCUDABlasHandle());
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_backward (CUDA): ", s.message);
  b.outputs = converted(std::move(b.outputs), c.dtype);  // the gradients in the inputs' dtype
  return b.outputs;
}

// The plan of a forward of x with num_heads heads on x's device, assuming
// 16-byte aligned weights (as PyTorch allocates them).
std::string describe_cuda_plan(const at::Tensor& x, int64_t num_heads, std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.describe_cuda_plan");
  TORCH_CHECK_VALUE(x.dim() == 4, "fastaxial.describe_cuda_plan: x must have 4 dimensions (B, H, W, D), got ",
                    x.dim());
  const c10::cuda::CUDAGuard guard(x.device());
  AxialParams p;
  p.batch = x.size(0), p.height = x.size(1), p.width = x.size(2), p.dim = x.size(3), p.heads = num_heads;
  p.products = products_for(products.value_or(x.scalar_type()), x.numel());  // as axial_attention_cuda plans it
  CudaPlan plan;
  const Status s = plan_cuda(p, &plan, /*caller_blas=*/p.products != Products::kFp32);  // as the call plans it
  TORCH_CHECK(s.ok(), "fastaxial.describe_cuda_plan: ", s.message);
  return plan.describe();
}

}  // namespace
}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, CUDA, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_cuda);
  m.impl("axial_attention_backward", &fastaxial::torch_binding::axial_attention_backward_cuda);
  m.impl("axial_attention_training", &fastaxial::torch_binding::axial_attention_training_cuda);
  m.impl("describe_cuda_plan", &fastaxial::torch_binding::describe_cuda_plan);
}
