// Kernels 2 and 3 of the attention backward on plain fp32 FFMA (attention_backward.cu): the
// fallback where the tensor-core tiles do not fit the device's shared memory, and a test hook
// (AttentionBackwardArgs::ffma). No split, no dS^T scratch; dropout draws each element on its
// own (a Philox call an element).
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
// in registers and shared memory stays near 100 KB (Tiles below). The two
// kernels are one template (grads_kernel, kKeys: dk, dv or dq) with one
// start and one layout (Smem), then a short body each over the parts below
// (dropout, the score step, the gradient steps and stores) and stream_tiles
// (backward_parts.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backward_launch.cuh"
#include "backward_parts.cuh"

namespace fastaxial::cuda::attention_backward_detail {
namespace {

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
// BN keys a block, RM x RK a thread) and the dq kernel's (BM queries a
// block x BN keys a step), the gradient tiles' lanes across features LX and
// a thread's RR rows x RC runs (dk, dv; dq: their rows are the block's BN
// keys, BM queries), and both kernels' stages (2: the next tile's copy
// overlaps this one's work). Shared memory, dk/dv and dq kernels: HDP 8: 51
// and 35 KB, 16: 63 and 47, 32: 53 and 71, 48: 81 and 95, 64: 85 and 77,
// 96: 92 and 84, 128: 91 and 87, 192: 78 and 76, 256: 102 and 100.
struct FfmaTiles {
  int kv_bm, kv_bn, kv_rm, kv_rk;    // dk, dv: ScoreMap's BM, BN, RM, RK
  int q_bm, q_bn, q_rm, q_rk;        // dq: ScoreMap's BM, BN, RM, RK
  int lx, kv_rr, kv_rc, q_rr, q_rc;  // GradMap's LX; RR, RC of dk, dv and of dq
  int stages;                        // both kernels'
};
constexpr FfmaTiles ffma_tiles(int hdp) {
  switch (hdp) {
    case 8: return {32, 128, 4, 4, 128, 32, 4, 4, 2, 1, 1, 1, 1, 2};
    case 16: return {32, 128, 4, 4, 128, 32, 4, 4, 4, 2, 1, 2, 1, 2};
    case 32: return {32, 64, 2, 4, 64, 64, 4, 4, 8, 2, 1, 2, 1, 2};
    case 48: return {16, 128, 2, 4, 128, 32, 4, 4, 4, 2, 3, 2, 3, 2};
    case 64: return {32, 64, 2, 4, 64, 32, 4, 2, 8, 4, 1, 4, 1, 2};
    case 96: return {32, 64, 2, 4, 64, 32, 4, 2, 8, 2, 3, 2, 3, 1};
    case 128: return {16, 64, 2, 2, 64, 16, 2, 2, 8, 4, 2, 4, 2, 1};
    case 192: return {16, 32, 1, 2, 32, 16, 1, 2, 8, 2, 3, 2, 3, 1};
    case 256: return {16, 32, 1, 2, 32, 16, 1, 2, 8, 8, 1, 4, 2, 1};
    default: return {};  // no kernel for hdp
  }
}

template <int HDP>
struct Tiles {
  static constexpr FfmaTiles t = ffma_tiles(HDP);
  using KvScore = ScoreMap<t.kv_bm, t.kv_bn, t.kv_rm, t.kv_rk>;
  using KvGrad = GradMap<t.kv_bn, HDP, t.lx, t.kv_rr, t.kv_rc>;
  using QScore = ScoreMap<t.q_bm, t.q_bn, t.q_rm, t.q_rk>;
  using QGrad = GradMap<t.q_bm, HDP, t.lx, t.q_rr, t.q_rc>;
  static constexpr int stages = t.stages;
};

// Row strides, in floats: key-side rows (k, v) are read 8 rows at a time
// (4 * odd apart: distinct bank quads), query-side rows (q, d_o) one row at
// a time (no padding needed).
template <int HDP>
constexpr int key_ld() {
  static_assert(HDP % 8 == 0, "HDP + 4 is 4 * odd");
  return HDP + 4;
}

// Shared memory of either kernel (kKeys: the dk, dv kernel's, else the dq kernel's), in floats:
//                         dk, dv                         dq
//   the block's rows:     k, v (BN, ldk) each            q, d_o (BM, ldq) each
//   stage s's rows:       q, d_o (BM, ldq) each          k, v (BN, ldk) each
//   scores:               p, ds (BM, ldp) each           ds (BM, ldp)
//   lse (hi, lo), delta:  (BM) each, stage s's           (BM) each, the block's
// The block's rows (F a buffer, stride ldf) and the stages' (R a buffer, stride lds) are each
// contiguous, so one pass a stride zeroes their padding columns (start_block).
template <int HDP, bool kKeys>
struct Smem {
  using T = Tiles<HDP>;
  using Score = std::conditional_t<kKeys, typename T::KvScore, typename T::QScore>;
  using Grad = std::conditional_t<kKeys, typename T::KvGrad, typename T::QGrad>;
  static constexpr int BM = Score::BM, BN = Score::BN, ST = T::stages, ldp = Score::ldp;
  static constexpr int ldk = key_ld<HDP>(), ldq = HDP;
  static constexpr int F = kKeys ? BN : BM, ldf = kKeys ? ldk : ldq;  // the block's rows a buffer
  static constexpr int R = kKeys ? BM : BN, lds = kKeys ? ldq : ldk;  // a stage's rows a buffer
  static constexpr int streamed = 2 * F * ldf, stage = 2 * R * lds;   // stage s at streamed + s stage
  static constexpr int k = kKeys ? 0 : streamed, v = k + BN * ldk;    // dq: stage 0's
  static constexpr int q = kKeys ? streamed : 0, d_o = q + BM * ldq;  // dk, dv: stage 0's
  static constexpr int p = streamed + ST * stage;                     // dk, dv only
  static constexpr int ds = p + (kKeys ? BM * ldp : 0);
  static constexpr int vec = ds + BM * ldp;  // lse hi, lo, then delta (dk, dv: stage s's at + 3 BM s)
  static constexpr int floats = vec + (kKeys ? ST : 1) * 3 * BM;
  static constexpr size_t bytes = (size_t)floats * sizeof(float);
  static_assert(stage % 4 == 0 && streamed % 4 == 0 && p % 4 == 0 && ldp % 4 == 0 && vec % 4 == 0, "16-byte rows");
};
template <int HDP>
using KvSmem = Smem<HDP, true>;
template <int HDP>
using QSmem = Smem<HDP, false>;

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

// ---- dropout ------------------------------------------------------------------------------------

// Dropout drawn an element at a time (common/dropout.h): the Philox state
// as a preceding kernel wrote it, read once a kernel, and e0, the element
// of (query q0, key 0) of the block's (sequence, head). Without dropout,
// nothing.
template <bool kDropout>
struct ElementDropout {
  DropoutParams drop;
  uint64_t e0 = 0;

  __device__ __forceinline__ ElementDropout(const DropoutPass& dpass, int64_t item, int q0, int L) {
    if constexpr (kDropout) {
      drop = dropout_read(dpass);
      e0 = dpass.base + ((uint64_t)item * (uint64_t)L + (uint64_t)q0) * (uint64_t)L;
    }
  }
  // The element of (query q0 + dq, key k0).
  __device__ __forceinline__ uint64_t at(int dq, int k0, int L) const {
    return e0 + (uint64_t)dq * (uint64_t)L + (uint64_t)k0;
  }
};

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
  // registers and into spills.
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

// Both kernels' start: the padding columns of the block's rows and of every stage's (S, a
// Smem) zeroed, as no copy writes them, before the wait for the kernel before (whose outputs are
// read from here on); then the next kernel may launch.
template <class S, int HDP>
__device__ __forceinline__ void start_block(float* sm, int hd) {
  zero_padding<S::ldf, HDP>(sm, 2 * S::F, hd, kThreads);
  zero_padding<S::lds, HDP>(sm + S::streamed, 2 * S::ST * S::R, hd, kThreads);
  grid_dependency_wait();
  allow_dependent_launch();
}

// Tile hp.tile of one (sequence, head): kKeys, dk and dv of BN keys, streaming the query tiles;
// else dq of BM queries, streaming the key tiles. One kernel for both, as they share their start
// and layout (Smem) and differ only in what they stream and sum. kDropout: dpass applies
// (threshold != 0).
template <bool kKeys, int HDP, bool kVec, bool kDropout>
__global__ void __launch_bounds__(kThreads)
    grads_kernel(const AttentionBackwardKernelArgs a, float scale, int tiles, const DropoutPass dpass) {
  using S = Smem<HDP, kKeys>;
  using Score = typename S::Score;
  using Grad = typename S::Grad;
  constexpr int BM = S::BM, BN = S::BN;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Head hp = block_head(a, tiles);
  const int p0 = hp.tile * S::F;  // the block's first key (dk, dv) or query (dq)
  start_block<S, HDP>(sm, hp.hd);  // k, v and a stage's q, d_o; or q, d_o and a stage's k, v

  const int64_t W = 3 * (int64_t)a.D;  // floats a row of qkv and dqkv
  if constexpr (kKeys) {
    const int k0 = p0;  // the block's first key
    const KeySideSlices in = key_side_slices(a, hp);
    const float scale_log2 = scale * kLog2e;  // as the tensor-core launch's
    const ElementDropout<kDropout> drop(dpass, hp.item, 0, hp.L);
    const auto load_queries = [&](int stage, int i) {  // query tile i: q, d_o, lse hi, lo, delta
      const int q0 = i * BM;
      float* qs = sm + S::q + stage * S::stage;
      float* vs = sm + S::vec + stage * 3 * BM;
      copy_rows<S::ldq, HDP, kVec>(qs, in.q, W, hp, q0, BM, kThreads);
      copy_rows<S::ldq, HDP, kVec>(sm + S::d_o + stage * S::stage, in.d_o, a.D, hp, q0, BM, kThreads);
      copy_positions(vs, in.lse, q0, BM, hp.L, kThreads);
      copy_positions(vs + BM, in.lse_lo, q0, BM, hp.L, kThreads);
      copy_positions(vs + 2 * BM, in.delta, q0, BM, hp.L, kThreads);
    };
    copy_key_rows<S::ldk, HDP, kVec>(sm + S::k, in.q, W, a.D, hp, k0, BN, kThreads);
    load_queries(0, 0);
    copy_async_commit();

    GradAcc<Grad> dk, dv;
    zero<Grad>(dk);
    zero<Grad>(dv);
    stream_tiles<S::ST>(make_int2(0, (hp.L + BM - 1) / BM), load_queries, [&](int i, int st) {
      const float* q = sm + S::q + st * S::stage;  // q and d_o are (BM, HDP)
      const float* d_o = sm + S::d_o + st * S::stage;
      const float* stats = sm + S::vec + st * 3 * BM;  // lse2 hi, then lo, then delta
      float s[Score::RM][Score::RK], dp[Score::RM][Score::RK];
      row_dots<Score, HDP, S::ldq, S::ldk>(s, q, sm + S::k, warp, lane);     // q k^T
      row_dots<Score, HDP, S::ldq, S::ldk>(dp, d_o, sm + S::v, warp, lane);  // d_o v^T
      softmax_grad<Score, kDropout>(s, dp, stats, stats + BM, stats + 2 * BM, scale_log2, i * BM, k0, hp.L, warp,
                                    lane, drop.drop, drop.at(i * BM, k0, hp.L));
      store_scores<Score>(sm + S::p, s, warp, lane);
      store_scores<Score>(sm + S::ds, dp, warp, lane);
      __syncthreads();  // P and dS (BM, BN) complete
      key_grads<Grad, BM, S::ldp, S::ldq>(dv, dk, sm + S::p, sm + S::ds, d_o, q, warp, lane);
    });
    float* out = a.dqkv + (int64_t)hp.h * hp.hd;  // head h's dq columns; dk at + D, dv at + 2D
    store_grads<Grad, kVec>(out + a.D, dk, scale, W, hp, k0, warp, lane);
    store_grads<Grad, kVec>(out + 2 * a.D, dv, 1.0f, W, hp, k0, warp, lane);
  } else {
    const int q0 = p0;  // the block's first query
    const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
    const auto load_keys = [&](int stage, int j) {  // key tile j: k, then v
      const int k0 = j * BN;
      copy_key_rows<S::ldk, HDP, kVec>(sm + S::k + stage * S::stage, qg, W, a.D, hp, k0, BN, kThreads);
    };
    copy_rows<S::ldq, HDP, kVec>(sm + S::q, qg, W, hp, q0, BM, kThreads);
    copy_rows<S::ldq, HDP, kVec>(sm + S::d_o, a.d_o + (int64_t)hp.h * hp.hd, a.D, hp, q0, BM, kThreads);
    // lse2 hi, lo (detail/lse.cuh), delta.
    copy_positions(sm + S::vec, a.lse + hp.item * hp.L, q0, BM, hp.L, kThreads);
    copy_positions(sm + S::vec + BM, a.lse + (a.pos.num_seq * a.heads + hp.item) * hp.L, q0, BM, hp.L, kThreads);
    copy_positions(sm + S::vec + 2 * BM, a.delta + hp.item * hp.L, q0, BM, hp.L, kThreads);
    const float scale_log2 = scale * kLog2e;  // as the tensor-core launch's
    load_keys(0, 0);
    copy_async_commit();
    const ElementDropout<kDropout> drop(dpass, hp.item, q0, hp.L);

    GradAcc<Grad> dq;
    zero<Grad>(dq);
    stream_tiles<S::ST>(make_int2(0, (hp.L + BN - 1) / BN), load_keys, [&](int j, int st) {
      const float* k = sm + S::k + st * S::stage;  // k and v are (BN, HDP)
      const float* v = sm + S::v + st * S::stage;
      float s[Score::RM][Score::RK], dp[Score::RM][Score::RK];
      row_dots<Score, HDP, S::ldq, S::ldk>(s, sm + S::q, k, warp, lane);     // q k^T
      row_dots<Score, HDP, S::ldq, S::ldk>(dp, sm + S::d_o, v, warp, lane);  // d_o v^T
      softmax_grad<Score, kDropout>(s, dp, sm + S::vec, sm + S::vec + BM, sm + S::vec + 2 * BM, scale_log2, q0,
                                    j * BN, hp.L, warp, lane, drop.drop, drop.at(0, j * BN, hp.L));
      store_scores<Score>(sm + S::ds, dp, warp, lane);
      __syncthreads();  // dS (BM, BN) complete
      query_grads<Grad, BN, S::ldp, S::ldk>(dq, sm + S::ds, k, warp, lane);
    });
    store_grads<Grad, kVec>(a.dqkv + (int64_t)hp.h * hp.hd, dq, scale, W, hp, q0, warp, lane);
  }
}

}  // namespace ffma

}  // namespace

size_t ffma_smem_bytes(int hdp) {
  return with_padded_head_dim(
      hdp,
      [](auto h) { return std::max(ffma::KvSmem<decltype(h)::value>::bytes, ffma::QSmem<decltype(h)::value>::bytes); },
      size_t{0});
}

cudaError_t launch_ffma(const AttentionBackwardArgs& a, const BackwardLaunch& s, const DeviceCaps& dev,
                        cudaStream_t stream) {
  return with_kernel_params(s, [&](auto hdp, auto vec, auto dropout) {
    constexpr int HDP = decltype(hdp)::value;
    constexpr bool kVec = decltype(vec)::value, kDropout = decltype(dropout)::value;
    using Kv = ffma::KvSmem<HDP>;
    using Q = ffma::QSmem<HDP>;
    int key_tiles, query_tiles;
    if (!tile_counts(a.pos.num_seq, a.heads, a.pos.len, Kv::BN, Q::BM, &key_tiles, &query_tiles))
      return cudaErrorInvalidValue;
    if (cudaError_t e = launch_delta(a, s, dev, stream); e != cudaSuccess) return e;
    if (cudaError_t e = launch_grid<ffma::grads_kernel<true, HDP, kVec, kDropout>>(
            s.items * key_tiles, ffma::kThreads, Kv::bytes, dev, stream, s.k, s.scale, key_tiles, s.dpass);
        e != cudaSuccess)
      return e;
    return launch_grid<ffma::grads_kernel<false, HDP, kVec, kDropout>>(
        s.items * query_tiles, ffma::kThreads, Q::bytes, dev, stream, s.k, s.scale, query_tiles, s.dpass);
  });
}

}  // namespace fastaxial::cuda::attention_backward_detail
