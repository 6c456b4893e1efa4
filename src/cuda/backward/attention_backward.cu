// The backward of one attention pass, flash-style: for each sequence n and
// head h (q, k, v, o, d_o below are head h's (L, hd) slices of sequence n)
//   S  = scale q k^T              scale = 1 / sqrt(hd)
//   P  = exp(S - lse)             lse from the forward (flash_attention)
//   dv = P^T d_o
//   dP = d_o v^T
//   dS = P * (dP - delta)         delta = rowsum(d_o * o)
//   dq = scale dS k,  dk = scale dS^T q
// written into the (T, 3D) dqkv rows in qkv's layout. The (L, L) matrices
// never reach memory: P is recomputed from lse, tile by tile.
//
// Three kernels, each a programmatic dependent of the one before:
// 1. delta: a thread per (position, head), its hd products in order.
// 2. dk, dv: a block per (sequence, head, BN keys), keys and values held
//    in shared memory, looping over the query tiles (BM queries) in order:
//    S and dP (BM, BN), then P and dS through shared memory, then
//    dv += P^T d_o and dk += dS^T q into registers.
// 3. dq: a block per (sequence, head, BM queries), q and d_o held, looping
//    over the key tiles in order: S, dP, dS as above, dq += dS k.
// dq could be summed in kernel 2 too, but only with atomics across its key
// blocks, whose order varies from run to run; recomputing S and dP in a
// kernel of its own keeps every output element a sum by one thread in a
// fixed order (queries, or keys, ascending), so the result is bitwise
// reproducible. 7 products of L^2 hd FMAs per (sequence, head), against 5
// with atomics.
//
// Arithmetic is plain fp32 FFMA (accuracy of an fp32 evaluation), with
// register micro-tiles: in the score step a thread owns RM queries x RK keys
// of S and dP (rows ly + 4r, keys lx + 8c of its warp's tile, lanes 4 x 8),
// reading 16-byte runs of features from q, d_o, k and v rows in shared
// memory: a quarter warp reads one query row (a broadcast) and 8
// consecutive key rows, 4 * odd floats apart (HDP + 4), so 8 distinct bank
// quads. In the gradient step a thread owns RR consecutive rows (keys for
// dk, dv; queries for dq) and RC runs of 4 features, strided by LX lanes so
// a quarter warp reads one contiguous run of a feature row; P and dS rows
// (BN + 8 floats, 8 mod 16) take the score step's scalar stores, 4 rows of
// 8 keys per warp, without conflicts.
//
// Head dims: a template on a padded head dim HDP (8, 16, 32, 48, 64, 96,
// 128, 192, 256, as the forward's flash kernel); columns hd..HDP-1 are zero
// in shared memory (they add nothing to S or dP; their gradient columns are
// not stored). Tiles shrink as HDP grows, so that the dk, dv accumulators
// (2 RR x 4 RC floats a thread) fit in registers and shared memory stays
// near 100 KB (Tiles below; bytes per kernel in the table's comment).
// Global loads are cp.async copies, double-buffered (the next tile in
// flight while this one is computed) where shared memory allows: 16 bytes
// where every head slice is 16-byte aligned (hd % 4 == 0 and 16-byte
// aligned qkv, d_o, dqkv), else 4 bytes an element (hd odd, say).
// Positions >= L are zero-filled by the copies and masked (P = dS = 0), and
// never read or written in global memory.
#include "attention_backward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxLen = 1 << 30;  // L below this: positions and tile arithmetic in int

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
//   stage s: lse, delta  (BM) each
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
  static constexpr int vec = ds + BM * ldp;  // stage s: lse at vec + 2 BM s, delta BM after
  static constexpr int floats = vec + ST * 2 * BM;
  static constexpr size_t bytes = (size_t)floats * sizeof(float);
  static_assert(q % 4 == 0 && stage % 4 == 0 && p % 4 == 0 && ldp % 4 == 0 && vec % 4 == 0, "16-byte rows");
};

// Shared memory of the dq kernel, in floats:
//   q, d_o:              (BM, ldq) each, the block's queries
//   stage s: k, v        (BN, ldk) each, one key tile
//   ds:                  (BM, ldp)
//   lse, delta:          (BM) each
template <int HDP>
struct QSmem {
  using T = Tiles<HDP>;
  static constexpr int BM = T::QScore::BM, BN = T::QScore::BN, ST = T::q_stages, ldp = T::QScore::ldp;
  static constexpr int ldk = key_ld<HDP>(), ldq = HDP;
  static constexpr int q = 0, d_o = BM * ldq, k = 2 * BM * ldq;
  static constexpr int stage = 2 * BN * ldk;  // k, then v
  static constexpr int ds = k + ST * stage;
  static constexpr int vec = ds + BM * ldp;  // lse, then delta
  static constexpr int floats = vec + 2 * BM;
  static constexpr size_t bytes = (size_t)floats * sizeof(float);
  static_assert(k % 4 == 0 && stage % 4 == 0 && ds % 4 == 0 && vec % 4 == 0, "16-byte rows");
};

// ---- small device helpers ---------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const float* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 4 bytes from global memory at src to shared memory at dst (a shared-space
// address); with src_bytes = 0 nothing is read and the word is zeroed.
__device__ __forceinline__ void copy_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

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

// One (sequence, head) and tile of the problem, as a block sees it:
// blockIdx.x = (n * heads + h) * tiles + tile, the tile fastest so that the
// blocks of one (sequence, head) run side by side and share its rows in L2.
struct Head {
  int64_t item;    // n * heads + h: the row of lse and delta
  int64_t first;   // row (of qkv, o, d_o, dqkv) of position 0
  int64_t stride;  // rows between neighbouring positions
  int h, hd, L, tile;
};

__device__ __forceinline__ Head block_head(const AttentionBackwardArgs& a, int tiles) {
  Head hp;
  hp.tile = (int)(blockIdx.x % (unsigned)tiles);
  hp.item = blockIdx.x / (unsigned)tiles;
  hp.h = (int)(hp.item % a.heads);
  hp.first = a.pos.offset(hp.item / a.heads, 0);
  hp.stride = a.pos.pos_stride;
  hp.hd = a.D / a.heads;
  hp.L = (int)a.pos.len;
  return hp;
}

// Zeroes columns hd..HDP-1 of `rows` rows at stride LD: padding the copies
// never write, so it stays zero for the whole block. Shared memory only.
template <int LD, int HDP>
__device__ __forceinline__ void zero_padding(float* dst, int rows, int hd) {
  const int pad = HDP - hd;
  if (pad <= 0) return;
  for (int e = threadIdx.x; e < rows * pad; e += kThreads) dst[(e / pad) * LD + hd + e % pad] = 0.0f;
}

// Positions p0 .. p0 + ROWS - 1 of one head slice into dst (ROWS, LD),
// columns 0..hd-1, positions >= L as zeros. src: the slice's column 0 in
// row 0 of a tensor of row_words floats a row (in bounds, so the zero-fill
// copies may name it).
template <int ROWS, int LD, int HDP, bool kVec>
__device__ __forceinline__ void copy_rows(float* dst, const float* src, int64_t row_words, const Head& hp, int p0) {
  constexpr int W = kVec ? 4 : 1;  // floats a copy
  constexpr int C = HDP / W;       // copies a row
#pragma unroll 1
  for (int e = threadIdx.x; e < ROWS * C; e += kThreads) {
    const int r = e / C, c = W * (e % C);
    if (c >= hp.hd) continue;  // kVec: hd % 4 == 0, so runs lie wholly inside or outside
    const int l = p0 + r;
    const bool valid = l < hp.L;
    const float* from = valid ? src + (hp.first + (int64_t)l * hp.stride) * row_words + c : src;
    if constexpr (kVec)
      copy_async16(smem_addr(dst + r * LD + c), from, valid ? 16 : 0);
    else
      copy_async4(smem_addr(dst + r * LD + c), from, valid ? 4 : 0);
  }
}

// Entries p0 .. p0 + N - 1 of one (sequence, head)'s lse or delta row src
// into dst, positions >= L as zeros.
template <int N>
__device__ __forceinline__ void copy_positions(float* dst, const float* src, int p0, int L) {
  for (int e = threadIdx.x; e < N; e += kThreads) {
    const int l = p0 + e;
    const bool valid = l < L;
    copy_async4(smem_addr(dst + e), valid ? src + l : src, valid ? 4 : 0);
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

// In place: s (q . k) -> P = exp(scale s - lse), dp -> dS = P (dp - delta);
// both zero where the query (q0 + row) or the key (k0 + key) is >= L. lse,
// delta: the tile's queries, from shared memory.
template <class Score>
__device__ __forceinline__ void softmax_grad(float (&s)[Score::RM][Score::RK], float (&dp)[Score::RM][Score::RK],
                                             const float* lse, const float* delta, float scale, int q0, int k0, int L,
                                             int warp, int lane) {
  const int m0 = Score::row(warp, lane), n0 = Score::key(warp, lane);
#pragma unroll
  for (int r = 0; r < Score::RM; ++r) {
    const int m = m0 + 4 * r;
    const bool q_in = q0 + m < L;
    const float lse_m = lse[m], delta_m = delta[m];
#pragma unroll
    for (int c = 0; c < Score::RK; ++c) {
      const bool in = q_in && k0 + n0 + 8 * c < L;
      const float p = in ? expf(s[r][c] * scale - lse_m) : 0.0f;
      dp[r][c] = in ? p * (dp[r][c] - delta_m) : 0.0f;
      s[r][c] = p;
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

// delta[(n heads + h) L + l] = d_o_h . o_h at position l of sequence n: a
// thread per (position, head), the head fastest (neighbouring threads read
// neighbouring slices of a row), its hd products summed in order.
__global__ void __launch_bounds__(kThreads) delta_kernel(const AttentionBackwardArgs a) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int hd = a.D / a.heads;
  const int64_t L = a.pos.len, total = a.pos.num_seq * L * a.heads;
  for (int64_t w = (int64_t)blockIdx.x * kThreads + threadIdx.x; w < total; w += (int64_t)gridDim.x * kThreads) {
    const int h = (int)(w % a.heads);
    const int64_t nl = w / a.heads, n = nl / L, l = nl % L;
    const int64_t at = a.pos.offset(n, l) * a.D + (int64_t)h * hd;
    const float *x = a.d_o + at, *y = a.o + at;
    float s = 0.0f;
    for (int c = 0; c < hd; ++c) s = fmaf(x[c], y[c], s);
    a.delta[(n * a.heads + h) * L + l] = s;
  }
}

// dk and dv of BN keys (tile hp.tile) of one (sequence, head).
template <int HDP, bool kVec>
__global__ void __launch_bounds__(kThreads)
    key_grads_kernel(const AttentionBackwardArgs a, float scale, int key_tiles) {
  using Score = typename Tiles<HDP>::KvScore;
  using Grad = typename Tiles<HDP>::KvGrad;
  using S = KvSmem<HDP>;
  constexpr int BM = S::BM, BN = S::BN, ST = S::ST;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hp = block_head(a, key_tiles);
  const int k0 = hp.tile * BN;
  zero_padding<S::ldk, HDP>(sm + S::k, 2 * BN, hp.hd);       // k, v
  zero_padding<S::ldq, HDP>(sm + S::q, 2 * ST * BM, hp.hd);  // every stage's q, d_o

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;               // floats a row of qkv and dqkv
  const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
  const float* dog = a.d_o + (int64_t)hp.h * hp.hd;
  const float* lse = a.lse + hp.item * hp.L;
  const float* delta = a.delta + hp.item * hp.L;
  const auto load_queries = [&](int stage, int q0) {
    float* qs = sm + S::q + stage * S::stage;
    float* vs = sm + S::vec + stage * 2 * BM;
    copy_rows<BM, S::ldq, HDP, kVec>(qs, qg, W, hp, q0);
    copy_rows<BM, S::ldq, HDP, kVec>(qs + BM * S::ldq, dog, a.D, hp, q0);
    copy_positions<BM>(vs, lse, q0, hp.L);
    copy_positions<BM>(vs + BM, delta, q0, hp.L);
  };
  copy_rows<BN, S::ldk, HDP, kVec>(sm + S::k, qg + a.D, W, hp, k0);
  copy_rows<BN, S::ldk, HDP, kVec>(sm + S::v, qg + 2 * a.D, W, hp, k0);
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
    const float* lse_s = sm + S::vec + st * 2 * BM;

    float s[Score::RM][Score::RK], dp[Score::RM][Score::RK];
    row_dots<Score, HDP, S::ldq, S::ldk>(s, q, sm + S::k, warp, lane);     // q k^T
    row_dots<Score, HDP, S::ldq, S::ldk>(dp, d_o, sm + S::v, warp, lane);  // d_o v^T
    softmax_grad<Score>(s, dp, lse_s, lse_s + BM, scale, i * BM, k0, hp.L, warp, lane);
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

// dq of BM queries (tile hp.tile) of one (sequence, head).
template <int HDP, bool kVec>
__global__ void __launch_bounds__(kThreads)
    query_grads_kernel(const AttentionBackwardArgs a, float scale, int query_tiles) {
  using Score = typename Tiles<HDP>::QScore;
  using Grad = typename Tiles<HDP>::QGrad;
  using S = QSmem<HDP>;
  constexpr int BM = S::BM, BN = S::BN, ST = S::ST;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hp = block_head(a, query_tiles);
  const int q0 = hp.tile * BM;
  zero_padding<S::ldq, HDP>(sm + S::q, 2 * BM, hp.hd);       // q, d_o
  zero_padding<S::ldk, HDP>(sm + S::k, 2 * ST * BN, hp.hd);  // every stage's k, v

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;
  const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
  const auto load_keys = [&](int stage, int k0) {
    float* ks = sm + S::k + stage * S::stage;
    copy_rows<BN, S::ldk, HDP, kVec>(ks, qg + a.D, W, hp, k0);
    copy_rows<BN, S::ldk, HDP, kVec>(ks + BN * S::ldk, qg + 2 * a.D, W, hp, k0);
  };
  copy_rows<BM, S::ldq, HDP, kVec>(sm + S::q, qg, W, hp, q0);
  copy_rows<BM, S::ldq, HDP, kVec>(sm + S::d_o, a.d_o + (int64_t)hp.h * hp.hd, a.D, hp, q0);
  copy_positions<BM>(sm + S::vec, a.lse + hp.item * hp.L, q0, hp.L);
  copy_positions<BM>(sm + S::vec + BM, a.delta + hp.item * hp.L, q0, hp.L);
  load_keys(0, 0);
  copy_async_commit();

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
    softmax_grad<Score>(s, dp, sm + S::vec, sm + S::vec + BM, scale, q0, j * BN, hp.L, warp, lane);
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

// ---- host side ---------------------------------------------------------------------------------

// The padded head dim that serves head_dim (0: none).
int padded_head_dim(int64_t head_dim) {
  if (head_dim < 1) return 0;
  for (int p : {8, 16, 32, 48, 64, 96, 128, 192, 256})
    if (head_dim <= p) return p;
  return 0;
}

template <int HDP>
constexpr size_t smem_bytes() {
  return std::max(KvSmem<HDP>::bytes, QSmem<HDP>::bytes);
}

template <auto kernel>
cudaError_t launch_grid(int64_t blocks, size_t smem, const AttentionBackwardArgs& a, float scale, int tiles,
                        const DeviceCaps& dev, cudaStream_t stream) {
  if (smem > 48 * 1024)
    if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(kThreads), smem, stream, dev, a, scale, tiles);
}

// The three launches for padded head dim HDP, after the checks that no
// launch can fail on sizes.
template <int HDP>
cudaError_t launch_backward(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  if (smem_bytes<HDP>() > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  const int64_t L = a.pos.len, items = a.pos.num_seq * a.heads;
  const int key_tiles = (int)((L + KvSmem<HDP>::BN - 1) / KvSmem<HDP>::BN);
  const int query_tiles = (int)((L + QSmem<HDP>::BM - 1) / QSmem<HDP>::BM);
  if (a.pos.num_seq > INT32_MAX / ((int64_t)a.heads * std::max(key_tiles, query_tiles)))
    return cudaErrorInvalidValue;  // gridDim.x is at most 2^31 - 1

  const int hd = a.D / a.heads;
  // 16-byte copies and stores where every head slice of every row starts
  // 16-byte aligned: hd % 4 == 0 makes D % 4 == 0 too.
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = hd % 4 == 0 && aligned16(a.qkv) && aligned16(a.d_o) && aligned16(a.dqkv);
  const float scale = 1.0f / sqrtf((float)hd);

  const int64_t delta_threads = items * L;
  const int64_t delta_blocks =
      std::min<int64_t>((delta_threads + kThreads - 1) / kThreads, 1 << 20);  // grid-stride beyond
  if (cudaError_t e = launch_kernel<delta_kernel>(dim3((unsigned)delta_blocks), dim3(kThreads), 0, stream, dev, a);
      e != cudaSuccess)
    return e;
  if (vec) {
    if (cudaError_t e = launch_grid<key_grads_kernel<HDP, true>>(items * key_tiles, KvSmem<HDP>::bytes, a, scale,
                                                                 key_tiles, dev, stream);
        e != cudaSuccess)
      return e;
    return launch_grid<query_grads_kernel<HDP, true>>(items * query_tiles, QSmem<HDP>::bytes, a, scale, query_tiles,
                                                      dev, stream);
  }
  if (cudaError_t e = launch_grid<key_grads_kernel<HDP, false>>(items * key_tiles, KvSmem<HDP>::bytes, a, scale,
                                                                key_tiles, dev, stream);
      e != cudaSuccess)
    return e;
  return launch_grid<query_grads_kernel<HDP, false>>(items * query_tiles, QSmem<HDP>::bytes, a, scale, query_tiles, dev,
                                                     stream);
}

}  // namespace

bool attention_backward_supports(int64_t head_dim) { return padded_head_dim(head_dim) != 0; }

size_t attention_backward_smem_bytes(int64_t head_dim) {
  switch (padded_head_dim(head_dim)) {
    case 8: return smem_bytes<8>();
    case 16: return smem_bytes<16>();
    case 32: return smem_bytes<32>();
    case 48: return smem_bytes<48>();
    case 64: return smem_bytes<64>();
    case 96: return smem_bytes<96>();
    case 128: return smem_bytes<128>();
    case 192: return smem_bytes<192>();
    case 256: return smem_bytes<256>();
  }
  return 0;
}

cudaError_t attention_backward(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  if (a.heads <= 0 || a.D <= 0 || a.D % a.heads != 0 || a.pos.num_seq < 0 || a.pos.len < 0 || a.pos.len >= kMaxLen)
    return cudaErrorInvalidValue;
  const int hdp = padded_head_dim(a.D / a.heads);
  if (hdp == 0) return cudaErrorInvalidValue;
  if (a.pos.num_seq == 0 || a.pos.len == 0) return cudaSuccess;
  switch (hdp) {
    case 8: return launch_backward<8>(a, dev, stream);
    case 16: return launch_backward<16>(a, dev, stream);
    case 32: return launch_backward<32>(a, dev, stream);
    case 48: return launch_backward<48>(a, dev, stream);
    case 64: return launch_backward<64>(a, dev, stream);
    case 96: return launch_backward<96>(a, dev, stream);
    case 128: return launch_backward<128>(a, dev, stream);
    case 192: return launch_backward<192>(a, dev, stream);
    case 256: return launch_backward<256>(a, dev, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastaxial::cuda
