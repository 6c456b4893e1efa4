// Shared-memory layouts of the tensor-core kernels, in one place for the
// kernels (device) and for plan.cpp (host), which must size them without
// a device: row strides chosen so that fragment loads hit distinct banks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "axis.h"  // FASTAXIAL_HOST_DEVICE

namespace fastaxial {

// Rows read by 16-byte fragment loads (split pairs: a thread takes words
// 4t..4t+3 of rows g and g + 1 per quarter warp): 16 mod 32 words apart.
FASTAXIAL_HOST_DEVICE constexpr int pair_row_words(int words) { return words + (words % 32 == 16 ? 0 : 16); }

// Rows read by 8-byte fragment loads (a thread takes words 2t, 2t + 1 of rows
// g = 0..3 per half warp): 8 or 24 mod 32 words apart. `words` is a multiple of 8.
FASTAXIAL_HOST_DEVICE constexpr int float2_row_words(int words) { return words % 16 == 0 ? words + 8 : words; }

// The fused kernel (cuda/fused/forward.cu) for one sequence padded to lp rows
// (a multiple of 16) of dim d:
//   xs: (lp, ldx) LayerNorm(x), later the attention output, as split pairs
//   q, k: (lp, ldq) fp32 (q also holds the x tile as it arrives)
//   vt: (d, ldv) values, transposed
//   params: LayerNorm weight and bias, output bias (3 d), loaded once per block
struct FusedLayout {
  int lp, d, ldx, ldq, ldv;
  FASTAXIAL_HOST_DEVICE constexpr FusedLayout(int lp_, int d_)
      : lp(lp_), d(d_), ldx(pair_row_words(2 * d_)), ldq(float2_row_words(d_)), ldv(float2_row_words(lp_)) {}
  FASTAXIAL_HOST_DEVICE constexpr int64_t q_offset() const { return (int64_t)lp * ldx; }
  FASTAXIAL_HOST_DEVICE constexpr int64_t k_offset() const { return q_offset() + (int64_t)lp * ldq; }
  FASTAXIAL_HOST_DEVICE constexpr int64_t vt_offset() const { return k_offset() + (int64_t)lp * ldq; }
  FASTAXIAL_HOST_DEVICE constexpr int64_t params_offset() const { return vt_offset() + (int64_t)d * ldv; }
  FASTAXIAL_HOST_DEVICE constexpr int64_t floats() const { return params_offset() + 3 * (int64_t)d; }
};

// The staged path's whole-sequence attention kernel (cuda/staged/forward.cu), one head of head_dim hd over
// a sequence padded to lp rows: keys (lp, ldk) and transposed values (hd, ldv),
// both split pairs.
struct StagedAttentionLayout {
  int ldk, ldv;
  FASTAXIAL_HOST_DEVICE constexpr StagedAttentionLayout(int lp, int hd)
      : ldk(pair_row_words(2 * hd)), ldv(pair_row_words(2 * lp)) {}
};

// Shared memory the fused kernel's wgmma variant takes beyond FusedLayout:
// room to align its B operand to 1024 bytes.
constexpr size_t kFusedWgmmaSmemExtra = 1024;

// Shared memory of the staged path's largest GEMM tiling (4 stages of a
// 128 x 32 A tile and two 128 x 32 W planes, + 1024 to align): a device
// that cannot give a block this much has no staged path.
constexpr size_t kStagedGemmSmemBytes = 4 * (16384 + 2 * 16384) + 1024;

// The staged path's flash attention kernel (staged/flash_attention.cu): head
// dims up to 256, its largest tiling taking this much shared memory, less
// than the staged GEMM's, so a device with the staged path fits every one.
constexpr int kFlashMaxHeadDim = 256;
constexpr size_t kFlashMaxSmemBytes = 134656;
static_assert(kFlashMaxSmemBytes <= kStagedGemmSmemBytes, "the staged path's devices fit every flash tiling");

}  // namespace fastaxial
