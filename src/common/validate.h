// The argument checks behind fastaxial.h's validate(), in parts for the entry
// points that need less than a whole forward's arguments.
#pragma once

#include "fastaxial/fastaxial.h"

namespace fastaxial {

// Sizes, heads, eps and dropout alone: what a plan needs of p.
Status validate_sizes(const AxialParams& p);

// validate_sizes, then, where there is a position, x and the ten weights
// non-null: what a backward reads (p.out is not checked).
Status validate_inputs(const AxialParams& p);

}  // namespace fastaxial
