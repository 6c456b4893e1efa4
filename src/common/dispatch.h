// Which CUDA kernels serve one attention pass. Shape alone decides, so that
// cuda_workspace_bytes can size the scratch without a device; the CUDA side
// then checks what the device and the pointers allow (shared memory,
// alignment) and falls back to the generic kernel where they do not.
//   kFused:   axis_tensor_core.cu, a block per whole sequence, wherever it
//             holds one (L <= 128, and q, k, v of the sequence fit shared
//             memory): there it is the faster one.
//   kStaged:  axis_staged.cu, LayerNorm, the QKV product, attention and the
//             output product as separate tensor-core kernels with their
//             intermediates in the workspace: long sequences and wide dims
//             at longer L.
//   kGeneric: axis_generic.cu, FFMA, any shape.
// FASTAXIAL_CUDA_PATH=fused|staged|generic in the environment (read once per
// process) overrides the choice where the forced kernel supports the shape:
// for tests and benchmarks of one kernel family.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastaxial {

enum class AxisPath { kFused, kStaged, kGeneric };

// The fused kernel's 16-position tiles for a sequence of length L (0: L is
// too long for it), and its shared memory for that L and dim D.
int fused_tile_count(int64_t len);
size_t fused_smem_bytes(int64_t len, int64_t dim);

// Shared memory of the staged attention kernel: one head's keys and values
// of a whole sequence, split into (hi, lo) TF32 pairs.
size_t staged_attention_smem_bytes(int64_t len, int64_t head_dim);

AxisPath axis_path(int64_t len, int64_t dim, int64_t heads);

// Floats of workspace the staged path needs on top of the row pass's output:
// LayerNorm output / attention output (hi and lo planes, 2ND), q|k|v (3ND) and
// the pass's weights as hi and lo planes (8D^2).
int64_t staged_workspace_floats(int64_t tokens, int64_t dim);

}  // namespace fastaxial
