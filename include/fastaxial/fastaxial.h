// fastaxial: fused axial attention, forward pass, fp32.
//
// Axial attention on a (B, H, W, D) grid: self-attention along each row
// (sequences of length W), added to the input, then along each column
// (sequences of length H), added again. Per axis, on a sequence x of shape
// (L, D):
//   y   = LayerNorm(x)                       (eps, affine)
//   qkv = y @ Wqkv^T                         Wqkv is (3D, D), rows [q | k | v]
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h  per head h, hd = D / heads
//   x  += concat_h(o_h) @ Wout^T + bout      Wout is (D, D)
//
// This header knows nothing of PyTorch or of CUDA's headers: plain pointers,
// sizes and a status. All tensors are contiguous, row-major, float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;  // cudaStream_t is CUstream_st*; declared so this header needs no CUDA

namespace fastaxial {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a size, pointer or option is out of range
  kUnsupported,      // valid input this build or device cannot run
  kCudaError,        // a CUDA call or kernel launch failed
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;  // empty when ok

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
};

// The precision of the matrix products (AxialParams::products): fp32 (the tensor cores' 3xTF32
// split, within twice plain fp32's error), or bf16 or fp16 (operands rounded to the 16-bit type,
// fp32 accumulation: what PyTorch's Linear layers and attention compute under autocast).
enum class Products { kFp32, kBf16, kFp16 };

// The five parameter tensors of one axis (row or column).
struct AxisWeights {
  const float* norm_weight = nullptr;  // (D)      LayerNorm gain
  const float* norm_bias = nullptr;    // (D)      LayerNorm shift
  const float* qkv_weight = nullptr;   // (3D, D)  no bias
  const float* out_weight = nullptr;   // (D, D)
  const float* out_bias = nullptr;     // (D)
};

struct AxialParams {
  int64_t batch = 0;   // B
  int64_t height = 0;  // H: column sequence length
  int64_t width = 0;   // W: row sequence length
  int64_t dim = 0;     // D: features per position
  int64_t heads = 0;   // D % heads == 0
  float eps = 1e-5f;   // LayerNorm epsilon
  // Sizes: B, H, W >= 0; B*H*W*D, the product of the non-zero ones among B, H, W times D, and
  // 3 D^2 (the qkv weight) must fit in int64, else kInvalidArgument (even where a zero size leaves
  // nothing to compute).

  const float* x = nullptr;  // (B, H, W, D) input
  float* out = nullptr;      // (B, H, W, D) output; may not alias x
  AxisWeights row;           // attention along W
  AxisWeights col;           // attention along H

  // Attention dropout (nn.Dropout on the attention probabilities of both passes, as in
  // training mode): each probability is zeroed with probability `dropout`, the kept ones
  // scaled by 1 / (1 - dropout); dropout = 1 zeroes every attention branch. In [0, 1];
  // 0 (the default) is no dropout, the exact code and results of a forward without it.
  // The keep mask is a function of (seed, offset, element) alone (Philox4x32-10, defined
  // in src/common/dropout.h), so the backward, given the same params, regenerates the
  // forward's mask without storing it; the same (seed, offset) give the same mask on every
  // call and thread count. Advance offset (or change seed) for a fresh mask. forward_cpu,
  // backward_cpu and the CUDA training calls apply it (forward_cuda refuses it: kUnsupported).
  float dropout = 0.0f;
  uint64_t seed = 0;
  uint64_t offset = 0;

  // The matrix products of forward_cuda (Products above). kBf16 and kFp16 run every pass that
  // the staged path serves (an sm_90a build on a compute-capability 9.0 GPU, dim a multiple of 8,
  // aligned tensors; not where FASTAXIAL_CUDA_PATH forces the fused or generic family) on it, with
  // LayerNorm's output rounded to the type, the projections on cuBLAS's 16-bit products, the flash
  // attention kernel's 16-bit products, and LayerNorm's statistics and the softmax in fp32; the
  // other passes keep fp32 products (CudaPlan's PassPlan::products says which). The CPU calls
  // compute in fp32 whatever it is; the CUDA training calls run both passes on them (below).
  Products products = Products::kFp32;
  // CUDA graphs: where set, forward_cuda_training reads the seed and the offset from device
  // memory when the kernels run, seed = *seed_device and offset = *offset_device + offset, so
  // that a captured graph draws a fresh mask at each replay from values updated between
  // replays (PyTorch's generator keeps its state so under capture). Both or neither.
  const uint64_t* seed_device = nullptr;
  const uint64_t* offset_device = nullptr;

  // CPU training: the row pass's output x1 = x + RowPass(x), (B, H, W, D), the column pass's
  // input. Where given, forward_cpu writes it and backward_cpu reads it instead of running the
  // row pass again (about half a forward saved a step): give both calls the same buffer, and the
  // backward the forward's params. It must not be x, out, grad_out, grad_x, saved_qkv or saved_o
  // (pointers are compared, not ranges: buffers must not overlap). The CUDA calls do not use it
  // (validate still applies these rules).
  float* row_out = nullptr;
  // CPU training too: each pass's q, k and v at every position, (2, B, H, W, 3D), the row pass's
  // first. Where given, forward_cpu writes them and backward_cpu reads them instead of running
  // the QKV products again (3 B H W D^2 multiply-adds a pass). The same rules as row_out; give
  // both or neither (the backward mixes a kept q, k, v with a recomputed x1 otherwise, which may
  // differ from the forward's in the last bits).
  float* saved_qkv = nullptr;
  // CPU training too: the attention output o at every position (the heads' outputs before the
  // output product) of each pass whose sequences have 128 positions or more, (B, H, W, D) a pass,
  // the row pass's first: saved_o_floats(p) floats. Where given, forward_cpu writes it and
  // backward_cpu reads it for the output weight's gradient (dWout = dOut^T o) instead of running
  // p v again (one L^2 hd product a sequence and head; at shorter sequences writing o costs more
  // than that product). The same rules as row_out; it must not be saved_qkv either.
  float* saved_o = nullptr;
  // CPU training too: the softmax probabilities P of each pass whose sequences have fewer than 128
  // positions, a (L, L) matrix a sequence and head (sequences in the pass's order, heads within),
  // the row pass's first: saved_p_floats(p) floats. Where given, forward_cpu writes them and
  // backward_cpu reads them instead of running the scores and the softmax again (the same values:
  // the backward's own P at these lengths is the forward's, bit for bit). The same rules as
  // row_out; it must not be saved_qkv or saved_o either.
  float* saved_p = nullptr;
};

// Floats AxialParams::saved_o holds for p's sizes: B H W D for the row pass where W >= 128, and as
// many for the column pass where H >= 128; 0 where neither keeps it.
int64_t saved_o_floats(const AxialParams& p);

// Floats AxialParams::saved_p holds for p's sizes: B H W heads W for the row pass where W < 128, and
// B H W heads H for the column pass where H < 128.
int64_t saved_p_floats(const AxialParams& p);

// Checks sizes and pointers; the entry points below call it first.
Status validate(const AxialParams& p);

// CPU forward. Threads over sequences with OpenMP. With p.dropout > 0, attention dropout with the
// mask of (p.seed, p.offset): the same params and thread count give bitwise the same output.
Status forward_cpu(const AxialParams& p);

// ---- CPU products ---------------------------------------------------------------------------
// The CPU forward and backward run their matrix products on Eigen's own GEMM unless a BLAS sgemm
// is set here (the Fortran interface: column-major, 32-bit integers; MKL's, OpenBLAS's or BLIS's
// sgemm_). The torch module sets the one PyTorch itself runs on. The BLAS must be safe to call
// from several threads at once and give the same bits for the same inputs, alignment and thread
// count. fastaxial calls it from its own OpenMP threads, one product per thread at a time, so it
// must run each call on one thread (a BLAS team beside fastaxial's stalls both: docs/cpu-blas.md):
// MKL through a wrapper that sets mkl_set_num_threads_local(1) around the call, or sequential
// MKL; a pthread OpenBLAS after openblas_set_num_threads(1) (process-wide). A BLAS whose header
// declares sgemm_ with other pointer types needs a wrapper of this signature.
// Products larger than 32-bit sizes fall back to Eigen. Set it before CPU calls run, not during.
using CpuSgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                          const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                          const float* beta, float* c, const int* ldc);
void set_cpu_sgemm(CpuSgemm sgemm);  // null: Eigen's GEMM again
CpuSgemm cpu_sgemm();                // the one set, or null

// ---- CPU backward --------------------------------------------------------------------------
// The gradients of a loss with respect to forward_cpu's input and its ten weights, given the
// gradient with respect to its output. Of the forward it reads what the caller kept (p.row_out,
// p.saved_qkv) and recomputes the rest (without them the row pass's output and each pass's q, k,
// v; always each pass's LayerNorm and softmax), so it takes the same AxialParams as the forward. fp32 throughout, like the forward, but for the column sums
// (the LayerNorm weight and shift and the output bias gradients), added in fp64 and rounded once.

// Gradients of one axis's five weights; a null pointer: that gradient is not wanted (and costs nothing).
struct AxisGrads {
  float* norm_weight = nullptr;  // (D)
  float* norm_bias = nullptr;    // (D)
  float* qkv_weight = nullptr;   // (3D, D)
  float* out_weight = nullptr;   // (D, D)
  float* out_bias = nullptr;     // (D)
};
struct AxialGrads {
  const float* grad_out = nullptr;  // (B, H, W, D): the gradient of the loss with respect to the forward's output
  float* grad_x = nullptr;          // (B, H, W, D), or null
  AxisGrads row, col;
};
// CPU backward of forward_cpu(p): writes (does not accumulate) every non-null gradient of g. p.out is not read (may be null).
// With p.dropout > 0 it draws the forward's dropout mask again from p.seed and p.offset: pass the forward's params.
// Deterministic: the same inputs and thread count give bitwise identical gradients (weight gradients are summed per block of
// sequences in a fixed order, never by atomics or in thread-arrival order).
// (The backward's blocking depends on the shape alone, so without p.row_out and p.saved_qkv the thread count does not
// change the result either. With them the gradients are those at the forward's x1 and q, k, v, whose blocks depend on
// the thread count, as the forward's output does: the last bits may differ at another thread count.)
// grad_x may be grad_out itself (overwritten in place) but not x; no gradient may overlap an input or another gradient.
// An empty problem (B H W = 0) writes zeros into the wanted weight gradients.
Status backward_cpu(const AxialParams& p, const AxialGrads& g);

// The dropout mask of one pass of p (0: rows, 1: columns) as the kernels draw it from p.dropout,
// p.seed and p.offset (CPU and CUDA alike), for tests and debugging: out (N, heads, L, L), N and L
// the pass's sequences and length (rows: B H and W, columns: B W and H), gets the multiplier of
// each attention probability, 1 / (1 - p.dropout) where kept and 0 where dropped (all ones
// with p.dropout = 0). Sizes and dropout are validated; pointers other than out are not read.
Status dropout_mask(const AxialParams& p, int pass, float* out);

// True when this build contains the CUDA kernels.
bool cuda_compiled();

// True when this build applies attention dropout (it was built with Random123); without it,
// every entry point refuses dropout > 0 (kUnsupported).
bool dropout_compiled();

// ---- CUDA: plan, workspace, forward --------------------------------------------------------
// As in CUTLASS: plan the problem, allocate the workspace the plan asks for,
// then run. The plan is made on the host from the problem (sizes, pointer
// alignment) and the current device; it picks each pass's kernel family (and
// attention kernel) and lays out every byte of the workspace, so the workspace covers the chosen
// kernels by construction.

// The CUDA kernel families of one attention pass (README, "Performance"):
//   kFused:   one block per whole sequence (L <= 128), every product on the
//             tensor cores;
//   kStaged:  LayerNorm, QKV product, attention and output product as
//             separate tensor-core kernels over all positions, with q, k, v
//             in the workspace (Hopper, an sm_90a build); any length, head
//             dims up to 256, dims a multiple of 8;
//   kGeneric: FFMA, any shape.
enum class KernelFamily { kFused, kStaged, kGeneric };
const char* to_string(KernelFamily family);  // "fused", "staged", "generic"

// The flash attention kernel of a staged pass that streams its keys (PassPlan::flash_kernel):
//   kShort:     sequences of up to 4 positions: a warp per (sequence, head), plain fp32;
//   kMmaSync:   blocks of 64 queries, keys streamed through shared memory, 3xTF32 mma.sync;
//   kWgmma:     the same on Hopper's wgmma, head dims 17 to 32, sequences longer than 64;
//   kWgmmaWide: the same for head dims 49 to 128;
//   kWgmma16:   16-bit products (AxialParams::products) on Hopper's wgmma, head dims 17 to 32 and 65 to 128,
//               sequences longer than 64 (elsewhere 16-bit products run on kMmaSync);
//   kQkv16:     16-bit products on q, k and v the QKV product stored in 16 bits (the pass without
//               gradients), Hopper's wgmma, head dims 24 to 128 a multiple of 8, sequences longer
//               than 64, no dropout.
// kNone: the pass does not run flash attention.
enum class FlashKernel { kNone, kShort, kMmaSync, kWgmma, kWgmmaWide, kWgmma16, kQkv16 };

// The attention backward of a pass (CudaBackwardPlan::PassKernels):
//   kSingleKey:   sequences of one position: one kernel writes dv = d_o (dq = dk = 0);
//   kTensorCores: dk and dv, then dq, on 3xTF32 mma.sync (dq as below);
//   kFfma:        the same in plain fp32, where the device's shared memory is too small for
//                 the tensor-core tiles.
enum class AttentionGradKernel { kNone, kSingleKey, kTensorCores, kFfma };
const char* to_string(AttentionGradKernel kernel);  // "none", "single-key", "tensor-cores", "ffma"

// Its dq: from the dS^T the dk, dv kernel stored (kFromScores: one product), or recomputing the
// scores on mma.sync, on Hopper's wgmma (head dims 17 to 32, long sequences), or in FFMA.
enum class QueryGradKernel { kNone, kFromScores, kMmaSync, kWgmma, kFfma };
const char* to_string(QueryGradKernel kernel);  // "none", "from-scores", "mma.sync", "wgmma", "ffma"
const char* to_string(FlashKernel kernel);  // "none", "short", "mma.sync", "wgmma", "wgmma-wide", "wgmma-16bit"

struct PassPlan {
  KernelFamily family = KernelFamily::kGeneric;
  bool wgmma = false;  // kFused only: the projections on Hopper's wgmma (else mma.sync)
  bool flash = false;  // kStaged only: attention by query tiles with keys streamed (else a
                       // block per (sequence, head) holding all its keys)
  // Where flash: its kernel, and how many blocks share each query tile's keys (split-KV, for
  // passes of few long sequences; 1: no split).
  FlashKernel flash_kernel = FlashKernel::kNone;
  int flash_splits = 1;
  // The pass's products: AxialParams::products where the pass is staged, else kFp32.
  Products products = Products::kFp32;
};

struct CudaPlan {
  static constexpr size_t kNone = ~size_t{0};  // offset of a region the plan does not use

  PassPlan row, col;  // attention along W, then along H

  // Workspace layout, in bytes from its start (which must be 256-byte aligned).
  size_t row_output = 0;                // (B, H, W, D) floats: row pass out, column pass in
  size_t staged_scratch = kNone;        // 4 T D floats (T = B H W) for the staged passes
  size_t row_weight_planes = kNone;     // a staged pass's weights as TF32 (hi, lo) planes:
  size_t col_weight_planes = kNone;     //   8 D^2 floats each
  // Split-KV partials of the staged passes that take the flash kernel with
  // its keys split (few sequences and heads, long sequences): sized for the
  // larger of the two passes, which run one after the other and share it;
  // kNone where no pass splits.
  size_t flash_partials = kNone;
  size_t flash_partials_bytes = 0;
  // Passes on 16-bit products: an operand rounded to the type, T D 16-bit values (the LayerNorm
  // output, then the attention output); each such pass's weights rounded, 4 D^2 values (Wqkv,
  // then Wout), the row pass's first; the workspace of the library's cuBLAS handle (kNone where
  // the caller gives its own: caller_blas).
  size_t operand16 = kNone;
  size_t weights16 = kNone;
  size_t blas = kNone;
  size_t blas_bytes = 0;
  bool caller_blas = false;  // plan_cuda's caller_blas: forward_cuda takes the caller's cuBLAS handle
  size_t workspace_bytes = 0;           // the whole workspace

  // What the plan was made for; forward_cuda rejects another problem, products or device.
  int64_t batch = 0, height = 0, width = 0, dim = 0, heads = 0;
  Products products = Products::kFp32;
  int device = -1;

  // One line, e.g. "row: fused (wgmma), col: staged (flash wgmma-wide, 2 splits); workspace
  // 1310720 B (...)".
  std::string describe() const;
};

// Plans the forward of p on the current CUDA device. p is validated first
// (its sizes decide the workspace; a negative size is an error, not a huge
// size); its pointers may be null when no forward is planned yet for them, as
// null counts as aligned. The choice depends on the shape, the device
// (multiprocessors, shared memory, compute capability), the alignment of p's
// pointers, and two environment variables read once per process:
// FASTAXIAL_CUDA_PATH=fused|staged|generic forces one family on every pass
// whose shape that family supports (an error where the device cannot run it),
// and FASTAXIAL_FUSED_WGMMA=0|1 turns the fused kernel's wgmma projections off
// or on (default on). Another value of either is an error.
// kUnsupported in a build without CUDA or with no device. caller_blas: the 16-bit
// products (AxialParams::products) will run on the caller's cuBLAS handle, given
// to forward_cuda (as the training calls take one), so the plan reserves no
// workspace for a handle of the library's own.
Status plan_cuda(const AxialParams& p, CudaPlan* plan, bool caller_blas = false);

// plan_cuda(p).workspace_bytes: the device scratch forward_cuda(p) needs on
// the current device.
Status cuda_workspace_bytes(const AxialParams& p, size_t* bytes);

// CUDA forward on `stream` (nullptr: the default stream) of the plan made by
// plan_cuda for p on the current device. All pointers are device pointers;
// `workspace` is 256-byte aligned and holds `workspace_bytes` >=
// plan.workspace_bytes bytes. Launches only: no allocation, no
// synchronisation, so it can be captured in a graph.
// Precision: fp32 inputs, outputs and accumulation. The fused and staged
// families run every product on the tensor cores, each fp32 operand split
// into two TF32 parts (3xTF32): error against float64 within twice that of
// plain fp32 arithmetic in the tests, though not bit-identical to it. The
// generic family uses fp32 FMA. PyTorch's TF32 switches do not apply. With
// 16-bit products (AxialParams::products), their cuBLAS calls run on
// blas_handle (a cublasHandle_t bound to `stream`) where the plan was made
// with caller_blas, else on a handle of the library's own, created on a
// thread's first such call (so make that call before any graph capture).
Status forward_cuda(const AxialParams& p, const CudaPlan& plan, void* workspace, size_t workspace_bytes,
                    CUstream_st* stream, void* blas_handle = nullptr);

// Plans p, then runs it: the same as plan_cuda followed by the call above.
Status forward_cuda(const AxialParams& p, void* workspace, size_t workspace_bytes, CUstream_st* stream);

// ---- CUDA training: a forward that keeps what the backward needs, and the backward --------
// As backward_cpu gives them, on the GPU, in two calls that share one plan:
//   forward_cuda_training(p, plan, saved, workspace)   p.out, and the forward's intermediates in
//                                                      `saved`: each pass's LayerNorm output and
//                                                      statistics, q, k, v, attention output and
//                                                      softmax log-sum-exp, and the row pass's output
//   backward_cuda(p, g, plan, saved, workspace)        the gradients, from `saved`
// No L x L matrix is stored: the attention backward recomputes the probabilities tile by tile
// from the saved log-sum-exp. A caller that kept nothing runs forward_cuda_training into a
// scratch output first (the torch binding does this for a backward without a saved forward).
//
// Precision and order: fp32 throughout, but for the column sums (the bias and LayerNorm
// gradients: fp64 adds, rounded once). The projections and the activations' gradients through
// them run on Hopper's tensor cores with 3xTF32 where the forward's staged path can (an sm_90a
// build on a compute-capability 9.0 GPU, dim a multiple of 8), else as cuBLAS fp32 GEMMs; the
// projection weights' gradients (sums over all B H W positions) are 3xTF32 tensor-core sums
// over chunks of positions, the chunks added in a fixed order (cuBLAS fp32 where that kernel
// does not fit the device); the bias and LayerNorm gradients are column sums in a fixed order; the attention is
// fp32 arithmetic. Deterministic: no floating-point atomics anywhere, so the same inputs on
// the same GPU give bitwise identical gradients.
// On 16-bit products (p.products bf16 or fp16, the plan made for them): every product takes its
// operands rounded to the type and accumulates in fp32, as PyTorch's Linear layers and attention
// under autocast: the projections, the activations' gradients through them and the weight
// gradients on cuBLAS's 16-bit products, the attention forward and backward on the tensor-core
// kernels' 16-bit instances; LayerNorm, its statistics, the softmax, the log-sum-exp and the column
// sums as on fp32 products. Deterministic as those. kUnsupported where a pass's attention backward has
// no tensor-core kernel (head dims whose tiles do not fit the device's shared memory). These calls
// stay out of the library's own graph replays (graph_replay.h: cuBLAS runs outside them).

// Largest head dim the CUDA training path serves (PyTorch's binding differentiates the
// reference math for wider heads).
constexpr int64_t kCudaBackwardMaxHeadDim = 256;

struct CudaBackwardPlan {
  static constexpr size_t kNone = ~size_t{0};

  // One pass's saved forward, in bytes from the start of `saved` (256-byte aligned each).
  struct Pass {
    size_t norm = 0;   // (T, D)  LayerNorm output (T = B H W positions)
    size_t stats = 0;  // (T, 2)  LayerNorm mean and 1 / std per position
    size_t qkv = 0;    // (T, 3D)
    size_t attn = 0;   // (T, D)  attention output before the output projection
    size_t lse = 0;    // 2 T heads floats: softmax log-sum-exp per (sequence, head, query), log2 units, hi then lo
    // On 16-bit products (`products` below): norm's region holds the LayerNorm output rounded to
    // the type (T D 16-bit values) and from attn16 on (its second half) the attention output rounded
    // (T, D): the backward's 16-bit operands. kNone on fp32 products. (saved_bytes is the same for
    // any products.)
    size_t attn16 = kNone;
  };
  Pass row, col;
  size_t row_output = 0;   // (T, D) the row pass's output: the column pass's input
  // 16 bytes, the last of `saved`: the dropout mask's seed and offset as two uint64, as the
  // training forward resolved them (zeros without dropout); the backward draws the mask from them.
  size_t dropout_state = 0;
  size_t saved_bytes = 0;  // the whole of `saved`

  // The workspace (scratch of either call), in bytes from its start.
  size_t grad_row_output = 0;  // (T, D) the loss's gradient with respect to the row pass's output
  size_t grad_attn = 0;        // (T, D) gradient of a pass's attention output, then LayerNorm scratch
  size_t grad_qkv = 0;         // (T, 3D)
  size_t grad_norm = 0;        // (T, D) gradient of a pass's LayerNorm output
  size_t delta = 0;            // (T, heads) rowsum(dO o O) per head, of the attention backward
  size_t column_partials = 0;  // (5 * 128 + 3) D doubles: column sums of the bias and LayerNorm weight gradients
  size_t blas = 0;             // cuBLAS's workspace (its products' scratch); none where caller_blas
  size_t blas_bytes = 0;
  // The training calls run their cuBLAS products on the caller's handle (plan_backward_cuda's
  // caller_blas), with its workspace: the plan reserves none.
  bool caller_blas = false;
  // Where the projections run on the tensor cores (3xTF32 wgmma), the weights as (hi, lo) TF32
  // planes, per pass (row, then column) Wqkv, Wout, Wout^T, Wqkv^T: 16 D^2 floats a pass; else kNone.
  bool tensor_core_products = false;
  size_t weight_planes = kNone;
  // Where the weight gradients (sums over all T positions) run on the tensor cores (3xTF32
  // wgmma on sm_90a, else mma.sync, compute capability 8.0 on), the partial sums of chunks of
  // positions, [S][N][K] floats, where the positions are split (S > 1): sized for the larger
  // product, d_Wqkv or d_Wo, and the larger split of the two kernels, and reused by each product
  // in turn; else kNone.
  bool tensor_core_weight_grads = false;
  size_t weight_grad_partials = kNone;
  size_t weight_grad_partials_bytes = 0;
  // The attention backward's score gradients dS^T (num_seq, heads, L, L rounded up to 4 floats), for
  // the passes whose scratch stays within a few activations (row_scores, col_scores); the dq of the
  // others recomputes the scores. kNone where neither pass takes it.
  bool row_scores = false, col_scores = false;
  size_t attention_scores = kNone;
  size_t attention_scores_bytes = 0;
  // The training forward's split-KV partials (as CudaPlan::flash_partials: a pass of few long
  // sequences splits each query tile's keys over several blocks; not with dropout), sized for the
  // larger pass; kNone where neither pass splits.
  size_t flash_partials = kNone;
  size_t flash_partials_bytes = 0;
  // The attention backward's partial sums where a pass of few long sequences splits its blocks'
  // streamed tiles (dk, dv over query ranges, dq over key ranges), added in split order after:
  // sized for the larger pass; kNone where neither pass splits. The same region as
  // flash_partials where both are there (one call uses each).
  size_t attention_partials = kNone;
  size_t attention_partials_bytes = 0;
  // On 16-bit products: a pass's projection weights rounded to the type, Wqkv (3D, D) then Wout
  // (D, D), 16-bit values (each pass of each call rounds them in turn); and 3 T D 16-bit values, the
  // backward's rounded operands (a pass's output gradient, then its qkv gradient). Else kNone.
  size_t weights16 = kNone;
  size_t operand16 = kNone;
  size_t workspace_bytes = 0;  // the whole workspace

  // The kernels each pass runs, by the rules the two calls follow (src/common/plan.h): the
  // training forward's flash attention and its key splits, the attention backward's kernels and
  // its splits (1: none).
  struct PassKernels {
    FlashKernel flash = FlashKernel::kNone;
    int flash_splits = 1;
    AttentionGradKernel grad = AttentionGradKernel::kNone;
    QueryGradKernel dq = QueryGradKernel::kNone;
    int grad_splits = 1;
  };
  PassKernels row_kernels, col_kernels;

  // What the plan was made for; the two calls reject another problem, products or device.
  int64_t batch = 0, height = 0, width = 0, dim = 0, heads = 0;
  Products products = Products::kFp32;
  int device = -1;

  std::string describe() const;
};

// Plans the training calls of p on the current CUDA device (p validated first; pointers may be
// null). kUnsupported for head dims above kCudaBackwardMaxHeadDim, on GPUs below compute
// capability 8.0, and in a build without CUDA. caller_blas: the caller will pass its own cuBLAS
// handle to the training calls (a framework's, whose workspace persists across calls, as
// PyTorch's does), so the workspace holds no cuBLAS scratch; otherwise the calls use a handle of
// the library's own with a region of the workspace (cuBLAS's recommended size for the GPU).
Status plan_backward_cuda(const AxialParams& p, CudaBackwardPlan* plan, bool caller_blas = false);

// The bytes of `saved` for p (plan.saved_bytes; it depends on the sizes alone, not the device).
Status cuda_saved_bytes(const AxialParams& p, size_t* bytes);

// forward_cuda's output in p.out, and `saved` (saved_bytes >= plan.saved_bytes) filled for
// backward_cuda (every one of its plan.saved_bytes bytes written: the alignment gaps with zeros;
// with p.dropout > 0 the mask's seed and offset as the kernels read them, else zeros, in its last
// 16 bytes). `saved` and `workspace` are 256-byte aligned device buffers; the workspace
// holds workspace_bytes >= plan.workspace_bytes bytes. Launches only (no device allocation, no
// synchronisation), so it can be captured in a graph; the second call of a key (below) also
// captures and instantiates its own graph, on a stream of the library's.
// blas_handle: where plan.caller_blas, the caller's cuBLAS handle (a cublasHandle_t) bound to
// `stream`, with its workspace set; its math mode is set to fp32 for the call's products and
// restored after. Null otherwise.
Status forward_cuda_training(const AxialParams& p, const CudaBackwardPlan& plan, void* saved, size_t saved_bytes,
                             void* workspace, size_t workspace_bytes, CUstream_st* stream,
                             void* blas_handle = nullptr);

// The backward of forward_cuda_training(p) on `stream`, from the `saved` it filled: writes (does
// not accumulate) every non-null gradient of g, with backward_cpu's aliasing rules (grad_x may
// be grad_out). p.out is not read. With p.dropout > 0 (pass the forward's rate) the mask is drawn
// again from the seed and offset the forward wrote into `saved` (p.seed, p.offset and the
// device pointers are not read). Launches only, as above.
//
// Both training calls replay a CUDA graph of their launches where a call comes again with the
// same sizes, pointers and plan (as each step of a training loop does when its allocator hands
// out the same buffers): the second such call captures its launches, later ones launch the graph
// at the cost of one launch (a call's 10 to 40 launches otherwise take longer to issue than a
// small problem's GPU work). The results are the same bits. Only calls that run no cuBLAS
// product are captured (the tensor-core products: an sm_90a build on a compute-capability 9.0
// GPU, 16-byte aligned activations); others always launch directly, as do calls on a stream
// being captured (into that capture). FASTAXIAL_CUDA_GRAPHS=0 turns replays off.
Status backward_cuda(const AxialParams& p, const AxialGrads& g, const CudaBackwardPlan& plan, const void* saved,
                     size_t saved_bytes, void* workspace, size_t workspace_bytes, CUstream_st* stream,
                     void* blas_handle = nullptr);

}  // namespace fastaxial
