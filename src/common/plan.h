// The plan of one CUDA forward (fastaxial.h's CudaPlan), made on the host:
// which kernel family serves each pass (and a staged pass's flash attention
// kernel), and where everything lies in the workspace. Host-only code: it knows the device through DeviceCaps, which
// the CUDA side reads once per device, so CI tests every rule without a GPU.
//
// Each pass's family, in order:
//   1. the shape's preference where every family could run it (from
//      timings on the H200, plan.cpp says which);
//   2. FASTAXIAL_CUDA_PATH, where the forced family can serve the pass;
//   3. narrowed to what the device and the pointers allow: the fused kernel
//      needs its shared memory and 16-byte aligned tensors, the staged path
//      an sm_90a build on a compute-capability 9.0 GPU; else the generic one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "axis.h"
#include "fastaxial/fastaxial.h"
#include "validate.h"  // validate_sizes: what make_plan needs of p

namespace fastaxial {

// What the plan needs to know of the device.
struct DeviceCaps {
  int device = 0;      // ordinal
  int sms = 0;         // multiprocessors
  int smem_optin = 0;  // bytes of shared memory a block may opt in to
  int cc_major = 0, cc_minor = 0;
  bool sm90a = false;  // the kernels run as this build's sm_90a code (cc 9.0, a build with 90a)
};

enum class ForcedFamily { kNone, kFused, kStaged, kGeneric };

// FASTAXIAL_CUDA_PATH and FASTAXIAL_FUSED_WGMMA, parsed.
struct PlanOptions {
  ForcedFamily forced = ForcedFamily::kNone;
  int fused_wgmma = -1;  // -1: where it applies (unset), 0: never, 1: required where it applies
};

// Parses the two variables' values (null: unset); an unknown value is an error.
Status parse_plan_options(const char* cuda_path, const char* fused_wgmma, PlanOptions* options);

// The process's options, read from the environment once.
Status env_plan_options(PlanOptions* options);

// The plan of p on dev; p must have passed validate_sizes() (validate.h).
Status make_plan(const AxialParams& p, const DeviceCaps& dev, const PlanOptions& options, CudaPlan* plan,
                 bool caller_blas = false);

// The plan of p's CUDA backward on dev (fastaxial.h's CudaBackwardPlan); p
// must have passed validate_sizes().
Status make_backward_plan(const AxialParams& p, const DeviceCaps& dev, CudaBackwardPlan* plan,
                          bool caller_blas = false);

// Most chunks of rows a column sum of the backward adds separately (norm/column_sums.cu). A pass
// sums dy (D columns), dqkv (3D, whose sums LayerNorm's bias gradient takes times Wqkv) and
// d_xn * xhat (D) at once: its scratch holds a chunk's partials of the 5D columns each, and the
// 3D sums of dqkv in fp64: kColumnPartialsPerDim D doubles.
constexpr int64_t kMaxColumnSumChunks = 128;
constexpr int64_t kColumnPartialsPerDim = 5 * kMaxColumnSumChunks + 3;

// cuBLAS's workspace in a backward on the library's own handle: its recommendation for Hopper
// (32 MiB), 4 MiB on older GPUs. Less changes its choice of algorithm for the weight gradients
// (long sums over all B H W positions into a small output) to ones with longer sums in one
// thread: 1 MiB gave errors 5 times fp32 PyTorch's at 4096 positions of dim 16. (The weight
// gradients now run on cuBLAS only where can_run(WeightGradProblem) says no; the size is kept for them
// and for the other products' cuBLAS fallback.)
size_t backward_blas_bytes(const DeviceCaps& dev);

// ---- the backward's weight gradients (gemm/weight_gradient.cu) ------------------------------
// C (N, K) = A^T B summed over T rows (d_Wo = dy^T o, d_Wqkv = dqkv^T xn) on the tensor cores: a
// block per (output tile, chunk of rows); with S > 1 chunks each block writes its partial tile
// into [S][N][K] floats, which a second kernel adds in a fixed order. Two kernels: 3xTF32 wgmma
// (sm_90a; 128 x 128 tiles, one block an SM) where the operands are 16-byte aligned with row
// strides and K multiples of 4, else 3xTF32 mma.sync (compute capability 8.0; 128 x 64 tiles, two
// blocks an SM). Each has its rule for S; the rules live here, in host code, so that the plan
// sizes the scratch for whichever kernel a call runs (CudaBackwardPlan::weight_grad_partials)
// without a GPU.

enum class WeightGradKernel { kMmaSync, kWgmma };

// The mma.sync kernel.
constexpr int kWeightGradTileN = 128, kWeightGradTileK = 64;  // a block's output tile
constexpr int kWeightGradStageRows = 32;                      // rows of A and B a pipeline stage holds (both kernels)
constexpr int kWeightGradStages = 3;                          // stages in shared memory
// Shared-memory rows padded by 8 floats (row strides 8 mod 32 words: the fragment loads meet
// distinct banks, weight_gradient.cu). The wgmma kernel stores its A tiles the same way.
constexpr int kWeightGradLdA = kWeightGradTileN + 8, kWeightGradLdB = kWeightGradTileK + 8;
constexpr size_t kWeightGradSmemBytes =
    (size_t)kWeightGradStages * kWeightGradStageRows * (kWeightGradLdA + kWeightGradLdB) * sizeof(float);

// The wgmma kernel: 128 x 128 tiles (128 x 64 where K <= 64: the same count of tiles); a ring of
// kWeightGradWgmmaStagesA A tiles (32 rows of 136 floats), two B stages (hi and lo planes of
// 128 x 32 TF32 values, 128-byte swizzled), + 1024 bytes to align the planes.
constexpr int kWeightGradWgmmaTileN = 128, kWeightGradWgmmaTileK = 128;
constexpr int kWeightGradWgmmaStagesA = 4;
constexpr size_t kWeightGradWgmmaSmemBytes =
    1024 + 2 * 2 * (size_t)kWeightGradWgmmaTileK * kWeightGradStageRows * sizeof(float) +
    (size_t)kWeightGradWgmmaStagesA * kWeightGradStageRows * kWeightGradLdA * sizeof(float);
static_assert(kWeightGradWgmmaTileN + 8 == kWeightGradLdA, "the wgmma kernel's A tiles are the mma.sync kernel's");

// Fewest rows a chunk has when the rows are split (see weight_gradient_split), and most (the
// kernels count a chunk's rows in int).
constexpr int64_t kWeightGradMinSplitRows = 256, kWeightGradMaxChunkRows = int64_t{1} << 30;
// Most chunks the wgmma kernel's rule takes where its tiles alone fill a wave of the device.
constexpr int64_t kWeightGradWgmmaMaxWaveSplits = 4;

// The device runs the wgmma kernel: sm_90a code (dev.sm90a) and its shared memory. (Where it does
// not, the mma.sync kernel: can_run(WeightGradProblem, dev).)
bool weight_gradient_wgmma_can_run(const DeviceCaps& dev);

// How a product over T rows is split for `kernel`: `splits` chunks (S) of `rows` rows each (a
// multiple of kWeightGradStageRows; the last chunk may have fewer). Depends on T, N, K, the
// kernel and the device's SMs and shared memory alone, so the result is the same on every call.
struct WeightGradSplit {
  int64_t splits = 1, rows = 0;
};
WeightGradSplit weight_gradient_split(int64_t T, int64_t N, int64_t K, const DeviceCaps& dev, WeightGradKernel kernel);

// Which kernel runs a product, its tiles' columns and its split: one rule, which the launcher
// follows (weight_gradient.cu) and tests read without a GPU. The wgmma kernel where the device runs
// it (weight_gradient_wgmma_can_run), the operands are `aligned` (A and B 16-byte aligned, their
// row strides multiples of 4), K is a multiple of 4 and the mma_sync hook is unset; its tiles
// take 64 columns where K <= 64 (as many tiles as 128), else 128. Else the mma.sync kernel (any
// alignment, stride and K), 64 columns.
struct WeightGradProblem {
  int64_t T = 0, N = 0, K = 0;
  bool aligned = false;
  bool mma_sync = false;  // test hook: the mma.sync kernel wherever it can run
};
struct WeightGradVariant {
  WeightGradKernel kernel = WeightGradKernel::kMmaSync;
  int tile_cols = kWeightGradTileK;
  WeightGradSplit split;
};
WeightGradVariant weight_gradient_variant(const WeightGradProblem& g, const DeviceCaps& dev);

// Floats of partials the product needs, whichever kernel runs it on dev: S N K for the larger S
// of the kernels dev runs, or 0 where each has S = 1 (the blocks write C directly).
size_t weight_gradient_partials_floats(int64_t T, int64_t N, int64_t K, const DeviceCaps& dev);

// The larger of a pass's two weight-gradient products: d_Wqkv (3D, D) and d_Wo (D, D).
size_t weight_gradient_pass_partials_floats(int64_t T, int64_t D, const DeviceCaps& dev);

// ---- the attention backward's score gradients (attention/attention_backward.cu) -------------
// The tensor-core attention backward stores dS^T, the gradient of a pass's scores, from its dk, dv
// kernel and computes dq as a product from it: 5 products of L^2 hd a (sequence, head) instead of
// 7 (a dq kernel of its own recomputing S and dP), for 8 bytes of memory traffic an element of dS
// (4 on 16-bit products: there dS^T is stored in the products' type, which dq's product rounds it to
// anyway, so the bits are the same). The scratch is one attention matrix a pass, num_seq heads L rows
// of attention_scores_stride(L, bytes) values (key rows, query columns), L / hd times a (T, D)
// activation in fp32. A pass takes it where that
// is at least kAttentionScoresMinActivations activations, so that attention matrices are what
// dominates an eager step's memory (it keeps one a pass and makes two more in its backward) and
// one more stays below it (perf notes v41: the peak memory of (2, 48, 80, 96, 3)'s step), and at most
// kAttentionScoresMaxActivations activations or kAttentionScoresMinBytes, whichever is larger, so
// that long sequences recompute rather than take gigabytes.
constexpr int64_t kAttentionScoresMinActivations = 4;
constexpr int64_t kAttentionScoresMaxActivations = 8;
constexpr size_t kAttentionScoresMinBytes = size_t{256} << 20;

// Values between rows of the scratch, each value_bytes (4: fp32; 2: a 16-bit type) wide: L rounded
// up to whole 16-byte rows (a multiple of 4 floats, or of 8 16-bit values).
FASTAXIAL_HOST_DEVICE constexpr int64_t attention_scores_stride(int64_t len, int value_bytes = 4) {
  return value_bytes == 2 ? (len + 7) / 8 * 8 : (len + 3) / 4 * 4;
}

// Bytes of one value of the scratch on these products: 4, or 2 on 16-bit products.
constexpr int attention_scores_value_bytes(Products products) { return products == Products::kFp32 ? 4 : 2; }

// Bytes of one pass's scratch (num_seq sequences of len positions, `heads` heads, dim D) where the
// pass takes it, else 0. Whether it takes it does not depend on the products (the rule counts fp32
// values); its size does.
size_t attention_scores_bytes(int64_t num_seq, int64_t len, int64_t heads, int64_t dim,
                              Products products = Products::kFp32);

// ---- the attention backward's kernels (attention/attention_backward.cu) ---------------------
// Which kernels a pass's attention backward runs: one rule, which the launcher follows and the
// backward plan records (CudaBackwardPlan::PassKernels), so tests see it without a GPU.
//   kSingleKey:   L = 1.
//   kTensorCores: where the device's shared memory holds the tensor-core tiles
//                 (attention_grad_smem_bytes), unless the ffma hook is set; else kFfma.
//   splits:       attention_grad_splits' S (or the hook's) on the tensor cores, where the caller
//                 gave 16-byte aligned room for the partials; at most the fewest tiles a kernel
//                 streams, so that no split's range is empty.
//   dq:           kFromScores where the caller gave the dS^T scratch and the dq-from-dS tiles
//                 fit; else kWgmma for padded head dim 32 on sm_90a code, sequences longer than
//                 kQueryGradsWgmmaMinLen (four key tiles or more: shorter ones are faster on
//                 mma.sync), its tiles fitting, no split and no mma_sync hook; else kMmaSync.
constexpr int64_t kQueryGradsWgmmaMinLen = 192;

// What the choice reads of an attention_backward call (AttentionBackwardArgs).
struct AttentionGradProblem {
  int64_t num_seq = 0, len = 0, head_dim = 0, heads = 0;
  bool scores = false;         // a dS^T scratch is given
  bool partials = false;       // room for split partials is given, 16-byte aligned
  size_t partials_bytes = 0;   // its size
  int splits = 0;              // test hook: S instead of the rule's (0: the rule)
  bool ffma = false;           // test hook: the FFMA kernels
  bool mma_sync = false;       // test hook: dq on mma.sync where wgmma would run
  Products products = Products::kFp32;  // 16-bit: the tensor-core kernels only, dq on mma.sync or from dS^T
};

struct AttentionGradVariant {
  AttentionGradKernel kernel = AttentionGradKernel::kNone;
  QueryGradKernel dq = QueryGradKernel::kNone;
  int splits = 1;
};

// The variant for a on dev (kNone where the head dim has no kernel). dev.sm90a is taken to mean
// that this build's sm_90a code runs (the launcher clears it in a build without).
AttentionGradVariant attention_grad_variant(const AttentionGradProblem& a, const DeviceCaps& dev);

// Shared memory of the tensor-core dk, dv and dq kernels' largest blocks (the larger), of the
// dq-from-dS kernel, and of the wgmma dq kernel, for padded head dim hdp (0: no kernel).
size_t attention_grad_smem_bytes(int hdp);
size_t query_grads_from_scores_smem_bytes(int hdp);
constexpr size_t kQueryGradsWgmmaSmemBytes = 209920;

// ---- the staged path's products (gemm/gemm.cu) --------------------------------------------
// One block an SM loops over BM x BN tiles of C (M, N), so a product takes about ceil(tiles / SMs)
// rounds of one tile's time, and a round where few SMs have a tile costs as much as a full one.
struct GemmTiling {
  int rows = 128, cols = 128;  // rows 64, 128 or 192 (one to three warpgroups); cols 96 or 128
};
// The tiles of C (M, N) on `sms` multiprocessors. Rows: 64 where 128-row tiles would leave half
// the SMs idle or more, with 96 columns where N pads less to a multiple of 96 than of 128. Else
// 128 rows, and 96 or 128 columns, whichever costs less as rounds x width, a 96-column tile's
// width weighted 1.15 (its lower rate per column: a thread loads and splits the same A fragments
// for either width; perf notes v22c); ties go to 128,
// and the narrower padding always wins. Then 192 rows instead of 128 where that takes fewer
// rounds by more than a 192-row tile's extra cost (1.22 a k-step, perf notes v49).
GemmTiling gemm_tiling(int64_t M, int64_t N, int sms);

// ---- the shape rules, for tests and for the kernels' launchers -----------------------------

// Head dims the fused kernel and the staged path's own attention kernel
// serve: 8, 16, 32, 64, with dim a multiple of 8.
bool tensor_core_head(int64_t dim, int64_t heads);

// Heads the staged path serves: its products need dim a multiple of 8, its
// flash attention kernel takes head dims up to 256.
bool staged_head(int64_t dim, int64_t heads);

// The fused kernel's 16-position tiles for a sequence of length L (0: L is
// too long for it), and its shared memory for that L and dim D.
int fused_tile_count(int64_t len);
size_t fused_smem_bytes(int64_t len, int64_t dim);

// Shared memory of the staged attention kernel: one head's keys and values
// of a whole sequence, split into (hi, lo) TF32 pairs.
size_t staged_attention_smem_bytes(int64_t len, int64_t head_dim);

// ---- the staged path's flash attention kernels (cuda/attention/flash_attention*.cu) ---------
// Which kernel flash_attention() runs for a pass, and with how many key splits: one rule, which
// the launcher follows and the plan records (PassPlan::flash_kernel), so tests see it without a GPU.
//   kShort:     L <= kFlashShortMaxLen (unless mma_sync): a warp per (sequence, head) in plain
//               fp32; the tiled kernels' products would be mostly padding at such lengths.
//   kWgmma:     padded head dim 32, L > kFlashWgmmaMinLen, sm_90a code, no split: warpgroups
//               share k and v planes split once a tile (the same results as mma.sync).
//   kWgmmaWide: padded head dims 64 to 128, L > kFlashWgmmaMinLen, sm_90a code; splits as many
//               as fill one round of a block an SM, at most the mma.sync rule's.
//   kWgmma16:   16-bit products, padded head dims 32, 96 and 128, L > kFlashWgmmaMinLen,
//               sm_90a code, no split (unless mma_sync).
//   kQkv16:     16-bit products on q, k, v stored in 16 bits (FlashProblem::qkv16: the caller
//               stored them so where flash_qkv16_can_run said it may), no split.
//   kMmaSync:   everything else (any sm_80+ GPU; 16-bit products unsplit), split by
//               flash_kv_splits where partials are given and dropout is off (the split kernels
//               have no dropout).
// A wgmma kernel needs two key tiles or more: a single one leaves no copy to overlap.
constexpr int kFlashShortMaxLen = 4;
constexpr int64_t kFlashWgmmaMinLen = 64;

// What the choice reads of a flash_attention call (FlashArgs).
// The element type of the attention kernels' products: fp32 on 3xTF32 (fp32 accuracy), or a 16-bit
// type with fp32 accumulation (detail/mma16.cuh), as autocast computes the reference's products.
// Products (the products' precision): fastaxial.h, AxialParams::products.

struct FlashProblem {
  int64_t num_seq = 0, len = 0, head_dim = 0;
  int64_t heads = 0;
  bool dropout = false;       // attention dropout on (threshold != 0)
  bool mma_sync = false;      // FlashArgs::mma_sync: the mma.sync kernel wherever it can run
  size_t partials_bytes = 0;  // room given for split-KV partials (0: none)
  Products products = Products::kFp32;
  bool qkv16 = false;  // q, k and v stored in the products' 16-bit type (FlashArgs::qkv16)
};

struct FlashVariant {
  FlashKernel kernel = FlashKernel::kMmaSync;
  int splits = 1;  // S: blocks (or units) that share a query tile's keys; 1: no split
};

// The variant for f on dev, f's sizes valid (head_dim 1..256, len >= 1). dev.sm90a is taken to
// mean that this build's sm_90a code runs (the launcher clears it in a build without).
FlashVariant flash_variant(const FlashProblem& f, const DeviceCaps& dev);

// Whether the kQkv16 kernel serves f (f.qkv16 aside) on dev: 16-bit products, no dropout, not
// mma_sync, sm_90a code, L > kFlashWgmmaMinLen, a tile for the head dim (flash_qkv16_tile_head_dim)
// and its shared memory. A pass's QKV product stores q, k and v in 16 bits where this holds.
bool flash_qkv16_can_run(const FlashProblem& f, const DeviceCaps& dev);

// The splits the wide kernel takes for a pass the mma.sync kernel would split `rule_splits` ways
// (flash_kv_splits; the partials are sized for that many): as many as fill one round of a block
// an SM, at most rule_splits, at least 1.
int flash_wgmma_wide_splits(int64_t num_seq, int64_t len, int64_t heads, int rule_splits, int sms);

// One pass's family and variant: `view` gives its sequences, `aligned`
// whether its tensors are 16-byte aligned. make_plan calls it for each pass.
Status plan_pass(const AxisView& view, int64_t dim, int64_t heads, bool aligned, const DeviceCaps& dev,
                 const PlanOptions& options, PassPlan* pass);

// ---- one contract per kernel -------------------------------------------------------------------
// Every kernel the plans choose from answers two questions the same way, on the host and without
// a GPU (as CUTLASS's can_implement and get_workspace_size):
//   can_run(problem, dev):         whether it serves the problem on the device;
//   workspace_bytes(problem, dev): the scratch it takes beside its operands, at most (0: none).
// The problem struct of each kernel holds what the answers read; the plans ask these and lay the
// scratch out, the launchers follow the same variant rules.

// The fused kernel (fused/forward.cu): a pass of num_seq sequences of len positions, dim D in
// `heads` heads, its tensors 16-byte aligned or not.
struct FusedProblem {
  int64_t num_seq = 0, len = 0, dim = 0, heads = 0;
  bool aligned = false;
};
bool can_run(const FusedProblem& f, const DeviceCaps& dev);
size_t workspace_bytes(const FusedProblem& f, const DeviceCaps& dev);

// The staged path's whole-sequence attention kernel (attention/whole_sequence.cu): a block per (sequence,
// head) holding the head's keys and values.
struct StagedAttentionProblem {
  int64_t num_seq = 0, len = 0, head_dim = 0;
};
bool can_run(const StagedAttentionProblem& s, const DeviceCaps& dev);
size_t workspace_bytes(const StagedAttentionProblem& s, const DeviceCaps& dev);

// The staged path's product (gemm/gemm.cu): C (M, N) = A (M, K) W^T, W as TF32 planes the pass
// splits into its own region (8 D^2 floats, CudaPlan's weight planes), not the product's scratch.
struct GemmProblem {
  int64_t M = 0, N = 0, K = 0;
};
bool can_run(const GemmProblem& g, const DeviceCaps& dev);
size_t workspace_bytes(const GemmProblem& g, const DeviceCaps& dev);

// The flash attention kernels (their variant: flash_variant); the scratch is the split-KV
// partials of the rule's split.
bool can_run(const FlashProblem& f, const DeviceCaps& dev);
size_t workspace_bytes(const FlashProblem& f, const DeviceCaps& dev);

// The attention backward (its variant: attention_grad_variant); the scratch is the split
// partials of the rule's split. The dS^T scratch that lets dq be one product is the plan's
// choice beside it (attention_scores_bytes).
bool can_run(const AttentionGradProblem& a, const DeviceCaps& dev);
size_t workspace_bytes(const AttentionGradProblem& a, const DeviceCaps& dev);

// The weight gradients (their variant: weight_gradient_variant); the scratch is the chunks'
// partial tiles, sized for whichever kernel runs the product on dev.
bool can_run(const WeightGradProblem& g, const DeviceCaps& dev);
size_t workspace_bytes(const WeightGradProblem& g, const DeviceCaps& dev);

}  // namespace fastaxial
