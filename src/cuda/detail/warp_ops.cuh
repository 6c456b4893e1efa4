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
// sum of f(v) over the calling lane's own values of the row. Every lane of the
// warp calls it (the reductions shuffle across the whole warp).
//
// Finite values so large that their sum or squared deviations overflow fp32 (|v -
// mean| past 1.8e19) would give rstd = 0, and a LayerNorm of zeros where the exact
// one is finite: such a row's statistics are taken again from the row scaled by an
// exact power of two 2^-k, k from the magnitude of its largest values (the sum of |v|
// 2^-64, which cannot overflow: |v| < 2^128). A warp-wide vote keeps that second
// pass off every other row (and its shuffles uniform); rows of ordinary values keep
// the first pass's statistics bit for bit, and a row holding an inf or a NaN keeps
// them too, so that it propagates as before.
template <int W, class SumOwn>
__device__ __forceinline__ float2 row_mean_rstd(int D, float eps, SumOwn sum_own) {
  const float mean = lane_group_sum<W>(sum_own([](float v) { return v; })) / D;
  const float sq = lane_group_sum<W>(sum_own([mean](float v) {
    const float d = v - mean;
    return d * d;
  }));
  float2 stats = make_float2(mean, rsqrtf(sq / D + eps));
  if (__any_sync(0xffffffffu, !isfinite(sq))) {
    const float a = lane_group_sum<W>(sum_own([](float v) { return fabsf(v) * 0x1p-64f; }));
    const int k = isfinite(a) && a > 0.0f ? ilogbf(a) + 65 : 0;  // every |v| 2^-k < 1
    const float mean_k = lane_group_sum<W>(sum_own([k](float v) { return scalbnf(v, -k); })) / D;
    const float sq_k = lane_group_sum<W>(sum_own([k, mean_k](float v) {
      const float d = scalbnf(v, -k) - mean_k;
      return d * d;
    }));
    // rstd = 2^-k / sqrt(sq_k / D + eps 2^-2k); eps 2^-2k may underflow to 0, as it is negligible then.
    if (!isfinite(sq) && isfinite(a))
      stats = make_float2(scalbnf(mean_k, k), scalbnf(rsqrtf(sq_k / D + scalbnf(eps, -2 * k)), -k));
  }
  return stats;
}

// LayerNorm of one row x[0, D) by the calling warp, then store(c, y_c) for
// each column c this lane owns (c = lane, lane + 32, ...). x may be the
// destination too: each lane reads its column before storing it. Returns the row's (mean, rstd),
// layer_norm_forward's statistics (every lane holds them).
template <class Store>
__device__ __forceinline__ float2 layer_norm_row(const float* x, int D, const float* __restrict__ gamma,
                                               const float* __restrict__ beta, float eps, Store store) {
  const int lane = threadIdx.x % 32;
  const float2 stats = row_mean_rstd<32>(D, eps, [&](auto f) {
    float sum = 0.0f;
    for (int c = lane; c < D; c += 32) sum += f(x[c]);
    return sum;
  });
  for (int c = lane; c < D; c += 32) store(c, (x[c] - stats.x) * stats.y * gamma[c] + beta[c]);
  return stats;
}

}  // namespace fastaxial::cuda
