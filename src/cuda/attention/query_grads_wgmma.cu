// The attention backward's query side (attention_backward.h: dq) on Hopper's
// warpgroup products (wgmma, sm_90a), for padded head dim 32 and sequences
// of two key tiles or more (the dispatch takes it from four:
// attention_backward.h): for each sequence n, head h and query l,
//   dq_l = scale sum_k dS_lk k_k,   dS = P * (dP - delta),
//   P = 2^(scale log2(e) q k^T - lse2),  dP = d_o v^T   (lse2: detail/lse.cuh)
// as backward_dq.cu's query_grads_kernel computes it (mma.sync):
// the same splits, runs of products, softmax gradient and dropout mask.
//
// Shaped as the forward's wgmma kernel (flash_attention_wgmma.cu),
// which this one follows step for step: a block of two warpgroups (128
// queries: a unit) streams a unit's keys 64 at a time (a step), one block
// an SM taking units in turn, the copies two steps ahead and the split one
// step ahead, under the products (pipeline_wgmma.cuh). Per step and
// warpgroup:
//   1. s (64, 64) = q k^T, issued: q's A fragments from registers (split
//      once a unit), k's straight planes as B (its 8-deep k-steps 0, 1 into
//      s, 2, 3 into ts).
//   2. while it runs: step s + 2's copies, step s + 1's split: k into
//      straight and transposed planes, v into straight ones
//      (detail/split_planes.cuh).
//   3. dp (64, 64) = d_o v^T, issued (d_o's A fragments split from shared
//      memory at each step: registers), v's straight planes as B; while it
//      runs, p = exp2(s scale log2(e) - lse2) (lse2 = hi + lo: detail/lse.cuh). Then dS = p (dP -
//      delta) (with dropout: dS = p (dP m / (1 - p_drop) - delta)), keys
//      >= L zero.
//   4. dq (64, 32) += dS k: dS's A fragments straight from dp's registers,
//      k's transposed planes as B.
//   5. one barrier: step s + 1's planes visible, step s's buffers free.
// After a unit's last step, scale dq goes to the q columns of dqkv.
//
// Shared memory (205 KB from a 1024-byte aligned base), each kind twice:
//   k, v:  straight (hi, lo) planes, 64 rows of 128 bytes
//   k^T:   transposed (hi, lo) planes, 2 atoms of 32 rows of 128 bytes
//   raw:   a step's k rows, then its v rows, (64, 32) at row stride 36
//   q, d_o: a unit's raw (128, 32) each at row stride 36
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/kernel_args.h"
#include "../detail/launch.cuh"
#include "../detail/lse.cuh"
#include "../detail/split_planes.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"
#include "attention_backward.h"
#include "backward_launch.cuh"  // with_kernel_flags
#include "backward_parts.cuh"   // Head, store_tiles
#include "flash_parts.cuh"
#include "mainloop_wgmma.cuh"
#include "pipeline_wgmma.cuh"

namespace fastaxial::cuda {
namespace {

using attention_backward_detail::Head;
using attention_backward_detail::tc::store_tiles;
using attention_backward_detail::tc::row_stats;

struct QgTile {
  static constexpr int HDP = 32, BM = 128, BN = 64, kThreads = 256;
  using Elem = Tf32x3;  // fp32 on the 3xTF32 products (detail/tf32x3.cuh): B operands in Elem::kPlanes planes
  static constexpr int ld = HDP + 4;
  static constexpr int plane = BN * 128;     // a straight plane (64 keys); a transposed one is as large
  static constexpr int operand = Elem::kPlanes * plane;  // a B operand's planes
  static constexpr int buffer = 3 * operand;             // k, v straight and k transposed
  static constexpr int raw_k = BN * ld * 4;
  static constexpr int unit_q = BM * ld * 4;  // q's rows of a unit; d_o's follow
  static constexpr int planes_off = 0;        // buffer b at + b buffer: k, v, k^T
  static constexpr int raw_off = planes_off + 2 * buffer;
  static constexpr int q_off = raw_off + 2 * 2 * raw_k;  // unit buffer u at + 2 u unit_q: q, d_o
  static constexpr int bytes = q_off + 2 * 2 * unit_q + 1024;
  static constexpr int k_pieces = BN * (HDP / 4) / kThreads;
  static constexpr int t_elems = BN * HDP / kThreads;  // elements of k's transposing split
  static_assert(t_elems * kThreads == BN * HDP, "whole rounds");
  static_assert(plane == (BN / 32) * HDP * 128, "transposed planes: 2 atoms of HDP rows");
  static_assert(plane % 1024 == 0 && raw_k % 16 == 0 && unit_q % 16 == 0, "alignment");
  static_assert(k_pieces * kThreads == BN * HDP / 4, "whole rounds");
};
static_assert(QgTile::bytes == kQueryGradsWgmmaSmemBytes, "plan.h sizes the kernel's shared memory");
static_assert(3 * QgTile::BN == kQueryGradsWgmmaMinLen, "the rule's sequences: four key tiles or more");

#if FASTAXIAL_SM90A_DEVICE
// A unit's own rows, copied with its first tile: q's and d_o's BM rows into
// unit buffer ui % 2 (q at base + q_off + 2 (ui % 2) unit_q, d_o unit_q after).
template <class Copy>
__device__ __forceinline__ void copy_unit_rows(const Copy& copy_rows, const AttentionBackwardKernelArgs& a,
                                               const FlashUnit& cu, int64_t ui, uint32_t base, int64_t row_words) {
  const uint32_t qd = base + QgTile::q_off + (uint32_t)((ui & 1) * 2 * QgTile::unit_q);
  copy_rows(Rows<QgTile::BM>(), qd, cu.qg, row_words, cu.q0);
  copy_rows(Rows<QgTile::BM>(), qd + QgTile::unit_q, a.d_o + cu.seq * a.D + cu.col, a.D, cu.q0);
}

// Step st's split into plane buffer st % 2 (pipeline_wgmma.cuh's
// split_stage): k and v into straight planes (q k^T, d_o v^T), k into
// transposed ones (dS k; kmap: TransposeMap).
template <class Map>
__device__ __forceinline__ void split_tile(char* sm, const float* raws, const Map& kmap, int64_t st, int tid) {
  using Tile = QgTile;
  char* pb = sm + Tile::planes_off + (st & 1) * Tile::buffer;
  split_stage<Tile::HDP, Tile::k_pieces, Tile::kThreads>(
      raws, Tile::raw_k, st, tid,
      [&](const float* kr, int r, int c) {
        split_piece<Tile::ld>(kr, pb, Tile::plane, r, c);                                      // k
        split_piece<Tile::ld>(kr + Tile::raw_k / 4, pb + Tile::operand, Tile::plane, r, c);    // v
      },
      [&](const float* kr) { kmap.split(kr, reinterpret_cast<float*>(pb + 2 * Tile::operand), Tile::plane / 4); });
}

// The unit's end: scale dq into dqkv's q columns (backward_parts.cuh's
// store_tiles), the warp's rows p0 + g, p0 + g + 8 of unit cu.
template <bool kVec>
__device__ __forceinline__ void store_dq(const AttentionBackwardKernelArgs& a, const FlashUnit& cu,
                                         const float (&dq)[QgTile::HDP / 2], float scale, int64_t row_words, int hd,
                                         int L, int p0, int g, int t) {
  constexpr int NF = QgTile::HDP / 8;
  const Head hp = {cu.item, cu.seq, a.pos.pos_stride, 0, hd, L, 0, 0};
  store_tiles<NF, kVec>(a.dqkv + cu.col, *reinterpret_cast<const float(*)[NF][4]>(dq), scale, row_words, hp, p0, 0, g,
                        t);
}

// s -> p = 2^(s scale_log2 - lse2) in place (prob_from_lse2), s a score
// tile in the accumulator layout: key 8 jn + 2t + (e & 1) of row g + 8 (e >> 1)
// in s[4 jn + e]; hi, lo: the rows' lse2.
template <int N>
__device__ __forceinline__ void probs_from_scores(float (&s)[N], float scale_log2, const float (&hi)[2],
                                                  const float (&lo)[2]) {
#pragma unroll
  for (int i = 0; i < N; ++i) s[i] = prob_from_lse2(s[i], scale_log2, hi[(i >> 1) & 1], lo[(i >> 1) & 1]);
}

template <int N>
__device__ __forceinline__ void zero(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = 0.0f;
}

// dp -> dS in place, dS = p (dP - delta) (with dropout: p (dP m keep_scale -
// delta), m the keep bit): backward_parts.cuh's softmax_grad_rows on the
// accumulator layout (key 8 jn + 2t + (e & 1) of row g + 8 (e >> 1) in
// x[4 jn + e]), p already in s. Keys k0 + .. >= L zero.
template <int NT, bool kDropout>
__device__ __forceinline__ void grads_from_probs(float (&dp)[4 * NT], const float (&s)[4 * NT],
                                                 const uint32_t (&keep)[NT / 2], const float (&dl)[2],
                                                 float keep_scale, int k0, int L, int t) {
  const bool partial = k0 + 8 * NT > L;
#pragma unroll
  for (int jn = 0; jn < NT; ++jn)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      const float p = s[4 * jn + e];
      float ds;
      if constexpr (kDropout) {
        const bool kept = (keep[jn / 2] >> (16 * (jn % 2) + dropout_bit_rows(t, e))) & 1u;
        const float m = kept ? keep_scale : 0.0f;
        ds = p * fmaf(m, dp[4 * jn + e], -dl[r]);
      } else {
        ds = p * (dp[4 * jn + e] - dl[r]);
      }
      const bool in = !partial || k0 + 8 * jn + 2 * t + (e & 1) < L;
      dp[4 * jn + e] = in ? ds : 0.0f;
    }
}
#endif

// A block's units are u = blockIdx.x, + gridDim.x, ... (unit u: query tile
// u % q_tiles of item u / q_tiles = n heads + h); every unit has two key
// tiles or more (L > 64), so a unit buffer is copied again only after
// every thread has read it (as in the forward's kernel). kVec: 16-byte
// copies and 8-byte stores.
template <bool kVec, bool kDropout>
__global__ void __launch_bounds__(256, 1)
    query_grads_wgmma_kernel(const AttentionBackwardKernelArgs a, float scale, float scale_log2, int q_tiles,
                             const DropoutPass dpass) {
#if FASTAXIAL_SM90A_DEVICE
  using Tile = QgTile;
  using Elem = Tile::Elem;
  constexpr int HDP = Tile::HDP, BM = Tile::BM, BN = Tile::BN, kThreads = Tile::kThreads, LD = Tile::ld;
  constexpr int NT = BN / 8, NO = HDP / 2;
  const int hd = a.D / a.heads, L = (int)a.pos.len;
  uint32_t base;  // the buffers' address in the shared window (pipeline_wgmma.cuh)
  char* sm = aligned_smem(base);
  float* qs = reinterpret_cast<float*>(sm + Tile::q_off);
  float* raws = reinterpret_cast<float*>(sm + Tile::raw_off);
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;

  // Columns hd..31 of the unit buffers (q and d_o, two each) and raw stages (k and v rows each).
  zero_head_padding<HDP, LD, kThreads>(qs, 2 * 2 * BM, raws, 2 * 2 * BN, hd, tid);
  grid_dependency_wait();
  allow_dependent_launch();

  // Unit i of this block: unit_at(i) (flash_parts.cuh); S = 1: no split.
  const BlockUnits<BM, AttentionBackwardKernelArgs> unit_at(a, q_tiles, 1, BN);
  const int64_t steps = unit_at.count * unit_at.tiles, W = unit_at.row_words;
  const HeadRowCopy<HDP, kVec, LD, kThreads> copy_rows{a.pos.pos_stride, L, hd, a.qkv, tid};
  CopyStream<BN, decltype(unit_at)> copy(unit_at);  // as in the forward's kernel (pipeline_wgmma.cuh)
  const auto copy_next = [&]() {
    copy.next(copy_rows, base + Tile::raw_off, Tile::raw_k,
              [&](const FlashUnit& cu, int64_t ui) { copy_unit_rows(copy_rows, a, cu, ui, base, W); },
              [&](const FlashUnit& cu, int m) { return cu.qg + a.D + m * a.D; });  // k, then v D further
  };
  const TransposeMap<LD, Tile::t_elems, kThreads> kmap(tid);
  const auto split_next = [&](int64_t st) { split_tile(sm, raws, kmap, st, tid); };
  stream_start(steps, copy_next, split_next);

  StepCursor step(unit_at);  // the step in the products
  Elem::FragA qa[2], qb[2];  // q's A fragments: k-steps 0, 1 and 2, 3
  const float* dw = nullptr;  // the warp's d_o rows (their fragments are split at each step: registers)
  float hi[2], lo[2], dl[2];  // lse2 (detail/lse.cuh) and delta of rows g, g + 8
  const int64_t n_rows = a.pos.num_seq * a.heads * L;
  UnitDropout<kDropout> dropout(dpass);
  float dq[NO];  // rows g (dq[4f], dq[4f + 1]) and g + 8, columns 8f + 2t, + 1

  for (int64_t st = 0; st < steps; ++st) {
    const FlashUnit& cur = step.cur;
    const int j = step.j;
    if (step.first()) {
      const float* qw = qs + ((step.ui & 1) * 2 * BM + 16 * warp) * LD;
      dw = qw + BM * LD;
      rows_frags<Elem, LD>(qa, qb, qw, g, t);
      row_stats(a, n_rows, cur.item, cur.q0 + 16 * warp + g, L, hi, lo, dl);
      dropout.start(dpass, cur.item, cur.q0 + 16 * warp, L);
      zero(dq);
    }
    // s = q k^T, issued (k-steps 2, 3 into ts); while it runs, the copies and split ahead.
    const uint32_t kb = base + Tile::planes_off + (uint32_t)((st & 1) * Tile::buffer);
    float s[BN / 2], ts[BN / 2];
    rows_times_plane<Elem, BN, true>(s, ts, qa, qb, kb, Tile::plane);
    stream_ahead(st, steps, copy_next, split_next);

    uint32_t keep[NT / 2];
    dropout.template keep_bits<NT>(keep, j * BN, L, g, t);
    rows_times_plane_done<Elem, BN>(s, ts, qa, qb);
    // dp (64, 64) = d_o v^T, issued (k-steps 2, 3 into tdp); p from s while it runs.
    float dp[BN / 2], tdp[BN / 2];
    Elem::FragA da[2], db[2];
    rows_frags<Elem, LD>(da, db, dw, g, t);
    rows_times_plane<Elem, BN, true>(dp, tdp, da, db, kb + Tile::operand, Tile::plane);
    probs_from_scores(s, scale_log2, hi, lo);
    rows_times_plane_done<Elem, BN>(dp, tdp, da, db);
    grads_from_probs<NT, kDropout>(dp, s, keep, dl, dpass.scale, j * BN, L, t);

    // dq += dS k, k^T's planes as B (as the forward's p v).
    tile_times_planes<Elem, HDP, true>(dq, dp, kb + 2 * Tile::operand, HDP * 128, Tile::plane);
    if (step.last()) store_dq<kVec>(a, cur, dq, scale, W, hd, L, cur.q0 + 16 * warp, g, t);  // the unit's last tile
    step.advance(unit_at, unit_at.count);
    stream_barrier(st, steps);
  }
#else
  (void)a, (void)scale, (void)scale_log2, (void)q_tiles, (void)dpass;
  __trap();  // built without sm_90a: attention_grad_variant never picks it there
#endif
}

template <bool kVec, bool kDropout>
cudaError_t launch(const AttentionBackwardArgs& a, float scale, const DropoutPass& dpass, const DeviceCaps& dev,
                   cudaStream_t stream) {
  constexpr auto kernel = query_grads_wgmma_kernel<kVec, kDropout>;
  if ((size_t)QgTile::bytes > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int L = (int)a.pos.len;
  const int q_tiles = (L + QgTile::BM - 1) / QgTile::BM;
  const int64_t units = a.pos.num_seq * a.heads * q_tiles;
  const int64_t blocks = std::min<int64_t>(units, std::max(dev.sms, 1));
  const AttentionBackwardKernelArgs k = {a.pos, a.qkv, a.o, a.d_o, a.lse, a.delta, a.dqkv, a.D, a.heads, nullptr};
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(QgTile::kThreads), QgTile::bytes, stream, dev, k, scale,
                               scale * kLog2e, q_tiles, dpass);
}

}  // namespace

cudaError_t query_grads_wgmma(const AttentionBackwardArgs& a, bool vec, float scale, const DropoutPass& dpass,
                              const DeviceCaps& dev, cudaStream_t stream) {
  // Units of two key tiles or more (L > 64); L below 2^30, as attention_backward checks.
  if (a.heads <= 0 || a.D % a.heads != 0 || flash_padded_head_dim(a.D / a.heads) != 32 || a.pos.len <= QgTile::BN ||
      a.pos.len >= (int64_t{1} << 30))
    return cudaErrorInvalidValue;
  if (a.pos.num_seq <= 0) return a.pos.num_seq == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return attention_backward_detail::with_kernel_flags(vec, dpass.threshold != 0, [&](auto v, auto dropout) {
    return launch<decltype(v)::value, decltype(dropout)::value>(a, scale, dpass, dev, stream);
  });
}

}  // namespace fastaxial::cuda
