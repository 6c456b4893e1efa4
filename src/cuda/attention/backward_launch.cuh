// The attention backward's launches, as its files share them (attention_backward.cu describes
// the kernels): attention_backward.cu sizes a call's launches and launches the small kernels
// (delta, combine, single key); each gradient kernel's file launches its own kernels through
// a function declared here, so that a kernel and its launch share one translation unit.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../common/dropout.h"
#include "../../common/plan.h"  // DeviceCaps
#include "../detail/host.h"
#include "../detail/kernel_args.h"
#include "../detail/launch.cuh"
#include "../detail/mma16.cuh"
#include "../detail/tf32x3.cuh"
#include "attention_backward.h"

namespace fastaxial::cuda::attention_backward_detail {

// A split launch (AttentionBackwardArgs::partials): each block of kernels 2 and 3 streams range
// `split` of `splits` contiguous ranges of its tiles and stores its sums into partials, (splits,
// items L, 2 hd) floats from kernel 2 (dk then dv a row), (splits, items L, hd) from kernel 3,
// which combine_kernel adds into dqkv. splits = 1: no split, the sums go to dqkv.
struct Split {
  float* partials;
  int splits;
};

// The sizes every launch of one call shares, and the kernels' arguments (the dropout fields of
// AttentionBackwardArgs go as a DropoutPass of their own, a kernel parameter of its own).
struct BackwardLaunch {
  int64_t items;  // num_seq * heads
  int hd, hdp;    // head dim, padded head dim (flash_padded_head_dim)
  bool vec;       // 16-byte copies and stores
  bool dropout;   // dpass applies: threshold != 0 in a build that draws the mask
  float scale;    // 1 / sqrt(hd)
  Products products = Products::kFp32;  // the tensor-core kernels' element traits (with_elem)
  AttentionBackwardKernelArgs k;
  DropoutPass dpass;
};

// A tensor-core gradient kernel's grid: blocks of `warps` warps of 16 rows (the launch takes
// fewer than the most for short sequences and small grids), `tiles` of them a (sequence, head),
// each split sp.splits ways.
struct TcBlocks {
  int warps, tiles;
  Split sp;
};

// kernel on `blocks` blocks of `threads`, with `smem` bytes of dynamic shared memory (opted in
// past the default 48 KB).
template <auto kernel, typename... Args>
cudaError_t launch_grid(int64_t blocks, int threads, size_t smem, const DeviceCaps& dev, cudaStream_t stream,
                        Args... args) {
  if (smem > 48 * 1024)
    if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(threads), smem, stream, dev, args...);
}

// f(std::bool_constant<vec>(), std::bool_constant<dropout>()) as with_bools (detail/host.h), for
// the kernels' kVec and kDropout; dropout counts only where the build draws the mask, so that a
// build without Random123 instantiates no dropout kernel.
template <class F>
cudaError_t with_kernel_flags(bool vec, bool dropout, F&& f) {
  return with_bools(
      [&](auto v, auto d) -> cudaError_t {
        if constexpr (decltype(d)::value && !kDropoutAvailable)
          return cudaErrorInvalidValue;  // never reached: d is false in such a build
        else
          return f(v, d);
      },
      vec, kDropoutAvailable && dropout);
}

// f(std::integral_constant<int, s.hdp>(), vec, dropout) with vec and dropout as
// with_kernel_flags gives them: a gradient kernel's template arguments for the launch s.
template <class F>
cudaError_t with_kernel_params(const BackwardLaunch& s, F&& f) {
  return with_padded_head_dim(
      s.hdp,
      [&](auto hdp) {
        return with_kernel_flags(s.vec, s.dropout, [&](auto vec, auto dropout) { return f(hdp, vec, dropout); });
      },
      cudaErrorInvalidValue);
}

// f(Elem()) for the element traits of `products`: Tf32x3, Bf16Mma or Fp16Mma.
template <class F>
cudaError_t with_elem(Products products, F&& f) {
  switch (products) {
    case Products::kBf16:
      return f(Bf16Mma());
    case Products::kFp16:
      return f(Fp16Mma());
    default:
      return f(Tf32x3());
  }
}

// The tile counts of the launch's two gradient kernels; false where a grid would pass
// gridDim.x's 2^31 - 1.
bool tile_counts(int64_t num_seq, int64_t heads, int64_t L, int key_rows, int query_rows, int* key_tiles,
                 int* query_tiles);

// Kernel 1, delta (attention_backward.cu).
cudaError_t launch_delta(const AttentionBackwardArgs& a, const BackwardLaunch& s, const DeviceCaps& dev,
                         cudaStream_t stream);

// Kernel 2 on the tensor cores, dk and dv (backward_dkdv.cu); k.ds: where it also stores dS^T.
cudaError_t launch_key_grads_tc(const BackwardLaunch& s, const AttentionBackwardKernelArgs& k, const TcBlocks& b,
                                const DeviceCaps& dev, cudaStream_t stream);

// Kernel 3 on the tensor cores, dq (backward_dq.cu): from recomputed S and dP, or (ds) a product
// from kernel 2's dS^T at k.ds.
cudaError_t launch_query_grads_tc(const BackwardLaunch& s, const TcBlocks& b, const DeviceCaps& dev,
                                  cudaStream_t stream);
cudaError_t launch_query_grads_ds(const BackwardLaunch& s, const AttentionBackwardKernelArgs& k, const TcBlocks& b,
                                  const DeviceCaps& dev, cudaStream_t stream);

// The shared memory of the bigger of the FFMA kernels at padded head dim hdp (backward_ffma.cu).
size_t ffma_smem_bytes(int hdp);

// Delta, dk and dv, then dq on the FFMA kernels (backward_ffma.cu).
cudaError_t launch_ffma(const AttentionBackwardArgs& a, const BackwardLaunch& s, const DeviceCaps& dev,
                        cudaStream_t stream);

}  // namespace fastaxial::cuda::attention_backward_detail
