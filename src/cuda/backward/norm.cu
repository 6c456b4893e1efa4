// Per-position kernels of the backward: a warp per position for the two
// LayerNorm kernels (a position's D features are one contiguous row, and its
// statistics are warp sums), a thread per element for the bias. Each block
// loops over positions so that any T launches a grid the device holds.
#include "norm.h"

#include <algorithm>

#include "../detail/launch.cuh"
#include "../detail/warp_ops.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int kWarps = 8;  // positions a block at a time

// out = LayerNorm(src), its (mean, rstd) in stats.
__global__ void __launch_bounds__(32 * kWarps)
    layer_norm_forward_kernel(const float* __restrict__ src, const float* __restrict__ gamma,
                              const float* __restrict__ beta, float eps, int64_t T, int D, float* __restrict__ out,
                              float2* __restrict__ stats) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int lane = threadIdx.x % 32;
  for (int64_t pos = blockIdx.x * (int64_t)kWarps + threadIdx.x / 32; pos < T; pos += (int64_t)gridDim.x * kWarps) {
    const float* x = src + pos * D;  // (D)
    const float2 s = row_mean_rstd<32>(D, eps, [&](auto f) {
      float sum = 0.0f;
      for (int c = lane; c < D; c += 32) sum += f(x[c]);
      return sum;
    });
    float* y = out + pos * D;
    for (int c = lane; c < D; c += 32) y[c] = (x[c] - s.x) * s.y * gamma[c] + beta[c];
    if (lane == 0) stats[pos] = s;
  }
}

__global__ void add_bias_kernel(const float* __restrict__ x, const float* __restrict__ bias, int64_t n, int D,
                                float* __restrict__ out) {
  grid_dependency_wait();
  allow_dependent_launch();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = x[i] + bias[i % D];
}

__global__ void __launch_bounds__(32 * kWarps)
    layer_norm_backward_kernel(const float* __restrict__ src, const float2* __restrict__ stats,
                               const float* __restrict__ gamma, const float* __restrict__ d_norm, const float* d_res,
                               int64_t T, int D, float* d_src, float* __restrict__ d_norm_xhat) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int lane = threadIdx.x % 32;
  for (int64_t pos = blockIdx.x * (int64_t)kWarps + threadIdx.x / 32; pos < T; pos += (int64_t)gridDim.x * kWarps) {
    const float* x = src + pos * D;     // (D)
    const float* dn = d_norm + pos * D;  // (D)
    const float2 s = stats[pos];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int c = lane; c < D; c += 32) {
      const float xhat = (x[c] - s.x) * s.y, g = dn[c] * gamma[c];
      g_sum += g, gx_sum += g * xhat;
    }
    const float g_mean = warp_sum(g_sum) / D, gx_mean = warp_sum(gx_sum) / D;
    for (int c = lane; c < D; c += 32) {
      const float xhat = (x[c] - s.x) * s.y, g = dn[c] * gamma[c];
      // d_src may be d_res: each lane reads its element before writing it.
      if (d_src != nullptr) d_src[pos * D + c] = d_res[pos * D + c] + s.y * (g - g_mean - xhat * gx_mean);
      if (d_norm_xhat != nullptr) d_norm_xhat[pos * D + c] = dn[c] * xhat;
    }
  }
}

// Blocks for `work` items of `per_block` each, at most what keeps every
// multiprocessor busy several times over (the kernels loop).
unsigned grid_for(int64_t work, int per_block, const DeviceCaps& dev) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(blocks, 32 * (int64_t)std::max(dev.sms, 1)));
}

}  // namespace

cudaError_t layer_norm_forward(const float* src, const float* gamma, const float* beta, float eps, int64_t T, int D,
                               float* out, float* stats, const DeviceCaps& dev, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  return launch_kernel<layer_norm_forward_kernel>(grid_for(T, kWarps, dev), 32 * kWarps, 0, stream, dev, src, gamma,
                                                  beta, eps, T, D, out, reinterpret_cast<float2*>(stats));
}

cudaError_t add_bias(const float* x, const float* bias, int64_t T, int D, float* out, const DeviceCaps& dev,
                     cudaStream_t stream) {
  const int64_t n = T * D;
  if (n == 0) return cudaSuccess;
  return launch_kernel<add_bias_kernel>(grid_for(n, 256, dev), 256, 0, stream, dev, x, bias, n, D, out);
}

cudaError_t layer_norm_backward(const float* src, const float* stats, const float* gamma, const float* d_norm,
                                const float* d_res, int64_t T, int D, float* d_src, float* d_norm_xhat,
                                const DeviceCaps& dev, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  return launch_kernel<layer_norm_backward_kernel>(grid_for(T, kWarps, dev), 32 * kWarps, 0, stream, dev, src,
                                                   reinterpret_cast<const float2*>(stats), gamma, d_norm, d_res, T,
                                                   D, d_src, d_norm_xhat);
}

}  // namespace fastaxial::cuda
