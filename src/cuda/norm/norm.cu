// Per-position kernels of the staged passes: a warp per position for the
// LayerNorm kernels (a position's D features are one contiguous row, and its
// statistics are warp sums), a thread per element for the bias.
//
// LayerNorm's forward comes in two families (norm.h: layer_norm_forward),
// one per forward, each keeping that forward's results bit for bit:
// - without statistics (the inference forward): a warp per position and a
//   block per 8 positions, plus blocks after them that split weights into
//   planes (gemm/weight_planes.cuh) in the same launch: the first staged pass
//   of a forward splits the weights of both, 4 D^2 elements a pass;
// - with statistics (the training forward): blocks that loop over the
//   positions, so that any T launches a grid the device holds.
// Per row the first does the arithmetic of the second's scalar form (below):
// the two forwards' LayerNorms agree bit for bit where the training forward
// runs that form; its vectorised one may differ in the last bits.
//
// The kernels with statistics, and the backward, come in two forms. The
// vectorised one (D % 4 == 0, D <= 1024, every pointer but stats 16-byte
// aligned; the launchers check) keeps a lane's share of the row in
// registers, as float4s: the forward reads x once (the scalar one three
// times: mean, variance, output), the backward reads x, d_norm and d_res once
// (the scalar one x and d_norm twice), all as 16-byte accesses. The scalar
// one (4-byte accesses, any D and alignment) serves the rest. Per element
// both do the same arithmetic; a lane's partial sums run over other columns
// (4 adjacent ones per float4 instead of every 32nd), so the two forms'
// results may differ in the last bits. Each is deterministic.
#include "norm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/round16.cuh"
#include "../detail/warp_ops.cuh"
#include "../gemm/weight_planes.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int kWarps = 8;  // positions a block at a time

// Blocks below ln_blocks: xs (T, D) = LayerNorm(x (T, D)), a warp per
// position. The blocks after them split the matrices of `splits` (split_total
// elements, all straight) into (hi, lo) planes, a thread per element of the
// flat list.
__global__ void layer_norm_and_split_kernel(const float* __restrict__ x, const float* __restrict__ gamma,
                                            const float* __restrict__ beta, float eps, int64_t T, int D,
                                            float* __restrict__ xs, int64_t ln_blocks, const PlaneJobs splits,
                                            int64_t split_total) {
  grid_dependency_wait();
  allow_dependent_launch();
  if (blockIdx.x >= ln_blocks) {
    const int64_t stride = (gridDim.x - ln_blocks) * (int64_t)blockDim.x;
    for (int64_t i = (blockIdx.x - ln_blocks) * (int64_t)blockDim.x + threadIdx.x; i < split_total; i += stride)
      split_plane_element<false>(splits, i);
    return;
  }
  const int64_t pos = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  if (pos >= T) return;
  float* out = xs + pos * D;
  layer_norm_row(x + pos * D, D, gamma, beta, eps, [&](int c, float v) { out[c] = v; });
}

// layer_norm_and_split_kernel with the output rounded to T and, in the blocks after the
// LayerNorm's, the rounding jobs (one flat list of `total` = rounds.elements()) in place of the splits.
template <class T>
__global__ void layer_norm_16bit_kernel(const float* __restrict__ x, const float* __restrict__ gamma,
                                        const float* __restrict__ beta, float eps, int64_t T_, int D,
                                        T* __restrict__ xs, const float* __restrict__ res_bias,
                                        float* __restrict__ res, float2* __restrict__ stats, int64_t ln_blocks,
                                        const RoundJobs rounds, int64_t total) {
  grid_dependency_wait();
  allow_dependent_launch();
  if (blockIdx.x >= ln_blocks) {
    const int64_t stride = (gridDim.x - ln_blocks) * (int64_t)blockDim.x;
    for (int64_t i = (blockIdx.x - ln_blocks) * (int64_t)blockDim.x + threadIdx.x; i < total; i += stride) {
      const bool first = i < rounds.job[0].n;  // (fields selected, not the array indexed: no local copy)
      const float* x_job = first ? rounds.job[0].x : rounds.job[1].x;
      T* y_job = static_cast<T*>(first ? rounds.job[0].y : rounds.job[1].y);
      const int64_t k = first ? i : i - rounds.job[0].n;
      y_job[k] = round16<T>(x_job[k]);
    }
    return;
  }
  const int64_t pos = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  if (pos >= T_) return;
  T* out = xs + pos * D;
  const float* row = x + pos * D;
  float* res_row = res != nullptr ? res + pos * D : nullptr;
  const float2 s = layer_norm_row(row, D, gamma, beta, eps, [&](int c, float v) {
    out[c] = round16<T>(v);
    if (res_row != nullptr) res_row[c] = row[c] + res_bias[c];  // add_bias's sum
  });
  if (stats != nullptr && threadIdx.x % 32 == 0) stats[pos] = s;
}

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

// The vectorised kernels: a lane holds V float4s of its position's row, the
// row's float4s lane, lane + 32, ..., lane + 32 (V - 1) (columns 4i to 4i + 3 for
// float4 i); those at or past D4 = D / 4 are left out.
constexpr int kMaxVec = 8;  // float4s a lane at most: D <= 32 * 4 * 8 = 1024

// f(v, i) for each of the lane's float4s v in [0, V) that the row of D4 float4s has, i its index there.
template <int V, class F>
__device__ __forceinline__ void for_own_float4s(int D4, F f) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int v = 0; v < V; ++v)
    if (lane + 32 * v < D4) f(v, lane + 32 * v);
}

__device__ __forceinline__ void load4(const float4* p, float (&a)[4]) {
  const float4 t = *p;
  a[0] = t.x, a[1] = t.y, a[2] = t.z, a[3] = t.w;
}

__device__ __forceinline__ void store4(float4* p, const float (&a)[4]) { *p = make_float4(a[0], a[1], a[2], a[3]); }

// layer_norm_forward_kernel with the row in registers: src and out (T, D4) float4s, gamma and beta (D4).
template <int V>
__global__ void __launch_bounds__(32 * kWarps)
    layer_norm_forward_vec_kernel(const float4* __restrict__ src, const float4* __restrict__ gamma,
                                  const float4* __restrict__ beta, float eps, int64_t T, int D,
                                  float4* __restrict__ out, float2* __restrict__ stats) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int lane = threadIdx.x % 32, D4 = D / 4;
  for (int64_t pos = blockIdx.x * (int64_t)kWarps + threadIdx.x / 32; pos < T; pos += (int64_t)gridDim.x * kWarps) {
    const int64_t row = pos * D4;
    float x[V][4];  // the lane's float4s of the row
    for_own_float4s<V>(D4, [&](int v, int i) { load4(src + row + i, x[v]); });
    const float2 s = row_mean_rstd<32>(D, eps, [&](auto f) {
      float sum = 0.0f;
      for_own_float4s<V>(D4, [&](int v, int) {
#pragma unroll
        for (int j = 0; j < 4; ++j) sum += f(x[v][j]);
      });
      return sum;
    });
    for_own_float4s<V>(D4, [&](int v, int i) {
      float g[4], b[4], y[4];
      load4(gamma + i, g), load4(beta + i, b);
#pragma unroll
      for (int j = 0; j < 4; ++j) y[j] = (x[v][j] - s.x) * s.y * g[j] + b[j];
      store4(out + row + i, y);
    });
    if (lane == 0) stats[pos] = s;
  }
}

// layer_norm_backward_kernel with the rows in registers, each read once: src, d_norm, d_res,
// d_src and d_norm_xhat (T, D4) float4s, gamma (D4).
template <int V>
__global__ void __launch_bounds__(32 * kWarps)
    layer_norm_backward_vec_kernel(const float4* __restrict__ src, const float2* __restrict__ stats,
                                   const float4* __restrict__ gamma, const float4* __restrict__ d_norm,
                                   const float4* d_res, int64_t T, int D, float4* d_src,
                                   float4* __restrict__ d_norm_xhat) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int D4 = D / 4;
  for (int64_t pos = blockIdx.x * (int64_t)kWarps + threadIdx.x / 32; pos < T; pos += (int64_t)gridDim.x * kWarps) {
    const int64_t row = pos * D4;
    float xhat[V][4], dn[V][4], res[V][4];  // the lane's float4s of the rows: src (then xhat), d_norm, d_res
    // d_src may be d_res: each lane reads its float4s of d_res here, before writing them below.
    for_own_float4s<V>(D4, [&](int v, int i) {
      load4(src + row + i, xhat[v]), load4(d_norm + row + i, dn[v]);
      if (d_src != nullptr) load4(d_res + row + i, res[v]);
    });
    const float2 s = stats[pos];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for_own_float4s<V>(D4, [&](int v, int i) {
      float gamma4[4];
      load4(gamma + i, gamma4);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        xhat[v][j] = (xhat[v][j] - s.x) * s.y;
        const float g = dn[v][j] * gamma4[j];
        g_sum += g, gx_sum += g * xhat[v][j];
      }
    });
    const float g_mean = warp_sum(g_sum) / D, gx_mean = warp_sum(gx_sum) / D;
    for_own_float4s<V>(D4, [&](int v, int i) {
      if (d_src != nullptr) {
        float gamma4[4], ds[4];
        load4(gamma + i, gamma4);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float g = dn[v][j] * gamma4[j];
          ds[j] = res[v][j] + s.y * (g - g_mean - xhat[v][j] * gx_mean);
        }
        store4(d_src + row + i, ds);
      }
      if (d_norm_xhat != nullptr) {
        float dnx[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) dnx[j] = dn[v][j] * xhat[v][j];
        store4(d_norm_xhat + row + i, dnx);
      }
    });
  }
}

// The vectorised kernels serve a row of D floats when D is a multiple of 4 up to
// 32 * 4 * kMaxVec and every pointer given (null ones aside) is 16-byte aligned.
bool vectorisable(int D, std::initializer_list<const void*> ptrs) {
  if (D % 4 != 0 || D > 32 * 4 * kMaxVec) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// V for a row of D floats: ceil(D / 128) float4s a lane, rounded up to 1, 2, 4 or 8.
int float4s_per_lane(int D) {
  int v = 1;
  while (32 * 4 * v < D) v *= 2;
  return v;
}

// launch(std::integral_constant<int, V>()) for the V = width (1, 2, 4 or 8) of
// float4s_per_lane: the vectorised kernels' template argument.
template <class Launch>
cudaError_t with_float4s_per_lane(int width, Launch launch) {
  return with_int<1, 2, 4, 8>(width, launch, cudaErrorInvalidValue);
}

// Blocks for `work` items of `per_block` each, at most what keeps every
// multiprocessor busy several times over (the kernels loop).
unsigned grid_for(int64_t work, int per_block, const DeviceCaps& dev) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(blocks, 32 * (int64_t)std::max(dev.sms, 1)));
}

// layer_norm_forward without statistics: one launch of layer_norm_and_split_kernel.
cudaError_t layer_norm_and_split(const float* src, const float* gamma, const float* beta, float eps, int64_t T, int D,
                                 float* out, const PlaneJobs& splits, const DeviceCaps& dev, cudaStream_t stream) {
  const int64_t ln_blocks = (T + kWarps - 1) / kWarps;
  // As many split blocks as one pass's 4 D^2 elements take at 256 a block, at most 4 an SM.
  const int64_t split_blocks = splits.count ? std::min<int64_t>(4 * (int64_t)D * D / 256 + 1, 4 * dev.sms) : 0;
  if (ln_blocks + split_blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  for (int j = 0; j < splits.count; ++j)
    if (splits.job[j].transpose) return cudaErrorInvalidValue;
  return launch_kernel<layer_norm_and_split_kernel>((unsigned)(ln_blocks + split_blocks), 32 * kWarps, 0, stream, dev,
                                                    src, gamma, beta, eps, T, D, out, ln_blocks, splits,
                                                    splits.elements());
}

}  // namespace

int layer_norm_forward_width(int D, const float* src, const float* gamma, const float* beta, const float* out) {
  return vectorisable(D, {src, gamma, beta, out}) ? float4s_per_lane(D) : 0;
}

int layer_norm_backward_width(int D, const float* src, const float* gamma, const float* d_norm, const float* d_res,
                              const float* d_src, const float* d_norm_xhat) {
  // d_res is read only with d_src.
  return vectorisable(D, {src, gamma, d_norm, d_src != nullptr ? d_res : nullptr, d_src, d_norm_xhat})
             ? float4s_per_lane(D)
             : 0;
}

cudaError_t layer_norm_forward(const float* src, const float* gamma, const float* beta, float eps, int64_t T, int D,
                               float* out, float* stats, const DeviceCaps& dev, cudaStream_t stream,
                               const PlaneJobs& splits) {
  if (stats == nullptr) return layer_norm_and_split(src, gamma, beta, eps, T, D, out, splits, dev, stream);
  if (cudaError_t e = split_weight_planes(splits, dev, stream); e != cudaSuccess) return e;
  if (T == 0) return cudaSuccess;
  const unsigned grid = grid_for(T, kWarps, dev);
  float2* stats2 = reinterpret_cast<float2*>(stats);
  const int width = layer_norm_forward_width(D, src, gamma, beta, out);
  if (width == 0)
    return launch_kernel<layer_norm_forward_kernel>(grid, 32 * kWarps, 0, stream, dev, src, gamma, beta, eps, T, D,
                                                    out, stats2);
  const auto launch = [&](auto per_lane) {
    return launch_kernel<layer_norm_forward_vec_kernel<decltype(per_lane)::value>>(
        grid, 32 * kWarps, 0, stream, dev, reinterpret_cast<const float4*>(src), reinterpret_cast<const float4*>(gamma),
        reinterpret_cast<const float4*>(beta), eps, T, D, reinterpret_cast<float4*>(out), stats2);
  };
  return with_float4s_per_lane(width, launch);
}

cudaError_t layer_norm_forward_16bit(const float* src, const float* gamma, const float* beta, float eps, int64_t T,
                                     int D, void* out, Products type, const RoundJobs& rounds, const float* res_bias,
                                     float* res, float* stats, const DeviceCaps& dev, cudaStream_t stream) {
  if (res != nullptr && res_bias == nullptr) return cudaErrorInvalidValue;
  if (type != Products::kBf16 && type != Products::kFp16) return cudaErrorInvalidValue;
  const int64_t ln_blocks = (T + kWarps - 1) / kWarps, total = rounds.elements();
  // As many rounding blocks as the jobs take at 256 elements a block, at most 4 an SM.
  const int64_t round_blocks = total > 0 ? std::min<int64_t>((total + 255) / 256, 4 * (int64_t)dev.sms) : 0;
  if (ln_blocks + round_blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  if (ln_blocks + round_blocks == 0) return cudaSuccess;
  const auto launch = [&](auto* typed_out) {
    return launch_kernel<layer_norm_16bit_kernel<std::remove_pointer_t<decltype(typed_out)>>>(
        (unsigned)(ln_blocks + round_blocks), 32 * kWarps, 0, stream, dev, src, gamma, beta, eps, T, D, typed_out,
        res_bias, res, reinterpret_cast<float2*>(stats), ln_blocks, rounds, total);
  };
  return type == Products::kBf16 ? launch(static_cast<__nv_bfloat16*>(out)) : launch(static_cast<__half*>(out));
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
  const unsigned grid = grid_for(T, kWarps, dev);
  const float2* stats2 = reinterpret_cast<const float2*>(stats);
  const int width = layer_norm_backward_width(D, src, gamma, d_norm, d_res, d_src, d_norm_xhat);
  if (width == 0)
    return launch_kernel<layer_norm_backward_kernel>(grid, 32 * kWarps, 0, stream, dev, src, stats2, gamma, d_norm,
                                                     d_res, T, D, d_src, d_norm_xhat);
  const auto launch = [&](auto per_lane) {
    return launch_kernel<layer_norm_backward_vec_kernel<decltype(per_lane)::value>>(
        grid, 32 * kWarps, 0, stream, dev, reinterpret_cast<const float4*>(src), stats2,
        reinterpret_cast<const float4*>(gamma), reinterpret_cast<const float4*>(d_norm),
        reinterpret_cast<const float4*>(d_res), T, D, reinterpret_cast<float4*>(d_src),
        reinterpret_cast<float4*>(d_norm_xhat));
  };
  return with_float4s_per_lane(width, launch);
}

}  // namespace fastaxial::cuda
