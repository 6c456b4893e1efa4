// Warp-wide reductions and the one-row LayerNorm every kernel family uses.
#pragma once

namespace fastaxial::cuda {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// LayerNorm of one row x[0, D) by the calling warp: mean, then the mean
// squared deviation (two passes, as the reference), then store(c, y_c) for
// each column c this lane owns (c = lane, lane + 32, ...). x may be the
// destination too: each lane reads its column before storing it.
template <class Store>
__device__ __forceinline__ void layer_norm_row(const float* x, int D, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, float eps, Store store) {
  const int lane = threadIdx.x % 32;
  float sum = 0.0f;
  for (int c = lane; c < D; c += 32) sum += x[c];
  const float mean = warp_sum(sum) / D;
  float sq = 0.0f;
  for (int c = lane; c < D; c += 32) {
    const float d = x[c] - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(warp_sum(sq) / D + eps);
  for (int c = lane; c < D; c += 32) store(c, (x[c] - mean) * rstd * gamma[c] + beta[c]);
}

}  // namespace fastaxial::cuda
