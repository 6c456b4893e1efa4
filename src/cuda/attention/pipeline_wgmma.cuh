// The copy and split pipeline of the head-dim-32 wgmma kernels
// (flash_attention_wgmma.cu, query_grads_wgmma.cu). A block streams its
// units' key tiles as steps (flash_parts.cuh: BlockUnits, StepCursor); while
// step s is in the products, step s + 2's raw k and v rows come by cp.async
// into the raw stage step s left, and step s + 1's are split into TF32
// (hi, lo) planes (detail/split_planes.cuh) in the other plane buffer: two
// raw stages, two plane buffers, one barrier a step. Each kernel keeps its
// own layout and passes it in: where its stages and buffers are, the rows a
// unit's first step brings besides k and v (q; q and d_o), which planes its
// split writes.
//   zero_head_padding, HeadRowCopy: the raw rows' padding and copies;
//   CopyStream, split_stage: a step's copies and a step's split;
//   stream_start, stream_ahead, stream_barrier: where in a step they run.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../detail/async_copy.cuh"
#include "../detail/wgmma.cuh"
#include "flash_parts.cuh"

#if FASTAXIAL_SM90A_DEVICE
namespace fastaxial::cuda {

// Columns hd..HDP-1 of the block's row buffers (row stride LD): q_rows rows
// at qs, then raw_rows rows at raws. Zero for the whole block: the copies
// never write them, and the split carries the zeros into the planes.
template <int HDP, int LD, int kThreads>
__device__ __forceinline__ void zero_head_padding(float* qs, int q_rows, float* raws, int raw_rows, int hd, int tid) {
  if (hd < HDP) {
    const int pad = HDP - hd;
    for (int e = tid; e < (q_rows + raw_rows) * pad; e += kThreads) {
      const int r = e / pad, c = hd + e % pad;
      if (r < q_rows)
        qs[r * LD + c] = 0.0f;
      else
        raws[(r - q_rows) * LD + c] = 0.0f;  // the raw rows are contiguous
    }
  }
}

// A row count as a type, HeadRowCopy's first argument: copy_rows(Rows<BM>(), ...).
template <int N>
using Rows = std::integral_constant<int, N>;

// cp.async copies by the block's kThreads threads of rows p0 .. p0 + ROWS - 1
// of a head slice (src: its row 0; a position ps rows of `words` floats
// further) into shared memory at dst (row stride LD); positions >= L as
// zeros (read from fill, any valid address).
template <int HDP, bool kVec, int LD, int kThreads>
struct HeadRowCopy {
  int64_t ps;
  int L, hd;
  const float* fill;
  int tid;

  template <int ROWS>
  __device__ __forceinline__ void operator()(Rows<ROWS>, uint32_t dst, const float* src,
                                             int64_t words, int p0) const {
    const auto at = [&](int l, int c) { return src + l * ps * words + c; };
    copy_head_rows<HDP, kVec, 4>(dst, RowMajor<LD>(), at, p0, ROWS, L, hd, fill, tid, kThreads);
  }
};

// The copy side of the stream: a cursor over the block's units (unit_at)
// one or two steps ahead of the products, and the step it copies next, cs,
// whose raw stage is cs % 2. next() is step cs's copies: with a unit's first
// tile unit_rows(unit, ui), the unit's own rows; then the tile's k rows (head
// slice slice(unit, 0)) into raw stage cs % 2 at raw + 2 (cs % 2) raw_k
// bytes, its v rows (slice(unit, 1)) raw_k after. A slice is asked for where
// its copy starts, so that a kernel's address arithmetic keeps its place
// among the copies. One commit group a step, so that a wait for all leaves
// none in flight; then the cursor and cs move on.
template <int BN, class Units>
struct CopyStream {
  const Units& unit_at;
  StepCursor cursor;
  int64_t cs = 0;

  __device__ __forceinline__ explicit CopyStream(const Units& units) : unit_at(units), cursor(units) {}

  template <class Copy, class UnitRows, class Slice>
  __device__ __forceinline__ void next(const Copy& copy_rows, uint32_t raw, int raw_k, UnitRows&& unit_rows,
                                       Slice&& slice) {
    const FlashUnit& cu = cursor.cur;
    if (cursor.first()) unit_rows(cu, cursor.ui);
    const uint32_t d = raw + (uint32_t)((cs & 1) * 2 * raw_k);
    copy_rows(Rows<BN>(), d, slice(cu, 0), unit_at.row_words, cursor.j * BN);
    copy_rows(Rows<BN>(), d + raw_k, slice(cu, 1), unit_at.row_words, cursor.j * BN);
    copy_async_commit();
    ++cs;
    cursor.advance(unit_at, unit_at.count);
  }
};

// Step st's split from raw stage st % 2 (k's rows at kr = raws + 2 (st % 2)
// raw_k bytes, v's raw_k after): piece(kr, r, c) for each of the thread's
// kPieces 16-byte pieces (features 4c .. 4c + 3 of row r; the straight
// planes), then transpose(kr) (the transposed planes: TransposeMap).
template <int HDP, int kPieces, int kThreads, class Piece, class Transpose>
__device__ __forceinline__ void split_stage(const float* raws, int raw_k, int64_t st, int tid, Piece&& piece,
                                            Transpose&& transpose) {
  const float* kr = raws + (st & 1) * 2 * (raw_k / 4);
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int e = tid + i * kThreads;
    piece(kr, e / (HDP / 4), e % (HDP / 4));
  }
  transpose(kr);
}

// The pipeline's start: steps 0 and 1 copied (copy_next: CopyStream::next), step 0
// split (split(st): split_stage) and its planes visible to wgmma.
template <class CopyNext, class Split>
__device__ __forceinline__ void stream_start(int64_t steps, CopyNext&& copy_next, Split&& split) {
  copy_next();
  if (steps > 1) copy_next();
  copy_async_wait<0>();
  __syncthreads();
  split(0);
  fence_async_smem();  // the planes were written by ordinary stores; wgmma reads them through the async proxy
  __syncthreads();
}

// While step st's products run: step st + 2's copies into the stage step st
// left, and step st + 1's split into the other plane buffer (both free:
// every warpgroup finished step st - 1 before the last barrier).
template <class CopyNext, class Split>
__device__ __forceinline__ void stream_ahead(int64_t st, int64_t steps, CopyNext&& copy_next, Split&& split) {
  if (st + 2 < steps) copy_next();
  if (st + 1 < steps) split(st + 1);
}

// Step st's end, where a step follows: step st + 2's raw rows in (this
// thread's copies, then everyone's), step st + 1's planes visible to wgmma,
// every warpgroup done with step st's buffers.
__device__ __forceinline__ void stream_barrier(int64_t st, int64_t steps) {
  if (st + 1 < steps) {
    if (st + 2 < steps) copy_async_wait<0>();
    fence_async_smem();
    __syncthreads();
  }
}

}  // namespace fastaxial::cuda
#endif  // FASTAXIAL_SM90A_DEVICE
