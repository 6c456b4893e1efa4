// The shape rule of dispatch.h, shared by cuda_workspace_bytes and forward_cuda.
#include "dispatch.h"

#include <cstdlib>
#include <cstring>
#include <initializer_list>

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

// x tile, q, k, v: four (16 MT, D + 4) float arrays.
size_t fused_smem_bytes(int64_t len, int64_t dim) {
  return 4 * (size_t)(16 * fused_tile_count(len)) * (size_t)(dim + 4) * sizeof(float);
}

// Keys (Lp, 2 hd + pad) and transposed values (hd, 2 Lp + pad), Lp = L rounded
// up to 16; the pads keep 16-byte fragment loads free of bank conflicts.
size_t staged_attention_smem_bytes(int64_t len, int64_t head_dim) {
  const int64_t lp = (len + 15) / 16 * 16;
  const int64_t ldk = 2 * head_dim + (2 * head_dim % 32 == 16 ? 0 : 16);
  const int64_t ldv = 2 * lp + (2 * lp % 32 == 16 ? 0 : 16);
  return (size_t)(lp * ldk + head_dim * ldv) * sizeof(float);
}

AxisPath axis_path(int64_t len, int64_t dim, int64_t heads, int64_t tokens) {
  static const Override forced = read_override();
  if (forced == Override::kGeneric || !tensor_core_shape(dim, heads)) return AxisPath::kGeneric;
  const bool fused = fused_tile_count(len) > 0 && fused_smem_bytes(len, dim) <= kSmemBudget;
  const bool staged = staged_attention_smem_bytes(len, dim / heads) <= kSmemBudget;
  if (forced == Override::kStaged && staged) return AxisPath::kStaged;
  if (forced == Override::kFused && fused) return AxisPath::kFused;
  // Measured on the H200 (docs/perf-notes.md, v13): from dim 96 up and with
  // thousands of positions the staged path wins over the fused kernel (dim
  // 96: 109 vs 149 us, dim 128: 446 vs 491 us); at dim 64 the fused kernel
  // wins on the default problem (29 vs 50 us) and the staged path from
  // 16384 positions up (16 x 32 x 32: 93 vs 103 us, wgmma products); small
  // problems pay for the staged path's ten launches.
  const bool staged_wins = (dim >= 96 && tokens >= 4096) || (dim >= 64 && tokens >= 16384);
  if (fused && !(staged && staged_wins)) return AxisPath::kFused;
  if (staged && forced != Override::kFused) return AxisPath::kStaged;
  return AxisPath::kGeneric;
}

int64_t staged_workspace_floats(int64_t tokens, int64_t dim) { return 5 * tokens * dim + 8 * dim * dim; }

}  // namespace fastaxial
