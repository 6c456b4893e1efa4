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
  int64_t len, dim, heads, num_seq;
  AxisPath path;
  const char* why;
};

constexpr int64_t kH200Sms = 132;

TEST(Dispatch, PicksTheFamilyByShapeAndDevice) {
  if (overridden()) GTEST_SKIP() << "FASTAXIAL_CUDA_PATH is set";
  const Case cases[] = {
      // The shapes behind the rule (dispatch.cpp), each pass on an H200.
      {32, 64, 4, 128, AxisPath::kFused, "default problem"},
      {32, 64, 4, 512, AxisPath::kFused, "16x32x32 dim 64: dim 64 stays fused"},
      {64, 64, 4, 512, AxisPath::kFused, "8x64x64 dim 64"},
      {64, 128, 8, 512, AxisPath::kStaged, "8x64x64 dim 128: 32768 positions"},
      {32, 128, 4, 512, AxisPath::kStaged, "16x32x32 dim 128: 16384 positions"},
      {32, 256, 8, 128, AxisPath::kFused, "4x32x32 dim 256: 128 sequences fill 132 SMs"},
      {32, 96, 3, 128, AxisPath::kFused, "4x32x32 dim 96"},
      {64, 96, 3, 128, AxisPath::kFused, "2x64x64 dim 96"},
      {80, 96, 3, 96, AxisPath::kStaged, "2x48x80 dim 96, rows: 96 sequences leave 36 SMs idle"},
      {48, 96, 3, 160, AxisPath::kStaged, "2x48x80 dim 96, columns: a second wave of 28"},
      {48, 128, 4, 192, AxisPath::kStaged, "4x48x48 dim 128: a second wave of 60"},
      {64, 128, 8, 64, AxisPath::kStaged, "1x64x64 dim 128: 64 sequences"},
      {8, 128, 4, 8, AxisPath::kFused, "1x8x8 dim 128: too small for eight launches"},
      // Where only one family fits, the device does not matter.
      {128, 64, 4, 4, AxisPath::kFused, "L = 128 at dim 64"},
      {128, 96, 3, 4, AxisPath::kStaged, "q, k, v of L = 128 at dim 96 exceed shared memory"},
      {128, 256, 8, 256, AxisPath::kStaged, "q, k, v of L = 128 at dim 256 exceed shared memory"},
      {100, 256, 8, 1, AxisPath::kStaged, "the same at L = 100"},
      {256, 128, 4, 256, AxisPath::kStaged, "L = 256 is past the fused kernel"},
      {129, 64, 4, 2, AxisPath::kStaged, "L = 129"},
      {1024, 64, 4, 2, AxisPath::kGeneric, "keys and values of L = 1024 exceed shared memory"},
      {20, 12, 4, 3, AxisPath::kGeneric, "head_dim 3"},
      {5, 1024, 8, 3, AxisPath::kGeneric, "head_dim 128"},
      {9, 72, 9, 3, AxisPath::kFused, "head_dim 8"},
      {7, 60, 3, 3, AxisPath::kGeneric, "dim not a multiple of 8"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(axis_path(c.len, c.dim, c.heads, c.num_seq, kH200Sms), c.path)
        << c.why << ": L " << c.len << ", dim " << c.dim << ", heads " << c.heads << ", " << c.num_seq
        << " sequences";
    // The workspace must cover the staged path wherever a device may pick it.
    if (c.path == AxisPath::kStaged) EXPECT_TRUE(staged_possible(c.len, c.dim, c.heads)) << c.why;
  }
}

TEST(Dispatch, WaveFillDependsOnTheDevice) {
  if (overridden()) GTEST_SKIP() << "FASTAXIAL_CUDA_PATH is set";
  // 96 sequences of 80 at dim 96: a quarter of 132 SMs idle, none of 96.
  EXPECT_EQ(axis_path(80, 96, 3, 96, 132), AxisPath::kStaged);
  EXPECT_EQ(axis_path(80, 96, 3, 96, 96), AxisPath::kFused);
  EXPECT_EQ(axis_path(80, 96, 3, 96, 48), AxisPath::kFused);  // two full waves
  // dim 64 never prefers the staged path; no staged scratch for it where the fused kernel fits.
  EXPECT_EQ(axis_path(64, 64, 4, 64, 132), AxisPath::kFused);
  EXPECT_FALSE(staged_possible(64, 64, 4));
  EXPECT_TRUE(staged_possible(64, 96, 3));
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
  EXPECT_EQ(staged_layout(p).scratch, -1);
  p.batch = 2, p.height = 48, p.width = 80, p.dim = 96, p.heads = 3;  // staged on an H200, fused elsewhere
  const int64_t e = 2 * 48 * 80 * 96, w96 = 8 * 96 * 96;
  StagedLayout lay = staged_layout(p);
  EXPECT_EQ(lay.scratch, e);
  EXPECT_EQ(lay.row_weights, 5 * e);
  EXPECT_EQ(lay.col_weights, 5 * e + w96);
  EXPECT_EQ(cuda_workspace_bytes(p), (size_t)(5 * e + 2 * w96) * sizeof(float));
  p.batch = 2, p.height = 128, p.width = 128, p.dim = 256, p.heads = 8;  // staged both ways
  const int64_t m = 2 * 128 * 128 * 256;
  EXPECT_EQ(cuda_workspace_bytes(p), (size_t)(5 * m + 2 * 8 * 256 * 256) * sizeof(float));
  p.batch = 1, p.height = 256, p.width = 4, p.dim = 64, p.heads = 4;  // columns of 256: only they may be staged
  const int64_t c = 256 * 4 * 64;
  lay = staged_layout(p);
  EXPECT_EQ(lay.row_weights, -1);
  EXPECT_EQ(lay.col_weights, 5 * c);
  EXPECT_EQ(cuda_workspace_bytes(p), (size_t)(5 * c + 8 * 64 * 64) * sizeof(float));
  p.batch = 0;  // nothing to compute, nothing to hold
  EXPECT_EQ(cuda_workspace_bytes(p), 0u);
}

// forward_cuda uses the staged scratch of a pass only where staged_layout
// reserved it: axis_path must stage only where staged_possible allows, for
// every device and every FASTAXIAL_CUDA_PATH.
TEST(Dispatch, StagedOnlyWhereReserved) {
  int staged = 0;
  for (int64_t len : {1, 9, 16, 32, 48, 64, 80, 100, 128, 129, 256, 512, 1024})
    for (int64_t dim : {8, 16, 32, 64, 72, 96, 128, 192, 256, 512})
      for (int64_t heads : {1, 2, 3, 4, 8})
        for (int64_t num_seq : {1, 8, 64, 96, 128, 160, 512, 4096})
          for (int64_t sms : {1, 48, 108, 132, 1000})
            if (axis_path(len, dim, heads, num_seq, sms) == AxisPath::kStaged) {
              ++staged;
              EXPECT_TRUE(staged_possible(len, dim, heads))
                  << "L " << len << ", dim " << dim << ", heads " << heads << ", " << num_seq << " sequences, "
                  << sms << " SMs";
            }
  if (!overridden()) EXPECT_GT(staged, 0);  // the sweep reaches the staged path
}

}  // namespace
}  // namespace fastaxial::test
