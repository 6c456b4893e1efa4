// The shape rule of dispatch.h, shared by cuda_workspace_bytes and forward_cuda.
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

AxisPath axis_path(int64_t len, int64_t dim, int64_t heads) {
  static const Override forced = read_override();
  if (forced == Override::kGeneric || !tensor_core_shape(dim, heads)) return AxisPath::kGeneric;
  const bool fused = fused_tile_count(len) > 0 && fused_smem_bytes(len, dim) <= kSmemBudget;
  const bool staged = staged_attention_smem_bytes(len, dim / heads) <= kSmemBudget;
  if (forced == Override::kStaged && staged) return AxisPath::kStaged;
  // Measured on the H200 (docs/perf-notes.md, v17): the fused kernel, where
  // it holds the sequence, takes less GPU time than the staged path on every
  // shape measured but one (us per forward, fused vs staged: 4x32x32 dim 64
  // 17.6 vs 49.3; 16x32x32 dim 64 64.2 vs 90.4; 8x64x64 dim 128 327 vs 363;
  // 4x32x32 dim 256 129 vs 149; 2x48x80 dim 96 98 vs 91), and it makes two
  // launches where the staged path makes ten.
  if (fused) return AxisPath::kFused;
  if (staged && forced != Override::kFused) return AxisPath::kStaged;
  return AxisPath::kGeneric;
}

int64_t staged_workspace_floats(int64_t tokens, int64_t dim) { return 5 * tokens * dim + 8 * dim * dim; }

}  // namespace fastaxial
