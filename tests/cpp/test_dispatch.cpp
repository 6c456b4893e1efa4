// The shape rule that picks a pass's CUDA kernel family and sizes the
// workspace (src/common/dispatch.cpp): no GPU needed, so CI runs it.
#include <gtest/gtest.h>

#include <cstdlib>

#include "../../src/common/dispatch.h"
#include "../../src/common/smem_layout.h"
#include "fastaxial/fastaxial.h"

namespace fastaxial::test {
namespace {

// The rule is read with FASTAXIAL_CUDA_PATH unset; a forced path changes it.
bool overridden() { return std::getenv("FASTAXIAL_CUDA_PATH") != nullptr; }

struct Case {
  int64_t len, dim, heads;
  AxisPath path;
  const char* why;
};

TEST(Dispatch, PicksTheFamilyByShape) {
  if (overridden()) GTEST_SKIP() << "FASTAXIAL_CUDA_PATH is set";
  const Case cases[] = {
      {32, 64, 4, AxisPath::kFused, "default problem"},
      {48, 96, 3, AxisPath::kFused, "dim 96"},
      {64, 128, 8, AxisPath::kFused, "dim 128"},
      {32, 256, 8, AxisPath::kFused, "dim 256 at L = 32"},
      {128, 64, 4, AxisPath::kFused, "L = 128 at dim 64"},
      {128, 96, 3, AxisPath::kStaged, "q, k, v of L = 128 at dim 96 exceed shared memory"},
      {128, 256, 8, AxisPath::kStaged, "q, k, v of L = 128 at dim 256 exceed shared memory"},
      {100, 256, 8, AxisPath::kStaged, "the same at L = 100"},
      {256, 128, 4, AxisPath::kStaged, "L = 256 is past the fused kernel"},
      {129, 64, 4, AxisPath::kStaged, "L = 129"},
      {1024, 64, 4, AxisPath::kGeneric, "keys and values of L = 1024 exceed shared memory"},
      {20, 12, 4, AxisPath::kGeneric, "head_dim 3"},
      {5, 1024, 8, AxisPath::kGeneric, "head_dim 128"},
      {9, 72, 9, AxisPath::kFused, "head_dim 8"},
      {7, 60, 3, AxisPath::kGeneric, "dim not a multiple of 8"},
  };
  for (const Case& c : cases)
    EXPECT_EQ(axis_path(c.len, c.dim, c.heads), c.path)
        << c.why << ": L " << c.len << ", dim " << c.dim << ", heads " << c.heads;
}

TEST(Dispatch, FusedTileCounts) {
  const int64_t lens[] = {1, 16, 17, 48, 49, 96, 97, 112, 128, 129};
  const int tiles[] = {1, 1, 2, 3, 4, 6, 8, 8, 8, 0};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(fused_tile_count(lens[i]), tiles[i]) << "L " << lens[i];
}

// The fused kernel's rows are 16-byte aligned and their strides put the
// fragment loads of a quarter warp (16-byte) or half warp (8-byte) on
// distinct banks; the README's largest dims per L follow from the layout.
TEST(Dispatch, FusedLayoutStridesAndLimits) {
  for (int lp = 16; lp <= 128; lp += 16)
    for (int d = 8; d <= 512; d += 8) {
      const FusedLayout lay(lp, d);
      EXPECT_EQ(lay.ldq % 16, 8) << "q, k rows: 8-byte loads of rows g = 0..3";
      EXPECT_EQ(lay.ldv % 16, 8) << "transposed values: the same";
      EXPECT_EQ(pair_row_words(2 * d) % 32, 16) << "split pairs: 16-byte loads of rows g = 0, 1";
      for (int64_t offset : {lay.q_offset(), lay.k_offset(), lay.vt_offset(), lay.params_offset()})
        EXPECT_EQ(offset % 4, 0) << "16-byte aligned, lp " << lp << ", d " << d;
    }
  const int64_t lens[] = {32, 64, 128}, widest[] = {328, 168, 88};
  for (int i = 0; i < 3; ++i) {
    EXPECT_LE(fused_smem_bytes(lens[i], widest[i]), 227u * 1024) << "L " << lens[i];
    EXPECT_GT(fused_smem_bytes(lens[i], widest[i] + 8), 227u * 1024) << "L " << lens[i];
  }
}

TEST(Dispatch, WorkspaceCoversTheStagedPath) {
  if (overridden()) GTEST_SKIP() << "FASTAXIAL_CUDA_PATH is set";
  AxialParams p;
  p.batch = 4, p.height = 32, p.width = 32, p.dim = 64, p.heads = 4;  // fused both ways
  const int64_t n = 4 * 32 * 32 * 64;
  EXPECT_EQ(cuda_workspace_bytes(p), (size_t)n * sizeof(float));
  p.batch = 2, p.height = 128, p.width = 128, p.dim = 256, p.heads = 8;  // staged both ways
  const int64_t tokens = 2 * 128 * 128, m = tokens * 256;
  EXPECT_EQ(cuda_workspace_bytes(p), (size_t)(m + staged_workspace_floats(tokens, 256)) * sizeof(float));
  EXPECT_EQ(staged_workspace_floats(tokens, 256), 5 * m + 8 * 256 * 256);
  p.batch = 0;  // nothing to compute, nothing to hold
  EXPECT_EQ(cuda_workspace_bytes(p), 0u);
}

}  // namespace
}  // namespace fastaxial::test
