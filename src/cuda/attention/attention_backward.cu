// The backward of one attention pass, flash-style: for each sequence n and
// head h (q, k, v, o, d_o below are head h's (L, hd) slices of sequence n)
//   S  = scale q k^T              scale = 1 / sqrt(hd)
//   P  = 2^(S log2(e) - lse2)     lse2 from the forward (flash_attention), in
//                                 log2 units as two floats (detail/lse.cuh)
//   dv = P^T d_o
//   dP = d_o v^T
//   dS = P * (dP - delta)         delta = rowsum(d_o * o)
//   dq = scale dS k,  dk = scale dS^T q
// written into the (T, 3D) dqkv rows in qkv's layout. The (L, L) matrices
// never reach memory: P is recomputed from lse, tile by tile.
//
// Three kernels, each a programmatic dependent of the one before:
// 1. delta: a warp per position, its lanes over the row's D floats (reads
//    of consecutive floats), each head's products summed by a segmented
//    scan across the lanes.
// 2. dk, dv: a block per (sequence, head, key tile), keys and values held
//    in shared memory, looping over the query tiles (BM queries) in order.
// 3. dq: a block per (sequence, head, query tile), q and d_o held, looping
//    over the key tiles (BN keys) in order.
// dq could be summed in kernel 2 too, but only with atomics across its key
// blocks, whose order varies from run to run; recomputing S and dP in a
// kernel of its own keeps every output element a sum by one thread in a
// fixed order (queries, or keys, ascending), so the result is bitwise
// reproducible. 7 products of L^2 hd multiply-adds per (sequence, head),
// against 5 with atomics.
//
// Few long sequences (AttentionBackwardArgs::partials; the rule is
// smem_layout.h's attention_grad_splits): kernels 2 and 3 then take S
// blocks a tile, each streaming a contiguous range of the tiles and
// storing partial dk, dv (or dq), and a combine kernel after each adds an
// element's S partials in split order: five kernels, every output element
// still a sum in a fixed order.
//
// Where the caller gives scratch for dS^T (AttentionBackwardArgs::ds; the
// training path's plan does where it stays within a few activations:
// plan.h, attention_scores_bytes), kernel 2 also stores its dS^T tiles and
// kernel 3 is a product from them (query_grads_ds_kernel): dq = scale dS k,
// dS read rather than recomputed, 5 products a (sequence, head) in all. dS
// is the same fixed-order result either way, so dq stays reproducible.
//
// Kernel 3 has a third version on Hopper's wgmma for head dims 17 to 32
// (query_grads_wgmma.cu), which the tensor-core path takes where it applies.
//
// Kernels 2 and 3 come twice. The default is the tensor cores (namespace
// tc): every product on mma.sync m16n8k8 with the 3xTF32 split of
// detail/tf32x3.cuh, fp32-accurate as the forward. A warp owns 16 rows of
// the block's fixed side (keys in kernel 2, queries in kernel 3) and takes
// the streamed side's whole tile:
//   kernel 2, per query tile: S^T = k q^T and dP^T = v d_o^T (16 x BM),
//     P^T and dS^T in place, then dv += P^T d_o and dk += dS^T q (16 x hd);
//   kernel 3, per key tile: S = q k^T and dP = d_o v^T (16 x BN), P and
//     dS in place, then dq += dS k (16 x hd).
// Computing the transposed scores in kernel 2 is what keeps P and dS out
// of shared memory: the C fragment of a score tile, k permuted (k index t
// for column 2t, t + 4 for 2t + 1, as the forward's P V), is the A fragment
// of the gradient product, whose B rows (queries or keys) are then read at
// rows 2t, 2t + 1. Every operand stays raw fp32 in shared memory, as
// cp.async copies it, at a row stride of hd_padded + 4 floats (4 mod 8):
// the score products' 4-byte fragment loads (lanes (g, t) at g ld + t) and
// the gradient products' (at 2t ld + g) both hit 32 distinct banks.
// Products sum over k in runs of two 8-deep steps, each run in a fresh
// accumulator added in fp32, as the forward. Registers set the tiles: a
// kernel-2 warp holds dk and dv (16 x hd each) and its score tiles (16 x
// BM, twice), so BM shrinks as hd grows, and at hd_padded 192 and 256 two
// warps share each 16 keys, each computing the same scores and summing
// half the features (redundant score products, against registers dk and
// dv would not fit). Tiles and shared memory per head dim: KvTc, QTc. A
// block has up to 4 warps of rows (a 64-row tile); the launch takes fewer
// where the sequence is shorter, and where the grid (items x tiles) would
// not cover the device twice: short sequences and small problems keep
// every warp busy and spread over more multiprocessors (a split launch
// keeps 4: its splits spread it).
//
// The FFMA kernels (namespace ffma) are the fallback where the
// tensor-core tiles do not fit the device's shared memory, and a test hook
// (AttentionBackwardArgs::ffma): fp32 FMAs with register micro-tiles, P
// and dS through shared memory (comments there).
//
// Head dims: templates on a padded head dim HDP (8, 16, 32, 48, 64, 96,
// 128, 192, 256, as the forward's flash kernel); columns hd..HDP-1 are zero
// in shared memory (they add nothing to S or dP; their gradient columns are
// not stored). Global loads are cp.async copies, double-buffered (the next
// tile in flight while this one is computed) where shared memory allows:
// 16 bytes where every head slice is 16-byte aligned (hd % 4 == 0 and
// 16-byte aligned qkv, d_o, dqkv), else 4 bytes an element (hd odd, say).
// Positions >= L are zero-filled by the copies and masked (P = dS = 0), and
// never read or written in global memory.
//
// Attention dropout (a second instantiation of kernels 2 and 3, kDropout;
// without it the code is as before): the forward's mask M drawn again
// (common/dropout.h), P -> P M scale for dv, and dS = P (dP M scale -
// delta) (dP = d_o v^T is the gradient of the dropped probabilities). On
// the tensor cores each lane draws one run of four elements per 16 x 8
// tile, shared by four lanes (dropout_share16): in kernel 2 (transposed
// scores) runs of 4 keys of one query, in kernel 3 runs of 4 keys of one
// query row, drawn before the tile's scores are live. The FFMA kernels draw
// each element on its own (a Philox call an element: the fallback).
#include "attention_backward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/lse.cuh"
#include "../detail/tf32x3.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int kMaxLen = 1 << 30;  // L below this: positions and tile arithmetic in int

// ---- shared by both paths ---------------------------------------------------------------------

// What the kernels read of AttentionBackwardArgs, the dropout fields aside
// (those go as a DropoutPass of their own): with them it is past 128
// bytes, where the compiler treats a struct parameter differently, and the
// kernels without dropout took other registers.
struct KernelArgs {
  AxisView pos;
  const float* qkv;
  const float* o;
  const float* d_o;
  const float* lse;
  float* delta;
  float* dqkv;
  int D, heads;
  float* ds;  // AttentionBackwardArgs::ds where kernel 2 stores dS^T and kernel 3 reads it, else null
};

// A split launch (AttentionBackwardArgs::partials): each block of kernels 2 and 3 streams range
// `split` of `splits` contiguous ranges of its tiles and stores its sums into partials, (splits,
// items L, 2 hd) floats from kernel 2 (dk then dv a row), (splits, items L, hd) from kernel 3,
// which combine_kernel adds into dqkv. splits = 1: no split, the sums go to dqkv.
struct Split {
  float* partials;
  int splits;
};

// One (sequence, head), tile and split of the problem, as a block sees it:
// blockIdx.x = ((n * heads + h) * tiles + tile) * splits + split, the split
// and tile fastest so that the blocks of one (sequence, head) run side by
// side and share its rows in L2.
struct Head {
  int64_t item;    // n * heads + h: the row of lse and delta
  int64_t first;   // row (of qkv, o, d_o, dqkv) of position 0
  int64_t stride;  // rows between neighbouring positions
  int h, hd, L, tile, split;
};

__device__ __forceinline__ Head block_head(const KernelArgs& a, int tiles, int splits = 1) {
  Head hp;
  const unsigned b = blockIdx.x / (unsigned)splits;
  hp.split = (int)(blockIdx.x % (unsigned)splits);
  hp.tile = (int)(b % (unsigned)tiles);
  hp.item = b / (unsigned)tiles;
  hp.h = (int)(hp.item % a.heads);
  hp.first = a.pos.offset(hp.item / a.heads, 0);
  hp.stride = a.pos.pos_stride;
  hp.hd = a.D / a.heads;
  hp.L = (int)a.pos.len;
  return hp;
}

// Zeroes columns hd..HDP-1 of `rows` rows at stride LD: padding the copies
// never write, so it stays zero for the whole block. Shared memory only;
// `threads`: the block's.
template <int LD, int HDP>
__device__ __forceinline__ void zero_padding(float* dst, int rows, int hd, int threads) {
  const int pad = HDP - hd;
  if (pad <= 0) return;
  for (int e = threadIdx.x; e < rows * pad; e += threads) dst[(e / pad) * LD + hd + e % pad] = 0.0f;
}

// Positions p0 .. p0 + rows - 1 of one head slice into dst (rows, LD),
// columns 0..hd-1, positions >= L as zeros. src: the slice's column 0 in
// row 0 of a tensor of row_words floats a row (in bounds, so the zero-fill
// copies may name it).
template <int LD, int HDP, bool kVec>
__device__ __forceinline__ void copy_rows(float* dst, const float* src, int64_t row_words, const Head& hp, int p0,
                                          int rows, int threads) {
  const auto at = [&](int l, int c) { return src + (hp.first + (int64_t)l * hp.stride) * row_words + c; };
  copy_head_rows<HDP, kVec, 1>(dst, RowMajor<LD>(), at, p0, rows, hp.L, hp.hd, src, threadIdx.x, threads);
}

// Entries p0 .. p0 + n - 1 of one (sequence, head)'s lse or delta row src
// into dst, positions >= L as zeros.
__device__ __forceinline__ void copy_positions(float* dst, const float* src, int p0, int n, int L, int threads) {
  for (int e = threadIdx.x; e < n; e += threads) {
    const int l = p0 + e;
    const bool valid = l < L;
    copy_async4(smem_addr(dst + e), valid ? src + l : src, valid ? 4 : 0);
  }
}

// ---- delta ---------------------------------------------------------------------------------------

constexpr int kDeltaWarps = 8;

// delta[(n heads + h) L + l] = d_o_h . o_h at position l of sequence n: a
// warp per position (grid-stride), its lanes over the row in chunks of 32 W
// floats (W = 4: float4 reads, where every row and head starts 16-byte
// aligned), so a warp reads whole 128-byte lines. A lane's products (W of
// one head) are summed in order, then an inclusive scan across the lanes,
// segmented by head (shuffles in a fixed order: deterministic), leaves each
// head's sum in the lane holding its last element, which writes it; a head
// that runs past a chunk carries its partial sum into the next one's lane 0.
template <bool kVec>
__global__ void __launch_bounds__(32 * kDeltaWarps) delta_kernel(const KernelArgs a) {
  grid_dependency_wait();
  allow_dependent_launch();
  constexpr int W = kVec ? 4 : 1;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32, hd = a.D / a.heads;
  const int64_t L = a.pos.len, rows = a.pos.num_seq * L;
  for (int64_t w = (int64_t)blockIdx.x * kDeltaWarps + threadIdx.x / 32; w < rows;
       w += (int64_t)gridDim.x * kDeltaWarps) {
    const int64_t n = w / L, l = w % L;
    const int64_t at = a.pos.offset(n, l) * a.D;
    const float *x = a.d_o + at, *y = a.o + at;
    float carry = 0.0f;  // the sum so far of the head that the last chunk ended inside
    for (int c0 = 0; c0 < a.D; c0 += 32 * W) {
      const int c = c0 + W * lane;  // this lane's first element
      float s = 0.0f;
      int head = a.heads;  // past the row: a segment of its own, never written
      if (c < a.D) {
        if constexpr (kVec) {
          const float4 u = *reinterpret_cast<const float4*>(x + c), v = *reinterpret_cast<const float4*>(y + c);
          s = fmaf(u.w, v.w, fmaf(u.z, v.z, fmaf(u.y, v.y, u.x * v.x)));
        } else {
          s = x[c] * y[c];
        }
        head = c / hd;
      }
      if (lane == 0 && c0 % hd != 0) s = carry + s;  // head `head` began in an earlier chunk
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const float up = __shfl_up_sync(kAll, s, d);
        const int up_head = __shfl_up_sync(kAll, head, d);
        if (lane >= d && up_head == head) s += up;
      }
      if (c < a.D && (c + W) % hd == 0) a.delta[(n * a.heads + head) * L + l] = s;  // the head's last element
      carry = __shfl_sync(kAll, s, 31);
    }
  }
}

// ---- the tensor-core kernels -------------------------------------------------------------------

namespace tc {

constexpr float kLog2e = 1.4426950408889634f;

// Row stride, in floats, of every operand in shared memory: 4 mod 8, so
// that both fragment loads below hit 32 distinct banks (g ld + t for
// g < 8, t < 4; 2t ld + g with 2 ld 8 or 24 mod 32), and a multiple of 4
// (16-byte rows for cp.async).
template <int HDP>
constexpr int row_ld() {
  static_assert(HDP % 8 == 0, "HDP + 4 is 4 mod 8");
  return HDP + 4;
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
  static constexpr int BN = 16 * KW, FP = HDP / FW, ld = row_ld<HDP>();
  static constexpr int stage = 2 * BM * ld;  // q, then d_o
  __host__ __device__ static constexpr int v(int bn) { return bn * ld; }
  __host__ __device__ static constexpr int q(int bn) { return 2 * bn * ld; }
  __host__ __device__ static constexpr int vec(int bn) { return q(bn) + ST * stage; }  // stage s: lse at + 3 BM s
  __host__ __device__ static constexpr int floats(int bn) { return vec(bn) + ST * 3 * BM; }
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
  static constexpr int BM = 16 * QW, ld = row_ld<HDP>();
  static constexpr int stage = 2 * BN * ld;  // k, then v
  __host__ __device__ static constexpr int d_o(int bm) { return bm * ld; }
  __host__ __device__ static constexpr int k(int bm) { return 2 * bm * ld; }
  __host__ __device__ static constexpr int floats(int bm) { return k(bm) + ST * stage; }
  static constexpr size_t bytes(int bm) { return (size_t)floats(bm) * sizeof(float); }
  static_assert(BN % 16 == 0 && (ST == 1 || ST == 2), "runs of two k-groups");
  static_assert(ld % 4 == 0 && stage % 4 == 0, "16-byte rows");
};

// Per padded head dim: the largest blocks, shared memory, and what a
// Hopper multiprocessor holds (registers from ptxas -v, none spilled; 64K
// registers and 228 KB of shared memory a multiprocessor).
//   HDP | dk, dv: warps keys  BM  KB regs blocks | dq: warps queries  BN  KB regs blocks
//     8 |          4x1   64  32  13  108      4 |          4      64  64  18  123      4
//    16 |          4x1   64  32  20  125      4 |          4      64  64  30  128      4
//    32 |          4x1   64  32  36  167      3 |          4      64  32  36  128      4
//    48 |          4x1   64  16  39  159      3 |          4      64  32  52  128      4
//    64 |          4x1   64  16  51  168      3 |          4      64  32  68  159      3
//    96 |          4x1   64  16  75  247      2 |          4      64  32 100  199      2
//   128 |          4x1   64  16  99  255      2 |          4      64  16  99  191      2
//   192 |          2x2   32  16  98  247      2 |          2      32  16  98  246      2
//   256 |          2x2   32  16  98  255      2 |          2      32  16  98  255      2
// (warps KW x FW; 256: one stage). Up to HDP 64 the budgets keep 12-16
// warps a multiprocessor; beyond, shared memory allows two blocks.
template <int HDP>
struct KvTc;
template <int HDP>
struct QTc;
template <>
struct KvTc<8> : KvTiling<8, 4, 1, 32, 2, 4> {};
template <>
struct KvTc<16> : KvTiling<16, 4, 1, 32, 2, 4> {};
template <>
struct KvTc<32> : KvTiling<32, 4, 1, 32, 2, 3> {};
template <>
struct KvTc<48> : KvTiling<48, 4, 1, 16, 2, 3> {};
template <>
struct KvTc<64> : KvTiling<64, 4, 1, 16, 2, 3> {};
template <>
struct KvTc<96> : KvTiling<96, 4, 1, 16, 2, 2> {};
template <>
struct KvTc<128> : KvTiling<128, 4, 1, 16, 2, 2> {};
template <>
struct KvTc<192> : KvTiling<192, 2, 2, 16, 2, 2> {};
template <>
struct KvTc<256> : KvTiling<256, 2, 2, 16, 1, 2> {};
template <>
struct QTc<8> : QTiling<8, 4, 64, 2, 4> {};
template <>
struct QTc<16> : QTiling<16, 4, 64, 2, 4> {};
template <>
struct QTc<32> : QTiling<32, 4, 32, 2, 4> {};
template <>
struct QTc<48> : QTiling<48, 4, 32, 2, 4> {};
template <>
struct QTc<64> : QTiling<64, 4, 32, 2, 3> {};
template <>
struct QTc<96> : QTiling<96, 4, 32, 2, 2> {};
template <>
struct QTc<128> : QTiling<128, 4, 16, 2, 2> {};
template <>
struct QTc<192> : QTiling<192, 2, 16, 2, 2> {};
template <>
struct QTc<256> : QTiling<256, 2, 16, 1, 2> {};

// The dq-from-dS kernel's tiles: up to QW = 4 warps of 16 queries (64 a
// block; the launch takes fewer as for the dq kernel), BN keys a step, two
// stages. No score tiles in registers, only dq (HDP / 2 a thread), so the
// key tiles are longer than QTc's; min_blocks: 4 blocks (16 warps) an SM up
// to HDP 32 (128 registers, no spills; the kernel is latency-bound at 3).
// Shared memory a stage, in floats:
//   dS^T  (BN, ls): ls = 68 = 64 + 4, 4 mod 8, so that load_a_cols's
//         loads (2t ls + g) hit 32 distinct banks
//   k     (BN, ld)
// e.g. 53 KB at HDP 32, 70 KB at 64, 84 KB at 256 (BN 32).
template <int HDP_>
struct DsTc {
  static constexpr int HDP = HDP_, QW = 4, BN = HDP <= 64 ? 64 : 32, ST = 2;
  static constexpr int min_blocks = HDP <= 32 ? 4 : HDP <= 64 ? 3 : 2;
  static constexpr int threads = 32 * QW, ld = row_ld<HDP>(), ls = 16 * QW + 4;
  static constexpr int stage = BN * (ls + ld);
  static constexpr size_t bytes = (size_t)ST * stage * sizeof(float);
  static_assert(BN % 16 == 0 && ls % 8 == 4 && stage % 4 == 0, "runs of two k-groups, 16-byte rows");
};

// ---- fragments from fp32 rows in shared memory (PTX m16n8k8 .tf32 layouts, g = lane / 4, t = lane % 4)

// A (16 x 8) = rows 0..15, elements 0..7 of the rows at p: (g, t), (g + 8,
// t), (g, t + 4), (g + 8, t + 4).
template <int LD>
__device__ __forceinline__ FragA load_a_rows(const float* p, int g, int t) {
  const float* r = p + g * LD + t;
  return make_a(r[0], r[8 * LD], r[4], r[8 * LD + 4]);
}

// B (8 x 8) with B[k][n] = M[n][k]: rows (n) 0..7, elements (k) 0..7 of the
// rows of M at p: (t, g), (t + 4, g).
template <int LD>
__device__ __forceinline__ FragB load_b_rows(const float* p, int g, int t) {
  const float* r = p + g * LD + t;
  return make_b(r[0], r[4]);
}

// B (8 x 8) with B[k][n] = M[k][n], k permuted as c_as_a: (t, g) is row 2t,
// (t + 4, g) row 2t + 1, both at column g of the rows of M at p.
template <int LD>
__device__ __forceinline__ FragB load_b_cols(const float* p, int g, int t) {
  const float* r = p + 2 * t * LD + g;
  return make_b(r[0], r[LD]);
}

// A C fragment (16 x 8: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1))
// as the A fragment of the next product, k permuted: (g, t) is column 2t,
// (g, t + 4) column 2t + 1.
__device__ __forceinline__ FragA c_as_a(const float (&c)[4]) { return make_a(c[0], c[2], c[1], c[3]); }

// ---- the products ------------------------------------------------------------------------------

// acc[j] (16 x 8) = rows 0..15 of a . rows 8j .. 8j + 7 of b, over HDP
// features: S^T = k q^T (a the warp's keys, b the tile's queries), dP^T = v
// d_o^T, or S = q k^T and dP = d_o v^T. Runs of two 8-deep k-steps, each in
// a fresh accumulator added in fp32 (the first run is acc itself).
template <int HDP, int NT, int LD>
__device__ __forceinline__ void score_tiles(float (&acc)[NT][4], const float* a, const float* b, int g, int t) {
  constexpr int KS = HDP / 8;
  if constexpr (KS == 1) {
    const FragA fa = load_a_rows<LD>(a, g, t);
#pragma unroll
    for (int j = 0; j < NT; ++j) three_products<true>(acc[j], fa, load_b_rows<LD>(b + 8 * j * LD, g, t));
  } else {
    static_assert(KS % 2 == 0, "runs of two k-steps");
    {
      const FragA fa0 = load_a_rows<LD>(a, g, t), fa1 = load_a_rows<LD>(a + 8, g, t);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float* bj = b + 8 * j * LD;
        three_products<true>(acc[j], fa0, load_b_rows<LD>(bj, g, t));
        three_products<false>(acc[j], fa1, load_b_rows<LD>(bj + 8, g, t));
      }
    }
    // Rolled beyond HDP 32: unrolled, the loads hoisted ahead of their
    // products take the kernels past their register budgets (dk and dv, or
    // dq, stay live throughout) and into spills.
    constexpr int kUnroll = HDP > 32 ? 1 : KS;
#pragma unroll kUnroll
    for (int kk = 2; kk < KS; kk += 2) {
      const FragA fa0 = load_a_rows<LD>(a + 8 * kk, g, t), fa1 = load_a_rows<LD>(a + 8 * kk + 8, g, t);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float* bj = b + 8 * j * LD + 8 * kk;
        mma_3xtf32_x2(acc[j], fa0, load_b_rows<LD>(bj, g, t), fa1, load_b_rows<LD>(bj + 8, g, t));
      }
    }
  }
}

// acc[f] (16 x 8) += C (16 x 8 NK) . rows 0 .. 8 NK - 1, columns 8f .. 8f +
// 7 of b: c[j] is the C fragment of columns 8j .. 8j + 7 of the left
// operand (P^T, dS^T or dS), its A fragment by c_as_a; b's rows (queries or
// keys) are the k index, read as load_b_cols permutes it. dv += P^T d_o,
// dk += dS^T q, dq += dS k. Runs of two k-groups, each in a fresh
// accumulator added in fp32.
template <int NK, int NF, int LD>
__device__ __forceinline__ void grad_tiles(float (&acc)[NF][4], const float (&c)[NK][4], const float* b, int g, int t) {
  static_assert(NK % 2 == 0, "runs of two k-groups");
#pragma unroll
  for (int j = 0; j < NK; j += 2) {
    const FragA a0 = c_as_a(c[j]), a1 = c_as_a(c[j + 1]);
    const float* bj = b + 8 * j * LD;  // rows 8j .. 8j + 15
#pragma unroll
    for (int f = 0; f < NF; ++f)
      mma_3xtf32_x2(acc[f], a0, load_b_cols<LD>(bj + 8 * f, g, t), a1, load_b_cols<LD>(bj + 8 * LD + 8 * f, g, t));
  }
}

// In place on a warp's S^T and dP^T tiles (its 16 keys x 8 NQ queries): s
// -> P^T = 2^(scale_log2 s - lse2), dp -> dS^T = P^T (dp - delta), lse2 and
// delta per query (column 8j + 2t + e of c[j][e], e = 0, 1, and of c[j][2 +
// e]), from the stage's copies at lse (hi), lse_lo, delta (query q0 first). kMasked (tiles
// that reach past L): zero for keys key0 + row >= L and queries q0 +
// column >= L. kDropout: P -> P M scale and dS = P (dP M scale - delta),
// M from keep (16 bits of c[j] at 16 (j % 2) in keep[j / 2],
// dropout_bit_cols).
template <int NQ, bool kMasked, bool kDropout>
__device__ __forceinline__ void softmax_grad_cols(float (&s)[NQ][4], float (&dp)[NQ][4], const float* lse,
                                                  const float* lse_lo, const float* delta, float scale_log2, int key0,
                                                  int q0, int L, int g, int t, const uint32_t (&keep)[NQ / 2],
                                                  float keep_scale) {
  const bool key_in[2] = {key0 + g < L, key0 + g + 8 < L};
#pragma unroll
  for (int j = 0; j < NQ; ++j) {
    const float2 h2 = *reinterpret_cast<const float2*>(lse + 8 * j + 2 * t);
    const float2 l2 = *reinterpret_cast<const float2*>(lse_lo + 8 * j + 2 * t);
    const float2 d2 = *reinterpret_cast<const float2*>(delta + 8 * j + 2 * t);
    const float hi[2] = {h2.x, h2.y}, lo[2] = {l2.x, l2.y}, dl[2] = {d2.x, d2.y};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = e & 1;  // column 8j + 2t + c; row g + 8 (e >> 1)
      float p = prob_from_lse2(s[j][e], scale_log2, hi[c], lo[c]), ds;
      if constexpr (kDropout) {
        const bool kept = (keep[j / 2] >> (16 * (j % 2) + dropout_bit_cols(g, e))) & 1u;
        const float m = kept ? keep_scale : 0.0f;
        ds = p * fmaf(m, dp[j][e], -dl[c]);
        p *= m;
      } else {
        ds = p * (dp[j][e] - dl[c]);
      }
      const bool in = !kMasked || (key_in[e >> 1] && q0 + 8 * j + 2 * t + c < L);
      s[j][e] = in ? p : 0.0f;
      dp[j][e] = in ? ds : 0.0f;
    }
  }
}

// In place on a warp's S and dP tiles (its 16 queries x 8 NK keys): s -> P,
// dp -> dS, with the thread's rows' lse2 (hi, lo: detail/lse.cuh) and delta
// (rows g, g + 8) in registers. kMasked (tiles that reach past L): zero for keys
// k0 + column >= L. kDropout: as softmax_grad_cols, keep's bits by
// dropout_bit_rows.
template <int NK, bool kMasked, bool kDropout>
__device__ __forceinline__ void softmax_grad_rows(float (&s)[NK][4], float (&dp)[NK][4], const float (&hi)[2],
                                                  const float (&lo)[2], const float (&dl)[2], float scale_log2, int k0,
                                                  int L, int t, const uint32_t (&keep)[NK / 2], float keep_scale) {
#pragma unroll
  for (int j = 0; j < NK; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;  // row g + 8r; column 8j + 2t + (e & 1)
      float p = prob_from_lse2(s[j][e], scale_log2, hi[r], lo[r]), ds;
      if constexpr (kDropout) {
        const bool kept = (keep[j / 2] >> (16 * (j % 2) + dropout_bit_rows(t, e))) & 1u;
        const float m = kept ? keep_scale : 0.0f;
        ds = p * fmaf(m, dp[j][e], -dl[r]);
        p *= m;
      } else {
        ds = p * (dp[j][e] - dl[r]);
      }
      const bool in = !kMasked || k0 + 8 * j + 2 * t + (e & 1) < L;
      s[j][e] = in ? p : 0.0f;
      dp[j][e] = in ? ds : 0.0f;
    }
}

// factor * acc into the gradient rows of positions p0 + g, p0 + g + 8 (< L),
// features f0 + 8f + 2t, + 1 (< hd): dst is one head's column 0 of one part
// ([dq | dk | dv]) in row 0 of dqkv.
template <int NF, bool kVec>
__device__ __forceinline__ void store_tiles(float* dst, const float (&acc)[NF][4], float factor, int64_t row_words,
                                            const Head& hp, int p0, int f0, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int l = p0 + g + 8 * r;
    if (l >= hp.L) continue;
    float* out = dst + (hp.first + (int64_t)l * hp.stride) * row_words;
#pragma unroll
    for (int f = 0; f < NF; ++f) {
      const int c = f0 + 8 * f + 2 * t;
      if (c >= hp.hd) continue;
      const float x = factor * acc[f][2 * r], y = factor * acc[f][2 * r + 1];
      if constexpr (kVec) {
        *reinterpret_cast<float2*>(out + c) = make_float2(x, y);  // hd % 4 == 0: pairs lie wholly inside
      } else {
        out[c] = x;
        if (c + 1 < hp.hd) out[c + 1] = y;
      }
    }
  }
}

// The first and one-past-last of `tiles` streamed tiles that split `split` of `splits` takes
// (contiguous ranges, sizes differing by one at most).
__device__ __forceinline__ int2 split_range(int tiles, int split, int splits) {
  return make_int2((int)((int64_t)split * tiles / splits), (int)((int64_t)(split + 1) * tiles / splits));
}

// hp's rows of a split's partials (Split): row (split items + item) L + l, contiguous.
__device__ __forceinline__ Head partial_rows(const Head& hp, int64_t items) {
  Head p = hp;
  p.first = ((int64_t)hp.split * items + hp.item) * hp.L;
  p.stride = 1;
  return p;
}

// A warp's dS^T (its 16 keys from key0 x 8 NQ queries from q0, C fragments)
// into the scratch rows of keys < L (ds: the (sequence, head)'s first row,
// rows of Lp floats): one float2 a pair of queries, pairs from query < L
// (the second of a pair at L is a zero, as dS is past L; Lp is even).
template <int NQ>
__device__ __forceinline__ void store_scores_t(float* ds, const float (&c)[NQ][4], int L, int Lp, int key0, int q0,
                                               int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + g + 8 * r;
    if (key >= L) continue;
    float* row = ds + (int64_t)key * Lp;
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
      const int q = q0 + 8 * j + 2 * t;
      if (q < L) *reinterpret_cast<float2*>(row + q) = make_float2(c[j][2 * r], c[j][2 * r + 1]);
    }
  }
}

// A (16 x 8) of dS = rows 0..15 (queries), elements 0..7 (keys) read from
// dS^T stored a row per key at p (row stride LS), k permuted as c_as_a:
// (g, t) is key 2t, (g, t + 4) key 2t + 1, so that load_b_cols's k rows
// meet them. LS 4 mod 8 puts the four rows 2t at banks 0, 8, 16, 24 (or
// their mirror), so a load's 32 words (2t LS + g) meet 32 distinct banks.
template <int LS>
__device__ __forceinline__ FragA load_a_cols(const float* p, int g, int t) {
  const float* r = p + 2 * t * LS + g;
  return make_a(r[0], r[8], r[LS], r[LS + 8]);
}

// ---- the kernels -------------------------------------------------------------------------------

// dk and dv of one key tile (hp.tile) of one (sequence, head): 16 keys for
// each of the block's blockDim.x / (32 FW) <= KW key groups (the launch
// takes fewer for short sequences and small grids); warp w owns keys
// 16 (w / FW) .. + 15 of the tile and features FP (w % FW) .. + FP - 1 of
// their gradients. Shared memory as KvTiling lays it out for KW groups.
// kDropout: dpass applies (threshold != 0).
template <int HDP, bool kVec, bool kDropout>
__global__ void __launch_bounds__(KvTc<HDP>::threads, KvTc<HDP>::min_blocks)
    key_grads_kernel(const KernelArgs a, float scale, float scale_log2, int key_tiles, const Split sp,
                     const DropoutPass dpass) {
  using T = KvTc<HDP>;
  constexpr int BM = T::BM, ST = T::ST, LD = T::ld;
  constexpr int NQ = BM / 8, NF = T::FP / 8;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int threads = blockDim.x, BN = threads / (32 * T::FW) * 16;  // keys a tile
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int kw = warp / T::FW, f0 = (warp % T::FW) * T::FP;
  const Head hp = block_head(a, key_tiles, sp.splits);
  const int Lp = (int)attention_scores_stride(hp.L);         // dS^T's row stride, where stored
  const int k0 = hp.tile * BN, key0 = k0 + 16 * kw;          // the tile's first key, the warp's
  float* const k_sm = sm;                                    // (BN, HDP), then v (BN, HDP)
  float* const q_sm = sm + T::q(BN);                         // stage s at + s stage: q (BM, HDP), then d_o (BM, HDP)
  float* const vec_sm = sm + T::vec(BN);                     // stage s at + 3 BM s: lse hi, lo, delta (BM each)
  zero_padding<LD, HDP>(k_sm, 2 * BN, hp.hd, threads);       // k, v
  zero_padding<LD, HDP>(q_sm, 2 * ST * BM, hp.hd, threads);  // every stage's q, d_o

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;               // floats a row of qkv and dqkv
  const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
  const float* dog = a.d_o + (int64_t)hp.h * hp.hd;
  const float* lse = a.lse + hp.item * hp.L;                 // hi; lo at + rows (detail/lse.cuh)
  const float* lse_lo = lse + a.pos.num_seq * a.heads * hp.L;
  const float* delta = a.delta + hp.item * hp.L;
  // Dropout: seed and offset as a preceding kernel wrote them; e_warp is the
  // element of (query 0, the warp's first key).
  DropoutParams drop;
  uint64_t e_warp = 0;
  if constexpr (kDropout) {
    drop = dropout_read(dpass);
    e_warp = dpass.base + (uint64_t)hp.item * (uint64_t)hp.L * (uint64_t)hp.L + (uint64_t)key0;
  }
  const auto load_queries = [&](int stage, int q0) {
    float* qs = q_sm + stage * T::stage;
    float* vs = vec_sm + stage * 3 * BM;
    copy_rows<LD, HDP, kVec>(qs, qg, W, hp, q0, BM, threads);
    copy_rows<LD, HDP, kVec>(qs + BM * LD, dog, a.D, hp, q0, BM, threads);
    copy_positions(vs, lse, q0, BM, hp.L, threads);
    copy_positions(vs + BM, lse_lo, q0, BM, hp.L, threads);
    copy_positions(vs + 2 * BM, delta, q0, BM, hp.L, threads);
  };
  // The query tiles this block streams: all of them, or its split's range.
  const int2 range = split_range((hp.L + BM - 1) / BM, hp.split, sp.splits);
  copy_rows<LD, HDP, kVec>(k_sm, qg + a.D, W, hp, k0, BN, threads);
  copy_rows<LD, HDP, kVec>(k_sm + T::v(BN), qg + 2 * a.D, W, hp, k0, BN, threads);
  load_queries(0, range.x * BM);
  copy_async_commit();

  const float* ks = k_sm + 16 * kw * LD;  // the warp's keys (16, HDP)
  const float* vs = k_sm + T::v(BN) + 16 * kw * LD;
  const bool active = key0 < hp.L;  // a warp whose keys are all >= L only copies
  float dk[NF][4], dv[NF][4];
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[f][e] = dv[f][e] = 0.0f;
  for (int i = range.x; i < range.y; ++i) {
    copy_async_wait<0>();  // this thread's copies of tile i (and of k, v)
    // Every thread's copies of tile i are in, and every warp is done with
    // tile i - 1 (with two stages, the stage copied next).
    __syncthreads();
    if constexpr (ST == 2) {
      if (i + 1 < range.y) {
        load_queries((i + 1 - range.x) & 1, (i + 1) * BM);
        copy_async_commit();
      }
    }
    const int st = ST == 2 ? ((i - range.x) & 1) : 0;
    const float* q = q_sm + st * T::stage;  // q is (BM, HDP), d_o (BM, HDP) after it
    const float* d_o = q + BM * LD;
    const float* lse_s = vec_sm + st * 3 * BM;  // hi, then lo, then delta
    if (active) {
      const int q0 = i * BM;
      // Dropout's keep bits of the tile, drawn before s and dp are live:
      // query n-tiles j and j + 1 in keep[j / 2], 16 bits each.
      uint32_t keep[NQ / 2];
      if constexpr (kDropout) {
        static_assert(NQ % 2 == 0, "n-tiles in pairs");
#pragma unroll
        for (int j = 0; j < NQ; j += 2) {
          const uint64_t e_tile = e_warp + (uint64_t)(q0 + 8 * j) * (uint64_t)hp.L;
          const unsigned b0 = dropout_share16<4>(dropout_keep_run4(drop, dropout_run_cols(e_tile, hp.L, g, t)), g & 3);
          const unsigned b1 = dropout_share16<4>(
              dropout_keep_run4(drop, dropout_run_cols(e_tile + 8 * (uint64_t)hp.L, hp.L, g, t)), g & 3);
          keep[j / 2] = b0 | b1 << 16;
        }
      }
      float s[NQ][4], dp[NQ][4];
      score_tiles<HDP, NQ, LD>(s, ks, q, g, t);     // S^T = k q^T
      score_tiles<HDP, NQ, LD>(dp, vs, d_o, g, t);  // dP^T = v d_o^T
      if (q0 + BM > hp.L || key0 + 16 > hp.L)
        softmax_grad_cols<NQ, true, kDropout>(s, dp, lse_s, lse_s + BM, lse_s + 2 * BM, scale_log2, key0, q0, hp.L, g,
                                              t, keep, dpass.scale);
      else
        softmax_grad_cols<NQ, false, kDropout>(s, dp, lse_s, lse_s + BM, lse_s + 2 * BM, scale_log2, key0, q0, hp.L,
                                               g, t, keep, dpass.scale);
      // dS^T for kernel 3 where it reads it (one warp of the FW that share these keys).
      if (a.ds != nullptr && f0 == 0)
        store_scores_t<NQ>(a.ds + hp.item * (int64_t)hp.L * Lp, dp, hp.L, Lp, key0, q0, g, t);
      grad_tiles<NQ, NF, LD>(dv, s, d_o + f0, g, t);  // dv += P^T d_o
      grad_tiles<NQ, NF, LD>(dk, dp, q + f0, g, t);   // dk += dS^T q
    }
    if constexpr (ST == 1) {
      if (i + 1 < range.y) {
        __syncthreads();  // every warp done with the stage
        load_queries(0, (i + 1) * BM);
        copy_async_commit();
      }
    }
  }
  if (!active) return;
  if (sp.splits > 1) {  // dk, then dv, a row of the split's partials
    const Head pr = partial_rows(hp, a.pos.num_seq * a.heads);
    store_tiles<NF, kVec>(sp.partials, dk, scale, 2 * hp.hd, pr, key0, f0, g, t);
    store_tiles<NF, kVec>(sp.partials + hp.hd, dv, 1.0f, 2 * hp.hd, pr, key0, f0, g, t);
    return;
  }
  float* out = a.dqkv + (int64_t)hp.h * hp.hd;  // head h's dq columns; dk at + D, dv at + 2D
  store_tiles<NF, kVec>(out + a.D, dk, scale, W, hp, key0, f0, g, t);
  store_tiles<NF, kVec>(out + 2 * a.D, dv, 1.0f, W, hp, key0, f0, g, t);
}

// dq of one query tile (hp.tile) of one (sequence, head): 16 queries for
// each of the block's blockDim.x / 32 <= QW warps (the launch takes fewer
// for short sequences and small grids); warp w owns queries 16 w .. 16 w +
// 15 of the tile. Shared memory as QTiling lays it out for QW warps.
// kDropout: dpass applies (threshold != 0).
template <int HDP, bool kVec, bool kDropout>
__global__ void __launch_bounds__(QTc<HDP>::threads, QTc<HDP>::min_blocks)
    query_grads_kernel(const KernelArgs a, float scale, float scale_log2, int query_tiles, const Split sp,
                       const DropoutPass dpass) {
  using T = QTc<HDP>;
  constexpr int BN = T::BN, ST = T::ST, LD = T::ld;
  constexpr int NK = BN / 8, NF = HDP / 8;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int threads = blockDim.x, BM = threads / 32 * 16;  // queries a tile
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const Head hp = block_head(a, query_tiles, sp.splits);
  const int q0 = hp.tile * BM, m0 = q0 + 16 * warp;          // the tile's first query, the warp's
  float* const q_sm = sm;                                    // (BM, HDP), then d_o (BM, HDP)
  float* const k_sm = sm + T::k(BM);                         // stage s at + s stage: k (BN, HDP), then v (BN, HDP)
  zero_padding<LD, HDP>(q_sm, 2 * BM, hp.hd, threads);       // q, d_o
  zero_padding<LD, HDP>(k_sm, 2 * ST * BN, hp.hd, threads);  // every stage's k, v

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;
  const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
  const auto load_keys = [&](int stage, int k0) {
    float* ks = k_sm + stage * T::stage;
    copy_rows<LD, HDP, kVec>(ks, qg + a.D, W, hp, k0, BN, threads);
    copy_rows<LD, HDP, kVec>(ks + BN * LD, qg + 2 * a.D, W, hp, k0, BN, threads);
  };
  // The key tiles this block streams: all of them, or its split's range.
  const int2 range = split_range((hp.L + BN - 1) / BN, hp.split, sp.splits);
  copy_rows<LD, HDP, kVec>(q_sm, qg, W, hp, q0, BM, threads);
  copy_rows<LD, HDP, kVec>(q_sm + T::d_o(BM), a.d_o + (int64_t)hp.h * hp.hd, a.D, hp, q0, BM, threads);
  load_keys(0, range.x * BN);
  copy_async_commit();

  // lse2 (hi, lo: detail/lse.cuh) and delta of this thread's rows, m0 + g and m0 + g + 8.
  float hi[2], lo[2], dl[2];
  const int64_t rows = a.pos.num_seq * a.heads * hp.L;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int l = m0 + g + 8 * r;
    const bool in = l < hp.L;
    hi[r] = in ? a.lse[hp.item * hp.L + l] : 0.0f;
    lo[r] = in ? a.lse[rows + hp.item * hp.L + l] : 0.0f;
    dl[r] = in ? a.delta[hp.item * hp.L + l] : 0.0f;
  }
  // Dropout: seed and offset as a preceding kernel wrote them; e_warp is the
  // element of (the warp's first query, key 0).
  DropoutParams drop;
  uint64_t e_warp = 0;
  if constexpr (kDropout) {
    drop = dropout_read(dpass);
    e_warp = dpass.base + ((uint64_t)hp.item * (uint64_t)hp.L + (uint64_t)m0) * (uint64_t)hp.L;
  }
  const float* qs = q_sm + 16 * warp * LD;  // the warp's queries (16, HDP)
  const float* dos = q_sm + T::d_o(BM) + 16 * warp * LD;
  const bool active = m0 < hp.L;  // a warp whose queries are all >= L only copies
  float dq[NF][4];
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[f][e] = 0.0f;
  for (int j = range.x; j < range.y; ++j) {
    copy_async_wait<0>();
    __syncthreads();  // as in key_grads_kernel: tile j in, tile j - 1 done
    if constexpr (ST == 2) {
      if (j + 1 < range.y) {
        load_keys((j + 1 - range.x) & 1, (j + 1) * BN);
        copy_async_commit();
      }
    }
    const float* k = k_sm + (ST == 2 ? ((j - range.x) & 1) : 0) * T::stage;  // k is (BN, HDP), v (BN, HDP) after it
    const float* v = k + BN * LD;
    if (active) {
      const int k0 = j * BN;
      // Dropout's keep bits of the tile, drawn before s and dp are live: key
      // n-tiles jj and jj + 1 in keep[jj / 2], 16 bits each.
      uint32_t keep[NK / 2];
      if constexpr (kDropout) dropout_keep_rows<NK>(keep, drop, e_warp, k0, hp.L, g, t);
      float s[NK][4], dp[NK][4];
      score_tiles<HDP, NK, LD>(s, qs, k, g, t);    // S = q k^T
      score_tiles<HDP, NK, LD>(dp, dos, v, g, t);  // dP = d_o v^T
      if (k0 + BN > hp.L)
        softmax_grad_rows<NK, true, kDropout>(s, dp, hi, lo, dl, scale_log2, k0, hp.L, t, keep, dpass.scale);
      else
        softmax_grad_rows<NK, false, kDropout>(s, dp, hi, lo, dl, scale_log2, k0, hp.L, t, keep, dpass.scale);
      grad_tiles<NK, NF, LD>(dq, dp, k, g, t);  // dq += dS k
    }
    if constexpr (ST == 1) {
      if (j + 1 < range.y) {
        __syncthreads();
        load_keys(0, (j + 1) * BN);
        copy_async_commit();
      }
    }
  }
  if (!active) return;
  if (sp.splits > 1)
    store_tiles<NF, kVec>(sp.partials, dq, scale, hp.hd, partial_rows(hp, a.pos.num_seq * a.heads), m0, 0, g, t);
  else
    store_tiles<NF, kVec>(a.dqkv + (int64_t)hp.h * hp.hd, dq, scale, W, hp, m0, 0, g, t);
}

// dq of one query tile (hp.tile) of one (sequence, head) from kernel 2's
// dS^T (KernelArgs::ds): dq = scale dS k, the products and their order as
// query_grads_kernel's last one. 16 queries for each of the block's
// blockDim.x / 32 <= DsTc::QW warps; key tiles of BN streamed through ST
// stages, each dS^T's (BN keys, the block's queries) piece and k's (BN,
// HDP) rows. No scores, exponentials or mask: dS holds them.
template <int HDP, bool kVec>
__global__ void __launch_bounds__(DsTc<HDP>::threads, DsTc<HDP>::min_blocks)
    query_grads_ds_kernel(const KernelArgs a, float scale, int query_tiles, const Split sp) {
  using T = DsTc<HDP>;
  constexpr int BN = T::BN, LD = T::ld, LS = T::ls;
  constexpr int NK = BN / 8, NF = HDP / 8;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);  // stage s at + s stage: dS^T (BN, LS), then k (BN, LD)
  const int threads = blockDim.x, BM = threads / 32 * 16;  // queries a tile
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const Head hp = block_head(a, query_tiles, sp.splits);
  const int q0 = hp.tile * BM, m0 = q0 + 16 * warp;  // the tile's first query, the warp's
#pragma unroll
  for (int st = 0; st < T::ST; ++st) zero_padding<LD, HDP>(sm + st * T::stage + BN * LS, BN, hp.hd, threads);

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;
  const int Lp = (int)attention_scores_stride(hp.L);
  const float* dsg = a.ds + hp.item * (int64_t)hp.L * Lp;  // (L, Lp): row key, column query
  const float* kg = a.qkv + a.D + (int64_t)hp.h * hp.hd;   // head h's k columns
  // Keys k0 .. k0 + BN - 1 into stage `stage`: dS^T's queries q0 .. q0 + BM - 1 (16-byte
  // copies: rows of Lp floats, q0 a multiple of 16; keys and queries >= L as zeros) and k's rows.
  // A row's BM / 4 copies are a power of two (BM = 16 warps, warps 1, 2 or 4): shifts, not
  // divisions by a runtime value (a few dozen instructions each).
  const int c_shift = 31 - __clz(BM / 4);
  const auto load_keys = [&](int stage, int k0) {
    float* ss = sm + stage * T::stage;
#pragma unroll 1
    for (int e = threadIdx.x; e < BN * (BM / 4); e += threads) {
      const int r = e >> c_shift, c = 4 * (e & (BM / 4 - 1)), key = k0 + r, q = q0 + c;
      const bool valid = key < hp.L && q < hp.L;
      copy_async16(smem_addr(ss + r * LS + c), valid ? dsg + (int64_t)key * Lp + q : dsg,
                   valid ? 4 * min(4, hp.L - q) : 0);
    }
    copy_rows<LD, HDP, kVec>(ss + BN * LS, kg, W, hp, k0, BN, threads);
  };
  // The key tiles this block streams: all of them, or its split's range.
  const int2 range = split_range((hp.L + BN - 1) / BN, hp.split, sp.splits);
  load_keys(0, range.x * BN);
  copy_async_commit();

  const bool active = m0 < hp.L;  // a warp whose queries are all >= L only copies
  float dq[NF][4];
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[f][e] = 0.0f;
  for (int j = range.x; j < range.y; ++j) {
    copy_async_wait<0>();
    __syncthreads();  // tile j in, tile j - 1 done (its stage is copied next)
    const int st = (j - range.x) & 1;
    if (j + 1 < range.y) {
      load_keys(st ^ 1, (j + 1) * BN);
      copy_async_commit();
    }
    const float* dst = sm + st * T::stage + 16 * warp;  // the warp's queries of dS^T
    const float* k = sm + st * T::stage + BN * LS;
    if (active) {
      // dq += dS k: runs of two key groups, as grad_tiles. Rolled beyond HDP 32, as in
      // score_tiles: unrolled, the hoisted fragment loads spill next to dq.
      constexpr int kUnroll = HDP > 32 ? 1 : NK / 2;
#pragma unroll kUnroll
      for (int jj = 0; jj < NK; jj += 2) {
        const FragA a0 = load_a_cols<LS>(dst + 8 * jj * LS, g, t), a1 = load_a_cols<LS>(dst + 8 * (jj + 1) * LS, g, t);
        const float* bj = k + 8 * jj * LD;
#pragma unroll
        for (int f = 0; f < NF; ++f)
          mma_3xtf32_x2(dq[f], a0, load_b_cols<LD>(bj + 8 * f, g, t), a1, load_b_cols<LD>(bj + 8 * LD + 8 * f, g, t));
      }
    }
  }
  if (!active) return;
  if (sp.splits > 1)
    store_tiles<NF, kVec>(sp.partials, dq, scale, hp.hd, partial_rows(hp, a.pos.num_seq * a.heads), m0, 0, g, t);
  else
    store_tiles<NF, kVec>(a.dqkv + (int64_t)hp.h * hp.hd, dq, scale, W, hp, m0, 0, g, t);
}

// After a split launch of kernel 2 (parts 2, first part 1: dk, dv) or 3 (parts 1, first part 0:
// dq): each element of dqkv they own is the sum of its sp.splits partials (Split), added in split
// order. A thread an element (grid-stride), consecutive threads along a partial row's parts hd
// columns, so the partials are read coalesced. The partials number fewer than 2^31 floats
// (launch_tc splits only then): int indices.
__global__ void __launch_bounds__(256) combine_kernel(const KernelArgs a, const Split sp, int parts, int first_part) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int hd = a.D / a.heads, L = (int)a.pos.len, w = parts * hd;
  const int total = (int)(a.pos.num_seq * a.heads) * L * w;  // one split's floats
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
    float x = sp.partials[e];
    for (int s = 1; s < sp.splits; ++s) x += sp.partials[(int64_t)s * total + e];
    const int r = e / w, c = e % w;  // partial row r = item L + l, column c
    const int item = r / L, l = r % L, part = first_part + c / hd;
    const int64_t row = a.pos.offset(item / a.heads, l);
    a.dqkv[row * 3 * a.D + (int64_t)part * a.D + (int64_t)(item % a.heads) * hd + c % hd] = x;
  }
}

}  // namespace tc

// ---- the FFMA kernels --------------------------------------------------------------------------
//
// Plain fp32 FFMA, with register micro-tiles: in the score step a thread
// owns RM queries x RK keys of S and dP (rows ly + 4r, keys lx + 8c of its
// warp's tile, lanes 4 x 8), reading 16-byte runs of features from q, d_o,
// k and v rows in shared memory: a quarter warp reads one query row (a
// broadcast) and 8 consecutive key rows, 4 * odd floats apart (HDP + 4), so
// 8 distinct bank quads. In the gradient step a thread owns RR consecutive
// rows (keys for dk, dv; queries for dq) and RC runs of 4 features, strided
// by LX lanes so a quarter warp reads one contiguous run of a feature row;
// P and dS rows (BN + 8 floats, 8 mod 16) take the score step's scalar
// stores, 4 rows of 8 keys per warp, without conflicts. Tiles shrink as HDP
// grows, so that the dk, dv accumulators (2 RR x 4 RC floats a thread) fit
// in registers and shared memory stays near 100 KB (Tiles below).

namespace ffma {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

// ---- which elements a thread owns ------------------------------------------------------------

// A score tile, BM queries x BN keys (S and dP, then P and dS): warps AM x
// AN, each a tile of 4 RM queries x 8 RK keys over lanes 4 (ly) x 8 (lx); a
// thread owns queries row() + 4r (r < RM) and keys key() + 8c (c < RK).
template <int BM_, int BN_, int RM_, int RK_>
struct ScoreMap {
  static constexpr int BM = BM_, BN = BN_, RM = RM_, RK = RK_;
  static constexpr int AN = BN / (8 * RK);  // warps across keys
  static constexpr int AM = kWarps / AN;    // warps across queries
  static constexpr int ldp = BN + 8;        // row stride of P and dS in shared memory
  static_assert(AN >= 1 && AM * AN == kWarps && AM * 4 * RM == BM && AN * 8 * RK == BN, "score tile map");
  static_assert(ldp % 16 == 8, "P, dS rows: 4 rows of 8 keys a store, distinct banks");
  __device__ static int row(int warp, int lane) { return (warp / AN) * 4 * RM + lane / 8; }
  __device__ static int key(int warp, int lane) { return (warp % AN) * 8 * RK + lane % 8; }
};

// A gradient tile, ROWS x HDP features, summed in registers: warps BK x BF,
// lanes LY x LX; a thread owns rows row() + r (r < RR) and features
// feature() + 4 LX c .. + 3 (c < RC).
template <int ROWS_, int HDP, int LX_, int RR_, int RC_>
struct GradMap {
  static constexpr int ROWS = ROWS_, LX = LX_, LY = 32 / LX_, RR = RR_, RC = RC_;
  static constexpr int BF = HDP / (4 * LX * RC);  // warps across features
  static constexpr int BK = kWarps / BF;          // warps across rows
  static_assert(BF >= 1 && BF * 4 * LX * RC == HDP && BK * BF == kWarps && BK * LY * RR == ROWS, "gradient map");
  static_assert(RR == 1 || RR == 2 || RR % 4 == 0, "runs of P and dS loaded as 1, 2 or 4 floats");
  __device__ static int row(int warp, int lane) { return (warp / BF) * LY * RR + lane / LX * RR; }
  __device__ static int feature(int warp, int lane) { return 4 * ((warp % BF) * LX * RC + lane % LX); }
};

// Per padded head dim: the dk, dv kernel's score tile (BM queries a step x
// BN keys a block) and gradient tile (BN keys), the dq kernel's (BM queries
// a block x BN keys a step) and gradient tile (BM queries), and each
// kernel's stages (2: the next tile's copy overlaps this one's work).
// Shared memory, dk/dv and dq kernels: HDP 8: 51 and 35 KB, 16: 63 and 47,
// 32: 53 and 71, 48: 81 and 95, 64: 85 and 77, 96: 92 and 84, 128: 91 and
// 87, 192: 78 and 76, 256: 102 and 100.
template <class KvScore_, class KvGrad_, int kv_stages_, class QScore_, class QGrad_, int q_stages_>
struct TileSet {
  using KvScore = KvScore_;
  using KvGrad = KvGrad_;
  using QScore = QScore_;
  using QGrad = QGrad_;
  static constexpr int kv_stages = kv_stages_, q_stages = q_stages_;
  static_assert(KvGrad::ROWS == KvScore::BN && QGrad::ROWS == QScore::BM, "gradient rows are the block's rows");
};

template <int HDP>
struct Tiles;
template <>
struct Tiles<8> : TileSet<ScoreMap<32, 128, 4, 4>, GradMap<128, 8, 2, 1, 1>, 2,  //
                          ScoreMap<128, 32, 4, 4>, GradMap<128, 8, 2, 1, 1>, 2> {};
template <>
struct Tiles<16> : TileSet<ScoreMap<32, 128, 4, 4>, GradMap<128, 16, 4, 2, 1>, 2,  //
                           ScoreMap<128, 32, 4, 4>, GradMap<128, 16, 4, 2, 1>, 2> {};
template <>
struct Tiles<32> : TileSet<ScoreMap<32, 64, 2, 4>, GradMap<64, 32, 8, 2, 1>, 2,  //
                           ScoreMap<64, 64, 4, 4>, GradMap<64, 32, 8, 2, 1>, 2> {};
template <>
struct Tiles<48> : TileSet<ScoreMap<16, 128, 2, 4>, GradMap<128, 48, 4, 2, 3>, 2,  //
                           ScoreMap<128, 32, 4, 4>, GradMap<128, 48, 4, 2, 3>, 2> {};
template <>
struct Tiles<64> : TileSet<ScoreMap<32, 64, 2, 4>, GradMap<64, 64, 8, 4, 1>, 2,  //
                           ScoreMap<64, 32, 4, 2>, GradMap<64, 64, 8, 4, 1>, 2> {};
template <>
struct Tiles<96> : TileSet<ScoreMap<32, 64, 2, 4>, GradMap<64, 96, 8, 2, 3>, 1,  //
                           ScoreMap<64, 32, 4, 2>, GradMap<64, 96, 8, 2, 3>, 1> {};
template <>
struct Tiles<128> : TileSet<ScoreMap<16, 64, 2, 2>, GradMap<64, 128, 8, 4, 2>, 1,  //
                            ScoreMap<64, 16, 2, 2>, GradMap<64, 128, 8, 4, 2>, 1> {};
template <>
struct Tiles<192> : TileSet<ScoreMap<16, 32, 1, 2>, GradMap<32, 192, 8, 2, 3>, 1,  //
                            ScoreMap<32, 16, 1, 2>, GradMap<32, 192, 8, 2, 3>, 1> {};
template <>
struct Tiles<256> : TileSet<ScoreMap<16, 32, 1, 2>, GradMap<32, 256, 8, 8, 1>, 1,  //
                            ScoreMap<32, 16, 1, 2>, GradMap<32, 256, 8, 4, 2>, 1> {};

// Row strides, in floats: key-side rows (k, v) are read 8 rows at a time
// (4 * odd apart: distinct bank quads), query-side rows (q, d_o) one row at
// a time (no padding needed).
template <int HDP>
constexpr int key_ld() {
  static_assert(HDP % 8 == 0, "HDP + 4 is 4 * odd");
  return HDP + 4;
}

// Shared memory of the dk, dv kernel, in floats:
//   k, v:                (BN, ldk) each, the block's keys
//   stage s: q, d_o      (BM, ldq) each, one query tile
//   p, ds:               (BM, ldp) each
//   stage s: lse (hi, lo), delta  (BM) each
// Row buffers with the same stride are contiguous, so one pass zeroes
// their padding columns.
template <int HDP>
struct KvSmem {
  using T = Tiles<HDP>;
  static constexpr int BM = T::KvScore::BM, BN = T::KvScore::BN, ST = T::kv_stages, ldp = T::KvScore::ldp;
  static constexpr int ldk = key_ld<HDP>(), ldq = HDP;
  static constexpr int k = 0, v = BN * ldk, q = 2 * BN * ldk;
  static constexpr int stage = 2 * BM * ldq;  // q, then d_o
  static constexpr int p = q + ST * stage, ds = p + BM * ldp;
  static constexpr int vec = ds + BM * ldp;  // stage s: lse hi at vec + 3 BM s, lo BM after, delta 2 BM after
  static constexpr int floats = vec + ST * 3 * BM;
  static constexpr size_t bytes = (size_t)floats * sizeof(float);
  static_assert(q % 4 == 0 && stage % 4 == 0 && p % 4 == 0 && ldp % 4 == 0 && vec % 4 == 0, "16-byte rows");
};

// Shared memory of the dq kernel, in floats:
//   q, d_o:              (BM, ldq) each, the block's queries
//   stage s: k, v        (BN, ldk) each, one key tile
//   ds:                  (BM, ldp)
//   lse (hi, lo), delta: (BM) each
template <int HDP>
struct QSmem {
  using T = Tiles<HDP>;
  static constexpr int BM = T::QScore::BM, BN = T::QScore::BN, ST = T::q_stages, ldp = T::QScore::ldp;
  static constexpr int ldk = key_ld<HDP>(), ldq = HDP;
  static constexpr int q = 0, d_o = BM * ldq, k = 2 * BM * ldq;
  static constexpr int stage = 2 * BN * ldk;  // k, then v
  static constexpr int ds = k + ST * stage;
  static constexpr int vec = ds + BM * ldp;  // lse hi, lo, then delta
  static constexpr int floats = vec + 3 * BM;
  static constexpr size_t bytes = (size_t)floats * sizeof(float);
  static_assert(k % 4 == 0 && stage % 4 == 0 && ds % 4 == 0 && vec % 4 == 0, "16-byte rows");
};

// ---- small device helpers ---------------------------------------------------------------------

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

__device__ __forceinline__ float lane_of(const float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

// acc += a * b, componentwise.
__device__ __forceinline__ void fma4(float4& acc, float a, const float4& b) {
  acc.x = fmaf(a, b.x, acc.x);
  acc.y = fmaf(a, b.y, acc.y);
  acc.z = fmaf(a, b.z, acc.z);
  acc.w = fmaf(a, b.w, acc.w);
}

// N consecutive floats from shared memory at p (aligned to min(N, 4) floats).
template <int N>
__device__ __forceinline__ void load_run(float (&v)[N], const float* p) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4) {
      const float4 x = ld4(p + j);
      v[j] = x.x, v[j + 1] = x.y, v[j + 2] = x.z, v[j + 3] = x.w;
    }
  } else if constexpr (N == 2) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    v[0] = x.x, v[1] = x.y;
  } else {
    v[0] = p[0];
  }
}

// ---- the score step: S, dP, then P, dS ---------------------------------------------------------

// acc (RM, RK) = this thread's query rows of a . its key rows of b, over
// HDP features in order: a is (BM, LDA), b is (BN, LDB).
template <class Score, int HDP, int LDA, int LDB>
__device__ __forceinline__ void row_dots(float (&acc)[Score::RM][Score::RK], const float* a, const float* b, int warp,
                                         int lane) {
  constexpr int RM = Score::RM, RK = Score::RK;
  const float* ar = a + Score::row(warp, lane) * LDA;  // query r at ar + 4 r LDA
  const float* br = b + Score::key(warp, lane) * LDB;  // key c at br + 8 c LDB
#pragma unroll
  for (int r = 0; r < RM; ++r) {
#pragma unroll
    for (int c = 0; c < RK; ++c) acc[r][c] = 0.0f;
  }
  // Rolled (as the gradient steps' loops, mostly): unrolled, the loads
  // hoisted ahead of their products take the larger tilings past 128
  // registers and into spills (ptxas -v).
#pragma unroll 1
  for (int f = 0; f < HDP; f += 4) {
    float4 x[RM], y[RK];
#pragma unroll
    for (int r = 0; r < RM; ++r) x[r] = ld4(ar + 4 * r * LDA + f);
#pragma unroll
    for (int c = 0; c < RK; ++c) y[c] = ld4(br + 8 * c * LDB + f);
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int c = 0; c < RK; ++c) {
        float s = acc[r][c];
        s = fmaf(x[r].x, y[c].x, s);
        s = fmaf(x[r].y, y[c].y, s);
        s = fmaf(x[r].z, y[c].z, s);
        acc[r][c] = fmaf(x[r].w, y[c].w, s);
      }
  }
}

// In place: s (q . k) -> P = 2^(scale_log2 s - lse2), dp -> dS = P (dp - delta);
// both zero where the query (q0 + row) or the key (k0 + key) is >= L. lse2
// (hi, lo: detail/lse.cuh), delta: the tile's queries, from shared memory. kDropout: P -> P M scale
// and dS = P (dp M scale - delta), M drawn an element at a time (e_tile:
// the element of query q0, key k0).
template <class Score, bool kDropout>
__device__ __forceinline__ void softmax_grad(float (&s)[Score::RM][Score::RK], float (&dp)[Score::RM][Score::RK],
                                             const float* lse, const float* lse_lo, const float* delta, float scale_log2,
                                             int q0, int k0, int L, int warp, int lane, const DropoutParams& drop,
                                             uint64_t e_tile) {
  const int m0 = Score::row(warp, lane), n0 = Score::key(warp, lane);
#pragma unroll
  for (int r = 0; r < Score::RM; ++r) {
    const int m = m0 + 4 * r;
    const bool q_in = q0 + m < L;
    const float hi = lse[m], lo = lse_lo[m], delta_m = delta[m];
#pragma unroll
    for (int c = 0; c < Score::RK; ++c) {
      const bool in = q_in && k0 + n0 + 8 * c < L;
      const float p = in ? prob_from_lse2(s[r][c], scale_log2, hi, lo) : 0.0f;
      if constexpr (kDropout) {
        const uint64_t e = e_tile + (uint64_t)m * (uint64_t)L + (uint64_t)(n0 + 8 * c);
        const float mk = dropout_keep_drawn(drop, e) ? drop.scale : 0.0f;
        dp[r][c] = in ? p * fmaf(mk, dp[r][c], -delta_m) : 0.0f;
        s[r][c] = p * mk;
      } else {
        dp[r][c] = in ? p * (dp[r][c] - delta_m) : 0.0f;
        s[r][c] = p;
      }
    }
  }
}

// This thread's elements of a score tile into dst (BM, ldp).
template <class Score>
__device__ __forceinline__ void store_scores(float* dst, const float (&v)[Score::RM][Score::RK], int warp, int lane) {
  float* d = dst + Score::row(warp, lane) * Score::ldp + Score::key(warp, lane);
#pragma unroll
  for (int r = 0; r < Score::RM; ++r)
#pragma unroll
    for (int c = 0; c < Score::RK; ++c) d[4 * r * Score::ldp + 8 * c] = v[r][c];
}

// ---- the gradient steps --------------------------------------------------------------------------

template <class Grad>
using GradAcc = float4[Grad::RR][Grad::RC];

template <class Grad>
__device__ __forceinline__ void zero(GradAcc<Grad>& g) {
#pragma unroll
  for (int r = 0; r < Grad::RR; ++r)
#pragma unroll
    for (int c = 0; c < Grad::RC; ++c) g[r][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// dv += P^T d_o and dk += dS^T q over one tile's BM queries, in order, for
// this thread's keys and features: p and ds are (BM, LDP) (queries x keys),
// d_o and q (BM, LDQ). Queries >= L add zeros (P, dS and their rows are 0).
template <class Grad, int BM, int LDP, int LDQ>
__device__ __forceinline__ void key_grads(GradAcc<Grad>& dv, GradAcc<Grad>& dk, const float* p, const float* ds,
                                          const float* d_o, const float* q, int warp, int lane) {
  constexpr int RR = Grad::RR, RC = Grad::RC, LX = Grad::LX;
  const int n0 = Grad::row(warp, lane), f0 = Grad::feature(warp, lane);
#pragma unroll 2
  for (int i = 0; i < BM; ++i) {
    float pr[RR], dr[RR];
    load_run(pr, p + i * LDP + n0);
    load_run(dr, ds + i * LDP + n0);
#pragma unroll
    for (int c = 0; c < RC; ++c) {
      const float4 g = ld4(d_o + i * LDQ + f0 + 4 * LX * c), x = ld4(q + i * LDQ + f0 + 4 * LX * c);
#pragma unroll
      for (int r = 0; r < RR; ++r) {
        fma4(dv[r][c], pr[r], g);
        fma4(dk[r][c], dr[r], x);
      }
    }
  }
}

// dq += dS k over one tile's BN keys, in order, for this thread's queries
// and features: ds is (BM, LDP) (queries x keys), k (BN, LDK). Keys >= L
// add zeros.
template <class Grad, int BN, int LDP, int LDK>
__device__ __forceinline__ void query_grads(GradAcc<Grad>& dq, const float* ds, const float* k, int warp, int lane) {
  constexpr int RR = Grad::RR, RC = Grad::RC, LX = Grad::LX;
  const int m0 = Grad::row(warp, lane), f0 = Grad::feature(warp, lane);
#pragma unroll 1
  for (int n = 0; n < BN; n += 4) {
    float4 d[RR];
#pragma unroll
    for (int r = 0; r < RR; ++r) d[r] = ld4(ds + (m0 + r) * LDP + n);
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int c = 0; c < RC; ++c) {
        const float4 kv = ld4(k + (n + e) * LDK + f0 + 4 * LX * c);
#pragma unroll
        for (int r = 0; r < RR; ++r) fma4(dq[r][c], lane_of(d[r], e), kv);
      }
  }
}

// factor * g into the gradient rows of positions p0 + row() + r < L,
// features < hd: dst is one head's column 0 of one part ([dq | dk | dv]) in
// row 0 of dqkv.
template <class Grad, bool kVec>
__device__ __forceinline__ void store_grads(float* dst, const GradAcc<Grad>& g, float factor, int64_t row_words,
                                            const Head& hp, int p0, int warp, int lane) {
  const int n0 = Grad::row(warp, lane), f0 = Grad::feature(warp, lane);
#pragma unroll
  for (int r = 0; r < Grad::RR; ++r) {
    const int l = p0 + n0 + r;
    if (l >= hp.L) continue;
    float* out = dst + (hp.first + (int64_t)l * hp.stride) * row_words;
#pragma unroll
    for (int c = 0; c < Grad::RC; ++c) {
      const int f = f0 + 4 * Grad::LX * c;
      if (f >= hp.hd) continue;
      const float4 v = make_float4(factor * g[r][c].x, factor * g[r][c].y, factor * g[r][c].z, factor * g[r][c].w);
      if constexpr (kVec) {
        *reinterpret_cast<float4*>(out + f) = v;  // hd % 4 == 0: runs lie wholly inside
      } else {
        out[f] = v.x;
        if (f + 1 < hp.hd) out[f + 1] = v.y;
        if (f + 2 < hp.hd) out[f + 2] = v.z;
        if (f + 3 < hp.hd) out[f + 3] = v.w;
      }
    }
  }
}

// ---- the kernels -------------------------------------------------------------------------------

// dk and dv of BN keys (tile hp.tile) of one (sequence, head). kDropout:
// dpass applies (threshold != 0).
template <int HDP, bool kVec, bool kDropout>
__global__ void __launch_bounds__(kThreads)
    key_grads_kernel(const KernelArgs a, float scale, int key_tiles, const DropoutPass dpass) {
  using Score = typename Tiles<HDP>::KvScore;
  using Grad = typename Tiles<HDP>::KvGrad;
  using S = KvSmem<HDP>;
  constexpr int BM = S::BM, BN = S::BN, ST = S::ST;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hp = block_head(a, key_tiles);
  const int k0 = hp.tile * BN;
  zero_padding<S::ldk, HDP>(sm + S::k, 2 * BN, hp.hd, kThreads);       // k, v
  zero_padding<S::ldq, HDP>(sm + S::q, 2 * ST * BM, hp.hd, kThreads);  // every stage's q, d_o

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;               // floats a row of qkv and dqkv
  const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
  const float* dog = a.d_o + (int64_t)hp.h * hp.hd;
  const float* lse = a.lse + hp.item * hp.L;  // hi; lo at + rows (detail/lse.cuh)
  const float* lse_lo = lse + a.pos.num_seq * a.heads * hp.L;
  const float* delta = a.delta + hp.item * hp.L;
  const float scale_log2 = scale * tc::kLog2e;  // as the tensor-core launch's
  // Dropout: seed and offset as a preceding kernel wrote them; e_head is the
  // element of (query 0, key 0).
  DropoutParams drop;
  uint64_t e_head = 0;
  if constexpr (kDropout) {
    drop = dropout_read(dpass);
    e_head = dpass.base + (uint64_t)hp.item * (uint64_t)hp.L * (uint64_t)hp.L;
  }
  const auto load_queries = [&](int stage, int q0) {
    float* qs = sm + S::q + stage * S::stage;
    float* vs = sm + S::vec + stage * 3 * BM;
    copy_rows<S::ldq, HDP, kVec>(qs, qg, W, hp, q0, BM, kThreads);
    copy_rows<S::ldq, HDP, kVec>(qs + BM * S::ldq, dog, a.D, hp, q0, BM, kThreads);
    copy_positions(vs, lse, q0, BM, hp.L, kThreads);
    copy_positions(vs + BM, lse_lo, q0, BM, hp.L, kThreads);
    copy_positions(vs + 2 * BM, delta, q0, BM, hp.L, kThreads);
  };
  copy_rows<S::ldk, HDP, kVec>(sm + S::k, qg + a.D, W, hp, k0, BN, kThreads);
  copy_rows<S::ldk, HDP, kVec>(sm + S::v, qg + 2 * a.D, W, hp, k0, BN, kThreads);
  load_queries(0, 0);
  copy_async_commit();

  GradAcc<Grad> dk, dv;
  zero<Grad>(dk);
  zero<Grad>(dv);
  const int q_tiles = (hp.L + BM - 1) / BM;
  for (int i = 0; i < q_tiles; ++i) {
    copy_async_wait<0>();  // this thread's copies of tile i (and of k, v)
    // Every thread's copies of tile i are in, and every thread is done with
    // tile i - 1 (its P, dS and, with two stages, the stage copied next).
    __syncthreads();
    if constexpr (ST == 2) {
      if (i + 1 < q_tiles) {
        load_queries((i + 1) & 1, (i + 1) * BM);
        copy_async_commit();
      }
    }
    const int st = ST == 2 ? (i & 1) : 0;
    const float* q = sm + S::q + st * S::stage;  // q is (BM, HDP), d_o (BM, HDP) after it
    const float* d_o = q + BM * S::ldq;
    const float* lse_s = sm + S::vec + st * 3 * BM;  // hi, then lo, then delta

    float s[Score::RM][Score::RK], dp[Score::RM][Score::RK];
    row_dots<Score, HDP, S::ldq, S::ldk>(s, q, sm + S::k, warp, lane);     // q k^T
    row_dots<Score, HDP, S::ldq, S::ldk>(dp, d_o, sm + S::v, warp, lane);  // d_o v^T
    softmax_grad<Score, kDropout>(s, dp, lse_s, lse_s + BM, lse_s + 2 * BM, scale_log2, i * BM, k0, hp.L, warp, lane,
                                  drop,
                                  e_head + (uint64_t)(i * BM) * (uint64_t)hp.L + (uint64_t)k0);
    store_scores<Score>(sm + S::p, s, warp, lane);
    store_scores<Score>(sm + S::ds, dp, warp, lane);
    __syncthreads();  // P and dS (BM, BN) complete
    key_grads<Grad, BM, S::ldp, S::ldq>(dv, dk, sm + S::p, sm + S::ds, d_o, q, warp, lane);
    if constexpr (ST == 1) {
      if (i + 1 < q_tiles) {
        __syncthreads();  // every thread done with the stage
        load_queries(0, (i + 1) * BM);
        copy_async_commit();
      }
    }
  }
  float* out = a.dqkv + (int64_t)hp.h * hp.hd;  // head h's dq columns; dk at + D, dv at + 2D
  store_grads<Grad, kVec>(out + a.D, dk, scale, W, hp, k0, warp, lane);
  store_grads<Grad, kVec>(out + 2 * a.D, dv, 1.0f, W, hp, k0, warp, lane);
}

// dq of BM queries (tile hp.tile) of one (sequence, head). kDropout: dpass
// applies (threshold != 0).
template <int HDP, bool kVec, bool kDropout>
__global__ void __launch_bounds__(kThreads)
    query_grads_kernel(const KernelArgs a, float scale, int query_tiles, const DropoutPass dpass) {
  using Score = typename Tiles<HDP>::QScore;
  using Grad = typename Tiles<HDP>::QGrad;
  using S = QSmem<HDP>;
  constexpr int BM = S::BM, BN = S::BN, ST = S::ST;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hp = block_head(a, query_tiles);
  const int q0 = hp.tile * BM;
  zero_padding<S::ldq, HDP>(sm + S::q, 2 * BM, hp.hd, kThreads);       // q, d_o
  zero_padding<S::ldk, HDP>(sm + S::k, 2 * ST * BN, hp.hd, kThreads);  // every stage's k, v

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;
  const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
  const auto load_keys = [&](int stage, int k0) {
    float* ks = sm + S::k + stage * S::stage;
    copy_rows<S::ldk, HDP, kVec>(ks, qg + a.D, W, hp, k0, BN, kThreads);
    copy_rows<S::ldk, HDP, kVec>(ks + BN * S::ldk, qg + 2 * a.D, W, hp, k0, BN, kThreads);
  };
  copy_rows<S::ldq, HDP, kVec>(sm + S::q, qg, W, hp, q0, BM, kThreads);
  copy_rows<S::ldq, HDP, kVec>(sm + S::d_o, a.d_o + (int64_t)hp.h * hp.hd, a.D, hp, q0, BM, kThreads);
  // lse2 hi, lo (detail/lse.cuh), delta.
  copy_positions(sm + S::vec, a.lse + hp.item * hp.L, q0, BM, hp.L, kThreads);
  copy_positions(sm + S::vec + BM, a.lse + (a.pos.num_seq * a.heads + hp.item) * hp.L, q0, BM, hp.L, kThreads);
  copy_positions(sm + S::vec + 2 * BM, a.delta + hp.item * hp.L, q0, BM, hp.L, kThreads);
  const float scale_log2 = scale * tc::kLog2e;  // as the tensor-core launch's
  load_keys(0, 0);
  copy_async_commit();
  // Dropout: as in key_grads_kernel; e_tile is the element of (query q0, key 0).
  DropoutParams drop;
  uint64_t e_tile = 0;
  if constexpr (kDropout) {
    drop = dropout_read(dpass);
    e_tile = dpass.base + ((uint64_t)hp.item * (uint64_t)hp.L + (uint64_t)q0) * (uint64_t)hp.L;
  }

  GradAcc<Grad> dq;
  zero<Grad>(dq);
  const int k_tiles = (hp.L + BN - 1) / BN;
  for (int j = 0; j < k_tiles; ++j) {
    copy_async_wait<0>();
    __syncthreads();  // as in key_grads_kernel: tile j in, tile j - 1 done
    if constexpr (ST == 2) {
      if (j + 1 < k_tiles) {
        load_keys((j + 1) & 1, (j + 1) * BN);
        copy_async_commit();
      }
    }
    const float* k = sm + S::k + (ST == 2 ? (j & 1) : 0) * S::stage;  // k is (BN, HDP), v (BN, HDP) after it
    const float* v = k + BN * S::ldk;

    float s[Score::RM][Score::RK], dp[Score::RM][Score::RK];
    row_dots<Score, HDP, S::ldq, S::ldk>(s, sm + S::q, k, warp, lane);
    row_dots<Score, HDP, S::ldq, S::ldk>(dp, sm + S::d_o, v, warp, lane);
    softmax_grad<Score, kDropout>(s, dp, sm + S::vec, sm + S::vec + BM, sm + S::vec + 2 * BM, scale_log2, q0, j * BN,
                                  hp.L, warp, lane, drop,
                                  e_tile + (uint64_t)(j * BN));
    store_scores<Score>(sm + S::ds, dp, warp, lane);
    __syncthreads();  // dS (BM, BN) complete
    query_grads<Grad, BN, S::ldp, S::ldk>(dq, sm + S::ds, k, warp, lane);
    if constexpr (ST == 1) {
      if (j + 1 < k_tiles) {
        __syncthreads();
        load_keys(0, (j + 1) * BN);
        copy_async_commit();
      }
    }
  }
  store_grads<Grad, kVec>(a.dqkv + (int64_t)hp.h * hp.hd, dq, scale, W, hp, q0, warp, lane);
}

}  // namespace ffma

// ---- host side ---------------------------------------------------------------------------------

// The padded head dim that serves head_dim (0: none).
int padded_head_dim(int64_t head_dim) { return flash_padded_head_dim(head_dim); }

template <int HDP>
constexpr size_t tc_smem_bytes() {
  return std::max(tc::KvTc<HDP>::bytes(tc::KvTc<HDP>::BN), tc::QTc<HDP>::bytes(tc::QTc<HDP>::BM));
}

template <int HDP>
constexpr size_t ffma_smem_bytes() {
  return std::max(ffma::KvSmem<HDP>::bytes, ffma::QSmem<HDP>::bytes);
}

template <int HDP>
constexpr size_t smem_bytes(bool ffma) {
  return ffma ? ffma_smem_bytes<HDP>() : tc_smem_bytes<HDP>();
}

template <auto kernel, typename... Args>
cudaError_t launch_grid(int64_t blocks, int threads, size_t smem, const DeviceCaps& dev, cudaStream_t stream,
                        Args... args) {
  if (smem > 48 * 1024)
    if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(threads), smem, stream, dev, args...);
}

// The sizes every launch of one call shares, and the kernels' arguments.
struct Launch {
  int64_t items;  // num_seq * heads
  int hd;
  bool vec;     // 16-byte copies and stores
  float scale;  // 1 / sqrt(hd)
  KernelArgs k;
  DropoutPass dpass;  // with kDropout
};

// The tile counts of the launch's two gradient kernels; false where a grid
// would pass gridDim.x's 2^31 - 1.
bool tile_counts(int64_t num_seq, int64_t heads, int64_t L, int key_rows, int query_rows, int* key_tiles,
                 int* query_tiles) {
  *key_tiles = (int)((L + key_rows - 1) / key_rows);
  *query_tiles = (int)((L + query_rows - 1) / query_rows);
  return num_seq <= INT32_MAX / ((int64_t)heads * std::max(*key_tiles, *query_tiles));
}

// delta, a warp per position: enough blocks to fill the device a few times
// over, grid-stride beyond.
cudaError_t launch_delta(const AttentionBackwardArgs& a, const Launch& s, const DeviceCaps& dev, cudaStream_t stream) {
  const int64_t rows = a.pos.num_seq * a.pos.len;
  const int64_t blocks = std::min<int64_t>((rows + kDeltaWarps - 1) / kDeltaWarps, 1 << 20);
  // float4 reads where every row of d_o and o starts 16-byte aligned and
  // heads start at multiples of 4 floats.
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = s.hd % 4 == 0 && aligned16(a.d_o) && aligned16(a.o);
  return vec ? launch_kernel<delta_kernel<true>>(dim3((unsigned)blocks), dim3(32 * kDeltaWarps), 0, stream, dev, s.k)
             : launch_kernel<delta_kernel<false>>(dim3((unsigned)blocks), dim3(32 * kDeltaWarps), 0, stream, dev, s.k);
}

// Warps along a tensor-core kernel's block rows (16 rows each), at most
// `most`: halved while half of them would still cover the sequence (no
// warp without rows), then while the grid (items x tiles) would not cover
// the device twice over (small blocks spread a small problem over more
// multiprocessors; each re-reads the streamed side, from L2).
int tc_row_warps(int most, int64_t L, int64_t items, int sms) {
  int w = most;
  while (w > 1 && 16 * (w / 2) >= L) w /= 2;
  while (w > 1 && items * ((L + 16 * w - 1) / (16 * w)) < 2 * (int64_t)sms) w /= 2;
  return w;
}

// The splits of a tensor-core launch at padded head dim HDP (AttentionBackwardArgs::partials):
// the rule's (or the hook's), where the caller gave room for their partials; at most the fewest
// tiles a kernel streams, so that no split's range is empty; and the partials below 2^31 floats
// (combine_kernel's int indices). 1: no split.
template <int HDP>
int tc_splits(const AttentionBackwardArgs& a, const DeviceCaps& dev) {
  // The rule's copy of the dk, dv kernel's blocks an SM and rows a block (smem_layout.h).
  static_assert(attention_grad_blocks_per_sm(HDP) == tc::KvTc<HDP>::min_blocks, "the split rule's blocks an SM");
  static_assert(attention_grad_block_rows(HDP) == tc::KvTc<HDP>::BN, "the split rule's rows a block");
  // The partials take float2 stores (16-byte aligned, as the plan's regions are).
  if (a.partials == nullptr || reinterpret_cast<uintptr_t>(a.partials) % 16 != 0) return 1;
  const int64_t L = a.pos.len, hd = a.D / a.heads, rows = a.pos.num_seq * a.heads * L;
  int64_t S = a.splits > 0 ? a.splits : attention_grad_splits(a.pos.num_seq, L, hd, a.heads, dev.sms);
  constexpr int64_t kTile = std::max({tc::KvTc<HDP>::BM, tc::QTc<HDP>::BN, tc::DsTc<HDP>::BN});  // the widest streamed
  const int64_t fewest_tiles = (L + kTile - 1) / kTile;
  S = std::min(S, fewest_tiles);
  if (S < 2 || rows > INT32_MAX / (2 * hd) / S) return 1;
  return a.partials_bytes >= attention_grad_partials_floats((int)S, rows, hd) * sizeof(float) ? (int)S : 1;
}

// combine_kernel after a split launch: enough blocks to cover the device a few times, grid-stride.
cudaError_t launch_combine(const KernelArgs& k, const Split& sp, int parts, int first_part, const DeviceCaps& dev,
                           cudaStream_t stream) {
  const int64_t floats = k.pos.num_seq * k.heads * k.pos.len * parts * (k.D / k.heads);
  const int64_t blocks = std::min<int64_t>((floats + 255) / 256, 8 * (int64_t)dev.sms);
  return launch_kernel<tc::combine_kernel>(dim3((unsigned)blocks), dim3(256), 0, stream, dev, k, sp, parts,
                                           first_part);
}

// dk, dv then dq on the tensor cores for padded head dim HDP; split over S = tc_splits blocks
// a tile, with a combine after each side, where S > 1.
template <int HDP, bool kVec, bool kDropout>
cudaError_t launch_tc(const AttentionBackwardArgs& a, const Launch& s, const DeviceCaps& dev, cudaStream_t stream) {
  using Kv = tc::KvTc<HDP>;
  using Q = tc::QTc<HDP>;
  using Ds = tc::DsTc<HDP>;
  const int64_t L = a.pos.len;
  const Split sp = {a.partials, tc_splits<HDP>(a, dev)};
  const bool split = sp.splits > 1;
  // A split launch keeps the largest blocks (the split gives the device its blocks), else
  // small problems take smaller ones (tc_row_warps).
  const int key_warps = split ? Kv::KW : tc_row_warps(Kv::KW, L, s.items, dev.sms),
            query_warps = split ? Q::QW : tc_row_warps(Q::QW, L, s.items, dev.sms);
  int key_tiles, query_tiles;
  if (!tile_counts(a.pos.num_seq, a.heads * sp.splits, L, 16 * key_warps, 16 * query_warps, &key_tiles,
                   &query_tiles))
    return cudaErrorInvalidValue;
  if (cudaError_t e = launch_delta(a, s, dev, stream); e != cudaSuccess) return e;
  const float scale_log2 = s.scale * tc::kLog2e;
  // dq from kernel 2's dS^T where the caller gave the scratch and its tiles fit the device.
  KernelArgs k = s.k;
  k.ds = a.ds != nullptr && Ds::bytes <= (size_t)dev.smem_optin ? a.ds : nullptr;
  if (cudaError_t e = launch_grid<tc::key_grads_kernel<HDP, kVec, kDropout>>(
          s.items * key_tiles * sp.splits, 32 * Kv::FW * key_warps, Kv::bytes(16 * key_warps), dev, stream, k,
          s.scale, scale_log2, key_tiles, sp, s.dpass);
      e != cudaSuccess)
    return e;
  if (split)
    if (cudaError_t e = launch_combine(k, sp, 2, 1, dev, stream); e != cudaSuccess) return e;
  cudaError_t e;
  if (k.ds != nullptr) {
    const int ds_warps = split ? Ds::QW : tc_row_warps(Ds::QW, L, s.items, dev.sms);
    const int ds_tiles = (int)((L + 16 * ds_warps - 1) / (16 * ds_warps));  // <= query_tiles: tile_counts bounds it
    e = launch_grid<tc::query_grads_ds_kernel<HDP, kVec>>(s.items * ds_tiles * sp.splits, 32 * ds_warps, Ds::bytes,
                                                          dev, stream, k, s.scale, ds_tiles, sp);
  } else if (HDP == 32 && query_grads_wgmma_applies(a, dev)) {  // never with a split
    e = query_grads_wgmma(a, kVec, s.scale, s.dpass, dev, stream);
  } else {
    e = launch_grid<tc::query_grads_kernel<HDP, kVec, kDropout>>(s.items * query_tiles * sp.splits, 32 * query_warps,
                                                                 Q::bytes(16 * query_warps), dev, stream, s.k, s.scale,
                                                                 scale_log2, query_tiles, sp, s.dpass);
  }
  if (e != cudaSuccess || !split) return e;
  return launch_combine(k, sp, 1, 0, dev, stream);
}

// dk, dv then dq on the FFMA kernels for padded head dim HDP.
template <int HDP, bool kVec, bool kDropout>
cudaError_t launch_ffma(const AttentionBackwardArgs& a, const Launch& s, const DeviceCaps& dev, cudaStream_t stream) {
  using Kv = ffma::KvSmem<HDP>;
  using Q = ffma::QSmem<HDP>;
  int key_tiles, query_tiles;
  if (!tile_counts(a.pos.num_seq, a.heads, a.pos.len, Kv::BN, Q::BM, &key_tiles, &query_tiles))
    return cudaErrorInvalidValue;
  if (cudaError_t e = launch_delta(a, s, dev, stream); e != cudaSuccess) return e;
  if (cudaError_t e = launch_grid<ffma::key_grads_kernel<HDP, kVec, kDropout>>(
          s.items * key_tiles, ffma::kThreads, Kv::bytes, dev, stream, s.k, s.scale, key_tiles, s.dpass);
      e != cudaSuccess)
    return e;
  return launch_grid<ffma::query_grads_kernel<HDP, kVec, kDropout>>(s.items * query_tiles, ffma::kThreads, Q::bytes,
                                                                    dev, stream, s.k, s.scale, query_tiles, s.dpass);
}

// The three launches for padded head dim HDP: the tensor-core path unless
// asked for the FFMA one or its tiles do not fit the device.
template <int HDP>
cudaError_t launch_backward(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  const bool ffma = a.ffma || tc_smem_bytes<HDP>() > (size_t)dev.smem_optin;
  if (ffma && ffma_smem_bytes<HDP>() > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  Launch s;
  s.items = a.pos.num_seq * a.heads;
  s.hd = a.D / a.heads;
  // 16-byte copies and stores where every head slice of every row starts
  // 16-byte aligned: hd % 4 == 0 makes D % 4 == 0 too.
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  s.vec = s.hd % 4 == 0 && aligned16(a.qkv) && aligned16(a.d_o) && aligned16(a.dqkv);
  s.scale = 1.0f / sqrtf((float)s.hd);
  s.k = {a.pos, a.qkv, a.o, a.d_o, a.lse, a.delta, a.dqkv, a.D, a.heads, nullptr};
  if constexpr (kDropoutAvailable) {
    if (a.dropout.threshold != 0) {
      s.dpass = dropout_pass(a.dropout, a.pass, a.philox);
      if (ffma)
        return s.vec ? launch_ffma<HDP, true, true>(a, s, dev, stream)
                     : launch_ffma<HDP, false, true>(a, s, dev, stream);
      return s.vec ? launch_tc<HDP, true, true>(a, s, dev, stream) : launch_tc<HDP, false, true>(a, s, dev, stream);
    }
  }
  if (ffma)
    return s.vec ? launch_ffma<HDP, true, false>(a, s, dev, stream) : launch_ffma<HDP, false, false>(a, s, dev, stream);
  return s.vec ? launch_tc<HDP, true, false>(a, s, dev, stream) : launch_tc<HDP, false, false>(a, s, dev, stream);
}

// Sequences of one position: the softmax over one key is 1 whatever the
// score, so dS = P o (dP - rowsum(d_o o o)) = 0 exactly (o = v f, dP = d_o . v
// f, f the keep mask's scale or 0): dq = dk = 0 and dv = d_o f. A warp per
// item (n heads + h), lanes over its columns; the tiled kernels would run
// all their products on 1-row tiles (the column pass of a (B, 1, W) grid).
// Where dS^T scratch is given, its one element a row is stored (0), as the
// tiled kernels store theirs.
constexpr int kSingleKeyThreads = 256;

template <bool kDropout>
__global__ void __launch_bounds__(kSingleKeyThreads)
    single_key_backward_kernel(const KernelArgs a, const DropoutPass dpass) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int hd = a.D / a.heads, lane = threadIdx.x % 32;
  const int64_t item = (int64_t)blockIdx.x * (kSingleKeyThreads / 32) + threadIdx.x / 32;
  if (item >= a.pos.num_seq * a.heads) return;
  const int h = (int)(item % a.heads);
  const int64_t row = a.pos.offset(item / a.heads, 0);
  const float* d_o = a.d_o + row * a.D + (int64_t)h * hd;
  float* dq = a.dqkv + row * 3 * a.D + (int64_t)h * hd;  // dk at + D, dv at + 2D
  float f = 1.0f;
  if constexpr (kDropout) f = dropout_keep(dropout_read(dpass), dpass.base + (uint64_t)item) ? dpass.scale : 0.0f;
  for (int c = lane; c < hd; c += 32) {
    dq[c] = 0.0f;
    dq[a.D + c] = 0.0f;
    dq[2 * a.D + c] = d_o[c] * f;
  }
  if (a.ds && lane == 0) a.ds[item * attention_scores_stride(1)] = 0.0f;
}

// A template so that a build without Random123 never instantiates the dropout kernel.
template <typename = void>
cudaError_t launch_single_key(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  const KernelArgs k = {a.pos, a.qkv, a.o, a.d_o, a.lse, a.delta, a.dqkv, a.D, a.heads, a.ds};
  const int64_t items = a.pos.num_seq * a.heads;
  const int64_t blocks = (items + kSingleKeyThreads / 32 - 1) / (kSingleKeyThreads / 32);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)blocks);
  if constexpr (kDropoutAvailable)
    if (a.dropout.threshold != 0)
      return launch_kernel<single_key_backward_kernel<true>>(grid, dim3(kSingleKeyThreads), 0, stream, dev, k,
                                                             dropout_pass(a.dropout, a.pass, a.philox));
  return launch_kernel<single_key_backward_kernel<false>>(grid, dim3(kSingleKeyThreads), 0, stream, dev, k,
                                                          DropoutPass{});
}

// Dropout's arguments, where it applies: the {seed, offset} pair given, and
// the mask's sizes those of this pass (its elements are numbered by them).
bool dropout_args_ok(const AttentionBackwardArgs& a) {
  if (a.dropout.threshold == 0) return true;
  return kDropoutAvailable && a.philox != nullptr && (a.pass == 0 || a.pass == 1) &&
         a.dropout.len[a.pass] == (uint64_t)a.pos.len && a.dropout.heads == (uint64_t)a.heads;
}

}  // namespace

bool attention_backward_supports(int64_t head_dim) { return padded_head_dim(head_dim) != 0; }

int attention_backward_splits(const AttentionBackwardArgs& a, const DeviceCaps& dev) {
  if (a.heads <= 0 || a.D <= 0 || a.D % a.heads != 0 || a.pos.num_seq <= 0 || a.pos.len <= 0 ||
      a.pos.len >= kMaxLen)
    return 1;
  const int64_t hd = a.D / a.heads;
  if (a.ffma || attention_backward_smem_bytes(hd) > (size_t)dev.smem_optin) return 1;  // the FFMA kernels
  return with_padded_head_dim(padded_head_dim(hd), [&](auto h) { return tc_splits<decltype(h)::value>(a, dev); }, 1);
}

size_t attention_backward_smem_bytes(int64_t head_dim, bool ffma) {
  return with_padded_head_dim(
      padded_head_dim(head_dim), [&](auto h) { return smem_bytes<decltype(h)::value>(ffma); }, size_t{0});
}

cudaError_t attention_backward(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  if (a.heads <= 0 || a.D <= 0 || a.D % a.heads != 0 || a.pos.num_seq < 0 || a.pos.len < 0 || a.pos.len >= kMaxLen)
    return cudaErrorInvalidValue;
  const int hdp = padded_head_dim(a.D / a.heads);
  if (hdp == 0 || !dropout_args_ok(a)) return cudaErrorInvalidValue;
  if (a.pos.num_seq == 0 || a.pos.len == 0) return cudaSuccess;
  if (a.pos.len == 1) return launch_single_key(a, dev, stream);
  return with_padded_head_dim(
      hdp, [&](auto h) { return launch_backward<decltype(h)::value>(a, dev, stream); }, cudaErrorInvalidValue);
}

}  // namespace fastaxial::cuda
