// The CUDA training calls (fastaxial.h: plan_backward_cuda,
// forward_cuda_training, backward_cuda). The forward is
//   x1  = x  + Attn_row(LayerNorm_row(x))  @ Wo_row^T + bo_row    rows of (B, H, W, D)
//   out = x1 + Attn_col(LayerNorm_col(x1)) @ Wo_col^T + bo_col    columns
// and with T = B H W positions its backward is, per pass from the last:
//   d_bo  = column sums of dy                         dy (T, D): gradient of the pass's output
//   d_Wo  = dy^T o                                    o  (T, D): attention output
//   d_o   = dy Wo
//   dqkv  = attention backward of (qkv, o, lse, d_o)  (T, 3D), attention/attention_backward.cu
//   d_Wqkv = dqkv^T xn                                xn (T, D): LayerNorm output
//   d_xn  = dqkv Wqkv
//   d_gamma, d_beta = column sums of d_xn * xhat, d_xn (d_beta as those of dqkv, times Wqkv)
//   d_src = dy + LayerNorm backward of d_xn           the residual and the branch
// Why this shape: the training forward runs each pass as the staged pass
// (staged/pass.h: LayerNorm with its statistics, the QKV product, flash
// attention with its log-sum-exp, the output product) and keeps those
// intermediates (`saved`), so that the backward recomputes nothing but the
// probabilities, tile by tile. The products are plain GEMMs over all T
// positions: the projections and the activations' gradients through them on
// Hopper's tensor cores with 3xTF32 (gemm/gemm.cu, weights split into planes
// once a call: gemm/weight_planes.h), else cuBLAS fp32. The projection
// weights' gradients, sums over all T positions into (D, D) and (3D, D), run
// on the tensor cores too (gemm/weight_gradient.cu: 3xTF32 on wgmma on
// sm_90a with aligned operands, else on mma.sync, compute capability 8.0 on,
// which every device the backward plans for has), since cuBLAS runs them in
// fp32 on the FFMA units; cuBLAS stays their fallback where the plan says
// the kernel cannot run (plan.tensor_core_weight_grads). No sum over
// positions needs atomics: the weight gradients split the positions into
// chunks by a rule of the sizes and the device alone and add the chunks in a
// fixed order, the column sums (norm/column_sums.cu) and the attention
// backward add in a fixed order, and cuBLAS's results are bitwise
// reproducible, so the whole backward is deterministic.
// On 16-bit products (plan.products bf16 or fp16) each pass runs the same steps with every
// product's operands rounded to the type, fp32 accumulation (forward_pass16, gradients_through16):
// the projections and the backward's products through them and into the weights on cuBLAS's
// 16-bit products (gemm_16bit), the flash forward and the attention backward on their kernels'
// 16-bit instances. The forward keeps the LayerNorm output and the attention output rounded (the
// weight gradients' operands) beside the fp32 ones the attention backward reads (qkv, o, lse);
// LayerNorm's statistics, its backward and the column sums stay fp32. Each call rounds a pass's
// weights again, into its workspace.
// Attention dropout (p.dropout > 0): the flash forward and the attention
// backward draw the mask of common/dropout.h from the seed and offset the
// forward writes into `saved` (dropout_state.cu), so the backward draws the
// forward's mask whatever the caller's state is by then, and a graph replay
// draws the replay's.
#include <cuda_runtime.h>

#include <string>
#include <tuple>
#include <utility>

#include "../common/dropout.h"
#include "../common/plan.h"
#include "../common/validate.h"
#include "detail/host.h"
#include "graph_replay.h"
#include "kernels.h"
#include "attention/attention_backward.h"
#include "attention/flash_attention.h"
#include "dropout_state.h"
#include "gemm/blas.h"
#include "gemm/gemm.h"
#include "gemm/weight_gradient.h"
#include "gemm/weight_planes.h"
#include "norm/column_sums.h"
#include "norm/norm.h"
#include "staged/pass.h"

namespace fastaxial {
namespace {

using cuda::cuda_error;

Status invalid(const std::string& what) { return {StatusCode::kInvalidArgument, what}; }

// One pass's intermediates in the workspace.
struct PassBuffers {
  float* norm;   // (T, D)
  float* stats;  // (T, 2)
  float* qkv;    // (T, 3D)
  float* attn;   // (T, D)
  float* lse;    // (2, num_seq, heads, L): lse2 hi, then lo (detail/lse.cuh)
  void* norm16 = nullptr;  // 16-bit products: (T, D) the LayerNorm output rounded (norm's region)
  void* attn16 = nullptr;  // and the attention output rounded
};

class Training {
 public:
  Training(const AxialParams& p, const CudaBackwardPlan& plan, char* saved, char* ws, const DeviceCaps& dev,
           cudaStream_t stream, cublasHandle_t blas)
      : p_(p),
        dev_(dev),
        stream_(stream),
        blas_(blas),
        T_(p.batch * p.height * p.width),
        D_((int)p.dim),
        dropout_(make_dropout(p)),
        dropout_state_(reinterpret_cast<uint64_t*>(saved + plan.dropout_state)) {
    const auto in = [](char* base, size_t offset) { return reinterpret_cast<float*>(base + offset); };
    const auto pass = [&](const CudaBackwardPlan::Pass& b) {
      PassBuffers buf{in(saved, b.norm), in(saved, b.stats), in(saved, b.qkv), in(saved, b.attn), in(saved, b.lse)};
      if (b.attn16 != CudaBackwardPlan::kNone) buf.norm16 = saved + b.norm, buf.attn16 = saved + b.attn16;
      return buf;
    };
    row_ = pass(plan.row), col_ = pass(plan.col), x1_ = in(saved, plan.row_output);
    d_x1_ = in(ws, plan.grad_row_output), d_attn_ = in(ws, plan.grad_attn), d_qkv_ = in(ws, plan.grad_qkv);
    d_norm_ = in(ws, plan.grad_norm), delta_ = in(ws, plan.delta);
    partials_ = reinterpret_cast<double*>(ws + plan.column_partials);  // 256-byte aligned (plan.cpp)
    tensor_core_weight_grads_ = plan.tensor_core_weight_grads && can_run(WeightGradProblem{}, dev);
    if (plan.weight_grad_partials != CudaBackwardPlan::kNone) {
      weight_partials_ = in(ws, plan.weight_grad_partials);
      weight_partials_bytes_ = plan.weight_grad_partials_bytes;
    }
    if (plan.flash_partials != CudaBackwardPlan::kNone) {
      flash_partials_ = in(ws, plan.flash_partials);
      flash_partials_bytes_ = plan.flash_partials_bytes;
    }
    if (plan.attention_partials != CudaBackwardPlan::kNone) {
      attention_partials_ = in(ws, plan.attention_partials);
      attention_partials_bytes_ = plan.attention_partials_bytes;
    }
    if (plan.attention_scores != CudaBackwardPlan::kNone) {
      float* scores = in(ws, plan.attention_scores);
      scores_[0] = plan.row_scores ? scores : nullptr, scores_[1] = plan.col_scores ? scores : nullptr;
    }
    products_ = plan.products;
    if (products_ != Products::kFp32) {
      weights16_ = reinterpret_cast<uint16_t*>(ws + plan.weights16);
      operand16_ = ws + plan.operand16;
    }
    if (plan.tensor_core_products) {
      const int64_t dd = (int64_t)D_ * D_;
      for (int i = 0; i < 2; ++i) {
        float* base = in(ws, plan.weight_planes) + i * 16 * dd;
        planes_[i] = {base, base + 6 * dd, base + 8 * dd, base + 10 * dd};
      }
    }
  }

  // out = the forward of x, each pass's intermediates kept; the mask's seed and offset are already in
  // saved (forward_cuda_training writes them).
  // The row pass's LayerNorm launch splits both passes' weights first.
  Status forward(float* out) {
    if (products_ != Products::kFp32) {
      if (Status s = needs_blas(); !s.ok()) return s;
      if (Status s = forward_pass16(0, row_view(p_), p_.row, p_.x, row_, x1_); !s.ok()) return s;
      return forward_pass16(1, col_view(p_), p_.col, x1_, col_, out);
    }
    if (Status s = forward_pass(0, row_view(p_), p_.row, p_.x, row_, planes_[0], x1_, plane_jobs(false)); !s.ok())
      return s;
    return forward_pass(1, col_view(p_), p_.col, x1_, col_, planes_[1], out, cuda::PlaneJobs{});
  }

  Status backward(const AxialGrads& g) {
    if (products_ != Products::kFp32)
      if (Status s = needs_blas(); !s.ok()) return s;
    if (cudaError_t e = cuda::split_weight_planes(plane_jobs(true), dev_, stream_); e != cudaSuccess)
      return cuda_error(e, "split_weight_planes launch");
    const bool want_row = g.grad_x != nullptr || any(g.row);
    // Back through the column pass (into the gradient of x1), then the row pass (into grad_x).
    if (Status s = backward_pass(1, col_view(p_), p_.col, x1_, col_, planes_[1], g.grad_out,
                                 want_row ? d_x1_ : nullptr, g.col);
        !s.ok())
      return s;
    if (!want_row) return Status::Ok();
    return backward_pass(0, row_view(p_), p_.row, p_.x, row_, planes_[0], d_x1_, g.grad_x, g.row);
  }

 private:
  // One pass's weights as (hi, lo) planes for the tensor-core product; all null: cuBLAS.
  struct Planes {
    float *qkv = nullptr, *out = nullptr, *out_t = nullptr, *qkv_t = nullptr;
  };

  // The planes this call's products take: Wqkv and Wout of both passes (forward), or their
  // transposes (backward); none where the products run on cuBLAS.
  cuda::PlaneJobs plane_jobs(bool transposed) const {
    cuda::PlaneJobs jobs;
    if (planes_[0].qkv == nullptr) return jobs;
    const AxisWeights* w[2] = {&p_.row, &p_.col};
    for (int i = 0; i < 2; ++i) {
      if (transposed) {
        jobs.add(w[i]->qkv_weight, planes_[i].qkv_t, D_, 3 * D_, true);
        jobs.add(w[i]->out_weight, planes_[i].out_t, D_, D_, true);
      } else {
        cuda::add_weight_splits(&jobs, *w[i], {planes_[i].qkv, planes_[i].out}, D_);
      }
    }
    return jobs;
  }

  // c (M, N) = a (M, K) W'^T (+ bias + residual, both or neither), W' = w (N, K), or with
  // `transposed` W' = w^T, w (K, N). On the tensor cores from `planes` (W' split) where given and
  // the activations are 16-byte aligned (the product's copies), else on cuBLAS.
  Status product(const float* a, const float* w, const float* planes, bool transposed, int N, int K,
                 const float* bias, const float* residual, float* c, const char* what) {
    if (planes != nullptr && aligned16(a) && aligned16(c) && (residual == nullptr || aligned16(residual))) {
      cuda::GemmArgs g;
      g.a = a, g.w = planes, g.bias = bias, g.residual = residual, g.c = c, g.M = T_, g.N = N, g.K = K;
      if (cudaError_t e = cuda::gemm_tf32x3(g, dev_, stream_); e != cudaSuccess) return cuda_error(e, what);
      return Status::Ok();
    }
    float beta = 0.0f;
    if (residual != nullptr) {  // c = residual + bias, then the product added to it
      if (cudaError_t e = cuda::add_bias(residual, bias, T_, D_, c, dev_, stream_); e != cudaSuccess)
        return cuda_error(e, "add_bias launch");
      beta = 1.0f;
    }
    return blas_gemm(false, !transposed, T_, N, K, a, K, w, transposed ? N : K, beta, c, N, what);
  }

  // 16-bit products run on cuBLAS alone: a call being captured without a handle (capture_blas) runs
  // directly instead.
  Status needs_blas() const {
    if (blas_ == nullptr) return {StatusCode::kUnsupported, "16-bit products: cuBLAS is not captured"};
    return Status::Ok();
  }

  // gemm_16bit (blas.h) on the call's products and handle.
  Status product16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                   const void* B, int64_t ldb, float beta, float* C, int64_t ldc, const char* what) {
    return cuda::gemm_16bit(blas_, products_, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc, what);
  }

  // y (T, N) = a (T, N) rounded, with job `job`'s column sums of a (*sums; -1: none) in the same read.
  Status round_operand(const float* a, void* y, int N, int job, cuda::ColumnSumJobs* sums) {
    const cudaError_t e = job >= 0 ? cuda::round_with_column_sums(sums, job, T_, y, products_, partials_, dev_, stream_)
                                   : cuda::round_to_16bit(a, y, T_ * N, products_, dev_, stream_);
    return e == cudaSuccess ? Status::Ok() : cuda_error(e, job >= 0 ? "round_with_column_sums launch" : "round_to_16bit launch");
  }

  // The pass's projection weights rounded into the workspace: Wqkv (3D, D) at weights16_, then Wout
  // (D, D).
  cuda::RoundJobs weight_rounds(const AxisWeights& w) const {
    const int64_t dd = (int64_t)D_ * D_;
    cuda::RoundJobs r;
    r.job[0] = {w.qkv_weight, weights16_, 3 * dd}, r.job[1] = {w.out_weight, weights16_ + 3 * dd, dd}, r.count = 2;
    return r;
  }

  // cuBLAS's product (blas.h), where the call has a handle: a call being captured into a graph has
  // none (graph_replay.h), and is then run directly instead.
  Status blas_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const char* what) {
    if (blas_ == nullptr) return {StatusCode::kUnsupported, std::string(what) + ": cuBLAS is not captured"};
    return cuda::gemm(blas_, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc, what);
  }

  // A weight's gradient c (N, D) = a^T b over the T positions, a (T, N), b (T, D): on the tensor
  // cores where the plan has them (its partials region, reused by each product in turn: they run
  // one after another on the stream), else on cuBLAS. Where a_job is one of *sums' jobs (a's
  // column sums), the product also takes that job's chunk partials, if its chunks fit the scratch.
  Status weight_gradient(const float* a, int N, const float* b, float* c, const char* what,
                         cuda::ColumnSumJobs* sums = nullptr, int a_job = -1) {
    if (tensor_core_weight_grads_) {
      cuda::WeightGradientArgs g;
      g.a = a, g.b = b, g.c = c, g.T = T_, g.lda = N, g.ldb = D_, g.ldc = D_, g.N = N, g.K = D_;
      const int64_t chunks = cuda::weight_gradient_variant(g, dev_).split.splits;
      const bool take = a_job >= 0 && chunks <= kMaxColumnSumChunks;
      if (take) g.a_sums = sums->chunk_partials(partials_, a_job);
      if (cudaError_t e = cuda::weight_gradient(g, weight_partials_, weight_partials_bytes_, dev_, stream_);
          e != cudaSuccess)
        return cuda_error(e, what);
      if (take) sums->take_chunks(a_job, chunks);
      return Status::Ok();
    }
    return blas_gemm(true, false, N, D_, T_, a, N, b, D_, 0.0f, c, D_, what);
  }

  // One pass of the forward (staged/pass.h), its intermediates kept in b: xn = LayerNorm(src),
  // qkv = xn Wqkv^T, attn and lse = attention of qkv, dst = src + attn Wo^T + bo (pass 0: rows,
  // 1: columns); `splits` go with the LayerNorm's launch.
  Status forward_pass(int pass, const AxisView& view, const AxisWeights& w, const float* src, const PassBuffers& b,
                      const Planes& planes, float* dst, const cuda::PlaneJobs& splits) {
    const cuda::StagedProduct project = [this](const cuda::GemmArgs& g, const float* weight, const char* what) {
      return product(g.a, weight, g.w, false, g.N, g.K, g.bias, g.residual, g.c, what);
    };
    cuda::StagedPass s;
    s.view = view, s.p = &p_, s.w = &w, s.src = src, s.dst = dst;
    s.norm = b.norm, s.qkv = b.qkv, s.attn = b.attn;
    s.planes = {planes.qkv, planes.out}, s.splits = splits;
    s.flash_partials = flash_partials_, s.flash_partials_bytes = flash_partials_bytes_;
    s.dropout = dropout_, s.pass = pass, s.philox = dropout_state_;
    s.keep = {b.stats, b.lse};
    s.product = &project;
    return cuda::run_staged_pass(s, dev_, stream_);
  }

  // forward_pass on 16-bit products (pass.h's launch_staged_16bit, keeping what the backward reads):
  //   norm16 = LayerNorm(src) rounded, its statistics, dst = src + bo, the weights rounded   one launch
  //   qkv    = norm16 Wqkv16^T                                                              (T, 3D) fp32
  //   attn, attn16 (attn rounded), lse = the flash kernel on 16-bit products
  //   dst   += attn16 Wo16^T
  Status forward_pass16(int pass, const AxisView& view, const AxisWeights& w, const float* src, const PassBuffers& b,
                        float* dst) {
    const uint16_t *wqkv16 = weights16_, *wout16 = weights16_ + 3 * (int64_t)D_ * D_;
    if (cudaError_t e = cuda::layer_norm_forward_16bit(src, w.norm_weight, w.norm_bias, p_.eps, T_, D_, b.norm16,
                                                       products_, weight_rounds(w), w.out_bias, dst, b.stats, dev_,
                                                       stream_);
        e != cudaSuccess)
      return cuda_error(e, "layer_norm_forward_16bit launch");
    if (Status s = product16(false, true, T_, 3 * D_, D_, b.norm16, D_, wqkv16, D_, 0.0f, b.qkv, 3 * D_,
                             "QKV product (16-bit)");
        !s.ok())
      return s;
    cuda::FlashArgs f;
    f.pos = row_indices(view, D_);
    f.qkv = b.qkv, f.o = b.attn, f.o16 = b.attn16, f.lse = b.lse;  // o both ways: fp32 for delta, rounded for d_Wo
    f.D = D_, f.heads = (int)p_.heads;
    f.dropout = dropout_, f.pass = pass, f.philox = dropout_state_;
    f.products = products_;
    if (cudaError_t e = cuda::flash_attention(f, dev_, stream_); e != cudaSuccess)
      return cuda_error(e, "flash_attention launch (16-bit products)");
    return product16(false, true, T_, D_, D_, b.attn16, D_, wout16, D_, 1.0f, dst, D_, "output product (16-bit)");
  }

  // gradients_through on 16-bit products: the same gradients, each product's operands rounded (dy and
  // dqkv into operand16_, one after the other; the weights again into weights16_).
  Status gradients_through16(int pass, const AxisView& view, const AxisWeights& w, const float* src,
                             const PassBuffers& b, const float* dy, float* d_src, const AxisGrads& grads,
                             int dy_job, cuda::ColumnSumJobs* sums) {
    const bool through = d_src != nullptr || grads.qkv_weight || grads.norm_weight || grads.norm_bias;
    if (!through && !grads.out_weight) return Status::Ok();
    const uint16_t *wqkv16 = weights16_, *wout16 = weights16_ + 3 * (int64_t)D_ * D_;
    void* dy16 = operand16_;  // (T, D), until the attention backward
    if (through)
      if (cudaError_t e = cuda::round_jobs_to_16bit(weight_rounds(w), products_, dev_, stream_); e != cudaSuccess)
        return cuda_error(e, "round_jobs_to_16bit launch");
    if (Status s = round_operand(dy, dy16, D_, dy_job, sums); !s.ok()) return s;
    if (grads.out_weight)  // d_Wo (D, D) = dy^T attn
      if (Status s = product16(true, false, D_, D_, T_, dy16, D_, b.attn16, D_, 0.0f, grads.out_weight, D_,
                               "out_weight gradient (16-bit)");
          !s.ok())
        return s;
    if (!through) return Status::Ok();

    // d_o (T, D) = dy Wo, then the attention backward into dqkv (T, 3D).
    if (Status s = product16(false, false, T_, D_, D_, dy16, D_, wout16, D_, 0.0f, d_attn_, D_,
                             "attention output gradient (16-bit)");
        !s.ok())
      return s;
    if (Status s = attention_grads(pass, view, b); !s.ok()) return s;
    const int dqkv_job = grads.norm_bias ? sums->add_projected(d_qkv_, 3 * D_, w.qkv_weight, D_, grads.norm_bias) : -1;
    if (!grads.qkv_weight && d_src == nullptr && !grads.norm_weight) return Status::Ok();
    void* dqkv16 = operand16_;  // (T, 3D)
    if (Status s = round_operand(d_qkv_, dqkv16, 3 * D_, dqkv_job, sums); !s.ok()) return s;
    if (grads.qkv_weight)  // d_Wqkv (3D, D) = dqkv^T xn
      if (Status s = product16(true, false, 3 * D_, D_, T_, dqkv16, 3 * D_, b.norm16, D_, 0.0f, grads.qkv_weight, D_,
                               "qkv_weight gradient (16-bit)");
          !s.ok())
        return s;
    if (d_src == nullptr && !grads.norm_weight) return Status::Ok();

    // d_xn (T, D) = dqkv Wqkv, then LayerNorm's backward as on fp32 products.
    if (Status s = product16(false, false, T_, D_, 3 * D_, dqkv16, 3 * D_, wqkv16, D_, 0.0f, d_norm_, D_,
                             "LayerNorm output gradient (16-bit)");
        !s.ok())
      return s;
    return norm_grads(w, src, b, dy, d_src, grads, sums);
  }

  // The pass's gradients from dy (T, D), the gradient of its output: the wanted weight
  // gradients of `grads`, and d_src = dy + the branch's gradient of src where d_src is not null.
  Status backward_pass(int pass, const AxisView& view, const AxisWeights& w, const float* src, const PassBuffers& b,
                       const Planes& planes, const float* dy, float* d_src, const AxisGrads& grads) {
    // The pass's column sums (d_bo, d_beta, d_gamma) in one set of launches at the end: their
    // inputs (dy, dqkv, d_xn * xhat) all stay until then. dy's and dqkv's are taken by the weight
    // gradients that read them, where those run (weight_gradient).
    cuda::ColumnSumJobs sums;
    const int dy_job = grads.out_bias ? sums.add(dy, D_, grads.out_bias) : -1;
    if (Status s = products_ != Products::kFp32
                       ? gradients_through16(pass, view, w, src, b, dy, d_src, grads, dy_job, &sums)
                       : gradients_through(pass, view, w, src, b, planes, dy, d_src, grads, dy_job, &sums);
        !s.ok())
      return s;
    if (cudaError_t e = cuda::column_sums(sums, T_, partials_, dev_, stream_); e != cudaSuccess)
      return cuda_error(e, "column_sums launch");
    return Status::Ok();
  }

  // backward_pass's products and kernels, from d_Wo on; the column sums it needs go into *sums
  // (dy's: job dy_job, or -1).
  Status gradients_through(int pass, const AxisView& view, const AxisWeights& w, const float* src,
                           const PassBuffers& b, const Planes& planes, const float* dy, float* d_src,
                           const AxisGrads& grads, int dy_job, cuda::ColumnSumJobs* sums) {
    if (grads.out_weight)  // d_Wo (D, D) = dy^T attn
      if (Status s = weight_gradient(dy, D_, b.attn, grads.out_weight, "out_weight gradient", sums, dy_job); !s.ok())
        return s;
    if (d_src == nullptr && !grads.qkv_weight && !grads.norm_weight && !grads.norm_bias) return Status::Ok();

    // d_o (T, D) = dy Wo, then the attention backward into dqkv (T, 3D).
    if (Status s = product(dy, w.out_weight, planes.out_t, true, D_, D_, nullptr, nullptr, d_attn_,
                           "attention output gradient");
        !s.ok())
      return s;
    if (Status s = attention_grads(pass, view, b); !s.ok()) return s;
    // d_beta, the column sums of d_xn = dqkv Wqkv, as those of dqkv times Wqkv (column_sums.h says why).
    const int dqkv_job = grads.norm_bias ? sums->add_projected(d_qkv_, 3 * D_, w.qkv_weight, D_, grads.norm_bias) : -1;
    if (grads.qkv_weight)  // d_Wqkv (3D, D) = dqkv^T xn
      if (Status s = weight_gradient(d_qkv_, 3 * D_, b.norm, grads.qkv_weight, "qkv_weight gradient", sums, dqkv_job);
          !s.ok())
        return s;
    if (d_src == nullptr && !grads.norm_weight) return Status::Ok();

    // d_xn (T, D) = dqkv Wqkv, then LayerNorm's backward.
    if (Status s = product(d_qkv_, w.qkv_weight, planes.qkv_t, true, D_, 3 * D_, nullptr, nullptr, d_norm_,
                           "LayerNorm output gradient");
        !s.ok())
      return s;
    return norm_grads(w, src, b, dy, d_src, grads, sums);
  }

  // The attention backward of the pass (attention/attention_backward.h) from its saved qkv, o and lse
  // and d_o (d_attn_) into dqkv (d_qkv_), on the call's products.
  Status attention_grads(int pass, const AxisView& view, const PassBuffers& b) {
    cuda::AttentionBackwardArgs a;
    a.pos = row_indices(view, D_);
    a.qkv = b.qkv, a.o = b.attn, a.d_o = d_attn_, a.lse = b.lse, a.delta = delta_, a.dqkv = d_qkv_;
    a.D = D_, a.heads = (int)p_.heads;
    a.dropout = dropout_, a.pass = pass, a.philox = dropout_state_;
    a.ds = scores_[pass];
    a.partials = attention_partials_, a.partials_bytes = attention_partials_bytes_;
    a.products = products_;
    if (cudaError_t e = cuda::attention_backward(a, dev_, stream_); e != cudaSuccess)
      return cuda_error(e, products_ == Products::kFp32 ? "attention_backward launch"
                                                        : "attention_backward launch (16-bit products)");
    return Status::Ok();
  }

  // From d_xn (d_norm_): LayerNorm's backward, d_src = dy + its gradient of src where d_src is not
  // null; d_attn_, free again, takes d_xn * xhat, whose column sums (a job of *sums) are gamma's gradient.
  Status norm_grads(const AxisWeights& w, const float* src, const PassBuffers& b, const float* dy, float* d_src,
                    const AxisGrads& grads, cuda::ColumnSumJobs* sums) {
    float* d_norm_xhat = grads.norm_weight ? d_attn_ : nullptr;
    if (cudaError_t e = cuda::layer_norm_backward(src, b.stats, w.norm_weight, d_norm_, dy, T_, D_, d_src,
                                                  d_norm_xhat, dev_, stream_);
        e != cudaSuccess)
      return cuda_error(e, "layer_norm_backward launch");
    if (grads.norm_weight) sums->add(d_norm_xhat, D_, grads.norm_weight);
    return Status::Ok();
  }

  const AxialParams& p_;
  const DeviceCaps& dev_;
  cudaStream_t stream_;
  cublasHandle_t blas_;
  int64_t T_;
  int D_;
  DropoutParams dropout_;   // the mask's sizes and rate; its seed and offset are read from dropout_state_
  uint64_t* dropout_state_;  // saved's {seed, offset}: written by forward_cuda_training, read by the kernels
  PassBuffers row_, col_;
  Planes planes_[2];  // row, column
  float *x1_, *d_x1_, *d_attn_, *d_qkv_, *d_norm_, *delta_;
  double* partials_;  // the column sums' chunk partials
  float* scores_[2] = {nullptr, nullptr};  // dS^T scratch of the row and column pass, where the plan has it
  Products products_ = Products::kFp32;   // the plan's products
  uint16_t* weights16_ = nullptr;         // 16-bit products: a pass's weights rounded (plan.weights16)
  void* operand16_ = nullptr;             // and the backward's rounded operands (plan.operand16)
  bool tensor_core_weight_grads_ = false;  // the weight gradients on weight_gradient.cu, else cuBLAS
  float* weight_partials_ = nullptr;       // their partial tiles where the positions are split
  size_t weight_partials_bytes_ = 0;
  float* flash_partials_ = nullptr;  // the training forward's split-KV partials, where a pass splits
  size_t flash_partials_bytes_ = 0;
  float* attention_partials_ = nullptr;  // the attention backward's split partials, where a pass splits
  size_t attention_partials_bytes_ = 0;
};

// Zeros in every wanted weight gradient: the gradients of an empty problem.
Status zero_weight_grads(const AxialParams& p, const AxialGrads& g, cudaStream_t stream) {
  const int64_t D = p.dim;
  for (const AxisGrads* a : {&g.row, &g.col}) {
    const std::pair<float*, int64_t> grads[] = {
        {a->norm_weight, D}, {a->norm_bias, D}, {a->qkv_weight, 3 * D * D}, {a->out_weight, D * D}, {a->out_bias, D}};
    for (const auto& [ptr, n] : grads)
      if (ptr != nullptr)
        if (cudaError_t e = cudaMemsetAsync(ptr, 0, n * sizeof(float), stream); e != cudaSuccess)
          return cuda_error(e, "cudaMemsetAsync");
  }
  return Status::Ok();
}

// The checks both training calls make before launching anything.
Status check_call(const AxialParams& p, const CudaBackwardPlan& plan, const void* saved, size_t saved_bytes,
                  const void* workspace, size_t workspace_bytes, DeviceCaps* dev) {
  if (Status s = validate_inputs(p); !s.ok()) return s;
  if (Status s = cuda::current_device(dev); !s.ok()) return s;
  if (Status s = check_plan_matches(p, plan, dev->device, "the backward plan"); !s.ok()) return s;
  if (plan.products != p.products)
    return invalid("the backward plan was made for other products (AxialParams::products): " + plan.describe());
  if ((p.seed_device == nullptr) != (p.offset_device == nullptr))
    return invalid("seed_device and offset_device must be given together");
  if (p.batch * p.height * p.width == 0) return Status::Ok();
  for (const auto& [buf, bytes, need, name] :
       {std::tuple{saved, saved_bytes, plan.saved_bytes, "saved"},
        std::tuple{workspace, workspace_bytes, plan.workspace_bytes, "workspace"}}) {
    if (buf == nullptr) return invalid(std::string(name) + " is null");
    if (reinterpret_cast<uintptr_t>(buf) % 256 != 0) return invalid(std::string(name) + " must be 256-byte aligned");
    if (bytes < need)
      return invalid(std::string(name) + " holds " + std::to_string(bytes) + " bytes; the plan needs " +
                     std::to_string(need));
  }
  return Status::Ok();
}

}  // namespace

Status plan_backward_cuda(const AxialParams& p, CudaBackwardPlan* plan, bool caller_blas) {
  if (Status s = validate_sizes(p); !s.ok()) return s;
  DeviceCaps dev;
  if (Status s = cuda::current_device(&dev); !s.ok()) return s;
  return make_backward_plan(p, dev, plan, caller_blas);
}

// Zeros in the alignment gaps between the saved buffer's regions, so that every byte of it is
// written (it is an operator's output: two calls on the same inputs give the same bytes).
Status zero_saved_gaps(const AxialParams& p, const CudaBackwardPlan& plan, char* saved, cudaStream_t stream) {
  const size_t T = (size_t)(p.batch * p.height * p.width), td = T * p.dim * sizeof(float);
  const size_t th = T * p.heads * sizeof(float);
  const std::pair<size_t, size_t> regions[] = {
      {plan.row.norm, td}, {plan.row.stats, 2 * T * sizeof(float)}, {plan.row.qkv, 3 * td}, {plan.row.attn, td},
      {plan.row.lse, 2 * th},  {plan.col.norm, td}, {plan.col.stats, 2 * T * sizeof(float)},   {plan.col.qkv, 3 * td},
      {plan.col.attn, td}, {plan.col.lse, 2 * th},  {plan.row_output, td}, {plan.dropout_state, 2 * sizeof(uint64_t)}};
  size_t end = 0;  // regions lie in this order (plan.cpp)
  for (const auto& [offset, bytes] : regions) {
    if (offset > end)
      if (cudaError_t e = cudaMemsetAsync(saved + end, 0, offset - end, stream); e != cudaSuccess)
        return cuda_error(e, "cudaMemsetAsync");
    end = offset + bytes;
  }
  return Status::Ok();
}

// The call's cuBLAS handle: the caller's (bound by `caller`), or the library's own with the plan's region.
static Status call_blas(const CudaBackwardPlan& plan, void* caller_handle, char* ws, cudaStream_t stream,
                 cuda::CallerBlas* caller, cublasHandle_t* blas) {
  if (plan.caller_blas != (caller_handle != nullptr))
    return invalid(plan.caller_blas ? "the plan was made for the caller's cuBLAS handle, and none was given"
                                    : "a cuBLAS handle was given to a plan made without caller_blas");
  if (caller_handle == nullptr) return cuda::blas_handle(stream, ws + plan.blas, plan.blas_bytes, blas);
  *blas = static_cast<cublasHandle_t>(caller_handle);
  return caller->bind(*blas, stream);
}

// The cuBLAS handle of a call being captured into a graph (graph_replay.h): on 16-bit products
// with the library's own handle (a plan without caller_blas), that handle bound to the capturing
// stream and the plan's region, so that the products are captured with the rest (cuBLAS captures
// within a workspace it was given); else none, and a call that needs cuBLAS then runs directly (a
// caller's handle is bound to the caller's stream; the fp32 products capture their tensor-core
// kernels alone, as before).
static cublasHandle_t capture_blas(const CudaBackwardPlan& plan, char* ws, cudaStream_t stream) {
  if (plan.products == Products::kFp32 || plan.caller_blas) return nullptr;
  cublasHandle_t h = nullptr;
  return cuda::blas_handle(stream, ws + plan.blas, plan.blas_bytes, &h).ok() ? h : nullptr;
}

// The handle an enqueue on `stream` takes: capture_blas's while capturing; else `blas` (call_blas's),
// the library's own bound to `stream` again, since a capture that failed (its call then runs
// directly, graph_replay.h) may have left it bound to the capturing stream.
static Status enqueue_blas(const CudaBackwardPlan& plan, char* ws, cudaStream_t stream, bool capturing,
                           cublasHandle_t blas, cublasHandle_t* out) {
  if (capturing) return *out = capture_blas(plan, ws, stream), Status::Ok();
  if (plan.caller_blas || blas == nullptr) return *out = blas, Status::Ok();
  return cuda::blas_handle(stream, ws + plan.blas, plan.blas_bytes, out);
}

// What a training call's launches take (graph_replay.h): the problem, the gradients, the plan
// and the buffers. `kind` tells the forward's key (0; 2 where the seed, passed by value, is written
// before the graph) from the backward's (1).
static cuda::CallKey call_key(int kind, const AxialParams& p, const AxialGrads* g, const CudaBackwardPlan& plan,
                       const void* saved, const void* workspace) {
  cuda::CallKey k;
  k.add(kind);
  for (int64_t v : {p.batch, p.height, p.width, p.dim, p.heads}) k.add(v);
  k.add(p.eps), k.add(p.dropout);
  // The mask's seed and offset enter the launches of a forward of kind 0 with dropout alone: kind
  // 2's are written before its graph, and the backward reads them from saved.
  if (kind == 0 && p.dropout > 0.0f) {
    k.add(p.seed), k.add(p.offset);
    k.add(static_cast<const void*>(p.seed_device)), k.add(static_cast<const void*>(p.offset_device));
  }
  k.add(static_cast<const void*>(p.x)), k.add(static_cast<const void*>(p.out));
  for (const AxisWeights* w : {&p.row, &p.col})
    for (const float* ptr : {w->norm_weight, w->norm_bias, w->qkv_weight, w->out_weight, w->out_bias}) k.add(ptr);
  if (g != nullptr) {
    k.add(g->grad_out), k.add(g->grad_x);
    for (const AxisGrads* a : {&g->row, &g->col})
      for (const float* ptr : {a->norm_weight, a->norm_bias, a->qkv_weight, a->out_weight, a->out_bias}) k.add(ptr);
  }
  for (const CudaBackwardPlan::Pass* b : {&plan.row, &plan.col})
    for (size_t v : {b->norm, b->stats, b->qkv, b->attn, b->lse, b->attn16}) k.add(static_cast<uint64_t>(v));
  k.add(static_cast<int>(plan.products));
  k.add(static_cast<uint64_t>(plan.weights16)), k.add(static_cast<uint64_t>(plan.operand16));
  for (size_t v : {plan.row_output, plan.dropout_state, plan.saved_bytes, plan.grad_row_output, plan.grad_attn,
                   plan.grad_qkv, plan.grad_norm, plan.delta, plan.column_partials, plan.blas, plan.blas_bytes,
                   plan.weight_planes, plan.weight_grad_partials, plan.weight_grad_partials_bytes,
                   plan.attention_scores, plan.attention_scores_bytes, plan.flash_partials,
                   plan.flash_partials_bytes, plan.attention_partials, plan.attention_partials_bytes,
                   plan.workspace_bytes})
    k.add(static_cast<uint64_t>(v));
  k.add(plan.caller_blas), k.add(plan.tensor_core_products), k.add(plan.tensor_core_weight_grads);
  k.add(plan.row_scores), k.add(plan.col_scores);
  k.add(saved), k.add(workspace);
  return k;
}

Status forward_cuda_training(const AxialParams& p, const CudaBackwardPlan& plan, void* saved, size_t saved_bytes,
                             void* workspace, size_t workspace_bytes, CUstream_st* stream, void* blas_handle) {
  if (Status s = validate(p); !s.ok()) return s;
  DeviceCaps dev;
  if (Status s = check_call(p, plan, saved, saved_bytes, workspace, workspace_bytes, &dev); !s.ok()) return s;
  if (p.batch * p.height * p.width == 0) return Status::Ok();
  char* ws = static_cast<char*>(workspace);
  cublasHandle_t blas = nullptr;
  cuda::CallerBlas caller;
  if (Status s = call_blas(plan, blas_handle, ws, stream, &caller, &blas); !s.ok()) return s;
  // The mask's seed and offset into saved, where the kernels read them (zeros without dropout: every
  // byte of saved is written). A seed passed by value changes every call, so it stays out of the
  // graph: its write is a launch of its own before it, and the graph is keyed without it. A
  // training step with dropout then replays as one without does.
  const bool drop = p.dropout > 0.0f, seed_by_value = drop && p.seed_device == nullptr;
  const auto write_state = [&](cudaStream_t s) -> Status {
    if (cudaError_t e = cuda::write_dropout_state(
            drop ? p.seed : 0, drop ? p.offset : 0, drop ? p.seed_device : nullptr, drop ? p.offset_device : nullptr,
            reinterpret_cast<uint64_t*>(static_cast<char*>(saved) + plan.dropout_state), dev, s);
        e != cudaSuccess)
      return cuda_error(e, "write_dropout_state launch");
    return Status::Ok();
  };
  if (seed_by_value)
    if (Status st = write_state(stream); !st.ok()) return st;
  const auto enqueue = [&](cudaStream_t s, bool capturing) {
    if (Status st = zero_saved_gaps(p, plan, static_cast<char*>(saved), s); !st.ok()) return st;
    if (!seed_by_value)
      if (Status st = write_state(s); !st.ok()) return st;
    cublasHandle_t h = nullptr;
    if (Status st = enqueue_blas(plan, ws, s, capturing, blas, &h); !st.ok()) return st;
    return Training(p, plan, static_cast<char*>(saved), ws, dev, s, h).forward(p.out);
  };
  return cuda::run_graphed(call_key(seed_by_value ? 2 : 0, p, nullptr, plan, saved, workspace), stream, dev.device,
                           enqueue);
}

Status backward_cuda(const AxialParams& p, const AxialGrads& g, const CudaBackwardPlan& plan, const void* saved,
                     size_t saved_bytes, void* workspace, size_t workspace_bytes, CUstream_st* stream,
                     void* blas_handle) {
  DeviceCaps dev;
  if (Status s = check_call(p, plan, saved, saved_bytes, workspace, workspace_bytes, &dev); !s.ok()) return s;
  if (g.grad_x != nullptr && g.grad_x == p.x) return invalid("grad_x must not alias x");
  if (p.batch * p.height * p.width == 0) return zero_weight_grads(p, g, stream);
  if (g.grad_out == nullptr) return invalid("grad_out is null");
  if (g.grad_x == nullptr && !any(g.row) && !any(g.col)) return Status::Ok();
  char* ws = static_cast<char*>(workspace);
  cublasHandle_t blas = nullptr;
  cuda::CallerBlas caller;
  if (Status s = call_blas(plan, blas_handle, ws, stream, &caller, &blas); !s.ok()) return s;
  // The saved forward is only read: the const is cast away for the shared buffer layout. The
  // backward reads the dropout mask's seed and offset from it, so a replay draws the right mask.
  char* kept = static_cast<char*>(const_cast<void*>(saved));
  const auto enqueue = [&](cudaStream_t s, bool capturing) {
    cublasHandle_t h = nullptr;
    if (Status st = enqueue_blas(plan, ws, s, capturing, blas, &h); !st.ok()) return st;
    return Training(p, plan, kept, ws, dev, s, h).backward(g);
  };
  return cuda::run_graphed(call_key(1, p, &g, plan, saved, workspace), stream, dev.device, enqueue);
}

}  // namespace fastaxial
