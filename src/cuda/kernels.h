// The CUDA kernels of one attention pass, as entry.cu launches them. The plan
// (common/plan.cpp, host) has already picked each pass's family and checked
// that the device, the shared memory and the pointers allow it: these
// launchers trust it and only launch.
//
// Each launch computes, for every sequence of the axis (see common/axis.h):
//   dst = src + Attention(LayerNorm(src)) @ Wout^T + bout
// - fused/forward.cu: one thread block per whole sequence (L <= 128), every
//   product on the tensor cores with the 3xTF32 split; the projections on
//   mma.sync, or on wgmma (sm_90a) where the plan says so.
// - staged/pass.cu: LayerNorm (norm/norm.cu), the QKV product
//   (gemm/gemm.cu), attention (whole-sequence: attention/whole_sequence.cu, or flash:
//   attention/flash_attention.cu) and the output product as separate
//   tensor-core kernels over all positions, intermediates in the workspace;
//   long sequences, wide dims and head dims off the fused kernel's list, on
//   an sm_90a build and a compute-capability 9.0 device.
// - generic/forward.cu: any shape; tiles of queries, online softmax over key
//   tiles, FFMA products.
// Every launch is a programmatic dependent of the one before it where the
// kernel's code waits for it (detail/launch.cuh).
#pragma once

#include <cuda_runtime.h>

#include "../common/axis.h"
#include "../common/plan.h"
#include "detail/host.h"
#include "fastaxial/fastaxial.h"
#include "gemm/weight_planes.h"

namespace fastaxial::cuda {

// The current device's capabilities, read once per device (entry.cu): the
// attribute queries cost microseconds a call.
Status current_device(DeviceCaps* caps);

// The fused kernel. wgmma: the projections on wgmma (the plan's choice);
// kUnsupported where this build has no sm_90a code.
Status launch_fused(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                    bool wgmma, const DeviceCaps& dev, cudaStream_t stream);

// A staged pass's weights as (hi, lo) planes in the workspace: Wqkv (3D, D)
// hi then lo, Wout (D, D) hi then lo.
struct StagedWeights {
  float* qkv = nullptr;
  float* out = nullptr;
};

// Adds a staged pass's Wqkv (3D, D) and Wout (D, D) to jobs, split straight into `planes`
// (staged/pass.cu). A staged pass splits the weights it is given in its first launch, beside its
// LayerNorm: the first staged pass of a forward splits those of every staged pass.
void add_weight_splits(PlaneJobs* jobs, const AxisWeights& w, const StagedWeights& planes, int D);

// The staged path (staged/pass.h). `scratch` holds 4 T D floats (T = the pass's positions);
// `split` holds the pass's weights as planes, written by `split_now` in this
// launch or by an earlier pass's.
// flash: the attention step on the flash kernel (attention/flash_attention.h),
// the plan's choice; else on the staged path's whole-sequence kernel.
// flash_partials (flash_partials_bytes): the plan's split-KV region, or null
// where no pass splits its keys.
Status launch_staged(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                     float* scratch, const StagedWeights& split, const PlaneJobs& split_now, bool flash,
                     float* flash_partials, size_t flash_partials_bytes, const DeviceCaps& dev, cudaStream_t stream);

// The generic kernel.
Status launch_generic(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                      const DeviceCaps& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
