// The torch binding's shared piece: checks one call's tensors and turns them
// into fastaxial::AxialParams. The CPU and CUDA files only allocate and call.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <vector>

#include "fastaxial/fastaxial.h"

namespace fastaxial::torch_binding {

// The op's arguments after checking: contiguous float32 tensors on one device.
struct Call {
  at::Tensor x;                     // (B, H, W, D)
  std::array<at::Tensor, 5> row;    // norm_weight, norm_bias, qkv_weight, out_weight, out_bias
  std::array<at::Tensor, 5> col;
  int64_t heads;
  double eps;
  double dropout = 0.0;  // attention dropout rate (checked by check_dropout); params() passes it
  // The caller's dtype. bfloat16 and float16: x and the weights above are float32 copies, and the
  // device kernels convert what they return back to this dtype; the math is fp32 but for a CUDA
  // call of 2^21 elements or more, whose products run in this dtype (AxialParams::products;
  // ops_cuda.cpp: products_for, training_plan).
  at::ScalarType dtype = at::kFloat;

  // Params for writing into `out`, a contiguous tensor shaped like x.
  AxialParams params(at::Tensor& out) const;
  // Params without an output (the backward reads x and the weights only).
  AxialParams params() const;
  // x and the ten weights, in the schema's order.
  std::array<const at::Tensor*, 11> inputs() const;
};

// The backward's checked gradient of the output and the gradients output_mask asks for
// (x, then the ten weights), float32 contiguous tensors shaped like their inputs, with `grads`
// pointing into them (unwanted ones null): a tensor each for a float32 call, views of one block
// for a 16-bit one (its kernel narrows them into tensors of their own: converted).
struct BackwardCall {
  at::Tensor grad_out;              // contiguous
  std::vector<at::Tensor> outputs;  // the wanted gradients, in the schema's order
  AxialGrads grads;
};
BackwardCall prepare_backward(const Call& c, const at::Tensor& grad_out, const std::array<bool, 11>& output_mask);

// bfloat16 or float16: the 16-bit dtypes the operators run as fp32 math on float32 copies.
inline bool low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Fresh contiguous tensors of these shapes, views of one allocation, each at a 64-byte boundary (the
// CPU products' alignment, gemm.h; the CUDA kernels' is 16): one allocator call where a call needs
// several tensors of its own. `shapes` refers to the sizes of tensors that outlive the call.
std::vector<at::Tensor> empty_in_one_block(const std::vector<at::IntArrayRef>& shapes, const at::TensorOptions& options);

// How converted allocates: a tensor each (what the caller gets back), or views of one block
// (a call's internal copies: empty_in_one_block).
enum class Storage { kSeparate, kOneBlock };

// The tensors converted to dtype (fresh contiguous ones; a tensor already of dtype as it is): one
// batched copy, a single launch on CUDA, in place of a conversion each. For the 16-bit calls'
// float32 copies (kOneBlock) and the gradients they return (kSeparate; Call::dtype).
std::vector<at::Tensor> converted(std::vector<at::Tensor> tensors, at::ScalarType dtype,
                                  Storage storage = Storage::kSeparate);

// Checks the `products` argument (axial_attention, describe_cuda_plan): none, float32, bfloat16 or
// float16.
void check_products(const std::optional<at::ScalarType>& products, const char* op);

// Checks an attention dropout rate argument: in [0, 1].
void check_dropout(double dropout, const char* op);

// The dropout state (seed, offset) kept in the last 16 bytes of a training forward's `saved`
// (CUDA: CudaBackwardPlan::dropout_state; CPU: after x1, q, k, v and x's sizes, ops_cpu.cpp).
constexpr int64_t kDropoutStateFloats = 4;

// The checks every operator kernel makes, `op` naming it: the dropout rate (check_dropout), x and
// the weights, and rng_state where the operator takes one (check_rng_state); c.dropout = dropout.
Call check_call(const char* op, const at::Tensor& x, const at::Tensor& row_norm_weight,
                const at::Tensor& row_norm_bias, const at::Tensor& row_qkv_weight, const at::Tensor& row_out_weight,
                const at::Tensor& row_out_bias, const at::Tensor& col_norm_weight, const at::Tensor& col_norm_bias,
                const at::Tensor& col_qkv_weight, const at::Tensor& col_out_weight, const at::Tensor& col_out_bias,
                int64_t num_heads, double eps, double dropout,
                const std::optional<at::Tensor>& rng_state = std::nullopt);

// The CPU training forward's cache of `saved` buffers (ops_cpu.cpp, SavedCache): frees what it
// holds and returns the bytes freed; the bytes it holds.
int64_t empty_cpu_cache();
int64_t cpu_cache_bytes();

}  // namespace fastaxial::torch_binding
