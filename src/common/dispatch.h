// Which CUDA kernels serve one attention pass: the pass's shape and the
// device's multiprocessor count decide. The CUDA side then checks what the
// device and the pointers allow (shared memory, alignment) and falls back to
// the generic kernel where they do not.
//   kFused:   axis_tensor_core.cu, a block per whole sequence (L <= 128, and
//             q, k, v of the sequence fit shared memory): for dim <= 64, and
//             for wider dims on small passes whose sequences fill the device.
//   kStaged:  axis_staged.cu, LayerNorm, the QKV product, attention and the
//             output product as separate tensor-core kernels with their
//             intermediates in the workspace: long sequences, and dims >= 72
//             wherever the pass is large or the fused kernel's blocks would
//             leave the device a quarter idle.
//   kGeneric: axis_generic.cu, FFMA, any shape.
// cuda_workspace_bytes has no device, so it reserves the staged path's
// scratch wherever some device could pick it (staged_possible).
// FASTAXIAL_CUDA_PATH=fused|staged|generic in the environment (read once per
// process) overrides the choice where the forced kernel supports the shape:
// for tests and benchmarks of one kernel family.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fastaxial/fastaxial.h"

namespace fastaxial {

enum class AxisPath { kFused, kStaged, kGeneric };

// The fused kernel's 16-position tiles for a sequence of length L (0: L is
// too long for it), and its shared memory for that L and dim D.
int fused_tile_count(int64_t len);
size_t fused_smem_bytes(int64_t len, int64_t dim);

// Shared memory of the staged attention kernel: one head's keys and values
// of a whole sequence, split into (hi, lo) TF32 pairs.
size_t staged_attention_smem_bytes(int64_t len, int64_t head_dim);

// The pass has num_seq sequences of len positions; the device sms multiprocessors.
AxisPath axis_path(int64_t len, int64_t dim, int64_t heads, int64_t num_seq, int64_t sms);

// True when axis_path can pick kStaged for this sequence length on some device.
bool staged_possible(int64_t len, int64_t dim, int64_t heads);

// Where the staged path's scratch lies in forward_cuda's workspace, in
// floats from its start, after the row pass's output (T D floats, T the
// positions): LayerNorm output / attention output (T D) and q|k|v (3 T D),
// then each pass's weights as hi and lo planes (8 D^2),
// for the passes that may take the staged path (staged_possible); -1 where
// nothing is reserved. cuda_workspace_bytes and forward_cuda both read it.
struct StagedLayout {
  int64_t scratch = -1, row_weights = -1, col_weights = -1;
  int64_t floats = 0;  // the whole workspace
};
StagedLayout staged_layout(const AxialParams& p);

}  // namespace fastaxial
