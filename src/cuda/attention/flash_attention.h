// The staged path's attention step as a flash-style kernel (flash_attention.cu):
// for every sequence n and head h of a pass,
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h
// from the (T, 3D) qkv rows that the QKV product wrote, keys and values
// streamed through shared memory in tiles, so any sequence length stays on
// the tensor cores (3xTF32 mma.sync, fp32 accuracy, any sm_80+ GPU; or 16-bit
// products with fp32 accumulation, FlashArgs::products).
// With attention dropout (FlashArgs::dropout), the probabilities are masked
// and scaled after the softmax's row sums: o_h = (P o M / (1 - p)) v_h with
// P = softmax(...), M the keep mask of common/dropout.h; lse stays P's.
// With a partials buffer (FlashArgs::partials: both forwards' plans give one), a
// pass of few (sequence, head, query tile) blocks splits each one's keys
// over S blocks and merges their partial softmaxes in a second kernel
// (split-KV; common/smem_layout.h's flash_kv_splits gives S).
// Which kernel runs a pass (short sequences, wgmma for some head dims, split
// or not) is common/plan.h's flash_variant, which the plan records too.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../common/axis.h"
#include "../../common/dropout.h"
#include "../../common/plan.h"  // DeviceCaps, FlashVariant
#include "../detail/kernel_args.h"

namespace fastaxial::cuda {

struct FlashArgs {
  // Sequence n, position l -> row of qkv and o: offsets in rows, not floats
  // (an axis view's strides divided by D, as the staged path's row_indices gives).
  AxisView pos;
  const float* qkv = nullptr;  // (T, 3D): row r is [q | k | v], head h at columns h*hd .. h*hd + hd - 1 of each part
  // On 16-bit products only: q, k and v stored in the products' type, laid out as qkv (which is then
  // not read), 16-byte aligned; the pass runs on the kQkv16 kernel, which must serve it
  // (flash_qkv16_chosen), else cudaErrorInvalidValue.
  const void* qkv16 = nullptr;
  float* o = nullptr;          // (T, D): head h written at columns h*hd .. h*hd + hd - 1 of each valid row
  // On 16-bit products only (else cudaErrorInvalidValue): where not null, o is written here too,
  // rounded to the products' type (nearest, ties to even: round_to_16bit's bits), (T, D) 16-bit
  // values laid out as o; `o` may then be null (the inference pass keeps the rounded one alone).
  void* o16 = nullptr;
  // (2, num_seq, heads, L) or null: row r = (n * heads + h) * L + l's
  //   lse2 = log2(sum_k 2^(s_k)),  s_k = q_l . k_k log2(e) / sqrt(hd)   (log2 units, of the scaled scores),
  // computed as max_k s_k + log2(sum_k 2^(s_k - that max)), as two floats hi + lo: hi at lse[r],
  // lo at lse[R + r], R = num_seq * heads * L (detail/lse.cuh says why).
  float* lse = nullptr;
  int D = 0, heads = 0;  // hd = D / heads
  // Attention dropout (common/dropout.h): where dropout.threshold != 0, the probability of
  // query i, key j of head h of sequence n is scaled by dropout.scale when
  // dropout_keep(dropout, pass, n, h, i, j), else zeroed (seed and offset read from `philox`).
  DropoutParams dropout;  // default: threshold 0, no dropout
  int pass = 0;           // 0 row pass, 1 column pass: which of dropout.base/len
  // Device memory {seed, offset}; read (after the kernel's grid-dependency wait) where
  // dropout.threshold != 0, overriding dropout.seed/offset; must be non-null then.
  const uint64_t* philox = nullptr;
  // Split-KV workspace (device memory), or null: S = 1. Used where
  // workspace_bytes(FlashProblem) of this pass is > 0 and partials_bytes is at
  // least that, and dropout is off (the split kernels have no dropout: a training forward
  // with dropout keeps S = 1); the layout is smem_layout.h's flash_partials_bytes.
  float* partials = nullptr;
  size_t partials_bytes = 0;
  // Run the mma.sync kernel even where a wgmma one or the short-sequence one would: for tests
  // and benchmarks that compare them.
  bool mma_sync = false;
  // The products' element type (plan.h): 16-bit products run unsplit, on the 16-bit wgmma kernel
  // or the mma.sync kernel (flash_variant).
  Products products = Products::kFp32;
};

// What the kernels receive of a (the dropout fields go as a DropoutPass of their own).
inline AttentionKernelArgs flash_kernel_args(const FlashArgs& a) {
  return {a.pos, a.qkv, a.o, a.lse, a.D, a.heads, a.o16};
}

// The kernel and splits flash_attention runs a's pass with on dev (common/plan.h's
// flash_variant, dev.sm90a cleared in a build without sm_90a code); a's sizes valid.
FlashVariant flash_attention_variant(const FlashArgs& a, const DeviceCaps& dev);

// Whether a pass of a's sizes, products and dropout may store q, k and v in 16 bits for the kQkv16
// kernel (plan.h's flash_qkv16_can_run as flash_attention_variant sees the device); a.qkv16 aside.
bool flash_qkv16_chosen(const FlashArgs& a, const DeviceCaps& dev);
// Whether flash_attention runs a's pass on the head-dim-32 wgmma kernel (for benchmarks).
inline bool flash_wgmma_chosen(const FlashArgs& a, const DeviceCaps& dev) {
  return flash_attention_variant(a, dev).kernel == FlashKernel::kWgmma;
}

// Whether it serves a pass, and the partials its split takes: plan.h's can_run and
// workspace_bytes of a FlashProblem (the plan reserves them: CudaPlan::flash_partials).

// Blocks of the split kernel for head_dim an SM holds on dev (the occupancy
// API), for the test that checks smem_layout.h's flash_split_blocks_per_sm
// against the build; 0 where the head_dim is not served or the query fails.
int flash_split_occupancy(int64_t head_dim, const DeviceCaps& dev);

// The most shared memory a launch for this head_dim takes (blocks of 64
// queries, two key buffers; short sequences take less); the plan checks it
// against the device; 0 where the head_dim is not supported.
size_t flash_attention_smem_bytes(int64_t head_dim);

// Launches the kernel on `stream`, a programmatic dependent of the stream's
// previous kernel (detail/launch.cuh). Errors: cudaErrorInvalidValue for
// sizes it does not serve (heads not dividing D, head_dim outside 1..256,
// L >= 2^30, more than 2^31 - 1 blocks; with dropout.threshold != 0: a null
// philox, pass not 0 or 1, dropout.len[pass] != L or dropout.heads != heads,
// or a build without Random123), cudaErrorInvalidConfiguration where the
// device gives a block less shared memory than the head_dim needs. An empty
// problem (no sequences or L = 0) launches nothing. With S > 1, two kernels:
// the split blocks, then the combine (both programmatic dependents).
cudaError_t flash_attention(const FlashArgs& a, const DeviceCaps& dev, cudaStream_t stream);

// ---- The wgmma kernel (flash_attention_wgmma.cu) ------------------------------------------
// FlashKernel::kWgmma: the mma.sync kernel's products, softmax and dropout mask in the same
// order on Hopper's warpgroup products, for padded head dim 32 (its o and lse bitwise equal to
// the mma.sync kernel's). The launch flash_attention makes for it (sizes already checked there);
// vec: every head slice of qkv 16-byte aligned; scale_log2 = log2(e) / sqrt(hd).
cudaError_t flash_attention_wgmma(const FlashArgs& a, bool vec, float scale_log2, const DeviceCaps& dev,
                                  cudaStream_t stream);

// ---- The wgmma kernel for head dims 49 to 128 (flash_attention_wgmma_wide.cu) ----------------
// FlashKernel::kWgmmaWide: padded head dims 64, 96 and 128: q raw in shared memory and split a
// run, keys 32 a step, blocks of 128 queries taking units in turn; dropout, and split-KV (S units
// a query tile, their partials in flash_partials_bytes' layout, merged by flash_attention's
// combine kernel). Not bitwise the mma.sync kernel's results (both within the float64 tests'
// bounds). The launch flash_attention makes for it; splits > 1: partials (room for the
// flash_kv_splits rule's S >= splits) get the unnormalised o, m and l, and a.o, a.lse are not
// written; cudaErrorInvalidValue for splits > 1 with dropout (the split kernels have none).
cudaError_t flash_attention_wgmma_wide(const FlashArgs& a, bool vec, float scale_log2, float* partials, int splits,
                                       const DeviceCaps& dev, cudaStream_t stream);

// ---- The 16-bit wgmma kernel (flash_attention_wgmma16.cu) -------------------------------------
// FlashKernel::kWgmma16: 16-bit products (a.products bf16 or fp16), padded head dims 32, 96 and
// 128 (on tiles of 32 and 128): k and v rounded once a step into wgmma's 16-bit operands, q once a unit
// into registers, keys 64 a step, blocks of 128 queries taking units in turn; dropout, o and/or
// o16, the lse; no split. The launch flash_attention makes for it (sizes already checked there).
cudaError_t flash_attention_wgmma16(const FlashArgs& a, bool vec, float scale_log2, const DeviceCaps& dev,
                                    cudaStream_t stream);
// ---- The 16-bit kernel on q, k, v stored in 16 bits (flash_attention_qkv16.cu) ------------------
// FlashKernel::kQkv16: a.qkv16's rows copied straight into wgmma's 16-bit operands (no rounding
// pass), tiles of head dims 32, 64 and 128, keys 64 a step four buffers deep, the next step's scores
// under this step's p v; o and/or o16, the lse; no dropout, no split. The launch flash_attention
// makes for it (sizes already checked there).
cudaError_t flash_attention_qkv16(const FlashArgs& a, float scale_log2, const DeviceCaps& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
