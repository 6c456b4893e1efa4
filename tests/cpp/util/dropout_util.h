// Helper of the dropout suites (CPU and CUDA): a problem with attention dropout whose float64
// reference applies the kernels' own mask (src/common/dropout.h), so a suite checks that the
// kernels draw exactly the mask it defines.
#pragma once

#include <cstdint>

#include "src/common/dropout.h"
#include "reference.h"

namespace fastaxial::test {

// p with dropout `rate`, seed and offset, and the reference's mask: the kernels' own function.
inline Problem with_dropout(Problem p, float rate, uint64_t seed, uint64_t offset) {
  p.dropout = rate;
  p.seed = seed;
  p.offset = offset;
  const DropoutParams d = make_dropout(params(p, nullptr));
  p.keep = [d](int pass, int64_t n, int64_t h, int64_t i, int64_t j) {
    return dropout_keep(d, pass, static_cast<uint64_t>(n), static_cast<uint64_t>(h), static_cast<uint64_t>(i),
                        static_cast<uint64_t>(j));
  };
  return p;
}

}  // namespace fastaxial::test
