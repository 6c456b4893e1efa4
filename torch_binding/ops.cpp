// Defines the operators once: axial_attention, with its CPU, CUDA and
// Autograd kernels in ops_cpu.cpp, ops_cuda.cpp and ops_autograd.cpp and its
// fake kernel in python/fastaxial/ops.py; axial_attention_backward, its fused
// backward (CPU and CUDA kernels beside the forward's, and a fake kernel);
// and describe_cuda_plan, which says which CUDA kernels a forward of x would
// run (ops_cuda.cpp).
#include "ops.h"

#include <ATen/ops/_foreach_copy.h>
#include <c10/util/accumulate.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace fastaxial::torch_binding {
namespace {

const char* const kWeightNames[5] = {"norm_weight", "norm_bias", "qkv_weight", "out_weight", "out_bias"};

// A dtype as Python spells it, for messages ("torch.float32", "torch.int32").
std::string dtype_name(at::ScalarType t) { return "torch." + c10::getDtypeNames(t).first; }

// The weight's name is `axis` + kWeightNames[i] ("row_", "col_"); the checks'
// messages are built only when one fails, as every call checks ten weights.
void check_weight(const at::Tensor& w, const char* axis, const char* name, at::IntArrayRef shape,
                  const at::Tensor& x) {
  TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), "fastaxial.axial_attention: ", axis, name, " must be ",
                   dtype_name(x.scalar_type()), " like x, got ", dtype_name(w.scalar_type()));
  TORCH_CHECK(w.device() == x.device(), "fastaxial.axial_attention: ", axis, name, " is on ", w.device(),
              " but x is on ", x.device());
  TORCH_CHECK_VALUE(w.sizes() == shape, "fastaxial.axial_attention: ", axis, name, " must have shape ", shape,
                    ", got ", w.sizes());
}

// An explicit dropout state (the ops' `rng_state`), where given: a contiguous int64 (seed, offset)
// pair on x's device.
void check_rng_state(const std::optional<at::Tensor>& rng_state, const at::Tensor& x, const char* op) {
  if (!rng_state.has_value()) return;
  const at::Tensor& r = *rng_state;
  TORCH_CHECK_VALUE(r.scalar_type() == at::kLong && r.numel() == 2 && r.is_contiguous(), op,
                    ": rng_state must be a contiguous int64 tensor of 2 elements (seed, offset), got ",
                    r.scalar_type(), " of shape ", r.sizes());
  TORCH_CHECK_VALUE(r.device() == x.device(), op, ": rng_state is on ", r.device(), " but x is on ", x.device());
}

}  // namespace

void check_products(const std::optional<at::ScalarType>& products, const char* op) {
  TORCH_CHECK_TYPE(!products || *products == at::kFloat || low_precision(*products), op, ": products must be None, ",
                   "torch.float32, torch.bfloat16 or torch.float16, got ", dtype_name(*products));
}

Call check_call(const char* op, const at::Tensor& x, const at::Tensor& row_norm_weight,
                const at::Tensor& row_norm_bias, const at::Tensor& row_qkv_weight, const at::Tensor& row_out_weight,
                const at::Tensor& row_out_bias, const at::Tensor& col_norm_weight, const at::Tensor& col_norm_bias,
                const at::Tensor& col_qkv_weight, const at::Tensor& col_out_weight, const at::Tensor& col_out_bias,
                int64_t num_heads, double eps, double dropout, const std::optional<at::Tensor>& rng_state) {
  check_dropout(dropout, op);
  TORCH_CHECK_VALUE(x.dim() == 4, "fastaxial.axial_attention: x must have 4 dimensions (B, H, W, D), got ",
                    x.dim(), " with shape ", x.sizes());
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || low_precision(dtype), "fastaxial.axial_attention: x must be float32, "
                   "bfloat16 or float16, got ", dtype_name(dtype));
  const int64_t D = x.size(3);
  // x's last dimension against the weights' before the heads: a wrong x is the likelier mistake.
  TORCH_CHECK_VALUE(row_norm_weight.dim() != 1 || row_norm_weight.size(0) == D, "fastaxial.axial_attention: x's last ",
                    "dimension is ", D, " but the weights are for dim ", row_norm_weight.size(0), ": x must be (B, H, W, ",
                    row_norm_weight.size(0), "), got ", x.sizes());
  TORCH_CHECK_VALUE(num_heads >= 1, "fastaxial.axial_attention: num_heads must be >= 1, got ", num_heads);
  TORCH_CHECK_VALUE(D % num_heads == 0, "fastaxial.axial_attention: dim (x.size(3) = ", D,
                    ") must be divisible by num_heads (", num_heads, ")");
  TORCH_CHECK_VALUE(eps >= 0, "fastaxial.axial_attention: eps must be >= 0, got ", eps);

  Call c{x.contiguous(), {}, {}, num_heads, eps};
  const at::Tensor* given[2][5] = {
      {&row_norm_weight, &row_norm_bias, &row_qkv_weight, &row_out_weight, &row_out_bias},
      {&col_norm_weight, &col_norm_bias, &col_qkv_weight, &col_out_weight, &col_out_bias}};
  const int64_t vec[1] = {D}, qkv[2] = {3 * D, D}, square[2] = {D, D};
  const at::IntArrayRef shapes[5] = {vec, vec, qkv, square, vec};
  for (int axis = 0; axis < 2; ++axis)
    for (int i = 0; i < 5; ++i) {
      check_weight(*given[axis][i], axis == 0 ? "row_" : "col_", kWeightNames[i], shapes[i], x);
      (axis == 0 ? c.row : c.col)[i] = given[axis][i]->contiguous();
    }
  if (dtype != at::kFloat) {  // fp32 math on 16-bit storage: float32 copies
    c.dtype = dtype;
    const auto inputs = c.inputs();
    std::vector<at::Tensor> wide(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) wide[i] = *inputs[i];
    wide = converted(std::move(wide), at::kFloat, Storage::kOneBlock);
    c.x = wide[0];
    for (int i = 0; i < 5; ++i) c.row[i] = wide[1 + i], c.col[i] = wide[6 + i];
  }
  check_rng_state(rng_state, c.x, op);
  c.dropout = dropout;
  return c;
}

BackwardCall prepare_backward(const Call& c, const at::Tensor& grad_out, const std::array<bool, 11>& output_mask) {
  TORCH_CHECK_VALUE(grad_out.sizes() == c.x.sizes(), "fastaxial.axial_attention_backward: grad_out must have x's "
                    "shape ", c.x.sizes(), ", got ", grad_out.sizes());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == c.dtype, "fastaxial.axial_attention_backward: grad_out must be ",
                   dtype_name(c.dtype), " like x, got ", dtype_name(grad_out.scalar_type()));
  TORCH_CHECK(grad_out.device() == c.x.device(), "fastaxial.axial_attention_backward: grad_out is on ",
              grad_out.device(), " but x is on ", c.x.device());
  BackwardCall b;
  b.grad_out = grad_out.to(at::kFloat).contiguous();  // (no copy where it is float32 and contiguous)
  b.grads.grad_out = b.grad_out.data_ptr<float>();
  float** slots[11] = {&b.grads.grad_x,         &b.grads.row.norm_weight, &b.grads.row.norm_bias,
                       &b.grads.row.qkv_weight, &b.grads.row.out_weight,  &b.grads.row.out_bias,
                       &b.grads.col.norm_weight, &b.grads.col.norm_bias,  &b.grads.col.qkv_weight,
                       &b.grads.col.out_weight, &b.grads.col.out_bias};
  const auto inputs = c.inputs();
  std::vector<at::IntArrayRef> shapes;
  for (int i = 0; i < 11; ++i)
    if (output_mask[i]) shapes.push_back(inputs[i]->sizes());
  if (c.dtype == at::kFloat) {  // the caller's gradients: a tensor each
    for (const at::IntArrayRef& shape : shapes)
      b.outputs.push_back(at::empty(shape, c.x.options().memory_format(at::MemoryFormat::Contiguous)));
  } else if (!shapes.empty()) {  // float32 gradients to be narrowed into the caller's (converted)
    b.outputs = empty_in_one_block(shapes, c.x.options());
  }
  for (int i = 0, j = 0; i < 11; ++i)
    if (output_mask[i]) *slots[i] = b.outputs[j++].data_ptr<float>();
  return b;
}

std::vector<at::Tensor> empty_in_one_block(const std::vector<at::IntArrayRef>& shapes, const at::TensorOptions& options) {
  const int64_t align = 64 / static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const at::IntArrayRef& shape : shapes) {
    offsets.push_back(total);
    total += (c10::multiply_integers(shape) + align - 1) / align * align;
  }
  const at::Tensor block = at::empty({total}, options.memory_format(at::MemoryFormat::Contiguous));
  TORCH_INTERNAL_ASSERT(total == 0 || reinterpret_cast<uintptr_t>(block.data_ptr()) % 64 == 0);
  std::vector<at::Tensor> views;
  for (size_t i = 0; i < shapes.size(); ++i) {
    std::vector<int64_t> strides(shapes[i].size());
    for (int64_t d = (int64_t)strides.size() - 1, stride = 1; d >= 0; stride *= std::max<int64_t>(shapes[i][d--], 1))
      strides[d] = stride;
    views.push_back(block.as_strided(shapes[i], strides, offsets[i]));
  }
  return views;
}

std::vector<at::Tensor> converted(std::vector<at::Tensor> tensors, at::ScalarType dtype, Storage storage) {
  std::vector<at::Tensor> src, dst;
  std::vector<at::IntArrayRef> shapes;
  for (const at::Tensor& t : tensors)
    if (t.scalar_type() != dtype) {
      src.push_back(t);
      shapes.push_back(t.sizes());
    }
  if (src.empty()) return tensors;
  const at::TensorOptions options = src[0].options().dtype(dtype);
  if (storage == Storage::kOneBlock) {
    dst = empty_in_one_block(shapes, options);
  } else {
    for (const at::IntArrayRef& shape : shapes)
      dst.push_back(at::empty(shape, options.memory_format(at::MemoryFormat::Contiguous)));
  }
  at::_foreach_copy_(dst, src);
  auto next = dst.begin();
  for (at::Tensor& t : tensors)
    if (t.scalar_type() != dtype) t = *next++;
  return tensors;
}

AxialParams Call::params(at::Tensor& out) const {
  AxialParams p = params();
  p.out = out.data_ptr<float>();
  return p;
}

std::array<const at::Tensor*, 11> Call::inputs() const {
  return {&x, &row[0], &row[1], &row[2], &row[3], &row[4], &col[0], &col[1], &col[2], &col[3], &col[4]};
}

void check_dropout(double dropout, const char* op) {
  TORCH_CHECK_VALUE(dropout >= 0.0 && dropout <= 1.0, op, ": dropout must be in [0, 1], got ", dropout);
}

AxialParams Call::params() const {
  AxialParams p;
  p.dropout = static_cast<float>(dropout);
  p.batch = x.size(0);
  p.height = x.size(1);
  p.width = x.size(2);
  p.dim = x.size(3);
  p.heads = heads;
  p.eps = static_cast<float>(eps);
  p.x = x.data_ptr<float>();
  auto weights = [](const std::array<at::Tensor, 5>& w) {
    return AxisWeights{w[0].data_ptr<float>(), w[1].data_ptr<float>(), w[2].data_ptr<float>(),
                       w[3].data_ptr<float>(), w[4].data_ptr<float>()};
  };
  p.row = weights(row);
  p.col = weights(col);
  return p;
}

at::Tensor dropout_mask(int64_t batch, int64_t height, int64_t width, int64_t num_heads, double dropout,
                        int64_t seed, int64_t offset, int64_t pass) {
  check_dropout(dropout, "fastaxial.dropout_mask");
  TORCH_CHECK_VALUE(pass == 0 || pass == 1, "fastaxial.dropout_mask: pass must be 0 (rows) or 1 (columns), got ", pass);
  TORCH_CHECK_VALUE(batch >= 0 && height >= 0 && width >= 0 && num_heads >= 1,
                    "fastaxial.dropout_mask: sizes must be >= 0 and num_heads >= 1");
  AxialParams p;
  p.batch = batch, p.height = height, p.width = width, p.heads = num_heads, p.dim = num_heads;
  p.dropout = static_cast<float>(dropout);
  p.seed = static_cast<uint64_t>(seed), p.offset = static_cast<uint64_t>(offset);
  const int64_t n = pass == 0 ? batch * height : batch * width, L = pass == 0 ? width : height;
  at::Tensor mask = at::empty({n, num_heads, L, L}, at::TensorOptions().dtype(at::kFloat));
  const Status s = fastaxial::dropout_mask(p, static_cast<int>(pass), mask.data_ptr<float>());
  TORCH_CHECK(s.ok(), "fastaxial.dropout_mask: ", s.message);
  return mask;
}

int64_t cuda_saved_floats(int64_t batch, int64_t height, int64_t width, int64_t dim, int64_t num_heads) {
  AxialParams p;
  p.batch = batch, p.height = height, p.width = width, p.dim = dim, p.heads = num_heads;
  size_t bytes = 0;
  const Status s = fastaxial::cuda_saved_bytes(p, &bytes);
  TORCH_CHECK_VALUE(s.ok(), "fastaxial.cuda_saved_floats: ", s.message);
  return static_cast<int64_t>(bytes / sizeof(float));
}

}  // namespace fastaxial::torch_binding

TORCH_LIBRARY(fastaxial, m) {
  m.def(
      "axial_attention(Tensor x, Tensor row_norm_weight, Tensor row_norm_bias, Tensor row_qkv_weight, "
      "Tensor row_out_weight, Tensor row_out_bias, Tensor col_norm_weight, Tensor col_norm_bias, "
      "Tensor col_qkv_weight, Tensor col_out_weight, Tensor col_out_bias, int num_heads, float eps=1e-05, "
      "float dropout=0.0, Tensor? rng_state=None, ScalarType? products=None) -> Tensor");
  // `products`: the precision of the products the call may run on (fastaxial.h, AxialParams::products).
  // None: x's dtype. float32: 3xTF32 products, whatever x's dtype. bfloat16 or float16: that type's
  // products with fp32 accumulation, where they are served and faster (CUDA calls without grad of
  // 2^21 elements or more, with grad or without: ops_cuda.cpp, products_for, training_plan);
  // 3xTF32 elsewhere, and always on the CPU, whose kernels run fp32 math. The autocast kernels
  // pass the autocast dtype (ops_autocast.cpp); the autograd kernel passes it on to the training
  // operators below, which take it alike.
  //
  // `dropout` > 0: attention dropout with that rate (the module passes it in training mode), its
  // mask drawn from PyTorch's default generator of x's device (fastaxial.h, AxialParams::dropout),
  // or, where `rng_state` is given, from that int64 (seed, offset) pair on x's device, the
  // generator untouched. The module passes one under torch.compile, drawn by a random op in the
  // traced graph: the compiler then sees each call's randomness as an input and never merges two
  // calls with equal tensors into one mask.
  //
  // The gradients of axial_attention for the inputs output_mask selects (x, then the ten weights),
  // in that order; `saved`, where given, is axial_attention_training's (required with dropout: it
  // holds the mask's seed and offset; `products` must be the training forward's, which laid it
  // out). CPU and CUDA kernels in ops_cpu.cpp and ops_cuda.cpp; the forward's autograd kernel
  // calls it and refuses double backward.
  m.def(
      "axial_attention_backward(Tensor grad_out, Tensor x, Tensor row_norm_weight, Tensor row_norm_bias, "
      "Tensor row_qkv_weight, Tensor row_out_weight, Tensor row_out_bias, Tensor col_norm_weight, "
      "Tensor col_norm_bias, Tensor col_qkv_weight, Tensor col_out_weight, Tensor col_out_bias, int num_heads, "
      "float eps, bool[11] output_mask, Tensor? saved=None, float dropout=0.0, ScalarType? products=None) -> Tensor[]");
  // The forward for training: axial_attention's output, and what the backward reads (`saved`, one
  // float32 buffer ending with the dropout mask's seed and offset, 16 bytes). On CUDA,
  // forward_cuda_training's: each pass's LayerNorm output and statistics, q, k, v, attention
  // output and log-sum-exp, and the row pass's output, so the backward recomputes nothing but the
  // probabilities; on the CPU, the row pass's output, both passes' q, k, v and x's sizes
  // (ops_cpu.cpp), so its backward recomputes LayerNorm and the probabilities. The autograd
  // kernel calls it in grad mode and passes `saved` to axial_attention_backward.
  m.def(
      "axial_attention_training(Tensor x, Tensor row_norm_weight, Tensor row_norm_bias, Tensor row_qkv_weight, "
      "Tensor row_out_weight, Tensor row_out_bias, Tensor col_norm_weight, Tensor col_norm_bias, "
      "Tensor col_qkv_weight, Tensor col_out_weight, Tensor col_out_bias, int num_heads, float eps, "
      "float dropout=0.0, Tensor? rng_state=None, ScalarType? products=None) -> (Tensor, Tensor)");
  m.def("describe_cuda_plan(Tensor x, int num_heads, ScalarType? products=None) -> str");
  // Whether this build applies attention dropout (built with Random123); the module falls back
  // to the reference math for dropout where it does not.
  m.def("dropout_available() -> bool", []() { return fastaxial::dropout_compiled(); });
  // What the CPU kernels' products run on: "blas" (the MKL sgemm_ that PyTorch runs on, one thread a
  // call, ops_cpu.cpp) or "eigen" (Eigen's own GEMM).
  m.def("cpu_blas() -> str", []() { return std::string(fastaxial::cpu_sgemm() != nullptr ? "blas" : "eigen"); });
  // The CPU training forward keeps freed `saved` buffers for the next step (ops_cpu.cpp,
  // SavedCache): empty_cpu_cache frees them (the bytes freed), cpu_cache_bytes says what it holds.
  m.def("empty_cpu_cache() -> int", &fastaxial::torch_binding::empty_cpu_cache);
  m.def("cpu_cache_bytes() -> int", &fastaxial::torch_binding::cpu_cache_bytes);
  // Debugging and tests: the multipliers (0 or 1 / (1 - dropout)) of one pass's dropout mask
  // (pass 0: rows, 1: columns), (N, num_heads, L, L) float32 on the CPU, for x of shape
  // (batch, height, width, .) and the seed and offset a training forward keeps (the last 16 bytes
  // of its `saved`; fastaxial.ops.dropout_state reads them).
  m.def(
      "dropout_mask(int batch, int height, int width, int num_heads, float dropout, int seed, int offset, int pass_) "
      "-> Tensor",
      &fastaxial::torch_binding::dropout_mask);
  // Tests: the floats of axial_attention_training's CUDA `saved` for x (batch, height, width,
  // dim), from the library's plan (cuda_saved_bytes); fastaxial.ops.saved_floats, which the fake
  // kernel uses (plain arithmetic, so that it takes symbolic sizes), must agree with it.
  m.def("cuda_saved_floats(int batch, int height, int width, int dim, int num_heads) -> int",
        &fastaxial::torch_binding::cuda_saved_floats);
}
