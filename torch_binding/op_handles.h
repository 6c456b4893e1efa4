// The operators' C++ signatures and typed dispatcher handles, for the binding files that call an
// operator through the dispatcher (the autograd, autocast and Python-entry kernels). typed()
// checks each signature against its schema (ops.cpp). Header-only: the Python entry is a library
// of its own (_python_entry.so), which finds the operators that _C.so registered.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace fastaxial::torch_binding {

// axial_attention(x, the ten weights, num_heads, eps, dropout, rng_state, products)
using OpSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, double,
                               const std::optional<at::Tensor>&, std::optional<at::ScalarType>);

// axial_attention_backward(grad_out, x, the ten weights, num_heads, eps, output_mask, saved, dropout,
// products)
using BackwardSignature = std::vector<at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    int64_t, double, std::array<bool, 11>, const std::optional<at::Tensor>&, double, std::optional<at::ScalarType>);

// axial_attention_training(x, the ten weights, num_heads, eps, dropout, rng_state, products) -> (out, saved)
using TrainingSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
    double, const std::optional<at::Tensor>&, std::optional<at::ScalarType>);

// A handle looked up once, on first use (after the library registered the schema). A function-local
// static: a throw leaves it unset and the next call tries again; concurrent first calls are safe.
inline const c10::TypedOperatorHandle<OpSignature>& op() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastaxial::axial_attention", "").typed<OpSignature>();
  return handle;
}

inline const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fastaxial::axial_attention_backward", "")
                                 .typed<BackwardSignature>();
  return handle;
}

inline const c10::TypedOperatorHandle<TrainingSignature>& training_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fastaxial::axial_attention_training", "")
                                 .typed<TrainingSignature>();
  return handle;
}

}  // namespace fastaxial::torch_binding
