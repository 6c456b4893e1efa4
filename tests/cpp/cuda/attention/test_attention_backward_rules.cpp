// The attention backward's host-side rules (src/cuda/attention/attention_backward.h), without
// a device: dropout's four-lane sharing of draws in the tensor-core kernels' score tiles, the
// arguments and sizes attention_backward refuses, the head dims it serves and their shared
// memory, where dq takes the wgmma kernel. The kernels' results: test_attention_backward.cpp.
#include "util/attention_dropout_util.h"  // first: whether dropout.h may include Random123

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>

#include "src/common/plan.h"
#include "src/cuda/attention/attention_backward.h"
#include "src/cuda/gemm/gemm.h"  // gemm_tf32x3_can_run: whether the build has sm_90a code
#include "util/cuda_test_util.h"

namespace fastaxial::test {
namespace {

#if !defined(FASTAXIAL_NO_RANDOM123)

// The four-lane sharing of draws in both tensor-core kernels' score tiles,
// replayed on the host: the dk, dv kernel's transposed tiles (rows keys;
// dropout_run_cols, dropout_share16<4>, dropout_bit_cols) and the dq
// kernel's (rows queries; as the forward). Every lane's four bits are
// dropout_keep's, for runs inside and across Philox blocks and indices
// past 2^32. Without a device.
TEST(AttentionBackwardRules, DropoutTilesDrawTheMask) {
  DropoutParams d;
  d.seed = 0x0123456789abcdefull, d.offset = 0xfedcba9876543210ull;
  d.threshold = dropout_threshold(0.5f), d.scale = dropout_scale(0.5f);
  for (bool rows : {false, true})
    for (uint64_t L : {1u, 7u, 8u, 17u, 64u, 65u, 130u, 301u})
      for (uint64_t e_tile : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{1} << 32,
                              (uint64_t{1} << 32) - 3, uint64_t{0x123456789abcull}})
        EXPECT_EQ(fragment_mismatches(d, L, rows, e_tile), 0)
            << (rows ? "rows" : "columns") << ", L " << L << ", e_tile " << e_tile;
}

// Dropout's arguments where threshold != 0: a null philox, a pass other
// than 0 and 1, a mask numbered for another L or head count. Checked
// before anything else, so without a device (and also for an empty
// problem); a valid set on an empty problem launches nothing.
TEST(AttentionBackwardRules, RejectsDropoutArguments) {
  DeviceCaps dev;  // not reached: the checks come before any CUDA call
  // Host memory: never read, as nothing launches.
  const uint64_t pair[2] = {1, 2};
  for (bool ffma : {false, true}) {
    cuda::AttentionBackwardArgs a;
    a.pos = {0, 4, 1, 4, 1, 4};  // no sequences
    a.D = 8, a.heads = 2, a.ffma = ffma;
    a.dropout.threshold = dropout_threshold(0.5f), a.dropout.scale = dropout_scale(0.5f);
    a.dropout.heads = 2, a.dropout.len[0] = 4, a.dropout.len[1] = 6;
    EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);  // philox null
    a.philox = pair;
    EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaSuccess);
    a.pass = 1;  // len[1] = 6 != L
    EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
    a.dropout.len[1] = 4;
    EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaSuccess);
    a.pass = -1;
    EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
    a.pass = 0, a.dropout.heads = 3;
    EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
    a.dropout.heads = 2, a.dropout.threshold = 0, a.philox = nullptr, a.pass = 5;  // no dropout: the fields unread
    EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaSuccess);
  }
}

#endif  // FASTAXIAL_NO_RANDOM123


// The host-side rules, without a device.
// dq on wgmma: padded head dim 32 past kQueryGradsWgmmaMinLen (192) on sm_90a code,
// unless a hook asks for other kernels.
TEST(AttentionBackwardRules, WgmmaDqWhereItApplies) {
  DeviceCaps h = h200();
  const bool sm90a_build = cuda::gemm_tf32x3_can_run(h);
  cuda::AttentionBackwardArgs a;
  a.pos = {2, 193, 1, 193, 1, 386};
  a.heads = 2;
  for (int hd : {17, 20, 32}) {
    a.D = 2 * hd;
    EXPECT_EQ(cuda::query_grads_wgmma_can_run(a, h), sm90a_build) << hd;
  }
  for (int hd : {1, 8, 16, 33, 64, 128}) {
    a.D = 2 * hd;
    EXPECT_FALSE(cuda::query_grads_wgmma_can_run(a, h)) << hd;
  }
  a.D = 64;
  a.pos.len = kQueryGradsWgmmaMinLen;
  EXPECT_FALSE(cuda::query_grads_wgmma_can_run(a, h));
  a.pos.len = 2048;
  EXPECT_EQ(cuda::query_grads_wgmma_can_run(a, h), sm90a_build);
  a.mma_sync = true;
  EXPECT_FALSE(cuda::query_grads_wgmma_can_run(a, h));
  a.mma_sync = false, a.ffma = true;
  EXPECT_FALSE(cuda::query_grads_wgmma_can_run(a, h));
  a.ffma = false, h.sm90a = false;
  EXPECT_FALSE(cuda::query_grads_wgmma_can_run(a, h));
}

TEST(AttentionBackwardRules, SupportedHeadDims) {
  EXPECT_FALSE(can_run(AttentionGradProblem{1, 64, 0, 1}, h200()));
  EXPECT_FALSE(can_run(AttentionGradProblem{1, 64, 257, 1}, h200()));
  for (bool ffma : {false, true}) {
    EXPECT_EQ(cuda::attention_backward_smem_bytes(0, ffma), 0u);
    EXPECT_EQ(cuda::attention_backward_smem_bytes(257, ffma), 0u);
    for (int64_t hd = 1; hd <= 256; ++hd) {
      ASSERT_TRUE(can_run(AttentionGradProblem{1, 64, hd, 1}, h200())) << hd;
      const size_t bytes = cuda::attention_backward_smem_bytes(hd, ffma);
      EXPECT_GT(bytes, 0u) << hd << (ffma ? " ffma" : " tc");
      EXPECT_LE(bytes, 105u * 1024u) << hd
                                     << (ffma ? " ffma" : " tc");  // two blocks a multiprocessor on Hopper (228 KB)
    }
  }
}

TEST(AttentionBackwardRules, RejectsSizesItDoesNotServe) {
  DeviceCaps dev;  // not reached: the checks come before any CUDA call
  cuda::AttentionBackwardArgs a;
  a.pos = {1, 4, 1, 4, 1, 4};
  a.D = 12, a.heads = 5;  // heads do not divide D
  EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
  a.D = 257 * 2, a.heads = 2;  // head_dim 257
  EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
  a.D = 8, a.heads = 0;
  EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
  a.D = 8, a.heads = 1, a.pos.len = int64_t{1} << 30;  // L too long
  EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
  a.pos.len = -1;
  EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaErrorInvalidValue);
  a.pos.len = 4, a.pos.num_seq = 0;  // nothing to do: no launch
  EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaSuccess);
  a.pos.num_seq = 3, a.pos.len = 0;
  EXPECT_EQ(cuda::attention_backward(a, dev, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace fastaxial::test
