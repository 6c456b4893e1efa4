// The flash attention step (flash_attention.h) on Hopper's warpgroup
// products (wgmma, sm_90a), for padded head dim 32 and sequences of two key
// tiles or more: for each sequence n and head h,
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h
// with the per-row log-sum-exp and attention dropout as the mma.sync kernel
// of flash_attention.cu computes them: the same splits, runs of products,
// softmax and mask (q k^T sums its features in natural order here, permuted
// inside each group of 8 there; on an H200 the two kernels' o and lse have
// come out bitwise equal).
//
// Why a second kernel. The mma.sync kernel gives each warp 16 queries and
// builds every B fragment from shared memory, split on the fly, for each
// warp; at head dim 32 it runs well below the rate the wgmma GEMMs reach.
// Here a warpgroup (4 warps) owns 64
// queries and issues each product as asynchronous 64 x N x 8 steps whose B
// operand the tensor cores read from shared memory; k and v are split into
// TF32 (hi, lo) planes once a tile for the whole block, not once a warp,
// and that split runs while the tile before it is in the products.
//
// Shape of the work. A block (two warpgroups, 128 queries: a unit) streams
// a unit's keys 64 at a time (a step), and takes units in turn: one block
// an SM (its registers and shared memory), units u = blockIdx.x, +
// gridDim.x, ... (unit u: query tile u % q_tiles of item u / q_tiles =
// n heads + h), so the steps of consecutive units form one stream and a
// unit's first copies overlap the last products of the one before. Step s:
//   1. s (64, 64) = q k^T per warpgroup, issued: q's A fragments from
//      registers (split once a unit), k's (hi, lo) planes as B (keys as
//      128-byte rows, the swizzled layout of detail/wgmma.cuh).
//   2. while it runs (the pipeline of pipeline_wgmma.cuh): step s + 2's
//      cp.async copies (raw k and v rows, and q with a unit's first step)
//      and step s + 1's split: k's rows rounded to TF32 into the hi plane,
//      the rest into the lo plane; v transposed into v^T's planes, keys
//      permuted inside each group of 8 (slot t for key 2t, t + 4 for key
//      2t + 1).
//   3. the online softmax on s in registers (wgmma's accumulator layout is
//      mma.sync's C layout per warp, so this is flash_attention.cu's code).
//   4. o (64, 32) += p v: p's A fragments straight from s's registers (k in
//      the permuted order), v^T's planes as B.
//   5. one barrier: step s + 1's planes visible, step s's buffers free.
// 3xTF32 throughout (the element traits Tf32x3 of detail/tf32x3.cuh, the
// mainloop parts' Elem): lo*hi, hi*lo, hi*hi a step, runs of two 8-deep
// steps into fresh accumulators, each added to its total in fp32.
//
// Shared memory (137 KB from a 1024-byte aligned base), each kind twice:
//   k:   (hi, lo) planes, 64 rows of 128 bytes (features 0..31)
//   v^T: (hi, lo) planes, 2 atoms (keys 0..31, 32..63) of 32 rows of 128 bytes
//   raw: a step's k rows, then its v rows, (64, 32) at row stride 36
//   q:   a unit's raw (128, 32) at row stride 36
// Positions >= L are zero-filled by the copies and their scores set to
// -inf; columns hd..31 are zeroed once and never copied.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/lse.cuh"
#include "../detail/online_softmax.cuh"
#include "../detail/split_planes.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"
#include "flash_attention.h"
#include "flash_parts.cuh"
#include "mainloop_wgmma.cuh"
#include "pipeline_wgmma.cuh"

namespace fastaxial::cuda {
namespace {

// Sizes and byte offsets of a block's shared memory (see the header comment).
template <int HDP>
struct WgFlashTile {
  static_assert(HDP == 32, "k rows are one 128-byte swizzle row; head dim 16 measured slower than mma.sync");
  static constexpr int BM = 128, BN = 64, kThreads = 256;  // two warpgroups of 64 queries
  using Elem = Tf32x3;  // fp32 on the 3xTF32 products (detail/tf32x3.cuh): B operands in Elem::kPlanes planes
  static constexpr int ld = HDP + 4;  // raw rows: conflict-free fragment and transposing reads
  static constexpr int k_plane = BN * 128;
  static constexpr int vt_atom = HDP * 128;  // 32 keys of every feature
  static constexpr int vt_plane = (BN / 32) * vt_atom;
  static constexpr int raw_k = BN * ld * 4;  // a stage: k's rows, then v's
  static constexpr int k_buf = Elem::kPlanes * k_plane, vt_buf = Elem::kPlanes * vt_plane;  // a buffer's planes
  // Two buffers of each kind: q (a unit's while the next one's comes), raw rows (step s + 1's
  // being split while step s + 2's arrive) and planes (step s's in the products while step
  // s + 1's are written).
  static constexpr int k_off = 0;  // k's planes, buffer b at + b k_buf
  static constexpr int vt_off = k_off + 2 * k_buf;
  static constexpr int raw_off = vt_off + 2 * vt_buf;
  static constexpr int q_off = raw_off + 2 * 2 * raw_k;
  static constexpr int bytes = q_off + 2 * BM * ld * 4 + 1024;  // + room to align the base
  // Per thread and tile: 16-byte pieces of k split, elements of v transposed and split.
  static constexpr int k_pieces = BN * (HDP / 4) / kThreads, v_elems = BN * HDP / kThreads;
  static_assert(k_plane % 1024 == 0 && vt_atom % 1024 == 0 && raw_k % 16 == 0 && (ld * 4) % 16 == 0,
                "swizzled planes on 1024-byte boundaries, cp.async rows on 16-byte ones");
  static_assert(k_pieces * kThreads == BN * (HDP / 4) && v_elems * kThreads == BN * HDP, "whole rounds");
  static_assert(BM == kFlashWgmmaQueryTile && bytes == flash_wgmma_smem_bytes(HDP), "common/smem_layout.h's sizes");
};

#if FASTAXIAL_SM90A_DEVICE
// A unit's own rows, copied with its first tile: q's BM rows into q buffer
// ui % 2 (at base + q_off + (ui % 2) BM LD floats).
template <int HDP, class Copy>
__device__ __forceinline__ void copy_unit_rows(const Copy& copy_rows, const FlashUnit& cu, int64_t ui, uint32_t base,
                                               int64_t row_words) {
  using Tile = WgFlashTile<HDP>;
  copy_rows(Rows<Tile::BM>(), base + Tile::q_off + (uint32_t)((ui & 1) * Tile::BM * Tile::ld * 4), cu.qg, row_words,
            cu.q0);
}

// Step st's split into plane buffer st % 2 (pipeline_wgmma.cuh's
// split_stage): k's rows into straight planes (q k^T), v's into transposed
// ones (p v; vmap: TransposeMap).
template <int HDP, class Map>
__device__ __forceinline__ void split_tile(char* sm, const float* raws, const Map& vmap, int64_t st, int tid) {
  using Tile = WgFlashTile<HDP>;
  char* kp = sm + Tile::k_off + (st & 1) * Tile::k_buf;
  split_stage<HDP, Tile::k_pieces, Tile::kThreads>(
      raws, Tile::raw_k, st, tid,
      [&](const float* kr, int r, int c) { split_piece<Tile::ld>(kr, kp, Tile::k_plane, r, c); },
      [&](const float* kr) {
        vmap.split(kr + Tile::raw_k / 4, reinterpret_cast<float*>(sm + Tile::vt_off + (st & 1) * Tile::vt_buf),
                   Tile::vt_plane / 4);
      });
}
#endif

// A block's units (a unit: 128 queries of one (sequence, head); unit u is
// query tile u % q_tiles of item u / q_tiles = n heads + h) are u =
// blockIdx.x, + gridDim.x, ...; their key tiles run as one stream of steps,
// so the copies and splits of a unit's first tiles overlap the products of
// the one before it. Every unit has two key tiles or more (L > 64): the q
// buffer of unit i + 2 is then copied after every thread read unit i's q.
// kVec: 16-byte copies.
template <int HDP, bool kVec, bool kDropout>
__global__ void __launch_bounds__(256, 1)
    flash_wgmma_kernel(const AttentionKernelArgs a, float scale_log2, int q_tiles, const DropoutPass dpass) {
#if FASTAXIAL_SM90A_DEVICE
  using Tile = WgFlashTile<HDP>;
  using Elem = typename Tile::Elem;
  constexpr int BM = Tile::BM, BN = Tile::BN, kThreads = Tile::kThreads, LD = Tile::ld;
  constexpr int NT = BN / 8, NO = HDP / 2;  // key n-tiles, o accumulators
  const int hd = a.D / a.heads, L = (int)a.pos.len;
  uint32_t base;  // the buffers' address in the shared window (pipeline_wgmma.cuh)
  char* sm = aligned_smem(base);
  float* qs = reinterpret_cast<float*>(sm + Tile::q_off);       // q buffer b at + b BM LD: (BM, HDP), stride LD
  float* raws = reinterpret_cast<float*>(sm + Tile::raw_off);   // stage s: k rows, then v rows, stride LD
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;

  // Columns hd..HDP-1 of both q buffers and both raw stages (k and v rows each): no input, so
  // before the wait for the kernel before.
  zero_head_padding<HDP, LD, kThreads>(qs, 2 * BM, raws, 2 * 2 * BN, hd, tid);
  grid_dependency_wait();
  allow_dependent_launch();

  // Unit i of this block: unit_at(i) (flash_parts.cuh); S = 1: no split.
  const BlockUnits<BM, AttentionKernelArgs> unit_at(a, q_tiles, 1, BN);
  const int64_t steps = unit_at.count * unit_at.tiles, row_words = unit_at.row_words;
  const HeadRowCopy<HDP, kVec, LD, kThreads> copy_rows{a.pos.pos_stride, L, hd, a.qkv, tid};
  CopyStream<BN, decltype(unit_at)> copy(unit_at);  // the copies, ahead of the products (pipeline_wgmma.cuh)
  const auto copy_next = [&]() {
    copy.next(copy_rows, base + Tile::raw_off, Tile::raw_k,
              [&](const FlashUnit& cu, int64_t ui) { copy_unit_rows<HDP>(copy_rows, cu, ui, base, row_words); },
              [&](const FlashUnit& cu, int m) { return cu.qg + (m + 1) * a.D; });  // k at qg + D, v at qg + 2D
  };
  const TransposeMap<LD, Tile::v_elems, kThreads> vmap(tid);
  const auto split_next = [&](int64_t st) { split_tile<HDP>(sm, raws, vmap, st, tid); };
  stream_start(steps, copy_next, split_next);

  FlashUnit cur;  // the unit in the products, ui of the block's: step st is its tile j
  int64_t ui = 0;
  int j = 0;
  typename Elem::FragA qa[2], qb[2];  // q's A fragments, made once a unit: steps 0, 1 in qa, 2, 3 in qb
  UnitDropout<kDropout> dropout(dpass);
  FlashRows<NO / 4> rows;  // the warp's 16 rows of o (flash_parts.cuh)

  // Step s = tile j of unit ui: its planes are split and visible, step s + 1's raw rows are in.
  for (int64_t st = 0; st < steps; ++st) {
    if (j == 0) {
      cur = unit_at(ui);
      rows_frags<Elem, LD>(qa, qb, qs + ((ui & 1) * BM + 16 * warp) * LD, g, t);  // the warp's q rows
      dropout.start(dpass, cur.item, cur.q0 + 16 * warp, L);
      rows.reset();
    }
    // s (64, BN) = q k^T, issued: s[4 jn + e] is key 8 jn + 2t + e of row g, s[4 jn + 2 + e] of
    // row g + 8 (steps 2, 3 into ts). While the products run, the copies and split ahead.
    float s[BN / 2], ts[BN / 2];
    rows_times_plane<Elem, BN>(s, ts, qa, qb, base + Tile::k_off + (uint32_t)((st & 1) * Tile::k_buf), Tile::k_plane);
    stream_ahead(st, steps, copy_next, split_next);

    uint32_t keep[NT / 2];
    dropout.template keep_bits<NT>(keep, j * BN, L, g, t);
    rows_times_plane_done<Elem, BN>(s, ts, qa, qb);

    // Scores in base 2, keys >= L at -inf, the online softmax; dropped p
    // zeroed after the row sums.
    const auto sx = [&](int jn, int e) -> float& { return s[4 * jn + e]; };
    rows.template step<NT>(sx, scale_log2, j * BN, L, t);
    dropout.template apply<NT>(sx, keep, t);

    // o += p v, v^T's planes as B.
    tile_times_planes<Elem, HDP>(rows.o, s, base + Tile::vt_off + (uint32_t)((st & 1) * Tile::vt_buf), Tile::vt_atom,
                                 Tile::vt_plane);

    if (++j == unit_at.tiles) {  // the unit's last tile: o / l and the lse out
      j = 0;
      ++ui;
      rows.store(a, kDropout ? dpass.scale : 1.0f, cur.seq, cur.col, cur.item, cur.q0 + 16 * warp + g, L, hd, t);
    }
    stream_barrier(st, steps);
  }
#else
  (void)a, (void)scale_log2, (void)q_tiles, (void)dpass;
  __trap();  // built without sm_90a: flash_attention_variant never picks it there
#endif
}

template <int HDP, bool kVec, bool kDropout>
cudaError_t launch(const FlashArgs& a, float scale_log2, const DeviceCaps& dev, cudaStream_t stream) {
  using Tile = WgFlashTile<HDP>;
  constexpr auto kernel = flash_wgmma_kernel<HDP, kVec, kDropout>;
  if ((size_t)Tile::bytes > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int L = (int)a.pos.len;
  if (L <= Tile::BN) return cudaErrorInvalidValue;  // units of two key tiles or more
  const int q_tiles = (L + Tile::BM - 1) / Tile::BM;
  const int64_t units = a.pos.num_seq * a.heads * q_tiles;  // <= flash_attention's count of 64-query tiles
  const int64_t blocks = std::min<int64_t>(units, std::max(dev.sms, 1));  // a block an SM, taking units in turn
  const AttentionKernelArgs k = flash_kernel_args(a);
  const DropoutPass dpass = kDropout ? dropout_pass(a.dropout, a.pass, a.philox) : DropoutPass{};
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(Tile::kThreads), Tile::bytes, stream, dev, k, scale_log2,
                               q_tiles, dpass);
}

template <int HDP>
cudaError_t launch(const FlashArgs& a, bool vec, float scale_log2, const DeviceCaps& dev, cudaStream_t stream) {
  return with_bools(
      [&](auto v, auto d) {
        if constexpr (decltype(d)::value && !kDropoutAvailable)
          return cudaErrorInvalidValue;  // never asked for
        else
          return launch<HDP, decltype(v)::value, decltype(d)::value>(a, scale_log2, dev, stream);
      },
      vec, kDropoutAvailable && a.dropout.threshold != 0);
}

}  // namespace

cudaError_t flash_attention_wgmma(const FlashArgs& a, bool vec, float scale_log2, const DeviceCaps& dev,
                                  cudaStream_t stream) {
  if (a.heads <= 0 || a.D % a.heads != 0 || flash_padded_head_dim(a.D / a.heads) != 32) return cudaErrorInvalidValue;
  if (a.pos.num_seq <= 0) return a.pos.num_seq == 0 ? cudaSuccess : cudaErrorInvalidValue;
  return launch<32>(a, vec, scale_log2, dev, stream);
}

}  // namespace fastaxial::cuda
