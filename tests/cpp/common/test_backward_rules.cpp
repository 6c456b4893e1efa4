// The CUDA attention backward's kernel rule (src/common/plan.h: attention_grad_variant), its
// tiles' shared memory (common/smem_layout.h), and the backward plan's record of the kernels
// each pass runs. Host code alone, so CI runs it without a GPU; test_attention_backward runs
// the kernels the rule picks.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "fastaxial/fastaxial.h"
#include "src/common/plan.h"
#include "src/common/smem_layout.h"
#include "util/devices.h"

namespace fastaxial::test {
namespace {

AttentionGradProblem pass_of(int64_t num_seq, int64_t len, int64_t head_dim, int64_t heads) {
  AttentionGradProblem a;
  a.num_seq = num_seq, a.len = len, a.head_dim = head_dim, a.heads = heads;
  return a;
}

// Room for the rule's split partials, as the backward plan gives it.
AttentionGradProblem with_partials(AttentionGradProblem a, const DeviceCaps& dev) {
  a.partials = true;
  a.partials_bytes = attention_grad_partials_bytes(a.num_seq, a.len, a.head_dim, a.heads, dev.sms);
  return a;
}

constexpr int kPaddedHeadDims[] = {8, 16, 32, 48, 64, 96, 128, 192, 256};

// The tiles' shared memory, in bytes: the dk, dv kernel's or the dq kernel's largest block
// (whichever is larger), and the dq-from-dS kernel's. Pinned, so that a tile table or layout
// edit shows here; every one leaves two blocks a Hopper multiprocessor (228 KB).
TEST(BackwardRules, TileSharedMemory) {
  const size_t tc[] = {18432, 30720, 37632, 53248, 69632, 102400, 101760, 100736, 100032};
  const size_t ds[] = {40960, 45056, 53248, 61440, 69632, 43008, 51200, 67584, 83968};
  for (int i = 0; i < 9; ++i) {
    const int hdp = kPaddedHeadDims[i];
    EXPECT_EQ(attention_grad_smem_bytes(hdp), tc[i]) << hdp;
    EXPECT_EQ(query_grads_from_scores_smem_bytes(hdp), ds[i]) << hdp;
    EXPECT_LE(tc[i], 105u * 1024u) << hdp;
  }
  EXPECT_EQ(attention_grad_smem_bytes(0), 0u);
  EXPECT_EQ(attention_grad_smem_bytes(40), 0u) << "not a padded head dim";
  EXPECT_EQ(query_grads_from_scores_smem_bytes(512), 0u);
}

// The split rule's view of the dk, dv kernel (blocks an SM, rows a block) is the tile table's.
TEST(BackwardRules, SplitRuleReadsTheTileTable) {
  for (int hdp : kPaddedHeadDims) {
    EXPECT_EQ(attention_grad_blocks_per_sm(hdp), hdp <= 16 ? 4 : hdp <= 64 ? 3 : 2) << hdp;
    EXPECT_EQ(attention_grad_block_rows(hdp), hdp <= 128 ? 64 : 32) << hdp;
  }
}

TEST(BackwardRules, KernelByLengthAndDevice) {
  const DeviceCaps h = h200();
  EXPECT_EQ(attention_grad_variant(pass_of(8, 1, 32, 2), h).kernel, AttentionGradKernel::kSingleKey);
  EXPECT_EQ(attention_grad_variant(pass_of(8, 1, 32, 2), h).dq, QueryGradKernel::kNone);
  for (int64_t hd = 1; hd <= 256; ++hd) {
    const AttentionGradVariant v = attention_grad_variant(pass_of(8, 40, hd, 2), h);
    EXPECT_EQ(v.kernel, AttentionGradKernel::kTensorCores) << hd;
    EXPECT_EQ(v.dq, QueryGradKernel::kMmaSync) << hd;
    EXPECT_EQ(v.splits, 1) << hd;
  }
  EXPECT_EQ(attention_grad_variant(pass_of(8, 40, 257, 1), h).kernel, AttentionGradKernel::kNone);
  EXPECT_EQ(attention_grad_variant(pass_of(0, 40, 32, 1), h).kernel, AttentionGradKernel::kNone);
  // The FFMA kernels where the tiles do not fit, or on the hook.
  DeviceCaps small = a100();
  small.smem_optin = 64 * 1024;
  EXPECT_EQ(attention_grad_variant(pass_of(8, 40, 64, 1), small).kernel, AttentionGradKernel::kFfma);
  EXPECT_EQ(attention_grad_variant(pass_of(8, 40, 48, 1), small).kernel, AttentionGradKernel::kTensorCores);
  AttentionGradProblem hook = pass_of(8, 40, 48, 1);
  hook.ffma = true;
  EXPECT_EQ(attention_grad_variant(hook, h).kernel, AttentionGradKernel::kFfma);
  EXPECT_EQ(attention_grad_variant(hook, h).dq, QueryGradKernel::kFfma);
}

TEST(BackwardRules, QueryGradientKernel) {
  const DeviceCaps h = h200();
  // wgmma: padded head dim 32, past kQueryGradsWgmmaMinLen, on sm_90a code.
  EXPECT_EQ(attention_grad_variant(pass_of(2, kQueryGradsWgmmaMinLen + 1, 32, 2), h).dq, QueryGradKernel::kWgmma);
  EXPECT_EQ(attention_grad_variant(pass_of(2, kQueryGradsWgmmaMinLen + 1, 17, 2), h).dq, QueryGradKernel::kWgmma);
  EXPECT_EQ(attention_grad_variant(pass_of(2, kQueryGradsWgmmaMinLen, 32, 2), h).dq, QueryGradKernel::kMmaSync);
  EXPECT_EQ(attention_grad_variant(pass_of(2, 1000, 16, 2), h).dq, QueryGradKernel::kMmaSync) << "padded 16";
  EXPECT_EQ(attention_grad_variant(pass_of(2, 1000, 33, 2), h).dq, QueryGradKernel::kMmaSync) << "padded 48";
  EXPECT_EQ(attention_grad_variant(pass_of(2, 1000, 32, 2), ptx_only()).dq, QueryGradKernel::kMmaSync);
  AttentionGradProblem a = pass_of(2, 1000, 32, 2);
  a.mma_sync = true;
  EXPECT_EQ(attention_grad_variant(a, h).dq, QueryGradKernel::kMmaSync);
  // From the stored dS^T wherever the scratch is given, ahead of wgmma.
  a = pass_of(2, 1000, 32, 2);
  a.scores = true;
  EXPECT_EQ(attention_grad_variant(a, h).dq, QueryGradKernel::kFromScores);
  a.head_dim = 256;
  EXPECT_EQ(attention_grad_variant(a, a100()).dq, QueryGradKernel::kFromScores);
  // A split pass stays on mma.sync.
  a = with_partials(pass_of(1, 4096, 32, 1), h);
  const AttentionGradVariant split = attention_grad_variant(a, h);
  ASSERT_GT(split.splits, 1);
  EXPECT_EQ(split.dq, QueryGradKernel::kMmaSync);
}

TEST(BackwardRules, SplitsWhereTheRoomIsGiven) {
  const DeviceCaps h = h200();
  const AttentionGradProblem one = pass_of(1, 4096, 128, 1);
  const int rule = attention_grad_splits(1, 4096, 128, 1, h.sms);
  ASSERT_GT(rule, 1);
  AttentionGradProblem a = with_partials(one, h);
  EXPECT_EQ(attention_grad_variant(a, h).splits, rule);
  EXPECT_EQ(attention_grad_variant(one, h).splits, 1) << "no room given";
  a.partials_bytes -= sizeof(float);
  EXPECT_EQ(attention_grad_variant(a, h).splits, 1) << "one float short";
  // The hook, capped at the fewest tiles a kernel streams (64 rows at padded head dim 32 and 128).
  a = with_partials(pass_of(1, 300, 32, 1), h);
  a.partials_bytes = size_t{1} << 30, a.splits = 16;
  EXPECT_EQ(attention_grad_variant(a, h).splits, 5) << "300 positions: 5 tiles of 64";
  a.splits = 3;
  EXPECT_EQ(attention_grad_variant(a, h).splits, 3);
  a.partials = false;
  EXPECT_EQ(attention_grad_variant(a, h).splits, 1) << "no aligned room";
  a.partials = true, a.ffma = true;
  EXPECT_EQ(attention_grad_variant(a, h).splits, 1) << "the FFMA kernels do not split";
}

// The weight gradients' kernel: wgmma where the device runs it and the operands allow, with
// 64-column tiles up to K = 64; else mma.sync. The split is the kernel's rule.
TEST(BackwardRules, WeightGradientKernel) {
  WeightGradProblem g;
  g.T = 4096, g.N = 200, g.K = 100, g.aligned = true;
  WeightGradVariant v = weight_gradient_variant(g, h200());
  EXPECT_EQ(v.kernel, WeightGradKernel::kWgmma);
  EXPECT_EQ(v.tile_cols, 128);
  const WeightGradSplit wgmma_split = weight_gradient_split(g.T, g.N, g.K, h200(), WeightGradKernel::kWgmma);
  EXPECT_EQ(v.split.splits, wgmma_split.splits);
  EXPECT_EQ(v.split.rows, wgmma_split.rows);
  g.K = 64;
  EXPECT_EQ(weight_gradient_variant(g, h200()).tile_cols, 64);
  g.K = 68;
  EXPECT_EQ(weight_gradient_variant(g, h200()).tile_cols, 128);
  const auto mma_sync = [](const WeightGradProblem& p, const DeviceCaps& dev) {
    const WeightGradVariant m = weight_gradient_variant(p, dev);
    const WeightGradSplit split = weight_gradient_split(p.T, p.N, p.K, dev, WeightGradKernel::kMmaSync);
    return m.kernel == WeightGradKernel::kMmaSync && m.tile_cols == 64 && m.split.splits == split.splits &&
           m.split.rows == split.rows;
  };
  g.K = 5;
  EXPECT_TRUE(mma_sync(g, h200())) << "K not a multiple of 4";
  g.K = 100, g.aligned = false;
  EXPECT_TRUE(mma_sync(g, h200())) << "unaligned operands";
  g.aligned = true, g.mma_sync = true;
  EXPECT_TRUE(mma_sync(g, h200())) << "the hook";
  g.mma_sync = false;
  EXPECT_TRUE(mma_sync(g, ptx_only())) << "no sm_90a code";
  EXPECT_TRUE(mma_sync(g, a100()));
}

// The backward plan records each pass's kernels as the calls choose them from its regions.
TEST(BackwardRules, PlanRecordsEachPassKernels) {
  struct Shape {
    int64_t B, H, W, D, heads;
  };
  for (const Shape& s : {Shape{4, 32, 32, 64, 4}, Shape{2, 48, 80, 96, 3}, Shape{1, 1, 4096, 32, 1},
                         Shape{1, 2, 2048, 64, 2}, Shape{8, 1, 300, 32, 1}, Shape{3, 5, 1, 24, 3}})
    for (float dropout : {0.0f, 0.1f}) {
      AxialParams p;
      p.batch = s.B, p.height = s.H, p.width = s.W, p.dim = s.D, p.heads = s.heads, p.dropout = dropout;
      CudaBackwardPlan c;
      ASSERT_TRUE(make_backward_plan(p, h200(), &c).ok());
      const std::string d = c.describe();
      for (int pass = 0; pass < 2; ++pass) {
        const AxisView view = pass == 0 ? row_view(p) : col_view(p);
        const CudaBackwardPlan::PassKernels& k = pass == 0 ? c.row_kernels : c.col_kernels;
        FlashProblem f;
        f.num_seq = view.num_seq, f.len = view.len, f.head_dim = s.D / s.heads, f.heads = s.heads;
        f.dropout = dropout > 0, f.partials_bytes = c.flash_partials_bytes;  // 0.1: a non-zero threshold
        const FlashVariant fv = flash_variant(f, h200());
        EXPECT_EQ(k.flash, fv.kernel) << d;
        EXPECT_EQ(k.flash_splits, fv.splits) << d;
        AttentionGradProblem a = pass_of(view.num_seq, view.len, s.D / s.heads, s.heads);
        a.scores = pass == 0 ? c.row_scores : c.col_scores;
        a.partials = c.attention_partials != CudaBackwardPlan::kNone, a.partials_bytes = c.attention_partials_bytes;
        const AttentionGradVariant gv = attention_grad_variant(a, h200());
        EXPECT_EQ(k.grad, gv.kernel) << d;
        EXPECT_EQ(k.dq, gv.dq) << d;
        EXPECT_EQ(k.grad_splits, gv.splits) << d;
        EXPECT_NE(d.find(std::string(pass == 0 ? "row" : "col") + ": flash " + to_string(k.flash)), std::string::npos)
            << d;
      }
    }
  // One long sequence splits both its forward and its backward, and says so.
  AxialParams p;
  p.batch = 1, p.height = 1, p.width = 4096, p.dim = 128, p.heads = 1;
  CudaBackwardPlan c;
  ASSERT_TRUE(make_backward_plan(p, h200(), &c).ok());
  EXPECT_EQ(c.row_kernels.flash, FlashKernel::kWgmmaWide);
  EXPECT_GT(c.row_kernels.flash_splits, 1);
  EXPECT_EQ(c.row_kernels.grad, AttentionGradKernel::kTensorCores);
  EXPECT_GT(c.row_kernels.grad_splits, 1);
  EXPECT_EQ(c.row_kernels.dq, QueryGradKernel::kFromScores) << "its dS^T takes 64 MB, below the 256 MB floor";
  EXPECT_EQ(c.col_kernels.grad, AttentionGradKernel::kSingleKey) << "columns of one position";
  const std::string d = c.describe();
  EXPECT_NE(d.find("row: flash wgmma-wide (" + std::to_string(c.row_kernels.flash_splits) + " splits), backward " +
                   "tensor-cores (dq from-scores, " + std::to_string(c.row_kernels.grad_splits) + " splits)"),
            std::string::npos)
      << d;
  EXPECT_NE(d.find("col: flash short, backward single-key"), std::string::npos) << d;
}

// The rule on 16-bit products (AttentionGradProblem::products): the tensor-core kernels, dq on
// mma.sync (never the wgmma kernel, which is 3xTF32) or from dS^T where given; no FFMA kernels
// (their math is fp32): no kernel where those would run.
TEST(BackwardRules, SixteenBitProductsOnTheTensorCoresOnly) {
  const DeviceCaps h = h200();
  AttentionGradProblem a = pass_of(64, 1000, 32, 2);
  EXPECT_EQ(attention_grad_variant(a, h).dq, QueryGradKernel::kWgmma);  // fp32: wgmma there
  for (Products t : {Products::kBf16, Products::kFp16}) {
    a.products = t;
    a.scores = false, a.ffma = false;
    const AttentionGradVariant v = attention_grad_variant(a, h);
    EXPECT_EQ(v.kernel, AttentionGradKernel::kTensorCores);
    EXPECT_EQ(v.dq, QueryGradKernel::kMmaSync);
    a.scores = true;
    EXPECT_EQ(attention_grad_variant(a, h).dq, QueryGradKernel::kFromScores);
    a.ffma = true;
    EXPECT_EQ(attention_grad_variant(a, h).kernel, AttentionGradKernel::kNone);
    DeviceCaps small = a100();
    small.smem_optin = 64 * 1024;
    AttentionGradProblem wide = pass_of(8, 40, 64, 1);
    wide.products = t;
    EXPECT_EQ(attention_grad_variant(wide, small).kernel, AttentionGradKernel::kNone);  // fp32 takes FFMA there
  }
}

}  // namespace
}  // namespace fastaxial::test
