// The softmax statistic the training forward saves and the attention backward reads: per
// (sequence, head, query) row, the log-sum-exp of the scaled scores in log2 units,
//   lse2 = m + log2(l),  m = max_k s_k,  l = sum_k 2^(s_k - m),  s_k = q . k_k log2(e) / sqrt(hd),
// kept as an unevaluated sum of two floats, hi + lo, in two planes of R = num_seq heads L
// floats each: hi at [0, R), lo at [R, 2R). The backward recomputes each probability as
// 2^((s - hi) - lo). One float would not do: lse2 of a long row is near log2(L) + m (12 and up
// at L = 4096), where a float's rounding (up to 4.8e-7) moves every probability of the row by
// the same factor, and sums over a long axis (the bias and LayerNorm gradients) add that drift
// up row after row (perf notes v48). With lo, what is left is each exponent's own rounding,
// independent from element to element, as in an fp32 softmax.
#pragma once

#include <cstdint>

namespace fastaxial::cuda {

// Row r's lse2 = m + log2(l) into the two planes at lse (R = rows floats apart), added in fp64.
__device__ __forceinline__ void store_lse2(float* lse, int64_t rows, int64_t r, float m, float l) {
  const double v = (double)m + log2((double)l);
  const float hi = (float)v;
  lse[r] = hi;
  lse[rows + r] = (float)(v - (double)hi);
}

// The probability of score s (unscaled q . k) in a row of lse2 = hi + lo: 2^(s scale_log2 - hi - lo).
__device__ __forceinline__ float prob_from_lse2(float s, float scale_log2, float hi, float lo) {
  return exp2f(fmaf(s, scale_log2, -hi) - lo);
}

}  // namespace fastaxial::cuda
