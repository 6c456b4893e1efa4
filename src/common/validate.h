// The argument checks behind fastaxial.h's validate(), in parts for the entry
// points that need less than a whole forward's arguments.
#pragma once

#include <cstdint>
#include <string>

#include "fastaxial/fastaxial.h"

namespace fastaxial {

// Sizes, heads, eps and dropout alone: what a plan needs of p.
Status validate_sizes(const AxialParams& p);

// validate_sizes, then, where there is a position, x and the ten weights
// non-null: what a backward reads (p.out is not checked).
Status validate_inputs(const AxialParams& p);

// 16-byte alignment: what the kernels' vector copies need of a pointer.
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Whether any of an axis's five weight gradients is wanted (non-null).
inline bool any(const AxisGrads& g) {
  return g.norm_weight || g.norm_bias || g.qkv_weight || g.out_weight || g.out_bias;
}

// A plan (CudaPlan, CudaBackwardPlan) made for p's sizes on `device`; `what` names it in the error.
template <class Plan>
Status check_plan_matches(const AxialParams& p, const Plan& plan, int device, const char* what) {
  if (plan.batch != p.batch || plan.height != p.height || plan.width != p.width || plan.dim != p.dim ||
      plan.heads != p.heads)
    return {StatusCode::kInvalidArgument, std::string(what) + " was made for another problem: " + plan.describe()};
  if (plan.device != device)
    return {StatusCode::kInvalidArgument, std::string(what) + " was made for device " + std::to_string(plan.device) +
                                              ", the current device is " + std::to_string(device)};
  return Status::Ok();
}

}  // namespace fastaxial
