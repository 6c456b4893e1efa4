// The CUDA plan's dispatch rules (src/common/plan.cpp) at each boundary: the last shape on one
// side and the first on the other, so that a rule moved by one (> for >=, a bound off by a
// sequence) fails here. test_plan.cpp has the shapes behind the rules; this file, their edges.
// Host code alone, so CI runs it without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "fastaxial/fastaxial.h"
#include "src/common/plan.h"
#include "util/devices.h"

namespace fastaxial::test {
namespace {

// The plan of a row pass of num_seq sequences of len positions (16-byte aligned tensors).
PassPlan row_pass(int64_t len, int64_t dim, int64_t heads, int64_t num_seq, const DeviceCaps& dev = h200()) {
  const AxisView view{num_seq, len, num_seq, len * dim, dim, num_seq * len * dim};
  PassPlan pass;
  const Status s = plan_pass(view, dim, heads, true, dev, {}, &pass);
  EXPECT_TRUE(s.ok()) << s.message;
  return pass;
}

std::string family(int64_t len, int64_t dim, int64_t heads, int64_t num_seq, const DeviceCaps& dev = h200()) {
  return to_string(row_pass(len, dim, heads, num_seq, dev).family);
}

// Many very short sequences take the staged path from 4 rounds of the SMs (L <= 4) or 8 rounds
// (L <= 16): on 132 SMs, from 397 and 925 sequences.
TEST(PlanRules, ShortSequencesFromFourOrEightRounds) {
  EXPECT_EQ(family(4, 32, 1, 396), "fused") << "L = 4: 3 rounds";
  EXPECT_EQ(family(4, 32, 1, 397), "staged") << "L = 4: past 3 rounds";
  EXPECT_EQ(family(5, 32, 1, 397), "fused") << "L = 5 is past the L <= 4 rule";
  EXPECT_EQ(family(5, 32, 1, 924), "fused") << "L = 5: 7 rounds";
  EXPECT_EQ(family(5, 32, 1, 925), "staged") << "L = 5: past 7 rounds";
  EXPECT_EQ(family(16, 32, 1, 925), "staged") << "L = 16: past 7 rounds";
  EXPECT_EQ(family(17, 32, 1, 925 * 16), "fused") << "L = 17: no short-sequence rule (dim 32 stays fused)";
  DeviceCaps dev = h200();
  dev.sms = 100;
  EXPECT_EQ(family(4, 32, 1, 300, dev), "fused") << "100 SMs: 3 rounds";
  EXPECT_EQ(family(4, 32, 1, 301, dev), "staged") << "100 SMs: past 3 rounds";
}

// Dims above 64 may take the staged path on longer sequences; dim 64 never does.
TEST(PlanRules, WideFromDim72) {
  EXPECT_EQ(family(32, 64, 4, 512), "fused") << "dim 64, 16384 positions";
  EXPECT_EQ(family(32, 72, 9, 512), "staged") << "dim 72, 16384 positions";
  EXPECT_EQ(family(64, 64, 4, 98), "fused") << "dim 64, a last wave three quarters empty";
  EXPECT_EQ(family(64, 72, 9, 98), "staged") << "dim 72, the same wave";
}

// Wide dims: the staged path from 16384 positions on; below, by the fused kernel's last wave;
// below 4096 positions, never.
TEST(PlanRules, StagedFrom16384Positions) {
  EXPECT_EQ(family(64, 128, 4, 255), "fused") << "16320 positions: 255 sequences fill two waves to 97%";
  EXPECT_EQ(family(64, 128, 4, 256), "staged") << "16384 positions";
}

TEST(PlanRules, NoStagedPathBelow4096Positions) {
  EXPECT_EQ(family(63, 128, 4, 65), "fused") << "4095 positions, though 65 sequences leave half the SMs idle";
  EXPECT_EQ(family(64, 128, 4, 64), "staged") << "4096 positions, 64 sequences on 132 SMs";
}

// Between 4096 and 16384 positions, wide dims: the fused kernel while its sequences fill at least
// three quarters of its waves' slots (4 num_seq >= 3 slots), the staged path below that.
TEST(PlanRules, WaveFillAtThreeQuarters) {
  EXPECT_EQ(family(64, 128, 4, 98), "staged") << "98 of 132 SMs: under three quarters";
  EXPECT_EQ(family(64, 128, 4, 99), "fused") << "99 of 132 SMs: exactly three quarters";
  EXPECT_EQ(family(64, 128, 4, 197), "staged") << "197 sequences in two waves' 264 slots";
  EXPECT_EQ(family(64, 128, 4, 198), "fused") << "198 of 264 slots: exactly three quarters";
  DeviceCaps dev = h200();
  dev.sms = 100;
  EXPECT_EQ(family(64, 128, 4, 74, dev), "staged") << "74 of 100 SMs";
  EXPECT_EQ(family(64, 128, 4, 75, dev), "fused") << "75 of 100 SMs: exactly three quarters";
}

// The staged path's own whole-sequence attention where the (sequence, head) items fill the
// device twice (num_seq heads >= 2 SMs); the flash kernel below that.
TEST(PlanRules, OwnAttentionFromTwiceTheSMs) {
  PassPlan p = row_pass(256, 128, 4, 66);  // L = 256: past the fused kernel, so staged
  EXPECT_EQ(to_string(p.family), std::string("staged"));
  EXPECT_FALSE(p.flash) << "264 items on 132 SMs: twice the SMs";
  p = row_pass(256, 128, 4, 65);
  EXPECT_EQ(to_string(p.family), std::string("staged"));
  EXPECT_TRUE(p.flash) << "260 items: short of twice the SMs";
}

// The tensor-core kernels (the fused one, the staged path's own attention) serve head dims 8, 16,
// 32 and 64 where dim is a multiple of 8; the staged path's flash attention, any head dim up to
// 256. So one head of 64 takes the fused kernel on an H200 and an A100-class GPU alike; without
// the fused kernel, the A100 (no staged path) would take the generic one.
TEST(PlanRules, TensorCoreHeadDims) {
  for (int64_t hd : {8, 16, 32, 64}) {
    EXPECT_TRUE(tensor_core_head(2 * hd, 2)) << "head dim " << hd;
    EXPECT_TRUE(staged_head(2 * hd, 2)) << "head dim " << hd;
  }
  for (int64_t hd : {4, 24, 48, 128, 256}) EXPECT_FALSE(tensor_core_head(2 * hd, 2)) << "head dim " << hd;
  EXPECT_FALSE(tensor_core_head(60, 3)) << "dim 60, not a multiple of 8";
  EXPECT_TRUE(staged_head(512, 2)) << "head dim 256: the flash kernel's largest";
  EXPECT_FALSE(staged_head(520, 2)) << "head dim 260";
  EXPECT_EQ(family(32, 64, 1, 128), "fused") << "one head of 64, H200";
  DeviceCaps a100;
  a100.sms = 108, a100.smem_optin = 163 * 1024, a100.cc_major = 8, a100.sm90a = false;
  EXPECT_EQ(family(32, 64, 1, 128, a100), "fused") << "one head of 64, A100-class";
  EXPECT_EQ(family(32, 128, 1, 128, a100), "generic") << "one head of 128, A100-class: no tensor-core kernel";
}

// The fused kernel's row tiles: L rounded up to 16, 32, ..., 96, then 128; none past 128.
TEST(PlanRules, FusedTilesAtMultiplesOf16) {
  const std::pair<int64_t, int> cases[] = {{1, 1},  {16, 1}, {17, 2}, {32, 2}, {33, 3},  {80, 5},
                                           {96, 6}, {97, 8}, {112, 8}, {128, 8}, {129, 0}};
  for (const auto& [len, tiles] : cases) EXPECT_EQ(fused_tile_count(len), tiles) << "L = " << len;
}

}  // namespace
}  // namespace fastaxial::test
