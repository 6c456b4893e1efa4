// The device parts of the attention backward's kernels (attention_backward.cu describes the
// whole): the block's (sequence, head) and tile, the copies into shared memory and the walk over
// the streamed tiles (stream_tiles) shared by the tensor-core and FFMA kernels, and the
// tensor-core kernels' tiles, fragments, products, softmax gradient, kernel 2's dropout and
// stores (backward_dkdv.cu: kernel 2, backward_dq.cu: kernel 3).
//
// Kernels 2 and 3 on the tensor cores (namespace tc): every product on
// mma.sync m16n8k8 with the 3xTF32 split of detail/tf32x3.cuh,
// fp32-accurate as the forward (the products' element traits are a template
// argument, Elem, of the parts and kernels; the launchers take Tf32x3). A warp owns 16 rows of
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
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/kernel_args.h"
#include "../detail/lse.cuh"
#include "../detail/tf32x3.cuh"
#include "backward_launch.cuh"  // Split

namespace fastaxial::cuda::attention_backward_detail {

// ---- shared by both paths ---------------------------------------------------------------------

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

__device__ __forceinline__ Head block_head(const AttentionBackwardKernelArgs& a, int tiles, int splits = 1) {
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

// The slices of head hp that kernel 2 reads (both versions): q's columns of qkv (k at + D, v at
// + 2D), d_o's, and the (sequence, head)'s rows of lse (hi, lo: detail/lse.cuh) and delta.
struct KeySideSlices {
  const float *q, *d_o, *lse, *lse_lo, *delta;
};

__device__ __forceinline__ KeySideSlices key_side_slices(const AttentionBackwardKernelArgs& a, const Head& hp) {
  KeySideSlices s;
  s.q = a.qkv + (int64_t)hp.h * hp.hd;
  s.d_o = a.d_o + (int64_t)hp.h * hp.hd;
  s.lse = a.lse + hp.item * hp.L;
  s.lse_lo = s.lse + a.pos.num_seq * a.heads * hp.L;
  s.delta = a.delta + hp.item * hp.L;
  return s;
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

// k and v of positions p0 .. p0 + rows - 1 of one head into dst (rows, LD), v's rows after k's:
// q is the head's q columns in row 0 of qkv (rows of W floats; k at + D, v at + 2D).
template <int LD, int HDP, bool kVec>
__device__ __forceinline__ void copy_key_rows(float* dst, const float* q, int64_t W, int D, const Head& hp, int p0,
                                              int rows, int threads) {
  copy_rows<LD, HDP, kVec>(dst, q + D, W, hp, p0, rows, threads);
  copy_rows<LD, HDP, kVec>(dst + rows * LD, q + 2 * D, W, hp, p0, rows, threads);
}

// The streamed tiles range.x .. range.y - 1 through ST stages of shared memory: load(stage, i)
// issues tile i's copies (the first tile's are the caller's, committed before), body(i, stage)
// uses tile i. Two stages: tile i + 1's copy overlaps tile i's work, issued once every warp is
// done with tile i - 1, whose stage it takes; one stage: it waits for every warp to finish.
template <int ST, class Load, class Body>
__device__ __forceinline__ void stream_tiles(int2 range, Load&& load, Body&& body) {
  for (int i = range.x; i < range.y; ++i) {
    copy_async_wait<0>();  // this thread's copies of tile i (and of the block's fixed rows)
    // Every thread's copies of tile i are in, and every warp is done with
    // tile i - 1 (with two stages, the stage copied next).
    __syncthreads();
    if constexpr (ST == 2) {
      if (i + 1 < range.y) {
        load((i + 1 - range.x) & 1, i + 1);
        copy_async_commit();
      }
    }
    body(i, ST == 2 ? ((i - range.x) & 1) : 0);
    if constexpr (ST == 1) {
      if (i + 1 < range.y) {
        __syncthreads();  // every warp done with the stage
        load(0, i + 1);
        copy_async_commit();
      }
    }
  }
}

// ---- the tensor-core kernels' parts ------------------------------------------------------------

namespace tc {

// The tiles (common/smem_layout.h, where the host sizes them too).
using fastaxial::DsTc;
using fastaxial::KvTc;
using fastaxial::QTc;

// The same kernels' tiles for sequences of at most kShortGradLen positions: 16 queries a step on
// the key side, 16 keys a step for dq, one stage (the sequence is one tile). At L = 16 the general
// steps (KvTc's 32 queries, QTc's 32 or 64 keys, up to head dim 96) were half or more padding,
// every product of it computed. Where the general step is 16 already, these are not launched.
constexpr int kShortGradLen = 16;
static_assert(kShortGradLen <= 16, "a short sequence is one 16-row step: one stage streams it");
template <int HDP>
struct KvTcShort : fastaxial::KvTiling<HDP, attention_grad_tiles(HDP).kw, attention_grad_tiles(HDP).fw, 16, 1,
                                       attention_grad_tiles(HDP).kv_min_blocks> {};
template <int HDP>
struct QTcShort
    : fastaxial::QTiling<HDP, attention_grad_tiles(HDP).qw, 16, 1, attention_grad_tiles(HDP).q_min_blocks> {};

// ---- fragments from fp32 rows in shared memory (PTX m16n8k8 .tf32 layouts, g = lane / 4, t = lane % 4)
// Elem: the products' element traits (detail/tf32x3.cuh's Tf32x3, detail/mma16.cuh's 16-bit ones),
// which make a fragment from the four (A) or two (B) values a thread holds in these layouts; a
// 16-bit one takes slot t as k 2t and slot t + 4 as k 2t + 1, the same for A and B, so every
// product below sums the same terms.

// A (16 x 8) = rows 0..15, elements 0..7 of the rows at p: (g, t), (g + 8,
// t), (g, t + 4), (g + 8, t + 4).
template <class Elem, int LD>
__device__ __forceinline__ typename Elem::FragA load_a_rows(const float* p, int g, int t) {
  const float* r = p + g * LD + t;
  return Elem::a(r[0], r[8 * LD], r[4], r[8 * LD + 4]);
}

// B (8 x 8) with B[k][n] = M[n][k]: rows (n) 0..7, elements (k) 0..7 of the
// rows of M at p: (t, g), (t + 4, g).
template <class Elem, int LD>
__device__ __forceinline__ typename Elem::FragB load_b_rows(const float* p, int g, int t) {
  const float* r = p + g * LD + t;
  return Elem::b(r[0], r[4]);
}

// B (8 x 8) with B[k][n] = M[k][n], k permuted as c_as_a: (t, g) is row 2t,
// (t + 4, g) row 2t + 1, both at column g of the rows of M at p.
template <class Elem, int LD>
__device__ __forceinline__ typename Elem::FragB load_b_cols(const float* p, int g, int t) {
  const float* r = p + 2 * t * LD + g;
  return Elem::b(r[0], r[LD]);
}

// A C fragment (16 x 8: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1))
// as the A fragment of the next product, k permuted: (g, t) is column 2t,
// (g, t + 4) column 2t + 1.
template <class Elem>
__device__ __forceinline__ typename Elem::FragA c_as_a(const float (&c)[4]) {
  return Elem::a(c[0], c[2], c[1], c[3]);
}

// ---- the products ------------------------------------------------------------------------------

// acc[j] (16 x 8) = rows 0..15 of a . rows 8j .. 8j + 7 of b, over HDP
// features: S^T = k q^T (a the warp's keys, b the tile's queries), dP^T = v
// d_o^T, or S = q k^T and dP = d_o v^T. Runs of two 8-deep k-steps, each in
// a fresh accumulator added in fp32 (the first run is acc itself).
template <class Elem, int HDP, int NT, int LD>
__device__ __forceinline__ void score_tiles(float (&acc)[NT][4], const float* a, const float* b, int g, int t) {
  using FragA = typename Elem::FragA;
  constexpr int KS = HDP / 8;
  if constexpr (KS == 1) {
    const FragA fa = load_a_rows<Elem, LD>(a, g, t);
#pragma unroll
    for (int j = 0; j < NT; ++j) Elem::template step<true>(acc[j], fa, load_b_rows<Elem, LD>(b + 8 * j * LD, g, t));
  } else {
    static_assert(KS % 2 == 0, "runs of two k-steps");
    {
      const FragA fa0 = load_a_rows<Elem, LD>(a, g, t), fa1 = load_a_rows<Elem, LD>(a + 8, g, t);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float* bj = b + 8 * j * LD;
        Elem::run_fresh(acc[j], fa0, load_b_rows<Elem, LD>(bj, g, t), fa1, load_b_rows<Elem, LD>(bj + 8, g, t));
      }
    }
    // Rolled beyond HDP 32: unrolled, the loads hoisted ahead of their
    // products take the kernels past their register budgets (dk and dv, or
    // dq, stay live throughout) and into spills.
    constexpr int kUnroll = HDP > 32 ? 1 : KS;
#pragma unroll kUnroll
    for (int kk = 2; kk < KS; kk += 2) {
      const FragA fa0 = load_a_rows<Elem, LD>(a + 8 * kk, g, t), fa1 = load_a_rows<Elem, LD>(a + 8 * kk + 8, g, t);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float* bj = b + 8 * j * LD + 8 * kk;
        Elem::template run<true>(acc[j], fa0, load_b_rows<Elem, LD>(bj, g, t), fa1,
                                 load_b_rows<Elem, LD>(bj + 8, g, t));
      }
    }
  }
}

// One score of softmax_grad_cols or _rows, in place: s -> P = 2^(scale_log2 s - lse2) (lse2 as
// hi + lo), dp -> dS = P (dp - delta); kDropout: P -> P m and dS = P (m dp - delta), m =
// keep_scale where bit `bit` of keep is set, else 0. kMasked: both 0 unless row_in and the
// score's column position, pair + c (c = 0, 1 in its thread's pair), is < L.
template <bool kMasked, bool kDropout>
__device__ __forceinline__ void score_grad(float& s, float& dp, float hi, float lo, float delta, float scale_log2,
                                           const uint32_t& keep, int bit, float keep_scale, bool row_in, int pair,
                                           int c, int L) {
  float p = prob_from_lse2(s, scale_log2, hi, lo), ds;
  if constexpr (kDropout) {
    const float m = ((keep >> bit) & 1u) ? keep_scale : 0.0f;
    ds = p * fmaf(m, dp, -delta);
    p *= m;
  } else {
    ds = p * (dp - delta);
  }
  const bool in = !kMasked || (row_in && pair + c < L);
  s = in ? p : 0.0f;
  dp = in ? ds : 0.0f;
}

// acc[f] (16 x 8) += C (16 x 8 NK) . rows 0 .. 8 NK - 1, columns 8f .. 8f +
// 7 of b: c[j] is the C fragment of columns 8j .. 8j + 7 of the left
// operand (P^T, dS^T or dS), its A fragment by c_as_a; b's rows (queries or
// keys) are the k index, read as load_b_cols permutes it. dv += P^T d_o,
// dk += dS^T q, dq += dS k. Runs of two k-groups, each in a fresh
// accumulator added in fp32.
template <class Elem, int NK, int NF, int LD>
__device__ __forceinline__ void grad_tiles(float (&acc)[NF][4], const float (&c)[NK][4], const float* b, int g, int t) {
  static_assert(NK % 2 == 0, "runs of two k-groups");
#pragma unroll
  for (int j = 0; j < NK; j += 2) {
    const typename Elem::FragA a0 = c_as_a<Elem>(c[j]), a1 = c_as_a<Elem>(c[j + 1]);
    const float* bj = b + 8 * j * LD;  // rows 8j .. 8j + 15
#pragma unroll
    for (int f = 0; f < NF; ++f)
      Elem::template run<true>(acc[f], a0, load_b_cols<Elem, LD>(bj + 8 * f, g, t), a1,
                               load_b_cols<Elem, LD>(bj + 8 * LD + 8 * f, g, t));
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
      score_grad<kMasked, kDropout>(s[j][e], dp[j][e], hi[c], lo[c], dl[c], scale_log2, keep[j / 2],
                                    16 * (j % 2) + dropout_bit_cols(g, e), keep_scale, key_in[e >> 1],
                                    q0 + 8 * j + 2 * t, c, L);
    }
  }
}

// softmax_grad_cols on a tile, masked only where it reaches past L (queries from q0 or keys
// from key0): the tiles inside skip the compares.
template <int NQ, bool kDropout>
__device__ __forceinline__ void tile_softmax_grad_cols(float (&s)[NQ][4], float (&dp)[NQ][4], const float* lse,
                                                       const float* lse_lo, const float* delta, float scale_log2,
                                                       int key0, int q0, int L, int g, int t,
                                                       const uint32_t (&keep)[NQ / 2], float keep_scale) {
  if (q0 + 8 * NQ > L || key0 + 16 > L)
    softmax_grad_cols<NQ, true, kDropout>(s, dp, lse, lse_lo, delta, scale_log2, key0, q0, L, g, t, keep, keep_scale);
  else
    softmax_grad_cols<NQ, false, kDropout>(s, dp, lse, lse_lo, delta, scale_log2, key0, q0, L, g, t, keep, keep_scale);
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
      score_grad<kMasked, kDropout>(s[j][e], dp[j][e], hi[r], lo[r], dl[r], scale_log2, keep[j / 2],
                                    16 * (j % 2) + dropout_bit_rows(t, e), keep_scale, true, k0 + 8 * j + 2 * t,
                                    e & 1, L);
    }
}

// softmax_grad_rows on a tile, masked only where its keys reach past L, as tile_softmax_grad_cols.
template <int NK, bool kDropout>
__device__ __forceinline__ void tile_softmax_grad_rows(float (&s)[NK][4], float (&dp)[NK][4], const float (&hi)[2],
                                                       const float (&lo)[2], const float (&dl)[2], float scale_log2,
                                                       int k0, int L, int t, const uint32_t (&keep)[NK / 2],
                                                       float keep_scale) {
  if (k0 + 8 * NK > L)
    softmax_grad_rows<NK, true, kDropout>(s, dp, hi, lo, dl, scale_log2, k0, L, t, keep, keep_scale);
  else
    softmax_grad_rows<NK, false, kDropout>(s, dp, hi, lo, dl, scale_log2, k0, L, t, keep, keep_scale);
}

// lse2 (hi, lo: detail/lse.cuh) and delta of a thread's query rows r0 and r0 + 8 of item (zeros
// from L; n_rows = num_seq heads L, where the lo halves start), held in registers for
// softmax_grad_rows.
__device__ __forceinline__ void row_stats(const AttentionBackwardKernelArgs& a, int64_t n_rows, int64_t item, int r0,
                                          int L, float (&hi)[2], float (&lo)[2], float (&dl)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int l = r0 + 8 * r;
    const bool in = l < L;
    hi[r] = in ? a.lse[item * L + l] : 0.0f;
    lo[r] = in ? a.lse[n_rows + item * L + l] : 0.0f;
    dl[r] = in ? a.delta[item * L + l] : 0.0f;
  }
}

// row_stats of a thread's rows m0 + g and m0 + g + 8 of the block's head: kernel 3's rows stay
// for the block.
__device__ __forceinline__ void query_row_stats(float (&hi)[2], float (&lo)[2], float (&dl)[2],
                                                const AttentionBackwardKernelArgs& a, const Head& hp, int m0, int g) {
  row_stats(a, a.pos.num_seq * a.heads * hp.L, hp.item, m0 + g, hp.L, hi, lo, dl);
}

// Kernel 2's dropout: the keep mask (common/dropout.h) of a warp's 16 keys, UnitDropout's
// (flash_parts.cuh) with rows and columns swapped, as S^T has them. The Philox state read once
// a kernel; a query tile's keep bits drawn before its scores are live (fewer registers at
// once). Without dropout, nothing.
template <bool kDropout>
struct KeyDropout {
  DropoutParams drop;
  uint64_t e_warp = 0;  // element of (query 0, the warp's first key)

  __device__ __forceinline__ KeyDropout(const DropoutPass& dpass, int64_t item, int key0, int L) {
    if constexpr (kDropout) {
      drop = dropout_read(dpass);
      e_warp = dpass.base + (uint64_t)item * (uint64_t)L * (uint64_t)L + (uint64_t)key0;
    }
  }
  // The keep bits of the NQ query n-tiles from q0: n-tiles j and j + 1 in keep[j / 2], 16 bits each.
  template <int NQ>
  __device__ __forceinline__ void keep_bits(uint32_t (&keep)[NQ / 2], int q0, int L, int g, int t) const {
    if constexpr (kDropout) {
      static_assert(NQ % 2 == 0, "n-tiles in pairs");
#pragma unroll
      for (int j = 0; j < NQ; j += 2) {
        const uint64_t e_tile = e_warp + (uint64_t)(q0 + 8 * j) * (uint64_t)L;
        const unsigned b0 = dropout_share16<4>(dropout_keep_run4(drop, dropout_run_cols(e_tile, L, g, t)), g & 3);
        const unsigned b1 =
            dropout_share16<4>(dropout_keep_run4(drop, dropout_run_cols(e_tile + 8 * (uint64_t)L, L, g, t)), g & 3);
        keep[j / 2] = b0 | b1 << 16;
      }
    }
  }
};

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

// The type kernel 2 stores dS^T in for kernel 3 (AttentionBackwardArgs::ds): float on the 3xTF32
// products; on 16-bit ones their type, which kernel 3's product rounds dS to in any case (half the
// bytes, the same fragments).
template <class Elem>
struct StoredScores {
  using type = float;
};
template <class T>
struct StoredScores<Mma16<T>> {
  using type = T;
};

// A warp's dS^T (its 16 keys from key0 x 8 NQ queries from q0, C fragments)
// into the scratch rows of keys < L (ds: the (sequence, head)'s first row,
// rows of Lp values of S): one float2, or two 16-bit values rounded as Mma16
// rounds fragments, a pair of queries; pairs from query < L (the second of a
// pair at L is a zero, as dS is past L; Lp is even).
template <int NQ, class S>
__device__ __forceinline__ void store_scores_t(S* ds, const float (&c)[NQ][4], int L, int Lp, int key0, int q0, int g,
                                               int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + g + 8 * r;
    if (key >= L) continue;
    S* row = ds + (int64_t)key * Lp;
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
      const int q = q0 + 8 * j + 2 * t;
      if (q >= L) continue;
      if constexpr (std::is_same_v<S, float>)
        *reinterpret_cast<float2*>(row + q) = make_float2(c[j][2 * r], c[j][2 * r + 1]);
      else
        *reinterpret_cast<uint32_t*>(row + q) = pack16<S>(c[j][2 * r], c[j][2 * r + 1]);
    }
  }
}

// A (16 x 8) of dS = rows 0..15 (queries), elements 0..7 (keys) read from
// dS^T stored a row per key at p (row stride LS values of S), k permuted as
// c_as_a: (g, t) is key 2t, (g, t + 4) key 2t + 1, so that load_b_cols's k
// rows meet them. Floats: LS 4 mod 8 puts the four rows 2t at banks 0, 8,
// 16, 24 (or their mirror), so a load's 32 words (2t LS + g) meet 32
// distinct banks; 16-bit values: LS 8 mod 16 does the same for the words
// (2t LS + g) / 2, two lanes to a word.
template <class Elem, int LS, class S>
__device__ __forceinline__ typename Elem::FragA load_a_cols(const S* p, int g, int t) {
  const S* r = p + 2 * t * LS + g;
  if constexpr (std::is_same_v<S, float>)
    return Elem::a(r[0], r[8], r[LS], r[LS + 8]);
  else
    return Elem::a_stored(r[0], r[8], r[LS], r[LS + 8]);
}

// acc = 0.
template <int NF>
__device__ __forceinline__ void zero_tiles(float (&acc)[NF][4]) {
#pragma unroll
  for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[f][e] = 0.0f;
}

// scale dq of a warp's 16 queries from m0 into the split's partials (sp.splits > 1) or into
// head hp.h's q columns of dqkv.
template <int NF, bool kVec>
__device__ __forceinline__ void store_query_grads(const AttentionBackwardKernelArgs& a, const Split& sp, const Head& hp,
                                                  const float (&dq)[NF][4], float scale, int m0, int g, int t) {
  if (sp.splits > 1)
    store_tiles<NF, kVec>(sp.partials, dq, scale, hp.hd, partial_rows(hp, a.pos.num_seq * a.heads), m0, 0, g, t);
  else
    store_tiles<NF, kVec>(a.dqkv + (int64_t)hp.h * hp.hd, dq, scale, 3 * (int64_t)a.D, hp, m0, 0, g, t);
}

}  // namespace tc
}  // namespace fastaxial::cuda::attention_backward_detail
