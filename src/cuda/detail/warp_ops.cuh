// Warp-wide reductions, the LayerNorm statistics of a row spread over a lane
// group (every kernel family), and the LayerNorm of a row by one warp (the
// staged and generic kernels).
#pragma once

namespace fastaxial::cuda {

// Sum of v over a group of W adjacent lanes (W a power of two, at most 32),
// returned to every lane of the group; float, or double (the column sums).
template <int W, class T>
__device__ __forceinline__ T lane_group_sum(T v) {
#pragma unroll
  for (int m = W / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return lane_group_sum<32>(v); }
__device__ __forceinline__ double warp_sum(double v) { return lane_group_sum<32>(v); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Mean and reciprocal standard deviation of a row of D values spread over a
// group of W adjacent lanes (W a power of two, at most 32): the mean, then the
// mean squared deviation, two reductions as in the reference. sum_own(f) returns the
// sum of f(v) over the calling lane's own values of the row.
template <int W, class SumOwn>
__device__ __forceinline__ float2 row_mean_rstd(int D, float eps, SumOwn sum_own) {
  const float mean = lane_group_sum<W>(sum_own([](float v) { return v; })) / D;
  const float sq = lane_group_sum<W>(sum_own([mean](float v) {
    const float d = v - mean;
    return d * d;
  }));
  return make_float2(mean, rsqrtf(sq / D + eps));
}

// LayerNorm of one row x[0, D) by the calling warp, then store(c, y_c) for
// each column c this lane owns (c = lane, lane + 32, ...). x may be the
// destination too: each lane reads its column before storing it.
template <class Store>
__device__ __forceinline__ void layer_norm_row(const float* x, int D, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, float eps, Store store) {
  const int lane = threadIdx.x % 32;
  const float2 stats = row_mean_rstd<32>(D, eps, [&](auto f) {
    float sum = 0.0f;
    for (int c = lane; c < D; c += 32) sum += f(x[c]);
    return sum;
  });
  for (int c = lane; c < D; c += 32) store(c, (x[c] - stats.x) * stats.y * gamma[c] + beta[c]);
}

}  // namespace fastaxial::cuda
