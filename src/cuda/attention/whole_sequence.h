// The staged pass's whole-sequence attention kernel (whole_sequence.cu): per (sequence, head), all
// of its keys and values in shared memory, for passes of many sequences that fit there (the plan
// decides: common/plan.h, StagedAttentionProblem).
#pragma once

#include <cuda_runtime.h>

#include "../../common/axis.h"
#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

// o (T, D) from qkv (T, 3D), pos the pass's view as rows (row_indices); head dims 8, 16, 32 and
// 64, else cudaErrorInvalidValue.
cudaError_t staged_attention(const AxisView& pos, const float* qkv, float* o, int D, int heads, const DeviceCaps& dev,
                             cudaStream_t stream);

}  // namespace fastaxial::cuda
