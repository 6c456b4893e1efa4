// Parts the flash kernels are built from, shared by the forward kernels
// (flash_attention.cu on mma.sync, flash_attention_wgmma*.cu on wgmma) and the
// query-side backward on wgmma (query_grads_wgmma.cu):
//   - the work-unit scheduler: which (sequence, head, query tile, key split)
//     a block takes, one unit a block (mma.sync) or units in turn (wgmma);
//   - the step cursor of a block's stream of (unit, key tile) steps;
//   - a warp's output rows: the accumulators of o with the online softmax,
//     and the epilogue that stores o / l and the lse, or a split's partials;
//   - the attention dropout of a unit's rows.
// The mainloops (the products of one key tile) are per instruction family:
// mainloop_mma.cuh and mainloop_wgmma.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../../common/dropout.h"
#include "../detail/kernel_args.h"
#include "../detail/online_softmax.cuh"

namespace fastaxial::cuda {

// ---- The scheduler ----------------------------------------------------------
// Unit u is query tile u % q_tiles of split (u / q_tiles) % S of item
// u / (q_tiles S) = n heads + h. A unit: its item, split, first query and the
// split's key tiles j0 .. j1 - 1 (of `tiles`: S contiguous ranges); seq, the
// row of its sequence's position 0; col = h hd; qg, its q columns in row 0 (k
// at + D, v at + 2D).
struct FlashUnit {
  int64_t item;
  int split, q0, j0, j1;
  int64_t seq;
  int col;
  const float* qg;
};

// The unit of a block that takes one, u = blockIdx.x (fewer than 2^32
// blocks, so 32-bit index arithmetic): its item = n heads + h, split and
// first query (BM queries a tile); S = splits under kSplit, else 1.
struct BlockUnit {
  int64_t item, n;
  int h, split, q0;
};
template <bool kSplit>
__device__ __forceinline__ BlockUnit flash_block_unit(int q_tiles, int splits, int heads, int BM) {
  BlockUnit x;
  x.q0 = (int)(blockIdx.x % (unsigned)q_tiles) * BM;
  const unsigned rest = blockIdx.x / (unsigned)q_tiles;  // item [* splits + split]
  x.split = kSplit ? (int)(rest % (unsigned)splits) : 0;
  x.item = kSplit ? rest / (unsigned)splits : rest;
  x.h = (int)(x.item % heads);
  x.n = x.item / heads;
  return x;
}

// The units a block takes of `units` when blocks take units in turn:
// u = blockIdx.x, + gridDim.x, ... (one block an SM, so that the steps of
// consecutive units form one stream).
__device__ __forceinline__ int64_t flash_block_units(int64_t units) {
  return (units - blockIdx.x + gridDim.x - 1) / gridDim.x;
}

// The key tiles [x, y) of split `split` of S over `tiles`: contiguous, in split order.
__device__ __forceinline__ int2 split_key_range(int tiles, int split, int S) {
  return make_int2((int)((int64_t)tiles * split / S), (int)((int64_t)tiles * (split + 1) / S));
}

// Unit i of this block (u = blockIdx.x + i gridDim.x): BM queries a tile, S splits of `tiles` key tiles.
// row_words: floats a row of qkv (3D). Args: the kernel's argument struct (pos, qkv, heads).
template <int BM, class Args>
__device__ __forceinline__ FlashUnit flash_unit(const Args& a, int64_t i, int q_tiles, int S, int tiles, int hd,
                                                int64_t row_words) {
  const int64_t u = blockIdx.x + i * gridDim.x;
  FlashUnit x;
  x.q0 = (int)(u % q_tiles) * BM;
  const int64_t rest = u / q_tiles;
  x.split = (int)(rest % S);
  x.item = rest / S;
  const int2 keys = split_key_range(tiles, x.split, S);
  x.j0 = keys.x;
  x.j1 = keys.y;
  const int h = (int)(x.item % a.heads);
  x.seq = a.pos.offset(x.item / a.heads, 0);
  x.col = h * hd;
  x.qg = a.qkv + x.seq * row_words + x.col;
  return x;
}

// A block's units when blocks take units in turn (flash_block_units), as the
// wgmma kernels walk them: `count` units, unit i by unit_at(i) (flash_unit),
// `tiles` key tiles a sequence of BN keys each, S splits of them.
template <int BM, class Args>
struct BlockUnits {
  const Args& a;
  int q_tiles, S, tiles, hd;
  int64_t row_words, count;  // row_words: floats a row of qkv (3D)

  __device__ __forceinline__ BlockUnits(const Args& args, int q_tiles_, int S_, int BN)
      : a(args),
        q_tiles(q_tiles_),
        S(S_),
        tiles(((int)args.pos.len + BN - 1) / BN),
        hd(args.D / args.heads),
        row_words(3 * (int64_t)args.D),
        count(flash_block_units(args.pos.num_seq * args.heads * (int64_t)q_tiles_ * S_)) {}
  __device__ __forceinline__ FlashUnit operator()(int64_t i) const {
    return flash_unit<BM>(a, i, q_tiles, S, tiles, hd, row_words);
  }
};

// A cursor over a block's stream of steps when it takes units in turn: step
// (ui, j) is key tile j of the block's unit ui (cur), unit_at(i) giving unit
// i. The products walk the stream with one cursor, the copies run ahead of
// them with another.
struct StepCursor {
  FlashUnit cur;
  int64_t ui = 0;
  int j = 0;

  template <class UnitAt>
  __device__ __forceinline__ explicit StepCursor(UnitAt&& unit_at) : cur(unit_at(0)), j(cur.j0) {}
  __device__ __forceinline__ bool first() const { return j == cur.j0; }
  __device__ __forceinline__ bool last() const { return j + 1 == cur.j1; }
  // To the next step: the next unit's first after a unit's last, where the block has one (of `units`).
  template <class UnitAt>
  __device__ __forceinline__ void advance(UnitAt&& unit_at, int64_t units) {
    if (!last()) {
      ++j;
    } else if (++ui < units) {
      cur = unit_at(ui);
      j = cur.j0;
    }
  }
};

// ---- A warp's output rows ------------------------------------------------------
// The warp's 16 query rows of a unit: o (16, 8 NF) in the accumulator layout
// of detail/online_softmax.cuh (o[4f + e]: rows g (e < 2) and g + 8, columns
// 8f + 2t + (e & 1)) and the rows' online softmax. reset() at a unit's start,
// step() on each key tile's scores, store() or store_partials() at its end.
template <int NF>
struct FlashRows {
  float o[4 * NF];
  RowSoftmax softmax;

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int i = 0; i < 4 * NF; ++i) o[i] = 0.0f;
    softmax = RowSoftmax{};
  }
  __device__ __forceinline__ float& at(int f, int e) { return o[4 * f + e]; }
  // Column group f as an mma.sync accumulator.
  __device__ __forceinline__ float (&group(int f))[4] { return *reinterpret_cast<float(*)[4]>(o + 4 * f); }

  // One key tile of NT column groups (keys key0 ..): the scores s (unscaled)
  // become p = 2^(s scale_log2 - m), o and l are rescaled to the new maxima.
  template <int NT, class S>
  __device__ __forceinline__ void step(S&& s, float scale_log2, int key0, int L, int t) {
    softmax.step<NT, NF>(s, [&](int f, int e) -> float& { return at(f, e); }, scale_log2, key0, L, t);
  }

  // The unit's end: o / l (times num: dropout's 1 / (1 - p), else 1) into the
  // warp's rows r0 = q0 + 16 warp + g and r0 + 8 of item `item`, whose
  // position 0 is row seq (a.pos, rows of D floats), columns col ..; with
  // a.lse, the rows' lse2. Out float: into a.o; a 16-bit type: into a.o16,
  // rounded to it.
  template <class Out = float>
  __device__ __forceinline__ void store(const AttentionKernelArgs& a, float num, int64_t seq, int col, int64_t item,
                                        int r0, int L, int hd, int t) {
    softmax.sum_rows();
    Out* out = std::is_same_v<Out, float> ? reinterpret_cast<Out*>(a.o) : static_cast<Out*>(a.o16);
    softmax.store_rows<NF>([&](int f, int e) -> float& { return at(f, e); }, num, out + seq * a.D + col,
                           a.pos.pos_stride * a.D, r0, L, hd, t, a.lse, a.pos.num_seq * a.heads * L, item * L);
  }

  // store's end both ways: o / l into a.o and rounded to Out16 into a.o16 (the 16-bit training
  // forward keeps both), the lse once.
  template <class Out16>
  __device__ __forceinline__ void store_both(const AttentionKernelArgs& a, float num, int64_t seq, int col,
                                             int64_t item, int r0, int L, int hd, int t) {
    softmax.sum_rows();
    const auto o = [&](int f, int e) -> float& { return at(f, e); };
    const int64_t stride = a.pos.pos_stride * a.D;
    softmax.store_rows<NF>(o, num, static_cast<Out16*>(a.o16) + seq * a.D + col, stride, r0, L, hd, t, nullptr, 0, 0);
    softmax.store_rows<NF>(o, num, a.o + seq * a.D + col, stride, r0, L, hd, t, a.lse, a.pos.num_seq * a.heads * L,
                           item * L);
  }

  // The end on 16-bit products (Out16): into a.o16 rounded where it is given, a.o too where that is
  // given as well (store_both); without a.o16, into a.o (store).
  template <class Out16>
  __device__ __forceinline__ void store_16bit(const AttentionKernelArgs& a, float num, int64_t seq, int col,
                                              int64_t item, int r0, int L, int hd, int t) {
    if (a.o16 == nullptr)
      store(a, num, seq, col, item, r0, L, hd, t);
    else if (a.o != nullptr)
      store_both<Out16>(a, num, seq, col, item, r0, L, hd, t);
    else
      store<Out16>(a, num, seq, col, item, r0, L, hd, t);
  }

  // A split's end: its unnormalised o, m and l of the rows into sp.partials.
  __device__ __forceinline__ void store_partials(const FlashPartials& sp, int split, int64_t item, int r0, int L, int hd,
                                                 int t) {
    softmax.sum_rows();
    softmax.store_partials<NF>([&](int f, int e) -> float& { return at(f, e); }, sp, split, item, r0, L, hd, t);
  }
};

// ---- Attention dropout of a unit's rows -----------------------------------------
// With kDropout, the keep mask (common/dropout.h) of the warp's 16 rows: the
// Philox state read once a kernel, the rows' first element set once a unit,
// a key tile's keep bits drawn before its scores are live (fewer registers
// at once). Without, nothing: the kernels without dropout carry none of it.
template <bool kDropout>
struct UnitDropout {
  DropoutParams drop;
  uint64_t e_warp = 0;  // element of the warp's first query row, key 0

  __device__ __forceinline__ explicit UnitDropout(const DropoutPass& dpass) {
    if constexpr (kDropout) drop = dropout_read(dpass);
  }
  __device__ __forceinline__ void start(const DropoutPass& dpass, int64_t item, int row0, int L) {
    if constexpr (kDropout) e_warp = dpass.base + ((uint64_t)item * (uint64_t)L + (uint64_t)row0) * (uint64_t)L;
  }
  // The keep bits of a tile of NT column groups from key0: groups jn, jn + 1 in keep[jn / 2], 16 bits each.
  template <int NT>
  __device__ __forceinline__ void keep_bits(uint32_t (&keep)[NT / 2], int key0, int L, int g, int t) const {
    if constexpr (kDropout) dropout_keep_rows<NT>(keep, drop, e_warp, key0, L, g, t);
  }
  // Dropped p zeroed, after the row sums took them (the kept ones' scale comes with 1 / l).
  template <int NT, class S>
  __device__ __forceinline__ void apply(S&& s, const uint32_t (&keep)[NT / 2], int t) const {
    if constexpr (kDropout) drop_probs<NT>(s, keep, t);
  }
};

// A key tile's scores through the online softmax (FlashRows::step), then dropout: NT column
// groups from key0, s(jn, e) the scores in mma.sync's C layout. The keep bits are drawn before
// the scores are live (fewer registers at once); dropped p are zeroed after the row sums took
// them (the kept ones' scale comes with 1 / l).
template <int NT, int NF, bool kDropout, class S>
__device__ __forceinline__ void softmax_tile(FlashRows<NF>& rows, const UnitDropout<kDropout>& dropout, S&& s,
                                             float scale_log2, int key0, int L, int g, int t) {
  uint32_t keep[NT / 2];
  dropout.template keep_bits<NT>(keep, key0, L, g, t);
  rows.template step<NT>(s, scale_log2, key0, L, t);
  dropout.template apply<NT>(s, keep, t);
}

}  // namespace fastaxial::cuda
