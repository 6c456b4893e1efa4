// The staged pass (pass.h): LayerNorm, the QKV product, attention and the
// output product as separate kernels over all the pass's positions, the
// intermediates in memory. The inference forward runs it for sequences
// longer than the fused kernel holds (L > 128), for dims whose q, k, v do not
// fit one block's shared memory, and for the wider-dim passes where it beats
// the fused kernel (the plan decides: common/plan.cpp); the training forward
// runs every pass this way, since its backward reads the intermediates.
// Why this shape: at these sizes the projections are most of the arithmetic,
// and as plain GEMMs over all T positions they run on Hopper's warpgroup
// tensor-core instructions (gemm/gemm.cu); the weights are stored split
// once, beside the first pass's LayerNorm, and the products split their A
// operands (norm, attn) in registers, so those are written once, as plain
// fp32. The inference path needs an sm_90a build on a compute-capability 9.0
// device; elsewhere the plan gives these shapes to the fused kernel where it
// holds the sequence, else to the generic one. The training forward's
// products fall back to cuBLAS where the tensor cores cannot take them
// (training.cu).
#include "pass.h"

#include "../attention/flash_attention.h"
#include "../attention/whole_sequence.h"
#include "../detail/host.h"
#include "../norm/norm.h"

namespace fastaxial::cuda {
namespace {

// One of the pass's products: on the caller's engine where it gives one, else on gemm_tf32x3.
Status project(const StagedPass& s, const GemmArgs& g, const float* weight, const char* what, const DeviceCaps& dev,
               cudaStream_t stream) {
  if (s.product != nullptr) return (*s.product)(g, weight, what);
  if (cudaError_t e = gemm_tf32x3(g, dev, stream); e != cudaSuccess) return cuda_error(e, what);
  return Status::Ok();
}

}  // namespace

void add_weight_splits(PlaneJobs* jobs, const AxisWeights& w, const StagedWeights& planes, int D) {
  jobs->add(w.qkv_weight, planes.qkv, 3 * (int64_t)D, D, false);
  jobs->add(w.out_weight, planes.out, D, D, false);
}

Status run_staged_pass(const StagedPass& s, const DeviceCaps& dev, cudaStream_t stream) {
  const AxialParams& p = *s.p;
  const AxisWeights& w = *s.w;
  const int D = (int)p.dim;
  const int64_t T = s.view.num_seq * s.view.len;

  if (cudaError_t e = layer_norm_forward(s.src, w.norm_weight, w.norm_bias, p.eps, T, D, s.norm, s.keep.stats, dev,
                                         stream, s.splits);
      e != cudaSuccess) {
    // Without statistics the launch takes a block per 8 positions (norm.h).
    if (e == cudaErrorInvalidConfiguration && s.keep.stats == nullptr)
      return {StatusCode::kUnsupported, "too many positions for one pass"};
    return cuda_error(e, "layer_norm_forward launch");
  }

  GemmArgs g;
  g.a = s.norm, g.w = s.planes.qkv, g.c = s.qkv, g.M = T, g.N = 3 * D, g.K = D;
  if (Status st = project(s, g, w.qkv_weight, "QKV product", dev, stream); !st.ok()) return st;

  cudaError_t e;
  if (s.flash) {
    FlashArgs f;
    f.pos = row_indices(s.view, D);
    f.qkv = s.qkv, f.o = s.attn, f.lse = s.keep.lse;
    f.D = D, f.heads = (int)p.heads;
    f.dropout = s.dropout, f.pass = s.pass, f.philox = s.philox;
    // The split-KV partials: used where the launcher's rule splits the pass and there is no dropout.
    f.partials = s.flash_partials, f.partials_bytes = s.flash_partials ? s.flash_partials_bytes : 0;
    e = flash_attention(f, dev, stream);
  } else {
    e = staged_attention(row_indices(s.view, D), s.qkv, s.attn, D, (int)p.heads, dev, stream);
  }
  if (e != cudaSuccess) return cuda_error(e, s.flash ? "flash_attention launch" : "staged_attention launch");

  g.a = s.attn, g.w = s.planes.out, g.bias = w.out_bias, g.residual = s.src, g.c = s.dst, g.N = D;
  return project(s, g, w.out_weight, "output product", dev, stream);
}

Status launch_staged(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                     float* scratch, const StagedWeights& split, const PlaneJobs& split_now, bool flash,
                     float* flash_partials, size_t flash_partials_bytes, const DeviceCaps& dev, cudaStream_t stream) {
  StagedPass s;
  s.view = view, s.p = &p, s.w = &w, s.src = src, s.dst = dst;
  const int64_t T = view.num_seq * view.len;
  s.norm = s.attn = scratch;               // (T, D): LayerNorm output, then attention output
  s.qkv = scratch + T * (int64_t)p.dim;  // (T, 3D)
  s.planes = split, s.splits = split_now;
  s.flash = flash, s.flash_partials = flash_partials, s.flash_partials_bytes = flash_partials_bytes;
  return run_staged_pass(s, dev, stream);
}

}  // namespace fastaxial::cuda

namespace fastaxial::cuda {

Status launch_staged_16bit(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                           float* dst, float* scratch, void* operand16, void* weights16, cublasHandle_t h,
                           Products type, const DeviceCaps& dev, cudaStream_t stream) {
  const int D = (int)p.dim;
  const int64_t T = view.num_seq * view.len, DD = (int64_t)D * D;
  float* qkv = scratch + T * (int64_t)D;  // (T, 3D); the first T D floats unused (the attention writes o16 alone)
  auto* wqkv16 = static_cast<uint16_t*>(weights16);  // (3D, D) rounded, then Wout (D, D)
  uint16_t* wout16 = wqkv16 + 3 * DD;
  const auto check = [](cudaError_t e, const char* what) { return e == cudaSuccess ? Status::Ok() : cuda_error(e, what); };
  // The positions are in memory order here: LayerNorm and the products act on each alone.
  // LayerNorm straight into the rounded operand, dst = src + bout (the output product adds to it)
  // and the weights rounded, in one launch.
  RoundJobs rounds;
  rounds.job[0] = {w.qkv_weight, wqkv16, 3 * DD}, rounds.job[1] = {w.out_weight, wout16, DD}, rounds.count = 2;
  if (cudaError_t e = layer_norm_forward_16bit(src, w.norm_weight, w.norm_bias, p.eps, T, D, operand16, type, rounds,
                                               w.out_bias, dst, /*stats=*/nullptr, dev, stream);
      e != cudaSuccess) {
    if (e == cudaErrorInvalidConfiguration) return {StatusCode::kUnsupported, "too many positions for one pass"};
    return cuda_error(e, "layer_norm_forward_16bit launch");
  }
  FlashArgs f;
  f.pos = row_indices(view, D);
  f.o = nullptr;
  f.o16 = operand16;  // the attention output rounded, for the output product (the LayerNorm output is read by now)
  f.D = D, f.heads = (int)p.heads;
  f.products = type;
  // q, k and v in 16 bits where the kQkv16 kernel serves the pass (in qkv's region: half its bytes),
  // else in fp32 for the kernels that round them.
  const bool qkv16 = flash_qkv16_chosen(f, dev);
  if (qkv16)
    f.qkv16 = qkv;
  else
    f.qkv = qkv;
  if (Status s = qkv16 ? gemm_16bit_rounded(h, type, false, true, T, 3 * D, D, operand16, D, wqkv16, D, qkv, 3 * D,
                                            "QKV product (16-bit, rounded)")
                       : gemm_16bit(h, type, false, true, T, 3 * D, D, operand16, D, wqkv16, D, 0.0f, qkv, 3 * D,
                                    "QKV product (16-bit)");
      !s.ok())
    return s;
  if (Status s = check(flash_attention(f, dev, stream), "flash_attention launch (16-bit products)"); !s.ok()) return s;
  return gemm_16bit(h, type, false, true, T, D, D, operand16, D, wout16, D, 1.0f, dst, D, "output product (16-bit)");
}

}  // namespace fastaxial::cuda
