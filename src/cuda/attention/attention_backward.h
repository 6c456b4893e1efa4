// The backward of one attention pass of the staged path (attention_backward.cu):
// for every sequence n and head h, with q_h, k_h, v_h, o_h and d_o_h (L, hd)
// and scale = 1 / sqrt(hd),
//   S = scale q_h k_h^T,  P = 2^(S log2(e) - lse2),  dP = d_o_h v_h^T,
//   dS = P * (dP - delta),  delta = rowsum(d_o_h * o_h),
//   dq_h = scale dS k_h,  dk_h = scale dS^T q_h,  dv_h = P^T d_o_h
// from the forward's qkv rows, its output o and its log-sum-exp
// (flash_attention with FlashArgs::lse), P recomputed tile by tile and never
// stored. Products on the tensor cores with the 3xTF32 split (fp32
// accuracy, as the forward), plain fp32 FFMA kernels as the fallback, or
// on 16-bit products (AttentionBackwardArgs::products, the tensor-core
// kernels only); all deterministic: every output element is summed in a
// fixed order (no atomics), so two calls give bitwise identical results.
//
// With attention dropout (AttentionBackwardArgs::dropout; the forward's mask,
// M, drawn again, scale = 1 / (1 - p)): dv_h = (P o M scale)^T d_o_h and
// dS = P * (dP o M scale - delta), delta as above from the dropped o.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../common/axis.h"
#include "../../common/dropout.h"
#include "../../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

struct AttentionBackwardArgs {
  // Sequence n, position l -> row of qkv, o, d_o and dqkv: offsets in rows,
  // not floats (as FlashArgs::pos).
  AxisView pos;
  const float* qkv = nullptr;  // (T, 3D): row r is [q | k | v], head h at columns h*hd .. h*hd + hd - 1 of each part
  const float* o = nullptr;    // (T, D): the forward's attention output (flash_attention's o)
  const float* d_o = nullptr;  // (T, D): gradient of the loss with respect to o
  const float* lse = nullptr;  // (2, num_seq, heads, L): flash_attention's lse2 = hi + lo (log2 units, detail/lse.cuh)
  float* delta = nullptr;      // (num_seq, heads, L) scratch the launcher fills: rowsum(d_o_h * o_h) per head
  // (T, 3D) output, qkv's layout: [dq | dk | dv]. Every column of every row
  // the view addresses is written (nothing accumulated into); other rows
  // are left alone.
  float* dqkv = nullptr;
  int D = 0, heads = 0;  // hd = D / heads
  // Scratch for dS^T, the scores' gradient (plan.h: attention_scores_bytes), or null: where given
  // and the tensor-core path runs, the dk, dv kernel also stores dS^T, (num_seq, heads, L,
  // attention_scores_stride(L, bytes)) values (a row per key, a column per query), and dq becomes
  // one product from it (5 products of L^2 hd a (sequence, head) instead of 7). The values are
  // floats, or on 16-bit products that type (bytes = 2): dq's product rounds dS to it anyway, so
  // the stored values are the ones it would round to. Null: the dq kernel recomputes S and dP.
  // Either way every output element is summed in a fixed order.
  void* ds = nullptr;
  // Room for the partial sums of a split pass, or null. Where a pass has few (sequence, head)
  // items (smem_layout.h: attention_grad_splits > 1) and partials_bytes holds the split's
  // attention_grad_partials_floats, the tensor-core kernels cut each block's streamed tiles over
  // S blocks, whose partial dk, dv and dq a combine kernel adds in split order (deterministic as
  // without the split); else (or where partials is not 16-byte aligned) they do not split.
  float* partials = nullptr;
  size_t partials_bytes = 0;
  // Test hook: S splits (>= 1) instead of the rule's, where partials_bytes holds them; 0: the rule.
  int splits = 0;
  // Test hook: run the FFMA kernels even where the tensor-core kernels
  // serve (the tests check both paths). Left false, the launcher takes the
  // FFMA kernels only where the tensor-core ones do not fit the device's
  // shared memory.
  bool ffma = false;
  // Test hook: the dq kernel on mma.sync even where the wgmma one applies
  // (query_grads_wgmma_can_run).
  bool mma_sync = false;
  // Attention dropout (common/dropout.h): where dropout.threshold != 0, the probability of
  // query i, key j of head h of sequence n is scaled by dropout.scale when
  // dropout_keep(dropout, pass, n, h, i, j), else zeroed (seed and offset read from `philox`).
  DropoutParams dropout;  // default: threshold 0, no dropout
  int pass = 0;           // 0 row pass, 1 column pass: which of dropout.base/len
  // Device memory {seed, offset}; read (after the kernel's grid-dependency wait) where
  // dropout.threshold != 0, overriding dropout.seed/offset; must be non-null then.
  const uint64_t* philox = nullptr;
  // The products' element type (plan.h): bf16 or fp16 runs the tensor-core kernels' products on
  // that type with fp32 accumulation (q, k, v, d_o, P and dS rounded as fragments are made), dq
  // on mma.sync; the lse must be the flash kernel's on the same products. No FFMA kernels
  // there: where the tensor-core ones do not fit, the launch fails (cudaErrorInvalidValue).
  Products products = Products::kFp32;
};

// Whether it serves a pass, and the split partials it takes: plan.h's can_run and
// workspace_bytes of an AttentionGradProblem.

// The largest shared memory one of the launch's kernels takes for this
// head_dim on the tensor-core path (ffma: on the FFMA kernels); 0 where the
// head_dim is not supported. The launch takes the tensor-core path where
// the device gives a block that much, else the FFMA one where it gives that
// much, else fails.
size_t attention_backward_smem_bytes(int64_t head_dim, bool ffma = false);

// The kernels attention_backward runs for `a` on dev: plan.h's rule (attention_grad_variant) on a's
// sizes, hooks and buffers.
AttentionGradVariant attention_backward_variant(const AttentionBackwardArgs& a, const DeviceCaps& dev);

// Its splits (1: none; AttentionBackwardArgs::partials).
int attention_backward_splits(const AttentionBackwardArgs& a, const DeviceCaps& dev);

// Launches three kernels on `stream`, each a programmatic dependent of the
// one before it (detail/launch.cuh): delta, then dk and dv, then dq (on the
// tensor cores, or the FFMA kernels: AttentionBackwardArgs::ffma), with a
// combine after each of the last two where the pass splits. Errors:
// cudaErrorInvalidValue for sizes it does not serve (heads not dividing D,
// head_dim outside 1..256, L >= 2^30, more than 2^31 - 1 blocks; with
// dropout.threshold != 0: a null philox, pass not 0 or 1, dropout.len[pass]
// != L or dropout.heads != heads, or a build without Random123; 16-bit
// products where the tensor-core kernels do not fit the device),
// cudaErrorInvalidConfiguration where the device gives a block less shared
// memory than the chosen path needs, else the launches' errors. An empty
// problem (no sequences or L = 0) launches nothing.
cudaError_t attention_backward(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream);

// ---- dq on wgmma (query_grads_wgmma.cu) ----------------------------------------------------------
// Where the variant says so (plan.h: attention_grad_variant), the tensor-core path computes dq with
// a kernel on Hopper's warpgroup products instead of the mma.sync one: the same splits, runs of
// products in the same order, softmax gradient and mask.

// Whether attention_backward computes a's dq on the wgmma kernel on dev where a has no dS^T
// scratch (its variant's dq); false for arguments it refuses.
bool query_grads_wgmma_can_run(const AttentionBackwardArgs& a, const DeviceCaps& dev);

// The dq launch attention_backward makes where query_grads_wgmma_can_run (after delta and the
// key side, as their programmatic dependent); vec: every head slice of qkv, d_o and dqkv 16-byte
// aligned; scale = 1 / sqrt(hd); dpass: the pass's dropout (threshold 0: none).
cudaError_t query_grads_wgmma(const AttentionBackwardArgs& a, bool vec, float scale, const DropoutPass& dpass,
                              const DeviceCaps& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
