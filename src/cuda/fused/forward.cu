// One attention pass with a thread block per whole sequence, every product on
// the tensor cores (3xTF32 split for fp32 accuracy: detail/tf32x3.cuh): mma.sync, or
// at dim 64 with two heads or more and L <= 64 the projections on wgmma
// (sm_90a). One pass: the attention along one axis (rows, then columns).
//
// For sequence n of the axis, x is its (L, D) positions (strided in the grid):
//   xs  = LayerNorm(x)                  (LP, D) split pairs, LP = 16*MT >= L
//   q, k, v = xs @ Wqkv^T               (LP, D) each; v stored transposed
//   o_h = softmax(q_h k_h^T * scale) v_h  per head, into xs's space (split pairs)
//   dst = x + o @ Wout^T + bout
// Why this shape: axial sequences are short (tens to a hundred positions), so
// a whole sequence's q, k and v fit one block's shared memory. Keys are then
// projected once per sequence, and each attention row is complete in one
// warp's registers: an exact softmax, no online rescaling, no block barrier
// inside the attention. Four barriers per sequence in all.
//
// A block runs one sequence per SM at a time with 8 warps (12 with wgmma), so
// its time is the latency of that chain: the instructions per warp and the
// waits between them are what count (docs/perf-notes.md). Hence:
// - xs and o, which every warp reads whole, are split once where they are
//   written: into split pairs whose fragments come in 16-byte loads, or
//   for wgmma into hi and lo planes in its swizzled layout (block.cuh);
// - q, k and v, read by few warps, stay fp32, in layouts whose fragments are
//   8-byte loads (k permuted inside each 8, detail/tf32x3.cuh); q carries the softmax
//   scale times log2(e), so scores come out in base 2;
// - weights are read from global memory (L2) as fragments and split in
//   registers: for mma.sync a group of four 8-deep steps ahead of the
//   products, for wgmma a warpgroup's 64-row tile at a time; the first are
//   issued before the barrier in front of the product, and each block first
//   asks DRAM for a slice of them, so that they are all in L2 by then;
// - products go in runs: two 8-deep steps into a fresh accumulator, then
//   added to the total, which keeps fp32 accuracy (detail/tf32x3.cuh);
// - the norm weights and output bias sit in shared memory; a block's next
//   sequence arrives during the current one's output product.
//
// Work split (mma.sync, 8 warps; fused/steps_mma.cuh): the projections go by
// items, (16 MI-row, 8 NI-column) tiles of the output, register-blocked per
// warp. With wgmma (three warpgroups; fused/steps_wgmma.cuh) the weights are
// the A operand: each warpgroup computes units, 64-row tiles of
// [q | k | v]^T for a range of positions, and two of them the output
// product. Either way the attention goes by (head, 16-query tile) items, on
// mma.sync: scores (16, LP) live in registers, P is fed to the P @ V product
// straight from the score registers (the key order inside each group of 8
// keys is permuted to match the A-fragment layout, and V is read in the same
// order), and o_h goes to shared memory.
//
// Padded rows (L <= i < LP) are zero in xs, so their q, k, v are zero;
// padded keys are masked out of the softmax; padded queries are never stored.
//
// This file holds the kernel, one sequence of steps, and its launch;
// fused/block.cuh what every step reads and the shared tile helpers;
// fused/steps_mma.cuh and fused/steps_wgmma.cuh the two variants of the steps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../common/plan.h"
#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/kernel_args.h"
#include "../detail/launch.cuh"
#include "../kernels.h"
#include "block.cuh"
#include "steps_mma.cuh"
#include "steps_wgmma.cuh"

namespace fastaxial::cuda {
namespace {

using namespace fused;

template <int MT, int HD, bool kWg>
using FusedSteps = std::conditional_t<kWg, WgmmaSteps<MT, HD>, MmaSteps<MT, HD>>;

template <int MT, int HD, bool kWg>
__global__ void __launch_bounds__(32 * kWarps<kWg>, 1) fused_forward_kernel(const FusedArgs a) {
  constexpr int NT = 32 * kWarps<kWg>;
  // The warp's first output weights and residual rows: in flight during the
  // attention where registers allow (the score tile grows with HD * MT),
  // else loaded after it.
  constexpr bool kEarlyOut = HD * MT <= 128;
  const FusedBlock<MT, kWg> b(a);

  prefetch_weights_l2<NT>(a);  // a hint, safe before the wait (detail/launch.cuh)
  grid_dependency_wait();
  allow_dependent_launch();
  if (blockIdx.x < a.view.num_seq) {
    load_params<NT>(b.params, a);
    load_tile<NT>(b.q, b.lay.ldq, a, seq_offset(a.view, blockIdx.x), b.L);
  }
  for (int64_t n = blockIdx.x; n < a.view.num_seq; n += gridDim.x) {
    const int64_t base = seq_offset(a.view, n);
    FusedSteps<MT, HD, kWg> step;  // registers carried from step to step
    step.load_qkv_weights(b);      // in flight during the LayerNorm
    copy_async_wait<0>();
    __syncthreads();
    step.template layer_norm<NT>(b);
    __syncthreads();
    step.project_qkv(b);
    if (kEarlyOut) step.load_out(b, base);
    __syncthreads();
    step.attend(b);
    if (!kEarlyOut) step.load_out(b, base);
    __syncthreads();
    // q is free from here on: the block's next sequence arrives there during
    // this one's output product.
    if (n + gridDim.x < a.view.num_seq) load_tile<NT>(b.q, b.lay.ldq, a, seq_offset(a.view, n + gridDim.x), b.L);
    step.project_out(b, base);
    // No barrier here: the next sequence's LayerNorm writes xs after the
    // barrier that follows its tile's arrival, which every warp reaches after
    // its output product.
  }
}

template <int MT, int HD, bool kWg>
cudaError_t launch(const FusedArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  constexpr auto kernel = fused_forward_kernel<MT, HD, kWg>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const size_t smem = fused_smem_bytes(a.view.len, a.D) + (kWg ? kFusedWgmmaSmemExtra : 0);  // FusedLayout of 16 MT rows
  if (smem > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  // As many blocks as run at once, each looping over sequences: a block's
  // next sequence arrives during its current one's output product, and the
  // start (norm parameters, weight prefetch) is paid once per block rather
  // than once per sequence.
  int per_sm = 0;
  constexpr int kThreads = 32 * kWarps<kWg>;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
      e != cudaSuccess)
    return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;  // the plan checked the shared memory
  const int64_t grid = std::min<int64_t>(a.view.num_seq, (int64_t)dev.sms * per_sm);
  return launch_kernel<kernel>((unsigned)grid, kThreads, smem, stream, dev, a);
}

template <int HD>
cudaError_t launch_tiles(const FusedArgs& a, int mt, bool wgmma, const DeviceCaps& dev, cudaStream_t stream) {
  // wgmma below head_dim 64 only: one head of 64 keeps more attention state
  // than the 168 registers a thread of three warpgroups has.
  if constexpr (HD < 64) {
    if (wgmma)
      return with_int<1, 2, 3, 4>(
          mt, [&](auto t) { return launch<decltype(t)::value, HD, true>(a, dev, stream); }, cudaErrorInvalidValue);
  }
  if (wgmma) return cudaErrorInvalidValue;
  return with_int<1, 2, 3, 4, 5, 6, 8>(
      mt, [&](auto t) { return launch<decltype(t)::value, HD, false>(a, dev, stream); }, cudaErrorInvalidValue);
}

}  // namespace

Status launch_fused(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                    bool wgmma, const DeviceCaps& dev, cudaStream_t stream) {
#if !defined(FASTAXIAL_WGMMA)
  if (wgmma) return {StatusCode::kUnsupported, "the fused kernel's wgmma variant needs a build with sm_90a"};
#endif
  FusedArgs a;
  a.view = view;
  a.D = (int)p.dim;
  a.heads = (int)p.heads;
  a.eps = p.eps;
  const int hd = (int)(p.dim / p.heads);
  a.q_scale = kLog2e / sqrtf((float)hd);
  a.w = w;
  a.src = src;
  a.dst = dst;
  const int mt = fused_tile_count(view.len);
  const cudaError_t e = with_int<8, 16, 32, 64>(
      hd, [&](auto h) { return launch_tiles<decltype(h)::value>(a, mt, wgmma, dev, stream); }, cudaErrorInvalidValue);
  if (e != cudaSuccess) return cuda_error(e, "fused_forward_kernel launch");
  return Status::Ok();
}

}  // namespace fastaxial::cuda
