// The rule of dispatch.h, shared by cuda_workspace_bytes and forward_cuda.
#include "dispatch.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "smem_layout.h"

namespace fastaxial {
namespace {

// Shared memory a block may opt in to on Hopper (sm_90); devices with less
// take the generic kernel where the chosen one does not fit.
constexpr size_t kSmemBudget = 227 * 1024;

bool tensor_core_shape(int64_t dim, int64_t heads) {
  const int64_t hd = dim / heads;
  return dim % 8 == 0 && (hd == 8 || hd == 16 || hd == 32 || hd == 64);
}

enum class Override { kNone, kFused, kStaged, kGeneric };

Override read_override() {
  const char* v = std::getenv("FASTAXIAL_CUDA_PATH");
  if (v == nullptr) return Override::kNone;
  if (std::strcmp(v, "fused") == 0) return Override::kFused;
  if (std::strcmp(v, "staged") == 0) return Override::kStaged;
  if (std::strcmp(v, "generic") == 0) return Override::kGeneric;
  return Override::kNone;
}

}  // namespace

int fused_tile_count(int64_t len) {
  for (int mt : {1, 2, 3, 4, 5, 6, 8})
    if (16 * mt >= len) return mt;
  return 0;
}

size_t fused_smem_bytes(int64_t len, int64_t dim) {
  const FusedLayout lay(16 * fused_tile_count(len), (int)dim);
  return (size_t)lay.floats() * sizeof(float);
}

// Lp = L rounded up to 16 (int: a longer sequence fits no block anyway).
size_t staged_attention_smem_bytes(int64_t len, int64_t head_dim) {
  const int64_t lp = std::min<int64_t>((len + 15) / 16 * 16, 1 << 24);
  const StagedAttentionLayout lay((int)lp, (int)head_dim);
  return (size_t)(lp * lay.ldk + head_dim * lay.ldv) * sizeof(float);
}

namespace {

// Dims at which the staged path beats the fused kernel on some passes (below).
bool staged_can_be_faster(int64_t dim) { return dim > 64; }

// Where both fit, by GPU time per forward measured on the H200 (132 SMs;
// docs/perf-notes.md, v21; B x H x W, dim, heads: fused vs staged, us):
// - dim 64: the fused kernel everywhere (4x32x32 17.8 vs 49.3, 16x32x32 64
//   vs 90, 8x64x64 124 vs 154): its projections are a small share there.
// - wider dims, passes of 16384 positions or more: the staged path, whose
//   projections run on wgmma (8x64x64 dim 128 294 vs 311, 16x32x32 dim 128
//   145 vs 151);
// - wider dims, smaller passes: the fused kernel while its sequences (a
//   block each, one block an SM) fill at least three quarters of the
//   device's last wave (4x32x32 dim 256 116 vs 129, 4x32x32 dim 96 30 vs 57,
//   2x64x64 dim 96 52 vs 83: 128 sequences), the staged path where they
//   leave more idle, from 4096 positions up (2x48x80 dim 96: 96 and 160
//   sequences, 93 vs 83; 4x48x48 dim 128 146 vs 111; 1x64x64 dim 128 81 vs
//   66). Below that, its eight launches cost more than they save.
bool staged_is_faster(int64_t len, int64_t dim, int64_t num_seq, int64_t sms) {
  if (!staged_can_be_faster(dim)) return false;
  const int64_t positions = num_seq * len;
  if (positions >= 16384) return true;
  if (positions < 4096 || sms < 1) return false;
  const int64_t slots = (num_seq + sms - 1) / sms * sms;  // blocks the fused kernel's waves could hold
  return 4 * num_seq < 3 * slots;
}

// The rule, given whether the staged path is the faster one where both fit.
AxisPath pick(int64_t len, int64_t dim, int64_t heads, bool staged_faster) {
  static const Override forced = read_override();
  if (forced == Override::kGeneric || !tensor_core_shape(dim, heads)) return AxisPath::kGeneric;
  const bool fused = fused_tile_count(len) > 0 && fused_smem_bytes(len, dim) <= kSmemBudget;
  const bool staged = staged_attention_smem_bytes(len, dim / heads) <= kSmemBudget;
  if (forced == Override::kStaged && staged) return AxisPath::kStaged;
  if (forced == Override::kFused && fused) return AxisPath::kFused;
  if (fused && !(staged && forced == Override::kNone && staged_faster)) return AxisPath::kFused;
  if (staged && forced != Override::kFused) return AxisPath::kStaged;
  return AxisPath::kGeneric;
}

}  // namespace

AxisPath axis_path(int64_t len, int64_t dim, int64_t heads, int64_t num_seq, int64_t sms) {
  return pick(len, dim, heads, staged_is_faster(len, dim, num_seq, sms));
}

bool staged_possible(int64_t len, int64_t dim, int64_t heads) {
  return pick(len, dim, heads, staged_can_be_faster(dim)) == AxisPath::kStaged;
}

StagedLayout staged_layout(const AxialParams& p) {
  StagedLayout lay;
  const int64_t tokens = p.batch * p.height * p.width;
  lay.floats = tokens * p.dim;  // the row pass's output
  if (p.dim < 1 || p.heads < 1 || p.dim % p.heads != 0 || tokens <= 0) return lay;
  const bool rows = staged_possible(p.width, p.dim, p.heads), cols = staged_possible(p.height, p.dim, p.heads);
  if (!rows && !cols) return lay;
  lay.scratch = lay.floats;
  lay.floats += 4 * tokens * p.dim;
  const int64_t weights = 8 * p.dim * p.dim;
  if (rows) lay.row_weights = lay.floats, lay.floats += weights;
  if (cols) lay.col_weights = lay.floats, lay.floats += weights;
  return lay;
}

}  // namespace fastaxial
