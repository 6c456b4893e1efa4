// One attention pass as a pipeline of launches over all T = N L positions of
// the pass (pass.cu), shared by the inference forward (launch_staged,
// kernels.h) and the training forward (training.cu):
//   1. LayerNorm:      norm = LayerNorm(src)                         (T, D)
//      (norm/norm.h), with the weight splits the pass is given
//   2. QKV product:    qkv  = norm @ Wqkv^T                          (T, 3D)
//   3. attention:      attn = softmax(q_h k_h^T / sqrt(hd)) v_h      (T, D)
//      per head h, on the flash kernel (attention/flash_attention.h)
//      or the whole-sequence one (attention/whole_sequence.h)
//   4. output product: dst  = src + attn @ Wout^T + bout             (T, D)
// Each launch is a programmatic dependent of the one before (detail/launch.cuh).
// The training forward keeps what its backward reads (KeptForBackward) and
// the intermediates in buffers of their own; the inference forward keeps
// nothing and writes attn over norm.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "../../common/axis.h"
#include "../../common/dropout.h"
#include "../../common/plan.h"  // DeviceCaps
#include "../gemm/blas.h"  // the 16-bit products
#include "../gemm/gemm.h"
#include "../gemm/weight_planes.h"
#include "../kernels.h"  // StagedWeights, add_weight_splits

namespace fastaxial::cuda {

// What the training forward keeps for its backward; null in the inference forward.
struct KeptForBackward {
  float* stats = nullptr;  // (T, 2): LayerNorm's (mean, rstd)
  float* lse = nullptr;    // (2, num_seq, heads, L): the attention's log-sum-exp (FlashArgs::lse)
};

// One of the pass's two products, c (T, N) = a (T, K) W^T (+ bias + residual), from g (g.w: W
// split into planes, may be null) and the weight W (N, K) itself, `what` naming it in errors.
using StagedProduct = std::function<Status(const GemmArgs& g, const float* weight, const char* what)>;

struct StagedPass {
  AxisView view;  // the pass's sequences in the (B, H, W, D) grid
  const AxialParams* p = nullptr;
  const AxisWeights* w = nullptr;
  const float* src = nullptr;  // (B, H, W, D)
  float* dst = nullptr;        // (B, H, W, D)
  float* norm = nullptr;       // (T, D)
  float* qkv = nullptr;        // (T, 3D)
  float* attn = nullptr;       // (T, D); may be norm, which the QKV product has read by then
  StagedWeights planes;        // Wqkv and Wout split, read by the products
  PlaneJobs splits;            // weights to split with the LayerNorm (the first pass's: both passes')
  bool flash = true;           // the attention on the flash kernel, else on the whole-sequence one
  float* flash_partials = nullptr;  // the plan's split-KV region, or null where no pass splits its keys
  size_t flash_partials_bytes = 0;
  // Attention dropout (FlashArgs: flash only): none by default.
  DropoutParams dropout;
  int pass = 0;                      // 0 row pass, 1 column pass
  const uint64_t* philox = nullptr;  // device {seed, offset}
  KeptForBackward keep;
  // The products' engine where given (the training forward: cuBLAS where the tensor cores
  // cannot take them), else gemm_tf32x3 from `planes`.
  const StagedProduct* product = nullptr;
};

// Launches the pass's steps on `stream`, in order.
Status run_staged_pass(const StagedPass& s, const DeviceCaps& dev, cudaStream_t stream);

// The inference pass on 16-bit products (AxialParams::products = type, bf16 or fp16), the
// same four steps with the products' operands rounded to the type and the products on cuBLAS
// (gemm_16bit, handle h bound to `stream`), in four launches:
//   1. norm16 = LayerNorm(src) rounded (fp32 statistics), dst = src + bout, and the weights
//      rounded: one launch (norm/norm.h: layer_norm_forward_16bit)          (T, D)
//   2. qkv  = norm16 @ Wqkv16^T (fp32 accumulation and output)             (T, 3D)
//   3. attn16 = the flash kernel on 16-bit products (fp32 softmax), its output written rounded
//      (FlashArgs::o16, into norm16's room)                                 (T, D)
//   4. dst += attn16 @ Wout16^T                                             (T, D)
// scratch holds 4 T D floats as launch_staged's (qkv after the first T D); operand16 T D 16-bit
// values; weights16 4 D^2 (Wqkv's rounding, then Wout's, written in step 1). dst must not
// overlap src.
Status launch_staged_16bit(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                           float* dst, float* scratch, void* operand16, void* weights16, cublasHandle_t h,
                           Products type, const DeviceCaps& dev, cudaStream_t stream);

}  // namespace fastaxial::cuda
