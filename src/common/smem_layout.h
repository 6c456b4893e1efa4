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

// The staged path's whole-sequence attention kernel (cuda/attention/whole_sequence.cu), one head of head_dim hd over
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
// 192 x 32 A tile and two 128 x 32 W planes, the stages' 8 mbarriers, + 1024
// to align): a device that cannot give a block this much has no staged path.
constexpr size_t kStagedGemmSmemBytes = 4 * (24576 + 2 * 16384) + 64 + 1024;

// The staged path's flash attention kernel (attention/flash_attention.cu): head
// dims up to 256, its largest tiling taking this much shared memory, less
// than the staged GEMM's, so a device with the staged path fits every one.
constexpr int kFlashMaxHeadDim = 256;
constexpr size_t kFlashMaxSmemBytes = 134656;
static_assert(kFlashMaxSmemBytes <= kStagedGemmSmemBytes, "the staged path's devices fit every flash tiling");

// The flash kernel's tiling, for its launcher and for plan.cpp: queries a
// block (kFlashQueryTile), the padded head dim HDP serving a head dim (0:
// none) and the keys a shared-memory tile (BN) at that HDP.
constexpr int kFlashQueryTile = 64;
FASTAXIAL_HOST_DEVICE constexpr int flash_padded_head_dim(int64_t head_dim) {
  return head_dim < 1     ? 0
         : head_dim <= 8  ? 8
         : head_dim <= 16 ? 16
         : head_dim <= 32 ? 32
         : head_dim <= 48 ? 48
         : head_dim <= 64 ? 64
         : head_dim <= 96 ? 96
         : head_dim <= 128 ? 128
         : head_dim <= 192 ? 192
         : head_dim <= kFlashMaxHeadDim ? 256
                                        : 0;
}
FASTAXIAL_HOST_DEVICE constexpr int flash_key_tile(int hdp) { return hdp <= 64 ? 64 : hdp <= 128 ? 32 : 16; }

// The wgmma flash kernels (flash_attention_wgmma*.cu; their tiles static_assert these): blocks of
// kFlashWgmmaQueryTile queries (two warpgroups), and a block's shared memory at padded head dim
// hdp, 0 where neither kernel serves it. At 32 (the head-dim-32 kernel, 64 keys a step): k and
// v^T (hi, lo) planes of 64 rows of 128 bytes, two buffers each; two raw stages of k and v rows
// and two q buffers of 128 rows, at row stride hdp + 4 floats; 1024 bytes to align the base. At
// 64, 96, 128 (the wide kernel, 32 keys a step): k and v^T planes, two buffers each (1024 hdp
// bytes), one raw stage (256 (hdp + 4)), q (512 hdp), + 1024.
constexpr int kFlashWgmmaQueryTile = 128;
FASTAXIAL_HOST_DEVICE constexpr size_t flash_wgmma_smem_bytes(int hdp) {
  return hdp == 32                                ? 4 * 64 * 128 * 2 + 4 * 64 * 36 * 4 + 2 * 128 * 36 * 4 + 1024
         : hdp == 64 || hdp == 96 || hdp == 128 ? (size_t)1024 * hdp + 256 * (hdp + 4) + 512 * hdp + 1024
                                                  : 0;
}

// The 16-bit wgmma flash kernel (flash_attention_wgmma16.cu; its tile static_asserts this): blocks
// of kFlashWgmmaQueryTile queries, 64 keys a step, tiles of head dims 32 and 128 (padded head dim
// 96 runs on the 128 one). Padded head dims 48 and 64 are not served: a tile of 64 gave wrong
// outputs on the H100 (perf notes v110), so they stay on the mma.sync kernel.
// k and v^T as 16-bit operands, two buffers each (2 x 2 x 128 hdp bytes), one raw fp32 stage of k
// and v rows (128 (hdp + 4) floats), q raw (128 hdp floats), + 1024 to align the base; 0 where
// it does not serve hdp.
FASTAXIAL_HOST_DEVICE constexpr int flash_wgmma16_tile_head_dim(int hdp) {
  return hdp == 32 ? 32 : hdp == 96 || hdp == 128 ? 128 : 0;
}
FASTAXIAL_HOST_DEVICE constexpr size_t flash_wgmma16_smem_bytes(int hdp) {
  return flash_wgmma16_tile_head_dim(hdp) == 0
             ? 0
             : (size_t)512 * flash_wgmma16_tile_head_dim(hdp) + (size_t)512 * (flash_wgmma16_tile_head_dim(hdp) + 4) +
                   (size_t)512 * flash_wgmma16_tile_head_dim(hdp) + 1024;
}

// The 16-bit flash kernel on q, k and v stored in 16 bits (flash_attention_qkv16.cu; its tile
// static_asserts this): tiles of head dims 32 (head dims 24 and 32), 64 (40 to 64) and 128 (72 to
// 128), head dims a multiple of 8 (the copies' 16-byte pieces); 0 where it does not serve head_dim.
// Its shared memory: q (128 rows) and four buffers of k and v rows (64 each), 2 bytes a value, +
// 1024 to align the base.
FASTAXIAL_HOST_DEVICE constexpr int flash_qkv16_tile_head_dim(int64_t head_dim) {
  return head_dim % 8 != 0 || head_dim <= 16 || head_dim > 128 ? 0
         : head_dim <= 32                                      ? 32
         : head_dim <= 64                                      ? 64
                                                               : 128;
}
FASTAXIAL_HOST_DEVICE constexpr size_t flash_qkv16_smem_bytes(int tile_head_dim) {
  return tile_head_dim == 32 || tile_head_dim == 64 || tile_head_dim == 128
             ? (size_t)2 * tile_head_dim * (128 + 4 * 2 * 64) + 1024
             : 0;
}

// Split-KV ("flash-decoding") in the forwards without dropout: where a pass's
// (sequence, head, query tile) blocks are too few to fill the device (a
// long sequence with few sequences and heads: (1, 1, 4096, 32, 1)'s row
// pass is 64 blocks on 132 SMs, each streaming all 4096 keys), the key tiles
// of each (item, query tile) are cut into S contiguous ranges, a block each,
// which write unnormalised partials that a combine kernel merges.
//
// S minimises an estimate of the time: the rounds of blocks the device runs
// at once (flash_split_blocks_per_sm an SM) times the key tiles a block
// streams plus a fixed cost of 1.3 tiles a block (fitted to the H200's
// times at head dim 128). S = 1 at padded head dim 32 runs the wgmma
// kernel instead, faster than the mma.sync kernel at these lengths: its
// estimate is taken at 3/4. So one long sequence takes the S
// that fills one round with the fewest tiles a block (where the cap below
// allows a round: not at head dims 8 and 16), and S = 1 is kept where a
// second round would cost more than the split saves. At most 16, every
// split at least two key tiles, fewer than 4 sms blocks in all; 1 (no
// split) where the blocks already number 2 sms or more, or for sequences
// shorter than kFlashMinSplitLen, whose blocks are short enough that the
// combine's launch and the partials' round trip through L2 would eat the
// gain (an estimate, not a measurement). With S > 1 the partials' rows are
// fewer than 4 sms * 64.
constexpr int kFlashMaxSplits = 16;
constexpr int64_t kFlashMinSplitLen = 1024;

// Blocks of the split kernel (attention/flash_attention.cu, 4 warps) an SM holds on
// sm_90a, by its registers (ptxas) and its two stages of shared memory;
// test_flash_attention checks them against the occupancy API on the device.
FASTAXIAL_HOST_DEVICE constexpr int flash_split_blocks_per_sm(int hdp) {
  return hdp <= 8 ? 6 : hdp <= 16 ? 4 : hdp <= 48 ? 3 : hdp <= 192 ? 2 : 1;
}

// The estimate, in tenths of a key tile: rounds of `slots` blocks x (10 tiles a block + 13).
FASTAXIAL_HOST_DEVICE constexpr int64_t flash_split_cost(int64_t blocks, int64_t s, int64_t slots, int64_t key_tiles) {
  return (blocks * s + slots - 1) / slots * (10 * ((key_tiles + s - 1) / s) + 13);
}

FASTAXIAL_HOST_DEVICE constexpr int flash_kv_splits(int64_t num_seq, int64_t len, int64_t head_dim, int64_t heads,
                                                    int sms) {
  const int hdp = flash_padded_head_dim(head_dim);
  if (hdp == 0 || num_seq < 1 || len < kFlashMinSplitLen || len >= (int64_t{1} << 30) || heads < 1 || sms < 1)
    return 1;
  if (num_seq >= 2 * (int64_t)sms || heads >= 2 * (int64_t)sms) return 1;  // no overflow below
  const int64_t blocks = num_seq * heads * ((len + kFlashQueryTile - 1) / kFlashQueryTile);
  if (blocks >= 2 * (int64_t)sms) return 1;
  const int64_t key_tiles = (len + flash_key_tile(hdp) - 1) / flash_key_tile(hdp);
  const int64_t slots = (int64_t)flash_split_blocks_per_sm(hdp) * sms;
  int64_t best = 1, best_cost = flash_split_cost(blocks, 1, slots, key_tiles);
  if (hdp == 32) best_cost = best_cost * 3 / 4;  // S = 1 on the wgmma kernel
  for (int64_t s = 2; s <= kFlashMaxSplits && 2 * s <= key_tiles && blocks * s < 4 * (int64_t)sms; ++s)
    if (const int64_t c = flash_split_cost(blocks, s, slots, key_tiles); c < best_cost) best = s, best_cost = c;
  return (int)best;
}

// Bytes of the split kernels' partials for S = flash_kv_splits(...) > 1 (0
// where S = 1). Rows r = (n heads + h) L + l (as the lse's), R of them:
//   o: (S, R, hd) floats, unnormalised (sum over the split's keys of p v)
//   m: (S, R) the split's row max, base-2 units of the scaled score
//   l: (S, R) the split's row sum of 2^(s - m)
FASTAXIAL_HOST_DEVICE constexpr size_t flash_partials_bytes(int64_t num_seq, int64_t len, int64_t head_dim,
                                                            int64_t heads, int sms) {
  const int s = flash_kv_splits(num_seq, len, head_dim, heads, sms);
  return s < 2 ? 0 : (size_t)s * (size_t)(num_seq * heads * len) * (size_t)(head_dim + 2) * sizeof(float);
}

// ---- the attention backward's tensor-core tiles (cuda/attention/backward_*.cu) ----------------
// Defined here, not beside the kernels, so that the backward's rule (plan.h:
// attention_grad_variant) sizes their shared memory on the host.

// Row stride of the tiles' raw fp32 rows: hd_padded + 4, 4 mod 8, so that the score
// products' fragment loads (lanes (g, t) at g ld + t) and the gradient products' (at 2t ld + g)
// both hit 32 distinct banks; a multiple of 4 for 16-byte cp.async rows.
FASTAXIAL_HOST_DEVICE constexpr int attention_grad_row_ld(int hdp) { return hdp + 4; }

// Per padded head dim: the largest blocks, their shared memory and the blocks a Hopper
// multiprocessor holds (min_blocks: the register budget each kernel is built to, none spilled;
// 64K registers and 228 KB of shared memory a multiprocessor).
//   HDP | dk, dv: warps keys  BM  KB blocks | dq: warps queries  BN  KB blocks
//     8 |          4x1   64  32  13      4 |          4      64  64  18      4
//    16 |          4x1   64  32  20      4 |          4      64  64  30      4
//    32 |          4x1   64  32  36      3 |          4      64  32  36      4
//    48 |          4x1   64  16  39      3 |          4      64  32  52      4
//    64 |          4x1   64  16  51      3 |          4      64  32  68      3
//    96 |          4x1   64  16  75      2 |          4      64  32 100      2
//   128 |          4x1   64  16  99      2 |          4      64  16  99      2
//   192 |          2x2   32  16  98      2 |          2      32  16  98      2
//   256 |          2x2   32  16  98      2 |          2      32  16  98      2
// (warps KW x FW; 256: one stage). Up to HDP 64 the budgets keep 12-16
// warps a multiprocessor; beyond, shared memory allows two blocks.
struct AttentionGradTiles {
  int kw, fw, bm, kv_stages, kv_min_blocks;  // dk, dv: KvTiling's KW, FW, BM, ST, min_blocks
  int qw, bn, q_stages, q_min_blocks;        // dq: QTiling's QW, BN, ST, min_blocks
};
FASTAXIAL_HOST_DEVICE constexpr AttentionGradTiles attention_grad_tiles(int hdp) {
  switch (hdp) {
    case 8:
    case 16: return {4, 1, 32, 2, 4, 4, 64, 2, 4};
    case 32: return {4, 1, 32, 2, 3, 4, 32, 2, 4};
    case 48: return {4, 1, 16, 2, 3, 4, 32, 2, 4};
    case 64: return {4, 1, 16, 2, 3, 4, 32, 2, 3};
    case 96: return {4, 1, 16, 2, 2, 4, 32, 2, 2};
    case 128: return {4, 1, 16, 2, 2, 4, 16, 2, 2};
    case 192: return {2, 2, 16, 2, 2, 2, 16, 2, 2};
    case 256: return {2, 2, 16, 1, 2, 2, 16, 1, 2};
    default: return {0, 0, 0, 0, 0, 0, 0, 0, 0};  // no kernel for hdp
  }
}

// The dk, dv kernel's tiles for padded head dim HDP: up to KW warps along
// keys (16 keys each: up to BN = 16 KW keys a block; the launch takes
// fewer, bn, for short sequences and small grids), FW warps along the
// gradients' features (each 16 keys' dk and dv summed by FW warps, FP =
// HDP / FW features each; all of them compute those keys' scores), BM
// queries a step, ST stages of the query tiles (2: the next tile's copy
// overlaps this one's work), min_blocks for __launch_bounds__ (the
// register budget: 65536 / (32 warps min_blocks)). Registers a thread: dk
// and dv FP, S^T and dP^T BM.
//
// Shared memory for a block of bn keys, in floats:
//   k, v:                (bn, ld) each, the block's keys
//   stage s: q, d_o      (BM, ld) each, one query tile
//   stage s: lse (hi, lo), delta  (BM) each
template <int HDP_, int KW_, int FW_, int BM_, int ST_, int MIN_BLOCKS_>
struct KvTiling {
  static constexpr int HDP = HDP_, KW = KW_, FW = FW_, BM = BM_, ST = ST_, min_blocks = MIN_BLOCKS_;
  static constexpr int warps = KW * FW, threads = 32 * warps;
  static constexpr int BN = 16 * KW, FP = HDP / FW, ld = attention_grad_row_ld(HDP);
  static constexpr int stage = 2 * BM * ld;  // q, then d_o
  FASTAXIAL_HOST_DEVICE static constexpr int v(int bn) { return bn * ld; }
  FASTAXIAL_HOST_DEVICE static constexpr int q(int bn) { return 2 * bn * ld; }
  FASTAXIAL_HOST_DEVICE static constexpr int vec(int bn) { return q(bn) + ST * stage; }  // stage s: lse at + 3 BM s
  FASTAXIAL_HOST_DEVICE static constexpr int floats(int bn) { return vec(bn) + ST * 3 * BM; }
  static constexpr size_t bytes(int bn) { return (size_t)floats(bn) * sizeof(float); }
  static_assert(FP % 8 == 0 && BM % 16 == 0 && (ST == 1 || ST == 2), "whole n-tiles, runs of two k-groups");
  static_assert(ld % 4 == 0 && stage % 4 == 0 && BM % 4 == 0, "16-byte rows, 8-byte lse pairs");
};

// The dq kernel's tiles: up to QW warps of 16 queries (up to BM = 16 QW a
// block; the launch takes fewer, bm, as above), BN keys a step, ST stages
// of the key tiles, min_blocks as above. Registers a thread: dq HDP / 2, S
// and dP BN.
//
// Shared memory for a block of bm queries, in floats:
//   q, d_o:              (bm, ld) each, the block's queries
//   stage s: k, v        (BN, ld) each, one key tile
template <int HDP_, int QW_, int BN_, int ST_, int MIN_BLOCKS_>
struct QTiling {
  static constexpr int HDP = HDP_, QW = QW_, BN = BN_, ST = ST_, min_blocks = MIN_BLOCKS_;
  static constexpr int warps = QW, threads = 32 * warps;
  static constexpr int BM = 16 * QW, ld = attention_grad_row_ld(HDP);
  static constexpr int stage = 2 * BN * ld;  // k, then v
  FASTAXIAL_HOST_DEVICE static constexpr int d_o(int bm) { return bm * ld; }
  FASTAXIAL_HOST_DEVICE static constexpr int k(int bm) { return 2 * bm * ld; }
  FASTAXIAL_HOST_DEVICE static constexpr int floats(int bm) { return k(bm) + ST * stage; }
  static constexpr size_t bytes(int bm) { return (size_t)floats(bm) * sizeof(float); }
  static_assert(BN % 16 == 0 && (ST == 1 || ST == 2), "runs of two k-groups");
  static_assert(ld % 4 == 0 && stage % 4 == 0, "16-byte rows");
};

template <int HDP>
struct KvTc : KvTiling<HDP, attention_grad_tiles(HDP).kw, attention_grad_tiles(HDP).fw, attention_grad_tiles(HDP).bm,
                       attention_grad_tiles(HDP).kv_stages, attention_grad_tiles(HDP).kv_min_blocks> {};
template <int HDP>
struct QTc : QTiling<HDP, attention_grad_tiles(HDP).qw, attention_grad_tiles(HDP).bn, attention_grad_tiles(HDP).q_stages,
                     attention_grad_tiles(HDP).q_min_blocks> {};

// The dq-from-dS kernel's tiles: up to QW = 4 warps of 16 queries (64 a
// block; the launch takes fewer as for the dq kernel), BN keys a step, two
// stages. No score tiles in registers, only dq (HDP / 2 a thread), so the
// key tiles are longer than QTc's; min_blocks: 4 blocks (16 warps) an SM up
// to HDP 32 (128 registers a thread), enough warps to cover the loads' latency.
// Shared memory a stage (dS^T's values kValueBytes wide: 4, floats, or 2 on 16-bit products):
//   dS^T  (BN, ls) values: ls = 68 = 64 + 4 floats, 4 mod 8, or 72 = 64 + 8 16-bit values, 8 mod
//         16, so that load_a_cols's loads (words (2t ls + g) / (4 / kValueBytes)) hit distinct banks
//   k     (BN, ld) floats, from ds_floats
// e.g. 53 KB at HDP 32, 70 KB at 64, 84 KB at 256 (BN 32) with fp32 dS^T; 37, 53 and 76 KB with 16-bit.
template <int HDP_, int kValueBytes = 4>
struct DsTc {
  static_assert(kValueBytes == 4 || kValueBytes == 2, "dS^T as floats or 16-bit values");
  static constexpr int HDP = HDP_, QW = 4, BN = HDP <= 64 ? 64 : 32, ST = 2;
  static constexpr int min_blocks = HDP <= 32 ? 4 : HDP <= 64 ? 3 : 2;
  static constexpr int threads = 32 * QW, ld = attention_grad_row_ld(HDP);
  static constexpr int ls = 16 * QW + 16 / kValueBytes;          // dS^T's row stride, in values
  static constexpr int ds_floats = BN * ls * kValueBytes / 4;    // dS^T's part of a stage
  static constexpr int stage = ds_floats + BN * ld;              // floats
  static constexpr size_t bytes = (size_t)ST * stage * sizeof(float);
  static_assert(BN % 16 == 0 && (ls * kValueBytes) % 32 == 16 && stage % 4 == 0, "runs of two k-groups, 16-byte rows");
};

// Split of the attention backward (cuda/attention/attention_backward.cu) for
// passes of few (sequence, head) items: its dk, dv kernel has a block per
// (item, key tile) streaming every query tile, its dq kernels a block per
// (item, query tile) streaming every key tile, so one sequence of 4096 at
// head dim 128 runs only 64 blocks. Where the 4-warp blocks are too few for one
// round, each block's streamed tiles are cut into S contiguous ranges, a
// block each, writing partial dk, dv (or dq) that a combine kernel adds in
// split order: deterministic.
//
// S fills one round of resident blocks (attention_grad_blocks_per_sm an SM,
// the dk, dv kernel's, the lower of the two) and no more: the forward's
// split runs best at the fewest tiles a block that one round allows. At
// most kAttentionGradMaxSplits, every split streaming at least
// kAttentionGradMinSplitLen positions (beyond that the partials' round trip
// through L2, 2 hd floats a row and split, nears the split's products); 1
// where the blocks fill half a round already.
constexpr int kAttentionGradMaxSplits = 16;
constexpr int64_t kAttentionGradMinSplitLen = 128;

// Blocks of 4 warps of the dk, dv kernel an SM holds (its __launch_bounds__ minimum, KvTc
// above), and the rows (keys, or queries) such a block owns.
FASTAXIAL_HOST_DEVICE constexpr int attention_grad_blocks_per_sm(int hdp) {
  return attention_grad_tiles(hdp).kv_min_blocks;
}
FASTAXIAL_HOST_DEVICE constexpr int attention_grad_block_rows(int hdp) { return 16 * attention_grad_tiles(hdp).kw; }

FASTAXIAL_HOST_DEVICE constexpr int attention_grad_splits(int64_t num_seq, int64_t len, int64_t head_dim,
                                                          int64_t heads, int sms) {
  const int hdp = flash_padded_head_dim(head_dim);
  if (hdp == 0 || num_seq < 1 || heads < 1 || sms < 1 || len < 2 * kAttentionGradMinSplitLen ||
      len >= (int64_t{1} << 30))
    return 1;
  if (num_seq >= 2 * (int64_t)sms || heads >= 2 * (int64_t)sms) return 1;  // no overflow below
  const int64_t rows = attention_grad_block_rows(hdp);
  const int64_t blocks = num_seq * heads * ((len + rows - 1) / rows);
  const int64_t slots = (int64_t)attention_grad_blocks_per_sm(hdp) * sms;
  int64_t s = slots / blocks;
  if (s > kAttentionGradMaxSplits) s = kAttentionGradMaxSplits;
  if (s > len / kAttentionGradMinSplitLen) s = len / kAttentionGradMinSplitLen;
  return s < 2 ? 1 : (int)s;
}

// Floats of the partials of S splits (S > 1) of a pass of R = num_seq heads len rows: dk and dv,
// (S, R, 2 hd), the larger of the two sides (dq's, (S, R, hd), take the same region after).
FASTAXIAL_HOST_DEVICE constexpr size_t attention_grad_partials_floats(int splits, int64_t rows, int64_t head_dim) {
  return splits < 2 ? 0 : (size_t)splits * (size_t)rows * 2 * (size_t)head_dim;
}

// Bytes of the partials of the rule's split of a pass (0 where it does not split).
FASTAXIAL_HOST_DEVICE constexpr size_t attention_grad_partials_bytes(int64_t num_seq, int64_t len, int64_t head_dim,
                                                                     int64_t heads, int sms) {
  return attention_grad_partials_floats(attention_grad_splits(num_seq, len, head_dim, heads, sms),
                                        num_seq * heads * len, head_dim) *
         sizeof(float);
}

}  // namespace fastaxial
