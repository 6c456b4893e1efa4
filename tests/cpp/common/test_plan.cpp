// The plan of a CUDA forward (src/common/plan.cpp): which kernel family each
// pass takes on a given device, and the workspace layout. Host code alone, so
// CI runs it without a GPU. The environment's FASTAXIAL_CUDA_PATH does not
// apply here: every test passes its options explicitly, so it runs once.
#include <gtest/gtest.h>

#include <array>

#include <string>
#include <vector>

#include "src/common/plan.h"
#include "src/common/smem_layout.h"
#include "fastaxial/fastaxial.h"
#include "util/devices.h"

namespace fastaxial::test {
namespace {

// The plan of the row pass of num_seq sequences of len positions.
PassPlan row_pass(int64_t len, int64_t dim, int64_t heads, int64_t num_seq, const DeviceCaps& dev,
                  const PlanOptions& options = {}, bool aligned = true) {
  const AxisView view{num_seq, len, num_seq, len * dim, dim, num_seq * len * dim};
  PassPlan pass;
  const Status s = plan_pass(view, dim, heads, aligned, dev, options, &pass);
  EXPECT_TRUE(s.ok()) << s.message;
  return pass;
}

AxialParams problem(int64_t B, int64_t H, int64_t W, int64_t D, int64_t heads) {
  AxialParams p;
  p.batch = B, p.height = H, p.width = W, p.dim = D, p.heads = heads;
  return p;  // null pointers: planned as aligned
}

CudaPlan plan_of(const AxialParams& p, const DeviceCaps& dev, const PlanOptions& options = {}) {
  CudaPlan plan;
  const Status s = make_plan(p, dev, options, &plan);
  EXPECT_TRUE(s.ok()) << s.message;
  return plan;
}

struct Case {
  int64_t len, dim, heads, num_seq;
  KernelFamily family;
  const char* why;
};

TEST(Plan, PicksTheFamilyByShapeAndDevice) {
  const Case cases[] = {
      // The shapes behind the rule (dispatch.cpp), each pass on an H200.
      {32, 64, 4, 128, KernelFamily::kFused, "default problem"},
      {32, 64, 4, 512, KernelFamily::kFused, "16x32x32 dim 64: dim 64 stays fused"},
      {64, 64, 4, 512, KernelFamily::kFused, "8x64x64 dim 64"},
      {64, 128, 8, 512, KernelFamily::kStaged, "8x64x64 dim 128: 32768 positions"},
      {32, 128, 4, 512, KernelFamily::kStaged, "16x32x32 dim 128: 16384 positions"},
      {32, 256, 8, 128, KernelFamily::kFused, "4x32x32 dim 256: 128 sequences fill 132 SMs"},
      {32, 96, 3, 128, KernelFamily::kFused, "4x32x32 dim 96"},
      {64, 96, 3, 128, KernelFamily::kFused, "2x64x64 dim 96"},
      {80, 96, 3, 96, KernelFamily::kStaged, "2x48x80 dim 96, rows: 96 sequences leave 36 SMs idle"},
      {48, 96, 3, 160, KernelFamily::kStaged, "2x48x80 dim 96, columns: a second wave of 28"},
      {48, 128, 4, 192, KernelFamily::kStaged, "4x48x48 dim 128: a second wave of 60"},
      {64, 128, 8, 64, KernelFamily::kStaged, "1x64x64 dim 128: 64 sequences"},
      {8, 128, 4, 8, KernelFamily::kFused, "1x8x8 dim 128: too small for eight launches"},
      // Where only one family fits, the device does not matter.
      {128, 64, 4, 4, KernelFamily::kFused, "L = 128 at dim 64"},
      {128, 96, 3, 4, KernelFamily::kStaged, "q, k, v of L = 128 at dim 96 exceed shared memory"},
      {128, 256, 8, 256, KernelFamily::kStaged, "q, k, v of L = 128 at dim 256 exceed shared memory"},
      {100, 256, 8, 1, KernelFamily::kStaged, "the same at L = 100"},
      {256, 128, 4, 256, KernelFamily::kStaged, "L = 256 is past the fused kernel"},
      {129, 64, 4, 2, KernelFamily::kStaged, "L = 129"},
      {1024, 64, 4, 2, KernelFamily::kStaged, "L = 1024: flash attention streams the keys"},
      {20, 12, 4, 3, KernelFamily::kGeneric, "head_dim 3"},
      {5, 1024, 8, 3, KernelFamily::kStaged, "head_dim 128: flash attention"},
      {32, 192, 4, 128, KernelFamily::kStaged, "head_dim 48"},
      {64, 512, 2, 64, KernelFamily::kStaged, "head_dim 256"},
      {8, 520, 2, 64, KernelFamily::kGeneric, "head_dim 260: past the flash kernel"},
      {9, 72, 9, 3, KernelFamily::kFused, "head_dim 8"},
      // Many very short sequences: the staged path (the fused kernel pads each to 16 rows, one an SM).
      {1, 32, 1, 4096, KernelFamily::kStaged, "(1, 1, 4096, 32, 1), columns: 4096 sequences of 1"},
      {4, 64, 4, 4096, KernelFamily::kStaged, "(1, 4, 4096, 64, 4), columns"},
      {2, 64, 4, 512, KernelFamily::kStaged, "(256, 2, 2, 64, 4): 4 rounds of L = 2"},
      {4, 32, 1, 396, KernelFamily::kFused, "L = 4: 3 rounds of 132"},
      {4, 32, 1, 397, KernelFamily::kStaged, "L = 4: 4 rounds"},
      {5, 32, 1, 397, KernelFamily::kFused, "L = 5 wants 8 rounds"},
      {8, 32, 2, 512, KernelFamily::kFused, "(64, 8, 8, 32, 2): L = 8 at 4 rounds ties"},
      {16, 64, 2, 2048, KernelFamily::kStaged, "(1, 16, 2048, 64, 2), columns: 16 rounds of L = 16"},
      {16, 64, 4, 924, KernelFamily::kFused, "L = 16: 7 rounds"},
      {16, 64, 4, 925, KernelFamily::kStaged, "L = 16: 8 rounds"},
      {17, 64, 4, 4096, KernelFamily::kFused, "L = 17 and longer: dim 64 stays fused"},
      {4, 128, 4, 200, KernelFamily::kFused, "dim 128, L = 4: 2 rounds, 800 positions"},
      {2, 128, 4, 600, KernelFamily::kStaged, "dim 128, L = 2: 5 rounds"},
      {7, 60, 3, 3, KernelFamily::kGeneric, "dim not a multiple of 8"},
  };
  for (const Case& c : cases)
    EXPECT_EQ(row_pass(c.len, c.dim, c.heads, c.num_seq, h200()).family, c.family)
        << c.why << ": L " << c.len << ", dim " << c.dim << ", heads " << c.heads << ", " << c.num_seq
        << " sequences";
}

TEST(Plan, WaveFillDependsOnTheDevice) {
  // 96 sequences of 80 at dim 96: a quarter of 132 SMs idle, none of 96.
  DeviceCaps dev = h200();
  EXPECT_EQ(row_pass(80, 96, 3, 96, dev).family, KernelFamily::kStaged);
  dev.sms = 96;
  EXPECT_EQ(row_pass(80, 96, 3, 96, dev).family, KernelFamily::kFused);
  dev.sms = 48;
  EXPECT_EQ(row_pass(80, 96, 3, 96, dev).family, KernelFamily::kFused);  // two full waves
  EXPECT_EQ(row_pass(64, 64, 4, 64, h200()).family, KernelFamily::kFused);  // dim 64 prefers staged only for short L
  // 512 sequences of 4: 4 rounds on 132 SMs, 2 on 256.
  EXPECT_EQ(row_pass(4, 64, 4, 512, h200()).family, KernelFamily::kStaged);
  dev = h200();
  dev.sms = 256;
  EXPECT_EQ(row_pass(4, 64, 4, 512, dev).family, KernelFamily::kFused);
}

TEST(Plan, NarrowsToWhatTheDeviceAndPointersAllow) {
  // No sm_90a code: the staged path's shapes take the fused kernel where it
  // holds the sequence, else the generic one.
  EXPECT_EQ(row_pass(64, 128, 8, 512, ptx_only()).family, KernelFamily::kFused);
  EXPECT_EQ(row_pass(256, 128, 4, 256, ptx_only()).family, KernelFamily::kGeneric);
  // The fused kernel's shared memory must fit this device: L = 128 at dim 88 fits 227 KB, not 163 KB.
  EXPECT_EQ(row_pass(128, 88, 11, 4, h200()).family, KernelFamily::kFused);
  EXPECT_EQ(row_pass(128, 88, 11, 4, a100()).family, KernelFamily::kGeneric);
  // Tensors not 16-byte aligned: generic.
  EXPECT_EQ(row_pass(32, 64, 4, 128, h200(), {}, false).family, KernelFamily::kGeneric);
  PlanOptions staged;
  staged.forced = ForcedFamily::kStaged;
  EXPECT_EQ(row_pass(256, 128, 4, 256, h200(), staged, false).family, KernelFamily::kGeneric);
}

// The staged path's attention: its own whole-sequence kernel where the
// head's keys fit shared memory and the (sequence, head) items fill the
// device twice; the flash kernel elsewhere.
TEST(Plan, StagedAttentionKernel) {
  const auto flash = [](int64_t len, int64_t dim, int64_t heads, int64_t num_seq) {
    const PassPlan pass = row_pass(len, dim, heads, num_seq, h200());
    EXPECT_EQ(pass.family, KernelFamily::kStaged) << "L " << len << ", dim " << dim;
    return pass.flash;
  };
  EXPECT_FALSE(flash(128, 256, 8, 256)) << "(2, 128, 128, 256, 8): 2048 items";
  EXPECT_FALSE(flash(256, 128, 4, 256)) << "(1, 256, 256, 128, 4)";
  EXPECT_FALSE(flash(80, 96, 3, 96)) << "(2, 48, 80, 96, 3) rows: 288 items";
  EXPECT_FALSE(flash(512, 64, 4, 512)) << "L = 512, head_dim 16: the keys fit";
  EXPECT_TRUE(flash(2048, 64, 4, 8)) << "L = 2048: the keys do not fit";
  EXPECT_TRUE(flash(1024, 256, 8, 32)) << "L = 1024, head_dim 32";
  EXPECT_TRUE(flash(256, 128, 4, 2)) << "8 items on 132 SMs";
  EXPECT_TRUE(flash(64, 512, 4, 128)) << "head_dim 128";
  EXPECT_TRUE(flash(32, 192, 4, 256)) << "head_dim 48";
  EXPECT_FALSE(row_pass(32, 64, 4, 128, h200()).flash) << "fused: no flash flag";
  // Without sm_90a code no staged path: head dims off the fused list go generic.
  EXPECT_EQ(row_pass(64, 512, 4, 128, ptx_only()).family, KernelFamily::kGeneric);
}

TEST(Plan, FusedWgmmaWhereItApplies) {
  EXPECT_TRUE(row_pass(32, 64, 4, 128, h200()).wgmma) << "the default problem";
  EXPECT_TRUE(row_pass(64, 64, 2, 128, h200()).wgmma) << "up to 64 positions";
  EXPECT_FALSE(row_pass(65, 64, 4, 128, h200()).wgmma) << "past 64 positions";
  EXPECT_FALSE(row_pass(32, 64, 1, 128, h200()).wgmma) << "one head of 64";
  EXPECT_FALSE(row_pass(32, 32, 4, 128, h200()).wgmma) << "dim 32";
  EXPECT_FALSE(row_pass(32, 64, 4, 128, a100()).wgmma) << "no sm_90a code";
  PlanOptions off;
  off.fused_wgmma = 0;
  EXPECT_FALSE(row_pass(32, 64, 4, 128, h200(), off).wgmma) << "FASTAXIAL_FUSED_WGMMA=0";
  EXPECT_FALSE(row_pass(80, 96, 3, 96, h200()).wgmma) << "only the fused family has the variant";
}

TEST(Plan, ForcedFamilyWhereItCanServe) {
  PlanOptions o;
  o.forced = ForcedFamily::kStaged;
  EXPECT_EQ(row_pass(32, 64, 4, 128, h200(), o).family, KernelFamily::kStaged);
  EXPECT_EQ(row_pass(20, 12, 4, 3, h200(), o).family, KernelFamily::kGeneric) << "head_dim 3: no tensor cores";
  o.forced = ForcedFamily::kFused;
  EXPECT_EQ(row_pass(80, 96, 3, 96, h200(), o).family, KernelFamily::kFused);
  EXPECT_EQ(row_pass(256, 128, 4, 256, h200(), o).family, KernelFamily::kStaged)
      << "L = 256: past the fused kernel, the default choice";
  o.forced = ForcedFamily::kGeneric;
  EXPECT_EQ(row_pass(32, 64, 4, 128, h200(), o).family, KernelFamily::kGeneric);
  EXPECT_FALSE(row_pass(32, 64, 4, 128, h200(), o).wgmma);
}

TEST(Plan, ForcedFamilyTheDeviceCannotRunIsAnError) {
  const AxisView view{128, 32, 32, 32 * 64, 64, 32 * 32 * 64};
  PassPlan pass;
  PlanOptions o;
  o.forced = ForcedFamily::kStaged;
  Status s = plan_pass(view, 64, 4, true, a100(), o, &pass);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("FASTAXIAL_CUDA_PATH=staged"), std::string::npos) << s.message;
  o = {};
  o.fused_wgmma = 1;
  s = plan_pass(view, 64, 4, true, a100(), o, &pass);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("FASTAXIAL_FUSED_WGMMA=1"), std::string::npos) << s.message;
}

TEST(Plan, EnvironmentValuesAreParsedOrRejected) {
  const struct { const char *path, *wgmma; ForcedFamily forced; int fused_wgmma; } good[] = {
      {nullptr, nullptr, ForcedFamily::kNone, -1}, {"fused", "0", ForcedFamily::kFused, 0},
      {"staged", "1", ForcedFamily::kStaged, 1}, {"generic", nullptr, ForcedFamily::kGeneric, -1}};
  PlanOptions o;
  for (const auto& g : good) {
    ASSERT_TRUE(parse_plan_options(g.path, g.wgmma, &o).ok());
    EXPECT_TRUE(o.forced == g.forced && o.fused_wgmma == g.fused_wgmma) << (g.path ? g.path : "unset");
  }
  for (const char* bad : {"", "Fused", "tensor_core", "staged "}) {
    const Status s = parse_plan_options(bad, nullptr, &o);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(s.message.find("FASTAXIAL_CUDA_PATH"), std::string::npos) << s.message;
  }
  for (const char* bad : {"", "2", "off", "true"}) {
    const Status s = parse_plan_options(nullptr, bad, &o);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(s.message.find("FASTAXIAL_FUSED_WGMMA"), std::string::npos) << s.message;
  }
}

TEST(Plan, FusedTileCounts) {
  const int64_t lens[] = {1, 16, 17, 48, 49, 96, 97, 112, 128, 129};
  const int tiles[] = {1, 1, 2, 3, 4, 6, 8, 8, 8, 0};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(fused_tile_count(lens[i]), tiles[i]) << "L " << lens[i];
}

// The fused kernel's rows are 16-byte aligned and their strides put the
// fragment loads of a quarter warp (16-byte) or half warp (8-byte) on
// distinct banks; the README's largest dims per L follow from the layout.
TEST(Plan, FusedLayoutStridesAndLimits) {
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

// The workspace holds exactly what the chosen families use, each region
// 256-byte aligned, none overlapping: the row output, then the staged scratch
// and weight planes only where a pass is staged.
TEST(Plan, WorkspaceCoversTheChosenFamilies) {
  const size_t f = sizeof(float);
  CudaPlan plan = plan_of(problem(4, 32, 32, 64, 4), h200());  // fused both ways
  EXPECT_EQ(plan.row.family, KernelFamily::kFused);
  EXPECT_EQ(plan.col.family, KernelFamily::kFused);
  EXPECT_EQ(plan.row_output, 0u);
  for (size_t region : {plan.staged_scratch, plan.row_weight_planes, plan.col_weight_planes})
    EXPECT_EQ(region, CudaPlan::kNone);
  EXPECT_EQ(plan.workspace_bytes, 4u * 32 * 32 * 64 * f);

  const size_t e = 2 * 48 * 80 * 96 * f, w96 = 8 * 96 * 96 * f;  // staged both ways on an H200
  plan = plan_of(problem(2, 48, 80, 96, 3), h200());
  EXPECT_EQ(plan.row.family, KernelFamily::kStaged);
  EXPECT_EQ(plan.col.family, KernelFamily::kStaged);
  EXPECT_EQ(plan.staged_scratch, e);
  EXPECT_EQ(plan.row_weight_planes, 5 * e);
  EXPECT_EQ(plan.col_weight_planes, 5 * e + w96);
  EXPECT_EQ(plan.workspace_bytes, 5 * e + 2 * w96);
  // The same problem where the device has no staged path: fused, and no staged scratch.
  plan = plan_of(problem(2, 48, 80, 96, 3), ptx_only());
  EXPECT_EQ(plan.row.family, KernelFamily::kFused);
  EXPECT_EQ(plan.workspace_bytes, e);

  const size_t c = 256 * 4 * 64 * f;  // columns of 256: only they are staged
  plan = plan_of(problem(1, 256, 4, 64, 4), h200());
  EXPECT_EQ(plan.row.family, KernelFamily::kFused);
  EXPECT_EQ(plan.col.family, KernelFamily::kStaged);
  EXPECT_EQ(plan.row_weight_planes, CudaPlan::kNone);
  EXPECT_EQ(plan.col_weight_planes, 5 * c);
  EXPECT_EQ(plan.workspace_bytes, 5 * c + 8 * 64 * 64 * f);

  PlanOptions staged;
  staged.forced = ForcedFamily::kStaged;
  plan = plan_of(problem(1, 3, 5, 24, 3), h200(), staged);  // head_dim 8: staged both ways
  EXPECT_EQ(plan.row.family, KernelFamily::kStaged);
  EXPECT_EQ(plan.staged_scratch, 1536u) << "15 positions x 24 floats = 1440 bytes, rounded up to 256";
  EXPECT_EQ(plan.row_weight_planes % 256, 0u);
  EXPECT_EQ(plan.col_weight_planes, plan.row_weight_planes + (8 * 24 * 24 * f + 255) / 256 * 256);

  plan = plan_of(problem(0, 32, 32, 64, 4), h200());  // nothing to compute, nothing to hold
  EXPECT_EQ(plan.workspace_bytes, 0u);
}

// The flash kernel's split-KV partials: 256-byte aligned, disjoint from the
// other regions and inside the workspace, sized for the larger flash pass
// (the passes run one after the other and share it); kNone where no pass splits.
TEST(Plan, FlashPartialsRegion) {
  // (1, 1, 4096, 32, 1): the row pass, one sequence of 4096, on the flash kernel, 6 splits.
  CudaPlan plan = plan_of(problem(1, 1, 4096, 32, 1), h200());
  ASSERT_EQ(plan.row.family, KernelFamily::kStaged);
  EXPECT_TRUE(plan.row.flash);
  // Its column pass (4096 sequences of 1) is staged too, on the whole-sequence kernel: no partials.
  EXPECT_EQ(plan.col.family, KernelFamily::kStaged);
  EXPECT_FALSE(plan.col.flash);
  const size_t T = 4096, D = 32, f = sizeof(float);
  ASSERT_NE(plan.flash_partials, CudaPlan::kNone);
  EXPECT_EQ(plan.flash_partials_bytes, flash_partials_bytes(1, 4096, 32, 1, 132));
  EXPECT_EQ(plan.flash_partials_bytes, 6 * T * (D + 2) * f);
  EXPECT_EQ(plan.flash_partials % 256, 0u);
  EXPECT_GE(plan.flash_partials, plan.staged_scratch + 4 * T * D * f);
  EXPECT_LE(plan.flash_partials + plan.flash_partials_bytes, plan.row_weight_planes);
  EXPECT_LE(plan.row_weight_planes + 8 * D * D * f, plan.workspace_bytes);
  EXPECT_NE(plan.describe().find("split-KV partials"), std::string::npos) << plan.describe();

  // (Both passes never split at once: that needs B H and B W both small with H and W long.)
  // Two sequences of 2051 (dim 64: staged, flash) on the row pass.
  plan = plan_of(problem(1, 2, 2051, 64, 1), h200());
  EXPECT_TRUE(plan.row.flash);
  EXPECT_EQ(plan.flash_partials_bytes, 4 * 2 * 2051 * (64 + 2) * f);
  EXPECT_LE(plan.flash_partials + plan.flash_partials_bytes, plan.workspace_bytes);

  // No pass splits: fused both ways; staged with many items; short flash sequences.
  for (const CudaPlan& p : {plan_of(problem(4, 32, 32, 64, 4), h200()), plan_of(problem(2, 48, 80, 96, 3), h200()),
                            plan_of(problem(1, 256, 4, 64, 4), h200()), plan_of(problem(1, 1, 4096, 32, 1), ptx_only())}) {
    EXPECT_EQ(p.flash_partials, CudaPlan::kNone) << p.describe();
    EXPECT_EQ(p.flash_partials_bytes, 0u) << p.describe();
  }
}

// The flash kernel of a pass (plan.h's flash_variant; test_flash_attention.cpp tries its edges). Split-KV
// on mma.sync at head dim 32, on the wide wgmma kernel at 64 to 128 with as many splits as fill a round.
TEST(Plan, FlashKernelVariant) {
  struct V { int64_t n, len, hd; bool mma_sync, partials; FlashKernel kernel; int splits; };
  const V cases[] = {
      {4096, 1, 128, false, false, FlashKernel::kShort, 1},    {8, 2048, 32, false, false, FlashKernel::kWgmma, 1},
      {8, 2048, 64, false, false, FlashKernel::kWgmmaWide, 1}, {8, 2048, 128, false, true, FlashKernel::kWgmmaWide, 1},
      {8, 2048, 256, false, false, FlashKernel::kMmaSync, 1},  {8, 2048, 32, true, false, FlashKernel::kMmaSync, 1},
      {4096, 1, 128, true, false, FlashKernel::kMmaSync, 1},   {1, 4096, 32, false, true, FlashKernel::kMmaSync, 6},
      {1, 4096, 128, false, true, FlashKernel::kWgmmaWide, 4}, {1, 4096, 128, true, true, FlashKernel::kMmaSync, 4},
  };
  for (const V& c : cases) {
    const FlashProblem f = {c.n, c.len, c.hd, 1, false, c.mma_sync,
                            c.partials ? flash_partials_bytes(c.n, c.len, c.hd, 1, 132) : 0};
    const FlashVariant v = flash_variant(f, h200());
    EXPECT_STREQ(to_string(v.kernel), to_string(c.kernel)) << c.n << " x " << c.len << ", head_dim " << c.hd;
    EXPECT_EQ(v.splits, c.splits) << c.n << " x " << c.len << ", head_dim " << c.hd;
  }
}

// 16-bit products (AxialParams::products): every pass the staged path serves takes it, on the
// 16-bit flash kernel flash_variant picks (past 64 positions: kQkv16 on q, k, v the QKV product
// stores in 16 bits for head dims 24 to 128 a multiple of 8, else wgmma for head dims 17 to 32 and
// 65 to 128; else mma.sync), unsplit, with the 16-bit regions (an operand of T D values, 4 D^2
// weights a pass, cuBLAS's workspace) and without the TF32 planes or split partials; where the
// staged path cannot run (no sm_90a code), the passes keep their fp32 plan and no region is added.
// The training plan takes them too. An out-of-range value is an invalid argument.
TEST(Plan, SixteenBitProductsTakeTheStagedPathOnTheFlashKernel) {
  for (Products type : {Products::kBf16, Products::kFp16}) {
    for (const auto& shape : {std::array<int64_t, 5>{4, 32, 32, 64, 4}, std::array<int64_t, 5>{1, 2, 4096, 128, 1},
                              std::array<int64_t, 5>{64, 16, 16, 96, 4}}) {
      AxialParams p = problem(shape[0], shape[1], shape[2], shape[3], shape[4]);
      const CudaPlan fp32 = plan_of(p, h200());
      p.products = type;
      const CudaPlan c = plan_of(p, h200());
      for (const PassPlan* pass : {&c.row, &c.col}) {
        EXPECT_EQ(pass->family, KernelFamily::kStaged) << c.describe();
        EXPECT_TRUE(pass->flash) << c.describe();
        const int64_t len = pass == &c.row ? shape[2] : shape[1];
        const int hdp = flash_padded_head_dim(shape[3] / shape[4]);
        const bool wgmma16 = len > kFlashWgmmaMinLen && (hdp == 32 || hdp == 96 || hdp == 128);
        // q, k, v stored in 16 bits where that kernel serves the pass (head dim 128 past 64 positions).
        const bool qkv16 = len > kFlashWgmmaMinLen && flash_qkv16_tile_head_dim(shape[3] / shape[4]) != 0;
        EXPECT_EQ(pass->flash_kernel,
                  qkv16 ? FlashKernel::kQkv16 : wgmma16 ? FlashKernel::kWgmma16 : FlashKernel::kMmaSync)
            << c.describe();
        EXPECT_EQ(pass->flash_splits, 1) << c.describe();
        EXPECT_EQ(pass->products, type) << c.describe();
      }
      EXPECT_EQ(c.products, type);
      const size_t T = (size_t)(shape[0] * shape[1] * shape[2]), D = (size_t)shape[3];
      ASSERT_NE(c.operand16, CudaPlan::kNone);
      ASSERT_NE(c.weights16, CudaPlan::kNone);
      ASSERT_NE(c.blas, CudaPlan::kNone);
      EXPECT_GE(c.weights16, c.operand16 + 2 * T * D);
      EXPECT_GE(c.blas, c.weights16 + 2 * 4 * D * D * 2);
      EXPECT_GE(c.workspace_bytes, c.blas + c.blas_bytes);
      EXPECT_EQ(c.blas_bytes, backward_blas_bytes(h200()));
      EXPECT_EQ(c.row_weight_planes, CudaPlan::kNone);
      EXPECT_EQ(c.col_weight_planes, CudaPlan::kNone);
      EXPECT_EQ(c.flash_partials, CudaPlan::kNone);
      EXPECT_NE(c.describe().find(type == Products::kBf16 ? "on bf16 products" : "on fp16 products"), std::string::npos)
          << c.describe();
      EXPECT_EQ(fp32.operand16, CudaPlan::kNone);
      EXPECT_EQ(fp32.row.products, Products::kFp32);
      // No sm_90a code: no staged path, so the fp32 plan.
      const CudaPlan ptx = plan_of(p, ptx_only());
      EXPECT_EQ(ptx.row.products, Products::kFp32) << ptx.describe();
      EXPECT_EQ(ptx.col.products, Products::kFp32) << ptx.describe();
      EXPECT_EQ(ptx.operand16, CudaPlan::kNone);
      // On the caller's cuBLAS handle: no workspace for the library's.
      CudaPlan callers;
      ASSERT_TRUE(make_plan(p, h200(), {}, &callers, /*caller_blas=*/true).ok());
      EXPECT_TRUE(callers.caller_blas);
      EXPECT_EQ(callers.blas, CudaPlan::kNone);
      EXPECT_EQ(callers.blas_bytes, 0u);
      EXPECT_LE(callers.workspace_bytes + c.blas_bytes, c.workspace_bytes);
      // A forced fused or generic family keeps fp32 products (FASTAXIAL_CUDA_PATH).
      for (ForcedFamily f : {ForcedFamily::kFused, ForcedFamily::kGeneric}) {
        PlanOptions o;
        o.forced = f;
        const CudaPlan forced = plan_of(p, h200(), o);
        EXPECT_EQ(forced.row.products, Products::kFp32) << forced.describe();
        EXPECT_EQ(forced.col.products, Products::kFp32) << forced.describe();
        EXPECT_EQ(forced.operand16, CudaPlan::kNone);
      }
      // The training calls on the same products (BackwardPlan.RegionsAreAlignedDisjointAndCovered has
      // their layout).
      CudaBackwardPlan b;
      const Status st = make_backward_plan(p, h200(), &b);
      ASSERT_TRUE(st.ok()) << st.message;
      EXPECT_EQ(b.products, type);
      EXPECT_NE(b.describe().find(type == Products::kBf16 ? "training on bf16 products" : "training on fp16 products"),
                std::string::npos)
          << b.describe();
    }
  }
  AxialParams p = problem(1, 4, 4, 8, 1);
  p.products = static_cast<Products>(7);
  const Status st = validate(p);  // (plan_cuda validates the sizes and this first, as forward_cuda)
  EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << st.message;
  EXPECT_NE(st.message.find("products"), std::string::npos) << st.message;
}

TEST(Plan, DescribesItself) {
  const CudaPlan plan = plan_of(problem(1, 256, 4, 64, 4), h200());
  std::string d = plan.describe();
  EXPECT_NE(d.find("row: fused (wgmma), col: staged (flash mma.sync)"), std::string::npos) << d;
  EXPECT_NE(d.find("workspace " + std::to_string(plan.workspace_bytes) + " B"), std::string::npos) << d;
  EXPECT_STREQ(to_string(KernelFamily::kGeneric), "generic");
  // (1, 1, 4096, 128, 1): rows of 4096 on the wide wgmma kernel, 4 splits; columns of 1 on the short one.
  const CudaPlan split = plan_of(problem(1, 1, 4096, 128, 1), h200());
  d = split.describe();
  EXPECT_TRUE(split.row.flash_kernel == FlashKernel::kWgmmaWide && split.row.flash_splits == 4) << d;
  EXPECT_NE(d.find("row: staged (flash wgmma-wide, 4 splits), col: staged (flash short)"), std::string::npos) << d;
}

// Sizes are checked before the workspace is sized: a negative size used to
// give a workspace of about 1.8e19 bytes.
TEST(Plan, InvalidSizesAreRejectedBeforeSizing) {
  for (int i = 0; i < 3; ++i) {
    AxialParams p = problem(2, 3, 4, 8, 2);
    (i == 0 ? p.batch : i == 1 ? p.height : p.width) = -1;
    size_t bytes = 12345;
    const Status s = cuda_workspace_bytes(p, &bytes);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
    EXPECT_NE(s.message.find("must be >= 0"), std::string::npos) << s.message;
    EXPECT_EQ(bytes, 12345u) << "left as it was";
    EXPECT_EQ(validate_sizes(p).code, StatusCode::kInvalidArgument);
  }
}

// ---- the backward's plan -----------------------------------------------------------------------

CudaBackwardPlan backward_plan_of(const AxialParams& p, const DeviceCaps& dev) {
  CudaBackwardPlan plan;
  const Status s = make_backward_plan(p, dev, &plan);
  EXPECT_TRUE(s.ok()) << s.message;
  return plan;
}

// Every region 256-byte aligned, of its size, inside its buffer (saved or workspace), and
// overlapping no other of that buffer.
// On 16-bit products (bf16 here; fp16 lays out the same) the saved layout is fp32's, the LayerNorm
// output's region holding it and the attention output rounded (attn16 its second half), and the
// workspace has the rounded weights and operands in place of the TF32 planes and the weight-gradient
// partials (cuBLAS runs those products).
TEST(BackwardPlan, RegionsAreAlignedDisjointAndCovered) {
  for (const Products type : {Products::kFp32, Products::kBf16})
  for (AxialParams p : {problem(4, 32, 32, 64, 4), problem(1, 7, 5, 9, 3), problem(2, 1, 2048, 16, 2),
                        problem(8, 64, 64, 128, 4)}) {
    SCOPED_TRACE(type == Products::kFp32 ? "fp32 products" : "bf16 products");
    const bool fp32 = type == Products::kFp32;
    const size_t fp32_saved = backward_plan_of(p, h200()).saved_bytes;
    p.products = type;
    const CudaBackwardPlan c = backward_plan_of(p, h200());
    EXPECT_EQ(c.products, type);
    EXPECT_EQ(c.saved_bytes, fp32_saved) << "the saved size does not depend on the products";
    const size_t T = (size_t)(p.batch * p.height * p.width), td = T * p.dim * 4, th = T * p.heads * 4;
    struct Region {
      size_t offset, bytes;
      const char* name;
    };
    std::vector<Region> saved, ws;
    for (const auto* pass : {&c.row, &c.col}) {
      if (fp32)
        EXPECT_EQ(pass->attn16, CudaBackwardPlan::kNone);
      else
        EXPECT_EQ(pass->attn16, pass->norm + td / 2) << "the attention output rounded: norm's second half";
      saved.push_back({pass->norm, td, "norm"}), saved.push_back({pass->stats, 2 * T * 4, "stats"});
      saved.push_back({pass->qkv, 3 * td, "qkv"}), saved.push_back({pass->attn, td, "attn"});
      saved.push_back({pass->lse, 2 * th, "lse"});  // hi, then lo
    }
    saved.push_back({c.row_output, td, "row_output"});
    saved.push_back({c.dropout_state, 16, "dropout_state"});
    EXPECT_EQ(c.dropout_state + 16, c.saved_bytes) << "the dropout state is the last 16 bytes";
    ws.push_back({c.grad_row_output, td, "grad_row_output"}), ws.push_back({c.grad_attn, td, "grad_attn"});
    ws.push_back({c.grad_qkv, 3 * td, "grad_qkv"}), ws.push_back({c.grad_norm, td, "grad_norm"});
    ws.push_back({c.delta, th, "delta"});
    ws.push_back({c.column_partials, (5 * 128 + 3) * (size_t)p.dim * sizeof(double), "column_partials"});
    ws.push_back({c.blas, c.blas_bytes, "blas"});
    EXPECT_EQ(c.weights16 == CudaBackwardPlan::kNone, fp32);
    EXPECT_EQ(c.operand16 == CudaBackwardPlan::kNone, fp32);
    if (!fp32) {
      EXPECT_EQ(c.weight_planes, CudaBackwardPlan::kNone);
      EXPECT_EQ(c.weight_grad_partials, CudaBackwardPlan::kNone);
      EXPECT_FALSE(c.tensor_core_products);
      EXPECT_FALSE(c.tensor_core_weight_grads);
      EXPECT_EQ(c.flash_partials, CudaBackwardPlan::kNone) << "16-bit products never split the forward's keys";
      ws.push_back({c.weights16, 4 * (size_t)p.dim * p.dim * 2, "weights16"});
      ws.push_back({c.operand16, 3 * td / 2, "operand16"});
    }
    if (c.weight_planes != CudaBackwardPlan::kNone)
      ws.push_back({c.weight_planes, 32 * (size_t)p.dim * p.dim * 4, "weight_planes"});
    if (c.weight_grad_partials != CudaBackwardPlan::kNone)
      ws.push_back({c.weight_grad_partials, c.weight_grad_partials_bytes, "weight_grad_partials"});
    if (c.attention_scores != CudaBackwardPlan::kNone)
      ws.push_back({c.attention_scores, c.attention_scores_bytes, "attention_scores"});
    // (2, 1, 2048, 16, 2)'s row pass splits in the forward and the backward: one region for both
    // (each call uses its own), the larger of the two.
    if (c.flash_partials != CudaBackwardPlan::kNone && c.attention_partials != CudaBackwardPlan::kNone)
      EXPECT_EQ(c.flash_partials, c.attention_partials);
    if (c.flash_partials != CudaBackwardPlan::kNone || c.attention_partials != CudaBackwardPlan::kNone)
      ws.push_back({std::min(c.flash_partials, c.attention_partials),
                    std::max(c.flash_partials != CudaBackwardPlan::kNone ? c.flash_partials_bytes : 0,
                             c.attention_partials != CudaBackwardPlan::kNone ? c.attention_partials_bytes : 0),
                    "split partials"});
    for (const auto& [regions, total] : {std::pair{&saved, c.saved_bytes}, std::pair{&ws, c.workspace_bytes}}) {
      const std::vector<Region>& r = *regions;
      for (size_t i = 0; i < r.size(); ++i) {
        EXPECT_EQ(r[i].offset % 256, 0u) << r[i].name;
        EXPECT_LE(r[i].offset + r[i].bytes, total) << r[i].name;
        for (size_t j = 0; j < i; ++j)
          EXPECT_TRUE(r[i].offset >= r[j].offset + r[j].bytes || r[j].offset >= r[i].offset + r[i].bytes)
              << r[i].name << " overlaps " << r[j].name;
      }
    }
    EXPECT_NE(c.describe().find("workspace " + std::to_string(c.workspace_bytes) + " B"), std::string::npos);
    size_t bytes = 0;
    ASSERT_TRUE(cuda_saved_bytes(p, &bytes).ok());
    EXPECT_EQ(bytes, c.saved_bytes) << "the saved layout does not depend on the device";
  }
}

// cuBLAS's workspace: its recommended size on the library's own handle (32 MiB on Hopper, 4 MiB
// before), none where the caller brings its handle.
TEST(BackwardPlan, BlasWorkspaceUnlessTheCallerBringsAHandle) {
  const AxialParams p = problem(4, 32, 32, 64, 4);
  const CudaBackwardPlan own = backward_plan_of(p, h200());
  EXPECT_EQ(own.blas_bytes, 32u << 20);
  EXPECT_FALSE(own.caller_blas);
  EXPECT_EQ(backward_plan_of(p, a100()).blas_bytes, 4u << 20);
  CudaBackwardPlan caller;
  ASSERT_TRUE(make_backward_plan(p, h200(), &caller, /*caller_blas=*/true).ok());
  EXPECT_TRUE(caller.caller_blas);
  EXPECT_EQ(caller.blas_bytes, 0u);
  EXPECT_EQ(caller.blas, CudaBackwardPlan::kNone);
  EXPECT_EQ(caller.workspace_bytes + (32u << 20), own.workspace_bytes) << "the same layout less cuBLAS's region";
  EXPECT_EQ(caller.saved_bytes, own.saved_bytes);
  EXPECT_NE(caller.describe().find("caller's handle"), std::string::npos) << caller.describe();
}

// The staged products' tiles on an H200 (132 SMs), common/plan.h: gemm_tiling.
TEST(GemmTiling, FewestRoundsTimesWidth) {
  struct Case {
    int64_t M, N;
    int rows, cols;
    const char* why;
  };
  const Case cases[] = {
      // The products of the six benchmark shapes (T = B H W rows; N = 3D and D).
      {32768, 384, 192, 128, "dim 128, qkv: 4 rounds of 192 rows against 6 of 128"},
      {32768, 128, 128, 128, "dim 128, out: 2 rounds of 128 or 192 rows, so 128; 2 rounds against 4 of 96 columns"},
      {32768, 768, 192, 128, "dim 256, qkv: 8 rounds against 12"},
      {32768, 256, 192, 128, "dim 256, out: 3 rounds against 4"},
      {65536, 384, 192, 128, "(1, 256, 256, 128): 8 rounds against 12"},
      {11520, 288, 192, 96, "dim 96, qkv: three 96-column tiles; 2 rounds of 192 rows against 3"},
      {11520, 96, 128, 96, "dim 96, out: one 96-column tile against a 128-wide one; one round either way"},
      {8192, 576, 192, 96, "(8, 32, 32, 192), qkv: 576 pads less to 96; 2 rounds against 3"},
      // Fewer rounds of narrower tiles where 128 columns leave the last round nearly empty.
      {4096, 1152, 192, 96, "(4, 32, 32, 384), qkv: 384 tiles of 96 columns, 3 rounds, as of 128; 2 of 192 rows"},
      {4096, 384, 128, 96, "(4, 32, 32, 384), out: 96 tiles of 128 columns, 128 of 96, one round each"},
      {8192, 1152, 192, 128, "(2, 64, 64, 384), qkv: 5 rounds of 128 columns against 6 of 96; 3 of 192 rows"},
      {8192, 384, 128, 96, "(2, 64, 64, 384), out: 2 rounds either way; 192 rows take 2 too"},
      {8192, 1536, 192, 128, "(2, 64, 64, 512), qkv: 6 rounds against 8; 4 of 192 rows"},
      {8192, 512, 128, 128, "(2, 64, 64, 512), out: 2 rounds of 128 or 192 rows (1.94 against 1.3: measured 60 against 70 us)"},
      {5632, 256, 128, 96, "one round of 132 tiles against one of 88, though 96 columns pad more"},
      // One round of 192-row tiles against two of 128.
      {9216, 160, 192, 96, "(4, 48, 48, 160), out: 96 tiles of 192 rows, against 144 of 128 (measured 16.9 against 22.6 us)"},
      {7680, 288, 192, 96, "(2, 48, 80, 96, 3), qkv: 120 tiles against 180 (measured 16.4 against 19.1 us)"},
      {9216, 288, 128, 96, "(4, 48, 48, 96, 4), qkv: 144 tiles of 192 rows take 2 rounds too (measured 24.2 against 19.5 us)"},
      // 64-row tiles where 128-row ones would leave half the SMs idle or more, their columns by
      // padding alone.
      {128, 128, 64, 128, "one tile"},
      {300, 200, 64, 128, "six tiles; 200 pads to 256 or 288"},
      {4096, 64, 64, 96, "dim 64, out: 32 tiles"},
      {40000, 8, 192, 96, "313 row tiles of 128 rows, 209 of 192"},
  };
  for (const Case& c : cases) {
    const GemmTiling t = gemm_tiling(c.M, c.N, 132);
    EXPECT_EQ(t.rows, c.rows) << c.M << " x " << c.N << ": " << c.why;
    EXPECT_EQ(t.cols, c.cols) << c.M << " x " << c.N << ": " << c.why;
  }
  // A device of one SM: every tile is a round, so the narrower tile wins only where it pads less.
  for (int64_t N : {128, 256, 384, 1152}) EXPECT_EQ(gemm_tiling(1024, N, 1).cols, 128) << N;
  for (int64_t N : {96, 288, 480}) EXPECT_EQ(gemm_tiling(1024, N, 1).cols, 96) << N;
}

// The projections on the tensor cores where the staged path's product runs: sm_90a code and
// dim a multiple of 8; the weights' planes then have their region, else none.
TEST(BackwardPlan, TensorCoreProductsWhereTheStagedProductRuns) {
  const CudaBackwardPlan h = backward_plan_of(problem(2, 8, 8, 64, 4), h200());
  EXPECT_TRUE(h.tensor_core_products);
  EXPECT_NE(h.weight_planes, CudaBackwardPlan::kNone);
  EXPECT_LE(h.weight_planes + 32 * 64 * 64 * 4, h.workspace_bytes);
  EXPECT_NE(h.describe().find("3xTF32 wgmma"), std::string::npos) << h.describe();
  for (const auto& [p, dev] : {std::pair{problem(2, 8, 8, 9, 3), h200()}, std::pair{problem(2, 8, 8, 64, 4), a100()},
                               std::pair{problem(2, 8, 8, 64, 4), ptx_only()}}) {
    const CudaBackwardPlan c = backward_plan_of(p, dev);
    EXPECT_FALSE(c.tensor_core_products) << c.describe();
    EXPECT_EQ(c.weight_planes, CudaBackwardPlan::kNone);
    EXPECT_NE(c.describe().find("cuBLAS fp32 projections"), std::string::npos) << c.describe();
  }
}

// What every split of T rows holds, whichever kernel: S >= 1 chunks of whole 32-row stages, at
// least kWeightGradMinSplitRows rows each where there are several, covering the rows exactly once.
void expect_chunks_cover(const WeightGradSplit& s, int64_t T, const std::string& what) {
  EXPECT_GE(s.splits, 1) << what;
  EXPECT_EQ(s.rows % 32, 0) << what;
  EXPECT_GE(s.splits * s.rows, T) << what;
  EXPECT_LT((s.splits - 1) * s.rows, T) << what << ": no empty chunk";
  if (s.splits > 1) EXPECT_GE(s.rows, kWeightGradMinSplitRows) << what;
}

// The partials' floats for the S of `s`: S N K, or 0 for one chunk.
size_t partials_of(const WeightGradSplit& s, int64_t N, int64_t K) {
  return s.splits > 1 ? (size_t)(s.splits * N * K) : 0u;
}

// The weight gradients' chunks of rows (weight_gradient_split), for the mma.sync kernel: the grid
// (tiles x S) at most two waves of the resident blocks, chunks of whole 32-row stages and at least
// 256 rows, covering the T rows exactly once; S depends on the device's SMs and shared memory.
TEST(BackwardPlan, WeightGradientSplitRule) {
  for (const DeviceCaps& dev : {h200(), a100()}) {
    const int64_t resident = 2 * (int64_t)dev.sms;  // both devices hold two 78 KB blocks an SM
    for (int64_t T : {1, 31, 255, 511, 512, 1000, 4096, 32768, 40000, 3000000})
      for (const auto& [N, K] : {std::pair<int64_t, int64_t>{1, 1}, {64, 64}, {192, 64}, {768, 256}, {3072, 1024}}) {
        const WeightGradSplit s = weight_gradient_split(T, N, K, dev, WeightGradKernel::kMmaSync);
        const int64_t tiles = (N + 127) / 128 * ((K + 63) / 64);
        const std::string what = "T " + std::to_string(T) + ", N " + std::to_string(N) + ", K " + std::to_string(K);
        expect_chunks_cover(s, T, what);
        if (s.splits > 1) EXPECT_LE(tiles * s.splits, 2 * resident) << what;
        if (T < 2 * kWeightGradMinSplitRows || tiles >= 2 * resident) EXPECT_EQ(s.splits, 1) << what;
      }
  }
  // d_Wqkv (384, 128) over 32768 rows on an H200: 6 tiles, 264 resident blocks, so at most 88
  // chunks: 373 rows, rounded up to 384, make 86.
  const WeightGradSplit s = weight_gradient_split(32768, 384, 128, h200(), WeightGradKernel::kMmaSync);
  EXPECT_EQ(s.rows, 384);
  EXPECT_EQ(s.splits, 86);
  DeviceCaps small_smem = a100();
  small_smem.smem_optin = 99 * 1024;  // one block an SM (compute capability 8.6, 8.9)
  EXPECT_EQ(weight_gradient_split(32768, 384, 128, small_smem, WeightGradKernel::kMmaSync).splits, 36)
      << "216 / 6 chunks of 911 -> 928 rows";
  EXPECT_TRUE(can_run(WeightGradProblem{}, small_smem));
  EXPECT_FALSE(weight_gradient_wgmma_can_run(small_smem));
}

// The same for the wgmma kernel (128 x 128 tiles, one block an SM): one wave, S = SMs / tiles,
// where the tiles leave room; where they fill a wave or more, the fewest S up to 4 that fill the
// waves to 90%.
TEST(BackwardPlan, WeightGradientWgmmaSplitRule) {
  const DeviceCaps dev = h200();
  EXPECT_TRUE(weight_gradient_wgmma_can_run(dev));
  for (int64_t T : {1, 31, 255, 511, 512, 1000, 4096, 32768, 40000, 3000000})
    for (const auto& [N, K] : {std::pair<int64_t, int64_t>{1, 1}, {64, 64}, {192, 64}, {768, 256}, {3072, 1024}}) {
      const WeightGradSplit s = weight_gradient_split(T, N, K, dev, WeightGradKernel::kWgmma);
      const int64_t tiles = (N + 127) / 128 * ((K + 127) / 128);
      const std::string what = "T " + std::to_string(T) + ", N " + std::to_string(N) + ", K " + std::to_string(K);
      expect_chunks_cover(s, T, what);
      if (tiles <= dev.sms) EXPECT_LE(tiles * s.splits, dev.sms) << what << ": one wave";
      if (tiles > dev.sms) EXPECT_LE(s.splits, kWeightGradWgmmaMaxWaveSplits) << what;
      if (T < 2 * kWeightGradMinSplitRows) EXPECT_EQ(s.splits, 1) << what;
      // The partials serve whichever kernel runs: the larger S.
      const WeightGradSplit mma = weight_gradient_split(T, N, K, dev, WeightGradKernel::kMmaSync);
      EXPECT_EQ(weight_gradient_partials_floats(T, N, K, dev), std::max(partials_of(mma, N, K), partials_of(s, N, K)))
          << what;
      // A device without the wgmma kernel sizes them for mma.sync alone.
      EXPECT_EQ(weight_gradient_partials_floats(T, N, K, a100()),
                partials_of(weight_gradient_split(T, N, K, a100(), WeightGradKernel::kMmaSync), N, K))
          << what;
    }
  // d_Wqkv at D 256 over 32768 rows: 6 x 2 tiles, 11 chunks of 2979 -> 3008 rows, 132 blocks.
  const WeightGradSplit qkv = weight_gradient_split(32768, 768, 256, dev, WeightGradKernel::kWgmma);
  EXPECT_EQ(qkv.rows, 3008);
  EXPECT_EQ(qkv.splits, 11);
  // d_Wo at D 128: one tile, 132 chunks wanted, 128 allowed (256 rows each).
  EXPECT_EQ(weight_gradient_split(32768, 128, 128, dev, WeightGradKernel::kWgmma).splits, 128);
  // (3072, 1024): 192 tiles on 132 SMs; S 1 fills 2 waves to 73%, S 2 fills 3 to 97%.
  EXPECT_EQ(weight_gradient_split(3000000, 3072, 1024, dev, WeightGradKernel::kWgmma).splits, 2);
  // K <= 64 (128 x 64 tiles): as many tiles as at 128 columns.
  EXPECT_EQ(weight_gradient_split(40000, 192, 64, dev, WeightGradKernel::kWgmma).splits, 66);
}

// The weight gradients' partial tiles: a workspace region where the rows are split, sized for
// the larger of a pass's two products (d_Wqkv), inside the workspace after the other regions;
// none where one chunk serves (few positions) or the device has no kernel for them.
TEST(BackwardPlan, WeightGradientPartialsWhereTheRowsSplit) {
  const CudaBackwardPlan big = backward_plan_of(problem(8, 64, 64, 128, 4), h200());  // T 32768, D 128
  EXPECT_TRUE(big.tensor_core_weight_grads);
  ASSERT_NE(big.weight_grad_partials, CudaBackwardPlan::kNone);
  EXPECT_EQ(big.weight_grad_partials_bytes, 86u * 384 * 128 * 4)
      << "d_Wqkv's 86 chunks on mma.sync (43 on wgmma; d_Wo's: 128 of 128 x 128 on either)";
  EXPECT_EQ(big.weight_grad_partials_bytes, weight_gradient_pass_partials_floats(32768, 128, h200()) * 4);
  EXPECT_EQ(big.weight_grad_partials % 256, 0u);
  EXPECT_GE(big.weight_grad_partials, big.weight_planes + 32 * 128 * 128 * 4) << "after the last other region";
  EXPECT_EQ(big.weight_grad_partials + big.weight_grad_partials_bytes, big.workspace_bytes);
  const std::string d = big.describe();
  EXPECT_NE(d.find("weight gradients as 3xTF32 tensor-core"), std::string::npos) << d;
  EXPECT_NE(d.find("weight-gradient partials at " + std::to_string(big.weight_grad_partials)), std::string::npos) << d;

  const CudaBackwardPlan small = backward_plan_of(problem(1, 7, 5, 9, 3), h200());  // 35 positions: one chunk
  EXPECT_TRUE(small.tensor_core_weight_grads);
  EXPECT_EQ(small.weight_grad_partials, CudaBackwardPlan::kNone);
  EXPECT_EQ(small.weight_grad_partials_bytes, 0u);
  EXPECT_EQ(small.describe().find("partials"), std::string::npos) << small.describe();

  DeviceCaps no_room = a100();
  no_room.smem_optin = 48 * 1024;  // less shared memory than the kernel's ring: cuBLAS
  const CudaBackwardPlan blas = backward_plan_of(problem(8, 64, 64, 128, 4), no_room);
  EXPECT_FALSE(blas.tensor_core_weight_grads);
  EXPECT_EQ(blas.weight_grad_partials, CudaBackwardPlan::kNone);
  EXPECT_NE(blas.describe().find("weight gradients as cuBLAS fp32"), std::string::npos) << blas.describe();
  EXPECT_EQ(big.saved_bytes, blas.saved_bytes);
}

// The attention backward's dS^T scratch: one attention matrix of a pass (num_seq heads L rows
// of L rounded up to 4 floats, L / hd activations of T D floats), where it is at least 4
// activations and at most 8 or 256 MiB, sized for the larger pass that takes it; other passes
// recompute.
TEST(BackwardPlan, ScoreGradientsWhereTheyStaySmall) {
  EXPECT_EQ(attention_scores_stride(1), 4);
  EXPECT_EQ(attention_scores_stride(4), 4);
  EXPECT_EQ(attention_scores_stride(257), 260);
  // (1, 256, 256, 128, 4): T 65536, heads 4, L 256 both passes: 256 MiB, exactly 8 activations.
  const CudaBackwardPlan sq = backward_plan_of(problem(1, 256, 256, 128, 4), h200());
  EXPECT_TRUE(sq.row_scores && sq.col_scores);
  EXPECT_EQ(sq.attention_scores_bytes, size_t{65536} * 4 * 256 * 4);
  ASSERT_NE(sq.attention_scores, CudaBackwardPlan::kNone);
  EXPECT_NE(sq.describe().find("score gradients (both passes) at " + std::to_string(sq.attention_scores)),
            std::string::npos)
      << sq.describe();
  // (2, 128, 128, 256, 8): L 128, head dim 32, exactly 4 activations: taken.
  EXPECT_EQ(backward_plan_of(problem(2, 128, 128, 256, 8), h200()).attention_scores_bytes,
            size_t{32768} * 8 * 128 * 4);
  // Fewer than 4 activations: the default problem (L 32, head dim 16: 2) and (2, 48, 80, 96, 3)
  // (L 80 and 48 at head dim 32) recompute, no scratch.
  for (const AxialParams& p : {problem(4, 32, 32, 64, 4), problem(2, 48, 80, 96, 3)}) {
    const CudaBackwardPlan c = backward_plan_of(p, h200());
    EXPECT_FALSE(c.row_scores || c.col_scores);
    EXPECT_EQ(c.attention_scores, CudaBackwardPlan::kNone);
    EXPECT_EQ(c.attention_scores_bytes, 0u);
    EXPECT_EQ(c.describe().find("score gradients"), std::string::npos) << c.describe();
  }
  EXPECT_EQ(attention_scores_bytes(7, 5, 3, 9), 0u);               // L / hd 8 / 3 (rows of 8 floats)
  EXPECT_EQ(attention_scores_bytes(7, 13, 3, 9), size_t{7} * 13 * 3 * 16 * 4);  // 16 / 3: taken, rows of 16
  // A long row pass (L 2048, head dim 8: 256 activations, 4 GiB) recomputes; its column pass (L 32, 4
  // activations) keeps.
  const CudaBackwardPlan wide = backward_plan_of(problem(1, 32, 2048, 64, 8), h200());
  EXPECT_FALSE(wide.row_scores);
  EXPECT_TRUE(wide.col_scores);
  EXPECT_EQ(wide.attention_scores_bytes, attention_scores_bytes(2048, 32, 8, 64));
  EXPECT_GT(wide.attention_scores_bytes, 0u);
  EXPECT_NE(wide.describe().find("score gradients (column pass)"), std::string::npos) << wide.describe();
  // On 16-bit products dS^T is stored in their type: the same passes take it (the rule counts
  // floats), with rows of L rounded up to 8 values of 2 bytes.
  EXPECT_EQ(attention_scores_stride(1, 2), 8);
  EXPECT_EQ(attention_scores_stride(8, 2), 8);
  EXPECT_EQ(attention_scores_stride(257, 2), 264);
  EXPECT_EQ(attention_scores_bytes(7, 5, 3, 9, Products::kBf16), 0u);
  EXPECT_EQ(attention_scores_bytes(7, 13, 3, 9, Products::kFp16), size_t{7} * 13 * 3 * 16 * 2);
  EXPECT_EQ(attention_scores_bytes(7, 17, 3, 9, Products::kBf16), size_t{7} * 17 * 3 * 24 * 2);
  for (const Products type : {Products::kBf16, Products::kFp16}) {
    AxialParams p = problem(1, 256, 256, 128, 4);
    p.products = type;
    const CudaBackwardPlan c = backward_plan_of(p, h200());
    EXPECT_TRUE(c.row_scores && c.col_scores);
    EXPECT_EQ(c.attention_scores_bytes, size_t{65536} * 4 * 256 * 2);
    AxialParams w = problem(1, 32, 2048, 64, 8);
    w.products = type;
    const CudaBackwardPlan cw = backward_plan_of(w, h200());
    EXPECT_FALSE(cw.row_scores);
    EXPECT_TRUE(cw.col_scores);
    EXPECT_EQ(cw.attention_scores_bytes, attention_scores_bytes(2048, 32, 8, 64, type));
  }
  // Past 8 activations but within 256 MiB: kept (L 1024 at head dim 32, 4 sequences: 128 MiB, 32
  // activations); past both (9 sequences: 288 MiB, 32 activations of 9 MiB): none.
  EXPECT_EQ(attention_scores_bytes(4, 1024, 8, 256), size_t{128} << 20);
  EXPECT_EQ(attention_scores_bytes(8, 1024, 8, 256), size_t{256} << 20);
  EXPECT_EQ(attention_scores_bytes(9, 1024, 8, 256), 0u);
  const CudaBackwardPlan none = backward_plan_of(problem(1, 9, 1024, 256, 8), h200());  // its column pass: L 9
  EXPECT_FALSE(none.row_scores || none.col_scores);
  EXPECT_EQ(none.attention_scores, CudaBackwardPlan::kNone);
  EXPECT_EQ(attention_scores_bytes(0, 16, 2, 8), 0u);
  EXPECT_EQ(attention_scores_bytes(3, 0, 2, 8), 0u);
  // The device tests' shapes that train through the scratch (test_backward_cuda.cpp,
  // test_dropout_cuda.cpp): their row passes take it, at head dims 8, 16, 32 and 192 (two warps
  // along the features share a key group there; one stores dS^T).
  for (const AxialParams& p : {problem(1, 2, 600, 32, 1), problem(1, 1, 800, 192, 1), problem(1, 3, 257, 16, 2),
                               problem(1, 2, 1030, 16, 1),
                               problem(1, 2, 300, 64, 2)})
    EXPECT_TRUE(backward_plan_of(p, h200()).row_scores) << p.height << " x " << p.width << ", dim " << p.dim;
}

// The training forward's split-KV partials: where a pass's flash attention splits its keys (few
// long sequences), sized as the inference plan's for the larger pass, inside the workspace and
// clear of the other regions; none where no pass splits.
TEST(BackwardPlan, FlashPartialsWhereAPassSplits) {
  const CudaBackwardPlan one = backward_plan_of(problem(1, 1, 4096, 32, 1), h200());
  ASSERT_NE(one.flash_partials, CudaBackwardPlan::kNone);
  EXPECT_EQ(one.flash_partials_bytes, size_t{6} * 4096 * 34 * 4);  // 6 splits, rows of hd + 2
  EXPECT_EQ(one.flash_partials % 256, 0u);
  EXPECT_LE(one.flash_partials + one.flash_partials_bytes, one.workspace_bytes);
  for (size_t region : {one.grad_row_output, one.grad_attn, one.grad_qkv, one.grad_norm, one.delta,
                        one.column_partials, one.attention_scores, one.weight_planes, one.weight_grad_partials})
    if (region != CudaBackwardPlan::kNone) EXPECT_NE(region, one.flash_partials);
  EXPECT_NE(one.describe().find("flash split-KV partials"), std::string::npos) << one.describe();
  // test_backward_cuda's (1, 2, 1030, 16, 1): the row pass (2 sequences of 1030) splits.
  EXPECT_EQ(backward_plan_of(problem(1, 2, 1030, 16, 1), h200()).flash_partials_bytes,
            flash_partials_bytes(2, 1030, 16, 1, 132));
  EXPECT_GT(flash_partials_bytes(2, 1030, 16, 1, 132), 0u);
  for (const AxialParams& p : {problem(4, 32, 32, 64, 4), problem(1, 256, 256, 128, 4)}) {
    const CudaBackwardPlan c = backward_plan_of(p, h200());
    EXPECT_EQ(c.flash_partials, CudaBackwardPlan::kNone);
    EXPECT_EQ(c.flash_partials_bytes, 0u);
  }
}

// The attention backward's split (smem_layout.h, attention_grad_splits): S fills one round of
// the dk, dv kernel's resident 4-warp blocks (3 an SM at head dims 17..64, 2 beyond: 396 and 264
// on 132 SMs), at most 16 and L / 128; none where the blocks fill half a round, for L < 256, or
// at 2 sms sequences or heads. One sequence of 4096: 64 blocks of 64 keys.
TEST(BackwardPlan, AttentionGradSplitRule) {
  EXPECT_EQ(attention_grad_splits(1, 4096, 128, 1, 132), 4);   // 264 / 64
  EXPECT_EQ(attention_grad_splits(1, 4096, 32, 1, 132), 6);    // 396 / 64
  EXPECT_EQ(attention_grad_splits(1, 4096, 16, 1, 132), 8);    // 528 / 64
  EXPECT_EQ(attention_grad_splits(2, 4096, 128, 1, 132), 2);   // 264 / 128
  EXPECT_EQ(attention_grad_splits(1, 4096, 256, 1, 132), 2);   // 128 blocks of 32 keys
  EXPECT_EQ(attention_grad_splits(1, 1024, 128, 1, 132), 8);   // L / 128
  EXPECT_EQ(attention_grad_splits(1, 300, 64, 1, 132), 2);     // L / 128
  EXPECT_EQ(attention_grad_splits(1, 2048, 64, 2, 132), 6);    // 396 / 64
  EXPECT_EQ(attention_grad_splits(1, 255, 64, 1, 132), 1);     // too short
  EXPECT_EQ(attention_grad_splits(4, 4096, 32, 1, 132), 1);    // 256 blocks: more than half of 396
  EXPECT_EQ(attention_grad_splits(2, 4096, 128, 2, 132), 1);   // 256 blocks: more than half of 264
  EXPECT_EQ(attention_grad_splits(264, 512, 32, 1, 132), 1);   // 2 sms sequences
  EXPECT_EQ(attention_grad_splits(1, 4096, 257, 1, 132), 1);   // no such head dim
  EXPECT_EQ(attention_grad_splits(1, 4096, 128, 1, 66), 2);    // half the SMs
  EXPECT_EQ(attention_grad_partials_bytes(1, 4096, 128, 1, 132), size_t{4} * 4096 * 2 * 128 * 4);
  EXPECT_EQ(attention_grad_partials_bytes(4, 4096, 32, 1, 132), 0u);
}

// The backward plan reserves those partials for the larger pass, clear of the other regions and
// named by describe(); none where neither pass splits.
TEST(BackwardPlan, AttentionPartialsWhereAPassSplits) {
  const CudaBackwardPlan one = backward_plan_of(problem(1, 1, 4096, 128, 1), h200());
  ASSERT_NE(one.attention_partials, CudaBackwardPlan::kNone);
  EXPECT_EQ(one.attention_partials_bytes, attention_grad_partials_bytes(1, 4096, 128, 1, 132));
  EXPECT_EQ(one.attention_partials % 256, 0u);
  EXPECT_LE(one.attention_partials + one.attention_partials_bytes, one.workspace_bytes);
  EXPECT_NE(one.describe().find("attention-backward split partials"), std::string::npos) << one.describe();
  // The forward splits too: one region, the larger size.
  ASSERT_NE(one.flash_partials, CudaBackwardPlan::kNone);
  EXPECT_EQ(one.flash_partials, one.attention_partials);
  EXPECT_LE(one.attention_partials + std::max(one.flash_partials_bytes, one.attention_partials_bytes),
            one.workspace_bytes);
  for (size_t region : {one.grad_row_output, one.grad_attn, one.grad_qkv, one.grad_norm, one.delta,
                        one.column_partials, one.attention_scores, one.weight_planes, one.weight_grad_partials})
    if (region != CudaBackwardPlan::kNone) EXPECT_NE(region, one.attention_partials);
  // (6, 1000, 2, 64, 2): the column pass (12 sequences of 1000, 2 heads: 384 blocks) does not
  // split, the row pass (6000 sequences of 2) neither.
  EXPECT_EQ(backward_plan_of(problem(6, 1000, 2, 64, 2), h200()).attention_partials, CudaBackwardPlan::kNone);
  // (1, 2048, 2, 64, 2): the column pass, 2 sequences of 2048 with 2 heads, splits 3 ways.
  EXPECT_EQ(backward_plan_of(problem(1, 2048, 2, 64, 2), h200()).attention_partials_bytes,
            size_t{3} * 2 * 2 * 2048 * 2 * 32 * 4);
  for (const AxialParams& p : {problem(4, 32, 32, 64, 4), problem(1, 256, 256, 128, 4)}) {
    const CudaBackwardPlan c = backward_plan_of(p, h200());
    EXPECT_EQ(c.attention_partials, CudaBackwardPlan::kNone);
    EXPECT_EQ(c.attention_partials_bytes, 0u);
  }
}

TEST(BackwardPlan, SaysWhatItCannotServe) {
  CudaBackwardPlan plan;
  Status s = make_backward_plan(problem(1, 4, 4, 2 * (kCudaBackwardMaxHeadDim + 1), 2), h200(), &plan);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("head dims up to 256"), std::string::npos) << s.message;
  EXPECT_TRUE(make_backward_plan(problem(1, 4, 4, 2 * kCudaBackwardMaxHeadDim, 2), h200(), &plan).ok());
  DeviceCaps old = a100();
  old.cc_major = 7;
  s = make_backward_plan(problem(1, 4, 4, 8, 2), old, &plan);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("compute capability 8.0"), std::string::npos) << s.message;
  // 16-bit products need the tensor-core attention backward: where its tiles do not fit the
  // device's shared memory, fp32 products run the FFMA kernels and 16-bit ones are refused.
  DeviceCaps small = a100();
  small.smem_optin = 48 * 1024;
  AxialParams p = problem(1, 4, 4, 256, 2);
  ASSERT_TRUE(make_backward_plan(p, small, &plan).ok());
  EXPECT_EQ(plan.row_kernels.grad, AttentionGradKernel::kFfma);
  p.products = Products::kBf16;
  s = make_backward_plan(p, small, &plan);
  EXPECT_EQ(s.code, StatusCode::kUnsupported);
  EXPECT_NE(s.message.find("16-bit products needs the tensor-core attention backward"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("head dim 128"), std::string::npos) << s.message;
}

}  // namespace
}  // namespace fastaxial::test
