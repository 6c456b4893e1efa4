// The rules of plan.h: each pass's kernel family, and the workspace layout.
#include "plan.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <string>

#include "dispatch.h"
#include "dropout.h"  // dropout_threshold: what the launchers test
#include "smem_layout.h"

namespace fastaxial {
namespace {

Status invalid(const std::string& what) { return {StatusCode::kInvalidArgument, what}; }

// Dims at which the staged path beats the fused kernel on passes of longer
// sequences; and the sequences short enough that many of them take the
// staged path at any dim (staged_is_faster).
constexpr int64_t kFusedShortLen = 16;
bool staged_can_be_faster(int64_t dim) { return dim > 64; }

// Where both fit, by GPU time per forward on the H200 (docs/perf-notes.md, "dispatch" and v43):
// - many very short sequences, at any dim: the staged path. The fused
//   kernel pads each sequence to 16 rows and runs one at a time an SM, a
//   fixed cost a round of `sms` sequences however short; a staged pass pays
//   a fixed cost of chained launches plus its positions' work, which wins
//   from 4 rounds for L <= 4 and from 8 for L <= 16 (at L = 32 the fused
//   kernel wins at 4 rounds).
// - otherwise, dim 64 and less: the fused kernel everywhere; its projections
//   are a small share of its time there.
// - wider dims, passes of 16384 positions or more: the staged path, whose
//   projections run on wgmma over all positions;
// - wider dims, smaller passes: the fused kernel while its sequences (a
//   block each, one block an SM) fill at least three quarters of the
//   device's last wave, the staged path where they leave more idle, from
//   4096 positions up. Below that, the staged path's launches cost more
//   than they save.
bool staged_is_faster(int64_t len, int64_t dim, int64_t num_seq, int64_t sms) {
  if (sms >= 1 && len <= kFusedShortLen && num_seq > sms * (len <= 4 ? 3 : 7)) return true;
  if (!staged_can_be_faster(dim)) return false;
  const int64_t positions = num_seq * len;
  if (positions >= 16384) return true;
  if (positions < 4096 || sms < 1) return false;
  const int64_t slots = (num_seq + sms - 1) / sms * sms;  // blocks the fused kernel's waves could hold
  return 4 * num_seq < 3 * slots;
}

// Regions of the workspace start on 256-byte boundaries, as allocators give.
constexpr size_t kAlign = 256;

// Appends `bytes` to a layout of `*end` bytes and returns the region's
// offset; false when the sum would overflow size_t.
bool append(size_t* end, size_t bytes, size_t* offset) {
  const size_t start = (*end + kAlign - 1) / kAlign * kAlign;
  if (start < *end || bytes > ~size_t{0} - start) return false;
  *offset = start;
  *end = start + bytes;
  return true;
}

bool pass_aligned(const AxisWeights& w, const float* src, const float* dst) {
  for (const void* ptr : {static_cast<const void*>(src), static_cast<const void*>(dst),
                          static_cast<const void*>(w.norm_weight), static_cast<const void*>(w.norm_bias),
                          static_cast<const void*>(w.qkv_weight), static_cast<const void*>(w.out_weight),
                          static_cast<const void*>(w.out_bias)})
    if (!aligned16(ptr)) return false;
  return true;
}

// The name of enumerator e, names listing them in order.
template <class E, size_t N>
const char* name_of(E e, const char* const (&names)[N]) {
  const size_t i = static_cast<size_t>(e);
  return i < N ? names[i] : "?";
}

}  // namespace

const char* to_string(KernelFamily family) { return name_of(family, {"fused", "staged", "generic"}); }

const char* to_string(FlashKernel kernel) {
  return name_of(kernel, {"none", "short", "mma.sync", "wgmma", "wgmma-wide", "wgmma-16bit", "wgmma-qkv16"});
}

const char* to_string(AttentionGradKernel kernel) {
  return name_of(kernel, {"none", "single-key", "tensor-cores", "ffma"});
}

const char* to_string(QueryGradKernel kernel) {
  return name_of(kernel, {"none", "from-scores", "mma.sync", "wgmma", "ffma"});
}

std::string CudaPlan::describe() const {
  std::ostringstream s;
  const auto pass = [&](const char* name, const PassPlan& p) {
    s << name << ": " << to_string(p.family);
    if (p.family == KernelFamily::kFused) s << (p.wgmma ? " (wgmma)" : " (mma.sync)");
    if (p.family == KernelFamily::kStaged && !p.flash) s << " (whole-sequence attention)";
    if (p.family == KernelFamily::kStaged && p.flash) {
      s << " (flash " << to_string(p.flash_kernel);
      if (p.flash_splits > 1) s << ", " << p.flash_splits << " splits";
      s << ")";
    }
    if (p.products != Products::kFp32) s << (p.products == Products::kBf16 ? " on bf16 products" : " on fp16 products");
  };
  pass("row", row);
  s << ", ";
  pass("col", col);
  s << "; workspace " << workspace_bytes << " B: row output at " << row_output;
  if (staged_scratch != kNone) s << ", staged scratch at " << staged_scratch;
  if (row_weight_planes != kNone) s << ", row weight planes at " << row_weight_planes;
  if (col_weight_planes != kNone) s << ", col weight planes at " << col_weight_planes;
  if (flash_partials != kNone)
    s << ", flash split-KV partials at " << flash_partials << " (" << flash_partials_bytes << " B)";
  if (operand16 != kNone) s << ", 16-bit operand at " << operand16 << ", 16-bit weights at " << weights16;
  if (blas != kNone) s << ", cuBLAS workspace at " << blas << " (" << blas_bytes << " B)";
  s << " (B " << batch << ", H " << height << ", W " << width << ", D " << dim << ", heads " << heads << ", device "
    << device << ")";
  return s.str();
}

Status parse_plan_options(const char* cuda_path, const char* fused_wgmma, PlanOptions* options) {
  PlanOptions o;
  if (cuda_path != nullptr) {
    const std::pair<const char*, ForcedFamily> names[] = {
        {"fused", ForcedFamily::kFused}, {"staged", ForcedFamily::kStaged}, {"generic", ForcedFamily::kGeneric}};
    const auto* hit = std::find_if(std::begin(names), std::end(names),
                                   [&](const auto& n) { return std::strcmp(cuda_path, n.first) == 0; });
    if (hit == std::end(names))
      return invalid(std::string("FASTAXIAL_CUDA_PATH='") + cuda_path +
                     "' is not a kernel family: use fused, staged or generic, or unset it");
    o.forced = hit->second;
  }
  if (fused_wgmma != nullptr) {
    if (std::strcmp(fused_wgmma, "0") == 0) {
      o.fused_wgmma = 0;
    } else if (std::strcmp(fused_wgmma, "1") == 0) {
      o.fused_wgmma = 1;
    } else {
      return invalid(std::string("FASTAXIAL_FUSED_WGMMA='") + fused_wgmma + "': use 0 (off) or 1 (on), or unset it");
    }
  }
  *options = o;
  return Status::Ok();
}

Status env_plan_options(PlanOptions* options) {
  static PlanOptions parsed;
  static const Status status =
      parse_plan_options(std::getenv("FASTAXIAL_CUDA_PATH"), std::getenv("FASTAXIAL_FUSED_WGMMA"), &parsed);
  if (status.ok()) *options = parsed;
  return status;
}

bool tensor_core_head(int64_t dim, int64_t heads) {
  const int64_t hd = dim / heads;
  return dim % 8 == 0 && (hd == 8 || hd == 16 || hd == 32 || hd == 64);
}

bool staged_head(int64_t dim, int64_t heads) { return dim % 8 == 0 && dim / heads <= kFlashMaxHeadDim; }

int fused_tile_count(int64_t len) {
  for (int mt : {1, 2, 3, 4, 5, 6, 8})
    if (16 * mt >= len) return mt;
  return 0;
}

size_t fused_smem_bytes(int64_t len, int64_t dim) {
  const int mt = fused_tile_count(len);
  if (mt == 0 || dim > (1 << 20)) return ~size_t{0};  // no block holds it
  const FusedLayout lay(16 * mt, (int)dim);
  return (size_t)lay.floats() * sizeof(float);
}

// Lp = L rounded up to 16 (int: a longer sequence fits no block anyway).
size_t staged_attention_smem_bytes(int64_t len, int64_t head_dim) {
  const int64_t lp = std::min<int64_t>((len + 15) / 16 * 16, 1 << 24);
  const StagedAttentionLayout lay((int)lp, (int)head_dim);
  return (size_t)(lp * lay.ldk + head_dim * lay.ldv) * sizeof(float);
}

Status plan_pass(const AxisView& view, int64_t dim, int64_t heads, bool aligned, const DeviceCaps& dev,
                 const PlanOptions& options, PassPlan* pass) {
  const size_t smem = (size_t)std::max(dev.smem_optin, 0);
  const bool staged_device = can_run(GemmProblem{}, dev);
  if (options.forced == ForcedFamily::kStaged && !staged_device)
    return {StatusCode::kUnsupported,
            "FASTAXIAL_CUDA_PATH=staged: this device or build has no staged path (it needs an sm_90a build on a "
            "compute-capability 9.0 GPU with " + std::to_string(kStagedGemmSmemBytes) +
                " bytes of shared memory a block)"};
  if (options.fused_wgmma == 1 && !dev.sm90a)
    return {StatusCode::kUnsupported,
            "FASTAXIAL_FUSED_WGMMA=1: this device or build has no wgmma (it needs an sm_90a build on a "
            "compute-capability 9.0 GPU)"};

  const int tiles = fused_tile_count(view.len);
  const bool fused = can_run(FusedProblem{view.num_seq, view.len, dim, heads, aligned}, dev);
  // The staged path's attention: its own kernel, a block per (sequence,
  // head) holding all the head's keys and values, where they fit and the
  // items fill the device twice over; elsewhere the flash kernel, blocks per
  // query tile with the keys streamed, which serves any length (its largest
  // tiling fits any device with the staged path: smem_layout.h).
  const bool staged = staged_head(dim, heads) && aligned && staged_device;
  const bool own_attention = tensor_core_head(dim, heads) && aligned &&
                             can_run(StagedAttentionProblem{view.num_seq, view.len, dim / heads}, dev) &&
                             view.num_seq * heads >= 2 * (int64_t)dev.sms;

  KernelFamily family = KernelFamily::kGeneric;
  if (options.forced == ForcedFamily::kFused && fused) {
    family = KernelFamily::kFused;
  } else if (options.forced == ForcedFamily::kStaged && staged) {
    family = KernelFamily::kStaged;
  } else if (options.forced != ForcedFamily::kGeneric) {
    if (fused && !(staged && staged_is_faster(view.len, dim, view.num_seq, dev.sms)))
      family = KernelFamily::kFused;
    else if (staged)
      family = KernelFamily::kStaged;
  }
  pass->family = family;
  pass->flash = family == KernelFamily::kStaged && !own_attention;
  pass->flash_kernel = FlashKernel::kNone, pass->flash_splits = 1;
  if (pass->flash) {
    // As the forward launches it: no dropout, the plan's partials (flash_partials, at least this pass's).
    FlashProblem f;
    f.num_seq = view.num_seq, f.len = view.len, f.head_dim = dim / heads, f.heads = heads;
    f.partials_bytes = flash_partials_bytes(view.num_seq, view.len, dim / heads, heads, dev.sms);
    const FlashVariant v = flash_variant(f, dev);
    pass->flash_kernel = v.kernel, pass->flash_splits = v.splits;
  }
  // The fused kernel's projections on wgmma: dim 64 with heads of less than
  // 64 (one head of 64 keeps more attention state than a thread of three
  // warpgroups has registers for), up to 64 positions.
  pass->wgmma = family == KernelFamily::kFused && options.fused_wgmma != 0 && dev.sm90a && dim == 64 &&
                dim / heads < 64 && tiles <= 4 && fused_smem_bytes(view.len, dim) + kFusedWgmmaSmemExtra <= smem;
  return Status::Ok();
}

namespace {

// The wgmma kernels serve padded head dim hdp for sequences of len on dev: sm_90a code, a kernel
// for hdp, its shared memory, and two key tiles or more.
bool flash_wgmma_can_run(int hdp, int64_t len, const DeviceCaps& dev) {
  const size_t bytes = flash_wgmma_smem_bytes(hdp);
  return dev.sm90a && len > kFlashWgmmaMinLen && bytes != 0 && bytes <= (size_t)dev.smem_optin;
}

}  // namespace

bool flash_qkv16_can_run(const FlashProblem& f, const DeviceCaps& dev) {
  const size_t bytes = flash_qkv16_smem_bytes(flash_qkv16_tile_head_dim(f.head_dim));
  return f.products != Products::kFp32 && !f.dropout && !f.mma_sync && dev.sm90a && f.len > kFlashWgmmaMinLen &&
         bytes != 0 && bytes <= (size_t)dev.smem_optin;
}

FlashVariant flash_variant(const FlashProblem& f, const DeviceCaps& dev) {
  if (f.qkv16) return {FlashKernel::kQkv16, 1};  // the one kernel that reads them (flash_qkv16_can_run)
  if (f.products != Products::kFp32) {  // unsplit: wgmma where its kernel serves the head dim, else mma.sync
    const size_t bytes = flash_wgmma16_smem_bytes(flash_padded_head_dim(f.head_dim));
    const bool wgmma = !f.mma_sync && dev.sm90a && f.len > kFlashWgmmaMinLen && bytes != 0 &&
                       bytes <= (size_t)dev.smem_optin;
    return {wgmma ? FlashKernel::kWgmma16 : FlashKernel::kMmaSync, 1};
  }
  if (f.len <= kFlashShortMaxLen && !f.mma_sync) return {FlashKernel::kShort, 1};
  int splits = 1;
  const size_t need = flash_partials_bytes(f.num_seq, f.len, f.head_dim, f.heads, dev.sms);
  if (need > 0 && f.partials_bytes >= need && !f.dropout)
    splits = flash_kv_splits(f.num_seq, f.len, f.head_dim, f.heads, dev.sms);
  const int hdp = flash_padded_head_dim(f.head_dim);
  if (!f.mma_sync && flash_wgmma_can_run(hdp, f.len, dev)) {
    if (hdp != 32)
      return {FlashKernel::kWgmmaWide, flash_wgmma_wide_splits(f.num_seq, f.len, f.heads, splits, dev.sms)};
    if (splits == 1) return {FlashKernel::kWgmma, 1};  // the split blocks stay on mma.sync
  }
  return {FlashKernel::kMmaSync, splits};
}

int flash_wgmma_wide_splits(int64_t num_seq, int64_t len, int64_t heads, int rule_splits, int sms) {
  if (rule_splits <= 1 || num_seq <= 0 || len <= 0 || heads <= 0) return 1;
  const int64_t tiles = num_seq * heads * ((len + kFlashWgmmaQueryTile - 1) / kFlashWgmmaQueryTile);
  return (int)std::max<int64_t>(1, std::min<int64_t>(rule_splits, std::max(sms, 1) / tiles));
}

size_t attention_grad_smem_bytes(int hdp) {
  return with_padded_head_dim(
      hdp,
      [](auto h) {
        constexpr int H = decltype(h)::value;
        return std::max(KvTc<H>::bytes(KvTc<H>::BN), QTc<H>::bytes(QTc<H>::BM));
      },
      size_t{0});
}

size_t query_grads_from_scores_smem_bytes(int hdp) {
  return with_padded_head_dim(hdp, [](auto h) { return DsTc<decltype(h)::value>::bytes; }, size_t{0});
}

namespace {

// S of a tensor-core launch: the rule's (or the hook's), at most the fewest tiles a kernel
// streams, the partials below 2^31 floats (the combine's int indices) and within the room given.
int attention_grad_split(const AttentionGradProblem& a, int hdp, const DeviceCaps& dev) {
  if (!a.partials) return 1;
  const int64_t rows = a.num_seq * a.heads * a.len;
  int64_t S = a.splits > 0 ? a.splits : attention_grad_splits(a.num_seq, a.len, a.head_dim, a.heads, dev.sms);
  const int64_t widest = with_padded_head_dim(  // the widest tile a kernel streams
      hdp,
      [](auto h) {
        constexpr int H = decltype(h)::value;
        return std::max({KvTc<H>::BM, QTc<H>::BN, DsTc<H>::BN});
      },
      1);
  S = std::min(S, (a.len + widest - 1) / widest);
  if (S < 2 || rows > INT32_MAX / (2 * a.head_dim) / S) return 1;
  return a.partials_bytes >= attention_grad_partials_floats((int)S, rows, a.head_dim) * sizeof(float) ? (int)S : 1;
}

}  // namespace

AttentionGradVariant attention_grad_variant(const AttentionGradProblem& a, const DeviceCaps& dev) {
  const int hdp = flash_padded_head_dim(a.head_dim);
  if (hdp == 0 || a.num_seq < 1 || a.len < 1 || a.heads < 1) return {};
  if (a.len == 1) return {AttentionGradKernel::kSingleKey, QueryGradKernel::kNone, 1};
  const size_t smem = (size_t)std::max(dev.smem_optin, 0);
  const bool fp32 = a.products == Products::kFp32;
  if (a.ffma || attention_grad_smem_bytes(hdp) > smem) {
    if (!fp32) return {};  // the FFMA kernels' math is fp32
    return {AttentionGradKernel::kFfma, QueryGradKernel::kFfma, 1};
  }
  AttentionGradVariant v;
  v.kernel = AttentionGradKernel::kTensorCores;
  v.splits = attention_grad_split(a, hdp, dev);
  if (a.scores && query_grads_from_scores_smem_bytes(hdp) <= smem)
    v.dq = QueryGradKernel::kFromScores;
  else if (fp32 && hdp == 32 && !a.mma_sync && dev.sm90a && a.len > kQueryGradsWgmmaMinLen &&
           kQueryGradsWgmmaSmemBytes <= smem && v.splits == 1)
    v.dq = QueryGradKernel::kWgmma;
  else
    v.dq = QueryGradKernel::kMmaSync;
  return v;
}

Status make_plan(const AxialParams& p, const DeviceCaps& dev, const PlanOptions& options, CudaPlan* plan,
                 bool caller_blas) {
  CudaPlan c;
  c.batch = p.batch, c.height = p.height, c.width = p.width, c.dim = p.dim, c.heads = p.heads;
  c.products = p.products;
  c.device = dev.device;
  // The row pass's output, the workspace's first region, is 256-byte
  // aligned; null stands in for it (it counts as aligned).
  const float* x1 = nullptr;
  const AxisView row = row_view(p), col = col_view(p);
  if (Status s = plan_pass(row_view(p), p.dim, p.heads, pass_aligned(p.row, p.x, x1), dev, options, &c.row); !s.ok())
    return s;
  if (Status s = plan_pass(col_view(p), p.dim, p.heads, pass_aligned(p.col, x1, p.out), dev, options, &c.col);
      !s.ok())
    return s;
  // 16-bit products: every pass the staged path serves takes it, with flash_variant's kernel for
  // them (wgmma or mma.sync), unsplit; not where FASTAXIAL_CUDA_PATH forces the fused or generic
  // family (fp32 products there).
  if (p.products != Products::kFp32 && options.forced != ForcedFamily::kFused &&
      options.forced != ForcedFamily::kGeneric) {
    PlanOptions staged = options;
    staged.forced = ForcedFamily::kStaged;
    const auto on_16bit = [&](const AxisView& view, bool aligned, PassPlan* pass) {
      PassPlan s;
      if (!plan_pass(view, p.dim, p.heads, aligned, dev, staged, &s).ok() || s.family != KernelFamily::kStaged) return;
      FlashProblem f;
      f.num_seq = view.num_seq, f.len = view.len, f.head_dim = p.dim / p.heads, f.heads = p.heads;
      f.products = p.products;
      f.qkv16 = flash_qkv16_can_run(f, dev);  // the QKV product stores them so (staged/pass.cu)
      const FlashVariant v = flash_variant(f, dev);
      s.flash = true, s.flash_kernel = v.kernel, s.flash_splits = v.splits, s.products = p.products;
      *pass = s;
    };
    on_16bit(row, pass_aligned(p.row, p.x, x1), &c.row);
    on_16bit(col, pass_aligned(p.col, x1, p.out), &c.col);
  }

  const size_t floats = (size_t)(p.batch * p.height * p.width * p.dim);  // validate() bounds it by int64
  const size_t bytes = floats * sizeof(float);
  if (bytes / sizeof(float) != floats) return invalid("the workspace size overflows size_t");
  size_t end = 0;
  bool fits = append(&end, bytes, &c.row_output);
  const bool row_staged = c.row.family == KernelFamily::kStaged, col_staged = c.col.family == KernelFamily::kStaged;
  if (fits && (row_staged || col_staged)) {
    const size_t D = (size_t)p.dim, planes = 8 * D * D * sizeof(float);
    fits = D <= ~size_t{0} / (8 * sizeof(float)) / D && bytes <= ~size_t{0} / 4 &&
           append(&end, 4 * bytes, &c.staged_scratch);
    // The flash kernel's split-KV partials (smem_layout.h): the larger pass's.
    // (16-bit products never split and take no TF32 planes.)
    const bool row32 = row_staged && c.row.products == Products::kFp32, col32 = col_staged && c.col.products == Products::kFp32;
    size_t partials = 0;
    if (c.row.flash && row32) partials = flash_partials_bytes(row.num_seq, row.len, p.dim / p.heads, p.heads, dev.sms);
    if (c.col.flash && col32)
      partials = std::max(partials, flash_partials_bytes(col.num_seq, col.len, p.dim / p.heads, p.heads, dev.sms));
    if (fits && partials > 0) {
      fits = append(&end, partials, &c.flash_partials);
      c.flash_partials_bytes = partials;
    }
    if (fits && row32) fits = append(&end, planes, &c.row_weight_planes);
    if (fits && col32) fits = append(&end, planes, &c.col_weight_planes);
    // 16-bit products: the rounded operand (2 bytes a value), the rounded weights of each such
    // pass (4 D^2 values), cuBLAS's workspace.
    const int passes16 = (c.row.products != Products::kFp32) + (c.col.products != Products::kFp32);
    if (fits && passes16 > 0) {
      fits = floats <= ~size_t{0} / 2 && append(&end, 2 * floats, &c.operand16) &&
             append(&end, (size_t)passes16 * 4 * D * D * 2, &c.weights16);
      c.caller_blas = caller_blas;
      c.blas_bytes = caller_blas ? 0 : backward_blas_bytes(dev);
      if (!caller_blas) fits = fits && append(&end, c.blas_bytes, &c.blas);
    }
  }
  if (!fits) return invalid("the workspace size overflows size_t");
  c.workspace_bytes = end;
  *plan = c;
  return Status::Ok();
}

size_t backward_blas_bytes(const DeviceCaps& dev) { return static_cast<size_t>(dev.cc_major >= 9 ? 32 : 4) << 20; }

size_t attention_scores_bytes(int64_t num_seq, int64_t len, int64_t heads, int64_t dim, Products products) {
  if (num_seq <= 0 || len <= 0 || heads <= 0 || dim <= 0) return 0;
  // Lp / hd activations: at least kAttentionScoresMinActivations (heads Lp >= 4 dim).
  if ((long double)heads * attention_scores_stride(len) < (long double)kAttentionScoresMinActivations * dim) return 0;
  // In long double: num_seq len is T (validate_sizes bounds T dim), but T heads stride need not fit.
  const long double fp32_bytes = (long double)num_seq * len * heads * attention_scores_stride(len) * sizeof(float);
  const long double activation = (long double)num_seq * len * dim * sizeof(float);
  const long double cap = std::max<long double>(kAttentionScoresMaxActivations * activation, kAttentionScoresMinBytes);
  if (!(fp32_bytes <= cap && fp32_bytes <= (long double)(int64_t{1} << 62))) return 0;
  const int value = attention_scores_value_bytes(products);
  return (size_t)((long double)num_seq * len * heads * attention_scores_stride(len, value) * value);
}

bool weight_gradient_wgmma_can_run(const DeviceCaps& dev) {
  return dev.sm90a && (size_t)std::max(dev.smem_optin, 0) >= kWeightGradWgmmaSmemBytes;
}

namespace {

// Chunks for the mma.sync kernel: the grid (tiles x S blocks) about two waves of the device's
// resident blocks, S rounded down so that the last wave is full or nearly (rounding up would add
// a wave of a few blocks).
int64_t mma_sync_splits(int64_t tiles, const DeviceCaps& dev) {
  // Blocks an SM holds: two where its shared memory takes two (the kernel's registers are bounded for two).
  const int64_t smem = std::max(dev.smem_optin, 0);
  const int64_t per_sm = std::clamp<int64_t>(smem / (int64_t)kWeightGradSmemBytes, 1, 2);
  const int64_t resident = std::max(dev.sms, 1) * per_sm;
  return 2 * resident / tiles;
}

// Chunks for the wgmma kernel: one block an SM (its shared memory, and 200-odd registers a
// thread), all running from the start to the end of the product, so one wave: S = SMs / tiles.
// Where the tiles alone fill a wave or more, the fewest S (up to kWeightGradWgmmaMaxWaveSplits)
// whose blocks fill their waves to 90%, else the S that fills them best (192 tiles on 132 SMs: S
// 2, 384 blocks in 3 waves of 132, 97% full, against 73% for S 1).
int64_t wgmma_splits(int64_t tiles, const DeviceCaps& dev) {
  const int64_t sms = std::max(dev.sms, 1);
  if (tiles <= sms) return sms / tiles;
  int64_t best = 1, best_waves = (tiles + sms - 1) / sms;  // fill of s: tiles s / (waves(s) sms)
  for (int64_t s = 1; s <= kWeightGradWgmmaMaxWaveSplits; ++s) {
    const int64_t waves = (tiles * s + sms - 1) / sms;
    if (10 * tiles * s >= 9 * waves * sms) return s;
    if (s * best_waves > best * waves) best = s, best_waves = waves;
  }
  return best;
}

}  // namespace

// S from the kernel's rule, then at least kWeightGradMinSplitRows rows a chunk, so that a block's
// partial tile (32 or 64 KB written, then read once more) stays small beside its rows' reads (192
// or 256 floats a row: 192 or 256 KB at 256 rows).
WeightGradSplit weight_gradient_split(int64_t T, int64_t N, int64_t K, const DeviceCaps& dev,
                                      WeightGradKernel kernel) {
  const int64_t step = kWeightGradStageRows;
  T = std::max<int64_t>(T, 0);
  const bool wgmma = kernel == WeightGradKernel::kWgmma;
  const int64_t tile_n = wgmma ? kWeightGradWgmmaTileN : kWeightGradTileN;
  const int64_t tile_k = wgmma ? kWeightGradWgmmaTileK : kWeightGradTileK;
  const int64_t tiles =
      std::max<int64_t>(1, (N + tile_n - 1) / tile_n) * std::max<int64_t>(1, (K + tile_k - 1) / tile_k);
  const int64_t wanted = wgmma ? wgmma_splits(tiles, dev) : mma_sync_splits(tiles, dev);
  int64_t splits = std::min<int64_t>({wanted, T / kWeightGradMinSplitRows, 65535});  // 65535: grid.y
  splits = std::max<int64_t>({splits, 1, (T + kWeightGradMaxChunkRows - 1) / kWeightGradMaxChunkRows});
  const int64_t per = (T + splits - 1) / splits;
  WeightGradSplit s;
  s.rows = std::max<int64_t>(step, (per + step - 1) / step * step);
  s.splits = std::max<int64_t>(1, (T + s.rows - 1) / s.rows);
  return s;
}

WeightGradVariant weight_gradient_variant(const WeightGradProblem& g, const DeviceCaps& dev) {
  WeightGradVariant v;
  if (!g.mma_sync && g.aligned && g.K % 4 == 0 && weight_gradient_wgmma_can_run(dev))
    v.kernel = WeightGradKernel::kWgmma, v.tile_cols = g.K <= 64 ? 64 : kWeightGradWgmmaTileK;
  v.split = weight_gradient_split(g.T, g.N, g.K, dev, v.kernel);
  return v;
}

size_t weight_gradient_partials_floats(int64_t T, int64_t N, int64_t K, const DeviceCaps& dev) {
  int64_t splits = weight_gradient_split(T, N, K, dev, WeightGradKernel::kMmaSync).splits;
  if (weight_gradient_wgmma_can_run(dev))
    splits = std::max(splits, weight_gradient_split(T, N, K, dev, WeightGradKernel::kWgmma).splits);
  return splits > 1 ? (size_t)splits * (size_t)N * (size_t)K : 0;
}

GemmTiling gemm_tiling(int64_t M, int64_t N, int sms) {
  const int64_t row_tiles = (M + 127) / 128, s = std::max(sms, 1);
  const auto tiles = [&](int64_t cols) { return row_tiles * ((N + cols - 1) / cols); };
  GemmTiling t;
  t.cols = (N + 95) / 96 * 96 < (N + 127) / 128 * 128 ? 96 : 128;  // the narrower padding
  if (2 * tiles(t.cols) <= s) {
    t.rows = 64;
    return t;
  }
  // Two-warpgroup tiles: rounds x width, in percent of a 128-column tile's width.
  const auto cost = [&](int64_t cols, int64_t weight) { return (tiles(cols) + s - 1) / s * cols * weight; };
  if (cost(96, 115) < cost(128, 100)) t.cols = 96;
  // Three-warpgroup tiles (192 rows) where they save rounds: a k-step of one costs about 1.22 of a
  // 128-row one's (perf notes v49).
  const int64_t col_tiles = (N + t.cols - 1) / t.cols;
  const int64_t r128 = (row_tiles * col_tiles + s - 1) / s, r192 = ((M + 191) / 192 * col_tiles + s - 1) / s;
  if (122 * r192 < 100 * r128) t.rows = 192;
  return t;
}

size_t weight_gradient_pass_partials_floats(int64_t T, int64_t D, const DeviceCaps& dev) {
  return std::max(weight_gradient_partials_floats(T, 3 * D, D, dev), weight_gradient_partials_floats(T, D, D, dev));
}

Status make_backward_plan(const AxialParams& p, const DeviceCaps& dev, CudaBackwardPlan* plan, bool caller_blas) {
  const int64_t hd = p.dim / p.heads;
  if (hd > kCudaBackwardMaxHeadDim)
    return {StatusCode::kUnsupported, "the CUDA backward serves head dims up to " +
                                          std::to_string(kCudaBackwardMaxHeadDim) + ", got " + std::to_string(hd)};
  if (dev.cc_major < 8)
    return {StatusCode::kUnsupported, "the CUDA backward needs a GPU of compute capability 8.0 or newer, got " +
                                          std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor)};
  CudaBackwardPlan c;
  c.batch = p.batch, c.height = p.height, c.width = p.width, c.dim = p.dim, c.heads = p.heads;
  c.products = p.products;
  c.device = dev.device;
  const bool fp32 = p.products == Products::kFp32;
  // Sizes in floats; validate_sizes bounds T D by int64, so only the byte counts can overflow.
  const size_t T = (size_t)(p.batch * p.height * p.width), D = (size_t)p.dim, heads = (size_t)p.heads;
  const size_t limit = ~size_t{0} / (4 * sizeof(float));
  if (T > limit / std::max<size_t>(D, 1) || T > limit / heads) return invalid("the workspace size overflows size_t");
  const size_t td = T * D * sizeof(float), th = T * heads * sizeof(float);
  // The saved forward: the same layout whatever the device and the products (cuda_saved_bytes; the
  // fake kernel's size knows neither). On 16-bit products the LayerNorm output's region holds it
  // rounded (T D 16-bit values) and then the attention output rounded.
  size_t end = 0;
  bool fits = true;
  for (CudaBackwardPlan::Pass* pass : {&c.row, &c.col}) {
    fits = fits && append(&end, td, &pass->norm) && append(&end, 2 * T * sizeof(float), &pass->stats) &&
           append(&end, 3 * td, &pass->qkv) && append(&end, td, &pass->attn) && append(&end, 2 * th, &pass->lse);
    if (!fp32) pass->attn16 = pass->norm + td / 2;  // 16-byte aligned where T D % 8 == 0 (D % 8 == 0)
  }
  fits = fits && append(&end, td, &c.row_output) && append(&end, 2 * sizeof(uint64_t), &c.dropout_state);
  c.saved_bytes = end;
  // The workspace.
  end = 0;
  fits = fits && append(&end, td, &c.grad_row_output) && append(&end, td, &c.grad_attn) &&
         append(&end, 3 * td, &c.grad_qkv) && append(&end, td, &c.grad_norm) && append(&end, th, &c.delta) &&
         append(&end, kColumnPartialsPerDim * D * sizeof(double), &c.column_partials);
  // dS^T of a pass where it takes the scratch (attention_scores_bytes): one region, sized for the
  // larger pass, used by each in turn.
  const size_t row_scores = attention_scores_bytes(p.batch * p.height, p.width, p.heads, p.dim, p.products);
  const size_t col_scores = attention_scores_bytes(p.batch * p.width, p.height, p.heads, p.dim, p.products);
  c.row_scores = row_scores > 0, c.col_scores = col_scores > 0;
  c.attention_scores_bytes = std::max(row_scores, col_scores);
  if (c.attention_scores_bytes > 0) fits = fits && append(&end, c.attention_scores_bytes, &c.attention_scores);
  // Split-KV partials for the training forward's flash attention, as the inference plan's, and
  // the attention backward's split partials (smem_layout.h), each the larger pass's: one region
  // for both, as the forward's are dead once it returns.
  // Each pass's attention, forward and backward, as the plan sizes them (the training forward's
  // dropout and the regions are added below, where the kernels are recorded).
  const AxisView views[2] = {row_view(p), col_view(p)};
  FlashProblem flash[2];
  AttentionGradProblem grad[2];
  for (int i = 0; i < 2; ++i) {
    flash[i] = {views[i].num_seq, views[i].len, hd, p.heads};
    grad[i] = {views[i].num_seq, views[i].len, hd, p.heads};
    flash[i].products = grad[i].products = p.products;
  }
  const size_t flash_partials = std::max(workspace_bytes(flash[0], dev), workspace_bytes(flash[1], dev));
  const size_t attention_partials = std::max(workspace_bytes(grad[0], dev), workspace_bytes(grad[1], dev));
  if (flash_partials > 0 || attention_partials > 0) {
    size_t shared = CudaBackwardPlan::kNone;
    fits = fits && append(&end, std::max(flash_partials, attention_partials), &shared);
    if (flash_partials > 0) c.flash_partials = shared, c.flash_partials_bytes = flash_partials;
    if (attention_partials > 0) c.attention_partials = shared, c.attention_partials_bytes = attention_partials;
  }
  c.caller_blas = caller_blas;
  c.blas_bytes = caller_blas ? 0 : backward_blas_bytes(dev);
  if (caller_blas)
    c.blas = CudaBackwardPlan::kNone;
  else
    fits = fits && append(&end, c.blas_bytes, &c.blas);
  // 16-bit products: a pass's weights rounded (each call rounds them again: the workspace is scratch)
  // and the backward's rounded operands (cuBLAS's 16-bit products take no fp32).
  if (!fp32) {
    if (D > limit / D / 8) return invalid("the workspace size overflows size_t");
    fits = fits && append(&end, 4 * D * D * sizeof(uint16_t), &c.weights16) && append(&end, 3 * td / 2, &c.operand16);
  }
  // The staged path's product (gemm/gemm.cu) where the device runs it and its N and K fit: fp32
  // products only (the 16-bit ones are cuBLAS's).
  c.tensor_core_products = fp32 && can_run(GemmProblem{(int64_t)T, 3 * (int64_t)D, (int64_t)D}, dev);
  if (c.tensor_core_products) {
    if (D > limit / D / 8) return invalid("the workspace size overflows size_t");  // 128 D^2 bytes
    fits = fits && append(&end, 2 * 16 * D * D * sizeof(float), &c.weight_planes);
  }
  // The weight gradients on the tensor cores (gemm/weight_gradient.cu) where the device runs
  // them; their partial tiles where the rows are split, sized for the larger product of a pass
  // (d_Wqkv, then d_Wo, then the other pass's: one after another on the stream, so one region).
  c.tensor_core_weight_grads = fp32 && can_run(WeightGradProblem{}, dev);
  if (c.tensor_core_weight_grads) {
    // S N K <= 2 resident blocks' tiles of 128 x 64 floats (mma.sync), one wave's tiles of 128 x
    // 128 (wgmma), or kWeightGradWgmmaMaxWaveSplits N K = 12 D^2 (wgmma, where the tiles alone
    // fill a wave): bytes below 64 D^2.
    if (D > limit / D / 4) return invalid("the workspace size overflows size_t");
    const size_t partials = weight_gradient_pass_partials_floats((int64_t)T, (int64_t)D, dev) * sizeof(float);
    if (partials > 0) {
      fits = fits && append(&end, partials, &c.weight_grad_partials);
      c.weight_grad_partials_bytes = partials;
    }
  }
  if (!fits) return invalid("the workspace size overflows size_t");
  c.workspace_bytes = end;
  // The kernels, as the two calls choose them from the regions above.
  const auto kernels = [&](int pass, bool scores) {
    CudaBackwardPlan::PassKernels k;
    FlashProblem f = flash[pass];
    f.dropout = dropout_threshold(p.dropout) != 0, f.partials_bytes = c.flash_partials_bytes;
    f.products = p.products;
    const FlashVariant fv = flash_variant(f, dev);
    k.flash = fv.kernel, k.flash_splits = fv.splits;
    AttentionGradProblem a = grad[pass];
    a.scores = scores, a.partials = c.attention_partials != CudaBackwardPlan::kNone;
    a.partials_bytes = c.attention_partials_bytes;
    a.products = p.products;
    const AttentionGradVariant gv = attention_grad_variant(a, dev);
    k.grad = gv.kernel, k.dq = gv.dq, k.grad_splits = gv.splits;
    return k;
  };
  c.row_kernels = kernels(0, c.row_scores);
  c.col_kernels = kernels(1, c.col_scores);
  // 16-bit products run the tensor-core attention backward only (attention_grad_variant).
  if (!fp32 && (c.row_kernels.grad == AttentionGradKernel::kNone || c.col_kernels.grad == AttentionGradKernel::kNone))
    return {StatusCode::kUnsupported, "the CUDA backward on 16-bit products needs the tensor-core attention backward, "
                                      "whose tiles do not fit this device's shared memory at head dim " +
                                          std::to_string(hd)};
  *plan = c;
  return Status::Ok();
}

Status cuda_saved_bytes(const AxialParams& p, size_t* bytes) {
  if (Status s = validate_sizes(p); !s.ok()) return s;
  DeviceCaps any;  // the saved layout depends on neither the device nor the products
  any.cc_major = 9;
  AxialParams fp32 = p;
  fp32.products = Products::kFp32;
  CudaBackwardPlan plan;
  if (Status s = make_backward_plan(fp32, any, &plan); !s.ok()) return s;
  *bytes = plan.saved_bytes;
  return Status::Ok();
}

// ---- one contract per kernel ----

bool can_run(const FusedProblem& f, const DeviceCaps& dev) {
  return tensor_core_head(f.dim, f.heads) && f.aligned && fused_tile_count(f.len) > 0 &&
         fused_smem_bytes(f.len, f.dim) <= (size_t)std::max(dev.smem_optin, 0) && f.num_seq <= INT32_MAX;
}
size_t workspace_bytes(const FusedProblem&, const DeviceCaps&) { return 0; }

bool can_run(const StagedAttentionProblem& s, const DeviceCaps& dev) {
  return staged_attention_smem_bytes(s.len, s.head_dim) <= (size_t)std::max(dev.smem_optin, 0);
}
size_t workspace_bytes(const StagedAttentionProblem&, const DeviceCaps&) { return 0; }

// sm_90a code and the largest tiling's shared memory; N and K multiples of 8 (whole 8-column groups,
// 16-byte rows).
bool can_run(const GemmProblem& g, const DeviceCaps& dev) {
  return dev.sm90a && (size_t)std::max(dev.smem_optin, 0) >= kStagedGemmSmemBytes && g.N % 8 == 0 && g.K % 8 == 0;
}
size_t workspace_bytes(const GemmProblem&, const DeviceCaps&) { return 0; }

bool can_run(const FlashProblem& f, const DeviceCaps& dev) {
  return flash_padded_head_dim(f.head_dim) != 0 && f.len < (int64_t{1} << 30) && dev.cc_major >= 8;
}
size_t workspace_bytes(const FlashProblem& f, const DeviceCaps& dev) {
  if (f.dropout || f.products != Products::kFp32) return 0;  // no split there
  return flash_partials_bytes(f.num_seq, f.len, f.head_dim, f.heads, dev.sms);
}

bool can_run(const AttentionGradProblem& a, const DeviceCaps& dev) {
  return flash_padded_head_dim(a.head_dim) != 0 && a.len < (int64_t{1} << 30) && dev.cc_major >= 8;
}
size_t workspace_bytes(const AttentionGradProblem& a, const DeviceCaps& dev) {
  return attention_grad_partials_bytes(a.num_seq, a.len, a.head_dim, a.heads, dev.sms);
}

// mma.sync of TF32 (compute capability 8.0) and the mma.sync kernel's shared memory.
bool can_run(const WeightGradProblem&, const DeviceCaps& dev) {
  return dev.cc_major >= 8 && (size_t)std::max(dev.smem_optin, 0) >= kWeightGradSmemBytes;
}
size_t workspace_bytes(const WeightGradProblem& g, const DeviceCaps& dev) {
  return weight_gradient_partials_floats(g.T, g.N, g.K, dev) * sizeof(float);
}

std::string CudaBackwardPlan::describe() const {
  std::ostringstream s;
  const char* type16 = products == Products::kBf16 ? "bf16" : "fp16";
  s << "training";
  if (products != Products::kFp32) s << " on " << type16 << " products";
  s << ": the forward with its intermediates saved ("
    << (products != Products::kFp32 ? std::string("cuBLAS ") + type16
        : tensor_core_products      ? std::string("3xTF32 wgmma")
                                    : std::string("cuBLAS fp32"))
    << " projections, flash attention with log-sum-exp), then column and row passes back (weight gradients as "
    << (products != Products::kFp32 ? std::string("cuBLAS ") + type16
        : tensor_core_weight_grads  ? std::string("3xTF32 tensor-core")
                                    : std::string("cuBLAS fp32"))
    << " products, flash-style attention backward); saved " << saved_bytes << " B, workspace " << workspace_bytes
    << " B, "
    << (caller_blas ? std::string("cuBLAS on the caller's handle")
                    : "of which cuBLAS " + std::to_string(blas_bytes) + " B");
  if (weight_grad_partials != kNone)
    s << ", weight-gradient partials at " << weight_grad_partials << " (" << weight_grad_partials_bytes << " B)";
  if (attention_scores != kNone)
    s << ", score gradients (" << (row_scores && col_scores ? "both passes" : row_scores ? "row pass" : "column pass")
      << ") at " << attention_scores << " (" << attention_scores_bytes << " B)";
  if (flash_partials != kNone)
    s << ", flash split-KV partials at " << flash_partials << " (" << flash_partials_bytes << " B)";
  if (attention_partials != kNone)
    s << ", attention-backward split partials at " << attention_partials << " (" << attention_partials_bytes
      << " B)";
  const auto pass = [&](const char* name, const PassKernels& k) {
    s << "; " << name << ": flash " << to_string(k.flash);
    if (k.flash_splits > 1) s << " (" << k.flash_splits << " splits)";
    s << ", backward " << to_string(k.grad);
    if (k.dq != QueryGradKernel::kNone) s << " (dq " << to_string(k.dq);
    if (k.grad_splits > 1) s << ", " << k.grad_splits << " splits";
    if (k.dq != QueryGradKernel::kNone) s << ")";
  };
  pass("row", row_kernels);
  pass("col", col_kernels);
  s << " (B " << batch << ", H " << height << ", W " << width << ", D " << dim << ", heads " << heads << ", device "
    << device << ")";
  return s.str();
}

}  // namespace fastaxial
