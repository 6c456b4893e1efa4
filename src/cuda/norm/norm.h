// The per-position kernels of the staged passes (norm.cu): LayerNorm, its
// statistics kept for the training backward or not, LayerNorm's backward
// with the residual's gradient added, and the bias-plus-residual start of an
// output product.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"  // DeviceCaps
#include "../gemm/weight_planes.h"

namespace fastaxial::cuda {

// For each of the T positions: out (T, D) = LayerNorm(src (T, D)) with gamma and beta, and where
// stats is not null (the training forward: its backward reads them) stats (T, 2) = (mean,
// 1 / sqrt(var + eps)); the weights of `splits` split into planes (weight_planes.h) first.
// Two forms, one per forward, each giving that forward's results bit for bit (the vectorised
// kernel sums a row in another order than the scalar ones, norm.cu):
// - stats null (the inference forward): one launch, a warp per position, 4-byte accesses, and the
//   splits (straight ones only, else cudaErrorInvalidValue) in blocks after the LayerNorm's;
//   cudaErrorInvalidConfiguration, and nothing launched, where that grid passes 2^31 - 1 blocks.
// - stats given: the splits' launch (split_weight_planes) where there are any, then the LayerNorm,
//   vectorised where layer_norm_forward_width allows, its warps looping over the positions.
cudaError_t layer_norm_forward(const float* src, const float* gamma, const float* beta, float eps, int64_t T, int D,
                               float* out, float* stats, const DeviceCaps& dev, cudaStream_t stream,
                               const PlaneJobs& splits = {});

// A pass's fp32 weights to round for its 16-bit products, in layer_norm_forward_16bit's launch:
// job[j].y (n) = job[j].x (n) rounded, for j < count.
struct RoundJobs {
  struct Job {
    const float* x;
    void* y;
    int64_t n;
  } job[2];
  int count = 0;
  int64_t elements() const { return count < 1 ? 0 : count < 2 ? job[0].n : job[0].n + job[1].n; }
};

// The 16-bit staged pass's LayerNorm: out (T, D) = LayerNorm(src (T, D)) with gamma and beta,
// rounded to `type` (bf16 or fp16: nearest, ties to even), the bits of layer_norm_forward without
// statistics followed by round_to_16bit (gemm/blas.h); where res is not null, res (T, D) = src +
// res_bias (D) on every row, add_bias's bits (the start of the pass's output product; res must not
// overlap src or out); where stats is not null, stats (T, 2) = each row's (mean, rstd), as
// layer_norm_forward writes them (the 16-bit training forward's: its backward reads them); and the
// jobs of `rounds` as round_to_16bit gives them; in one launch: a warp per
// position, then blocks that round the jobs. cudaErrorInvalidValue for another type or res
// without res_bias; cudaErrorInvalidConfiguration, and nothing launched, where the grid passes
// 2^31 - 1 blocks.
cudaError_t layer_norm_forward_16bit(const float* src, const float* gamma, const float* beta, float eps, int64_t T,
                                     int D, void* out, Products type, const RoundJobs& rounds, const float* res_bias,
                                     float* res, float* stats, const DeviceCaps& dev, cudaStream_t stream);

// The jobs of `rounds` alone: layer_norm_forward_16bit's launch without positions (the 16-bit
// backward's weights).
inline cudaError_t round_jobs_to_16bit(const RoundJobs& rounds, Products type, const DeviceCaps& dev,
                                       cudaStream_t stream) {
  return layer_norm_forward_16bit(nullptr, nullptr, nullptr, 0.0f, 0, 0, nullptr, type, rounds, nullptr, nullptr,
                                  nullptr, dev, stream);
}

// out (T, D) = x (T, D) + bias (D) on every row: the residual and bias that an output
// product (beta = 1) then adds to.
cudaError_t add_bias(const float* x, const float* bias, int64_t T, int D, float* out, const DeviceCaps& dev,
                     cudaStream_t stream);

// LayerNorm's backward with the residual: with xhat = (src - mean) * rstd and g = d_norm * gamma,
//   d_src = d_res + rstd * (g - mean(g) - xhat * mean(g * xhat))     (T, D)
// and, where d_norm_xhat is not null, d_norm_xhat = d_norm * xhat (T, D), whose column sums are
// gamma's gradient (those of d_norm are beta's). d_src may be d_res, or null (d_norm_xhat alone).
cudaError_t layer_norm_backward(const float* src, const float* stats, const float* gamma, const float* d_norm,
                                const float* d_res, int64_t T, int D, float* d_src, float* d_norm_xhat,
                                const DeviceCaps& dev, cudaStream_t stream);

// Float4s a lane holds where the vectorised kernels (norm.cu) run these arguments (the forward's:
// with stats): 1, 2, 4 or 8;
// 0 where the scalar ones do (D not a multiple of 4 or above 1024, or a pointer the kernel reads
// or writes not 16-byte aligned; null pointers, and d_res without d_src, are not read).
int layer_norm_forward_width(int D, const float* src, const float* gamma, const float* beta, const float* out);
int layer_norm_backward_width(int D, const float* src, const float* gamma, const float* d_norm, const float* d_res,
                              const float* d_src, const float* d_norm_xhat);

}  // namespace fastaxial::cuda
