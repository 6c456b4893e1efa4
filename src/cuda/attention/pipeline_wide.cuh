// The copy pipeline of the wgmma flash kernels of one raw stage
// (flash_attention_wgmma_wide.cu: 3xTF32, head dims 64 to 128;
// flash_attention_wgmma16.cu: 16-bit products): a block's shared memory
// (q raw and swizzled, one raw stage of k and v rows, two buffers of the
// operands the products read), the copies of q and of a step's rows, and the
// two barriers a step. Each kernel's Tile gives the layout (kHdp, BM, BN,
// kThreads, ld and the offsets k_off, k_buf, vt_off, vt_buf, raw_off,
// q_off); its split (raw rows -> the products' operands) is its own.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../detail/async_copy.cuh"
#include "../detail/kernel_args.h"
#include "../detail/wgmma.cuh"
#include "flash_parts.cuh"

namespace fastaxial::cuda {

// Word of q's element (r, c): rows of HDP words, the 16-byte piece c / 4
// XORed with r % 8 (inside its 128 bytes), so that a fragment read (rows g, g + 8,
// columns 8 kk + t (+ 4)) hits 32 banks.
template <int HDP>
__device__ __forceinline__ int q_word(int r, int c) {
  return r * HDP + (c ^ ((r & 7) << 2));
}

#if FASTAXIAL_SM90A_DEVICE
// The block's shared memory (Tile's layout) at its 1024-byte aligned
// base: base as a shared address (cp.async, wgmma's descriptors), sm as a
// generic one; q's buffer qs (BM, HDP) with q_word's swizzled rows and the
// raw stage raws (k's rows, then v's, (BN, HDP) each at stride ld).
template <class Tile>
struct WideSmem {
  static constexpr int HDP = Tile::kHdp;
  uint32_t base;
  char* sm;
  float* qs;
  float* raws;

  __device__ __forceinline__ WideSmem() {
    sm = aligned_smem(base);
    qs = reinterpret_cast<float*>(sm + Tile::q_off);
    raws = reinterpret_cast<float*>(sm + Tile::raw_off);
  }

  // Columns hd..HDP-1 of q and of the raw stage: zero for the whole block
  // (never copied, so the splits carry zeros into the planes).
  __device__ __forceinline__ void zero_padding(int hd, int tid) const {
    constexpr int BM = Tile::BM, BN = Tile::BN;
    if (hd < HDP) {
      const int pad = HDP - hd;
      for (int e = tid; e < (BM + 2 * BN) * pad; e += Tile::kThreads) {
        const int r = e / pad, c = hd + e % pad;
        if (r < BM)
          qs[q_word<HDP>(r, c)] = 0.0f;
        else
          raws[(r - BM) * Tile::ld + c] = 0.0f;
      }
    }
  }

  // The planes of k and of v^T in buffer b.
  __device__ __forceinline__ uint32_t k_planes(int b) const { return base + Tile::k_off + (uint32_t)(b * Tile::k_buf); }
  __device__ __forceinline__ uint32_t vt_planes(int b) const {
    return base + Tile::vt_off + (uint32_t)(b * Tile::vt_buf);
  }
};

// The block's copy pipeline: one raw stage, one q buffer (for shared memory
// at head dim 128), two plane buffers. A step's raw rows come two steps
// ahead of the products and are split one step ahead; a unit's q comes
// during its predecessor's last step. One stage and one q buffer mean two
// barriers a step: refill()'s, after the scores (the stage and q read), and
// landed()'s, after the products (the copies in, the planes free). The copy
// cursor `copy` walks the block's units (unit_at) ahead of the products'.
// The kernel's arguments come with each call, not as a member: held by
// reference, their loads (a.D, a.qkv) are no longer shared between steps.
template <class Tile, bool kVec>
struct WidePipeline {
  static constexpr int HDP = Tile::kHdp;
  static constexpr int BM = Tile::BM, BN = Tile::BN, kThreads = Tile::kThreads, LD = Tile::ld;
  using IsQ = std::integral_constant<bool, true>;
  using IsRaw = std::integral_constant<bool, false>;
  uint32_t base;  // WideSmem::base
  int L, hd, tid;
  int64_t row_words, ps;  // floats a row of qkv (3D); rows a position
  uint32_t raw_k, raw_v;  // the stage's k rows, v rows

  template <class Units>
  __device__ __forceinline__ WidePipeline(const AttentionKernelArgs& a, const Units& unit_at, uint32_t base_, int L_,
                                          int hd_, int tid_)
      : base(base_),
        L(L_),
        hd(hd_),
        tid(tid_),
        row_words(unit_at.row_words),
        ps(a.pos.pos_stride),
        raw_k(base_ + Tile::raw_off),
        raw_v(raw_k + BN * LD * 4) {}

  // Rows p0 .. p0 + rows - 1 of a head slice (src: row 0's) into raw rows at
  // dst (stride LD), or with kQ into q's swizzled rows; positions >= L as zeros.
  template <bool kQ>
  __device__ __forceinline__ void copy_rows(std::integral_constant<bool, kQ>, int rows, uint32_t dst, const float* src,
                                            int p0, const float* qkv) const {
    const auto word = [](int r, int c) { return kQ ? q_word<HDP>(r, c) : r * LD + c; };
    const auto at = [&](int l, int c) { return src + l * ps * row_words + c; };
    copy_head_rows<HDP, kVec, 4>(dst, word, at, p0, rows, L, hd, qkv, tid, kThreads);
  }
  // Step `copy`'s raw rows into the stage; `copy` moves on.
  template <class Units>
  __device__ __forceinline__ void copy_step(const AttentionKernelArgs& a, StepCursor& copy,
                                            const Units& unit_at) const {
    copy_rows(IsRaw(), BN, raw_k, copy.cur.qg + a.D, copy.j * BN, a.qkv);
    copy_rows(IsRaw(), BN, raw_v, copy.cur.qg + 2 * a.D, copy.j * BN, a.qkv);
    copy.advance(unit_at, unit_at.count);
  }
  // Unit x's q into the q buffer.
  __device__ __forceinline__ void copy_q(const AttentionKernelArgs& a, const FlashUnit& x) const {
    copy_rows(IsQ(), BM, base + Tile::q_off, x.qg, x.q0, a.qkv);
  }

  // Unit 0's q and step 0's rows in and split into plane buffer 0 (split(0)), step 1's rows in.
  template <class Units, class Split>
  __device__ __forceinline__ void prologue(const AttentionKernelArgs& a, StepCursor& copy, const Units& unit_at,
                                           Split&& split) const {
    copy_q(a, copy.cur);
    copy_step(a, copy, unit_at);
    copy_async_commit();
    copy_async_wait<0>();
    __syncthreads();
    split(0);
    __syncthreads();  // the stage read; its next rows may come
    if (copy.ui < unit_at.count) copy_step(a, copy, unit_at);  // step 1, where there is one
    copy_async_commit();
    copy_async_wait<0>();
    fence_async_smem();
    __syncthreads();
  }

  // After step st's scores (its split of step st + 1 written, q read): every
  // thread there, so the stage and the q buffer are free; step st + 2's rows
  // into the stage, where there is one. The caller adds the next unit's q
  // (copy_q) with a unit's last step and commits.
  template <class Units>
  __device__ __forceinline__ void refill(const AttentionKernelArgs& a, StepCursor& copy, const Units& unit_at) const {
    fence_async_smem();  // the planes were written by ordinary stores; wgmma reads them
    __syncthreads();
    if (copy.ui < unit_at.count) copy_step(a, copy, unit_at);
  }
  // refill, then with a unit's last step (`step`) the next unit's q where the block has one, and
  // the copies committed.
  template <class Units>
  __device__ __forceinline__ void refill_step(const AttentionKernelArgs& a, StepCursor& copy, const Units& unit_at,
                                              const StepCursor& step) const {
    refill(a, copy, unit_at);
    if (step.last() && step.ui + 1 < unit_at.count) copy_q(a, unit_at(step.ui + 1));
    copy_async_commit();
  }
  // Step st + 2's rows (and the next unit's q) in; every warpgroup done with step st's planes.
  __device__ __forceinline__ void landed() const {
    copy_async_wait<0>();
    __syncthreads();
  }
};

#endif  // FASTAXIAL_SM90A_DEVICE

}  // namespace fastaxial::cuda
