// Attention dropout's keep mask, for the host and the device: a pure function of (seed, offset,
// element), so that every kernel (the CPU forward and backward, CUDA kernels) draws the same
// mask for the same AxialParams without storing it, and the backward regenerates the forward's.
//
// The math (nn.Dropout on the attention probabilities, per pass and head): P = softmax(scores),
// Pd = P o M / (1 - p) with M the keep mask, o = Pd V. Backward: dV = Pd^T dO, dPd = dO V^T,
// dP = dPd o M / (1 - p), dS = P o (dP - rowsum(dO o O)) (rowsum(P o dP) = rowsum(Pd o dPd) =
// rowsum(dO o O), O the dropped output).
//
// ---- The mask, exactly ----------------------------------------------------------------------
// All arithmetic is uint64 (wrapping is impossible: validate() rejects problems whose mask has
// more than 2^64 elements).
//
// Passes and sequences, numbered as AxisView numbers them (axis.h):
//   pass 0, the row pass:    N0 = B H sequences of L0 = W positions, sequence n = b H + h_row;
//   pass 1, the column pass: N1 = B W sequences of L1 = H positions, sequence n = b W + w.
// Element (pass, n, head h, query i, key j), 0 <= h < heads, 0 <= i, j < L of that pass:
//   e = base[pass] + ((n heads + h) L + i) L + j,
//   base[0] = 0,  base[1] = N0 heads L0^2 = B H heads W^2 (the row pass's element count).
// On a square grid (H == W) this is e = (((pass N + n) heads + h) L + i) L + j; base[1] is the
// row pass's count rather than N1 heads L1^2 so that the two passes' elements never share an
// index (and so a random word) when H != W.
//
// The draw of element e: Philox4x32 with 10 rounds (Random123's philox4x32_R(10, ctr, key)),
//   ctr  = {lo32(e / 4), hi32(e / 4), lo32(offset), hi32(offset)},
//   key  = {lo32(seed), hi32(seed)},
//   word = output word e % 4 (so one Philox call serves the four elements 4 (e / 4) .. + 3).
// Keep e when word >= threshold (compared as uint64), threshold = floor(p 2^32 + 1/2) in
// [0, 2^32], computed in double, where p 2^32 is exact: p 2^32 rounded to the nearest integer,
// ties up. So P(keep) = 1 - threshold / 2^32, within 2^-33 of 1 - p. p = 0 (threshold 0): every
// element kept, nothing drawn; p = 1 (threshold 2^32, above every word): none kept. A kept
// probability is multiplied by scale = float(1 / (1 - p)), computed in double and rounded once;
// p = 1: scale = 0 (the attention branch is zero; no division by zero).
//
// A caller advances `offset` between calls that want fresh masks (as PyTorch's Philox offset);
// seed and offset reach Philox whole, 64 bits each.
#pragma once

#include <cstdint>

#if !defined(FASTAXIAL_NO_RANDOM123)
#include <Random123/philox.h>
#endif

#include "axis.h"  // FASTAXIAL_HOST_DEVICE, AxisView
#include "fastaxial/fastaxial.h"

// Philox inlined into its caller whatever the compiler's size heuristics say: dropout_row's batch
// of 16 calls vectorises only when the calls are inlined (a large caller such as the CPU pass
// otherwise gets a call per block).
#if defined(__CUDACC__)
#define FASTAXIAL_DROPOUT_INLINE __forceinline__
#elif defined(__GNUC__)
#define FASTAXIAL_DROPOUT_INLINE inline __attribute__((always_inline))
#else
#define FASTAXIAL_DROPOUT_INLINE inline
#endif

namespace fastaxial {

// What a kernel needs to draw the mask of both passes. Plain data: passed to CUDA kernels by value.
struct DropoutParams {
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint64_t threshold = 0;  // keep when the 32-bit word >= threshold; 0: keep all, 2^32: keep none
  float scale = 1.0f;      // multiplier of a kept probability: 1 / (1 - p), 0 when p = 1
  uint64_t heads = 1;
  uint64_t len[2] = {0, 0};   // L per pass: W (rows), H (columns)
  uint64_t base[2] = {0, 0};  // first element of each pass: 0, B H heads W^2
};

// threshold = floor(p 2^32 + 1/2), p clamped to [0, 1] (NaN: 0). validate() has rejected p
// outside [0, 1] already; the clamp only keeps the conversion defined.
FASTAXIAL_HOST_DEVICE inline uint64_t dropout_threshold(float p) {
  if (!(p > 0.0f)) return 0;
  if (p >= 1.0f) return uint64_t{1} << 32;
  return static_cast<uint64_t>(static_cast<double>(p) * 4294967296.0 + 0.5);  // >= 0: truncation is floor
}

// float(1 / (1 - p)), 0 for p >= 1.
FASTAXIAL_HOST_DEVICE inline float dropout_scale(float p) {
  if (!(p > 0.0f)) return 1.0f;
  if (p >= 1.0f) return 0.0f;
  return static_cast<float>(1.0 / (1.0 - static_cast<double>(p)));
}

// The mask of problem p's two passes (p.dropout, p.seed, p.offset and the sizes).
inline DropoutParams make_dropout(const AxialParams& p) {
  DropoutParams d;
  d.seed = p.seed;
  d.offset = p.offset;
  d.threshold = dropout_threshold(p.dropout);
  d.scale = dropout_scale(p.dropout);
  d.heads = static_cast<uint64_t>(p.heads);
  const AxisView rv = row_view(p), cv = col_view(p);
  d.len[0] = static_cast<uint64_t>(rv.len);
  d.len[1] = static_cast<uint64_t>(cv.len);
  d.base[0] = 0;
  d.base[1] = static_cast<uint64_t>(rv.num_seq) * d.heads * d.len[0] * d.len[0];
  return d;
}

// The element index e of (pass, sequence n, head h, query i, key j).
FASTAXIAL_HOST_DEVICE inline uint64_t dropout_element(const DropoutParams& d, int pass, uint64_t n, uint64_t h,
                                                      uint64_t i, uint64_t j) {
  const uint64_t L = d.len[pass];
  return d.base[pass] + ((n * d.heads + h) * L + i) * L + j;
}

#if !defined(FASTAXIAL_NO_RANDOM123)

// The four 32-bit words of Philox block b: the draws of elements 4b .. 4b + 3.
FASTAXIAL_HOST_DEVICE FASTAXIAL_DROPOUT_INLINE philox4x32_ctr_t dropout_words(const DropoutParams& d, uint64_t block) {
  const philox4x32_ctr_t ctr = {{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                 static_cast<uint32_t>(d.offset), static_cast<uint32_t>(d.offset >> 32)}};
  const philox4x32_key_t key = {{static_cast<uint32_t>(d.seed), static_cast<uint32_t>(d.seed >> 32)}};
  return philox4x32_R(10, ctr, key);
}

// The keep bits of elements 4b .. 4b + 3: bit k set when element 4b + k is kept. One Philox call
// (none when threshold is 0).
FASTAXIAL_HOST_DEVICE inline unsigned dropout_keep4(const DropoutParams& d, uint64_t block) {
  if (d.threshold == 0) return 0xFu;
  const philox4x32_ctr_t w = dropout_words(d, block);
  unsigned bits = 0;
  for (int k = 0; k < 4; ++k) bits |= (static_cast<uint64_t>(w.v[k]) >= d.threshold ? 1u : 0u) << k;
  return bits;
}

// Whether element e is kept.
FASTAXIAL_HOST_DEVICE inline bool dropout_keep(const DropoutParams& d, uint64_t e) {
  return (dropout_keep4(d, e / 4) >> (e % 4)) & 1u;
}

// Whether the probability of query i, key j of head h of sequence n in `pass` is kept.
FASTAXIAL_HOST_DEVICE inline bool dropout_keep(const DropoutParams& d, int pass, uint64_t n, uint64_t h, uint64_t i,
                                               uint64_t j) {
  return dropout_keep(d, dropout_element(d, pass, n, h, i, j));
}

namespace detail {
// dropout_row's elements e .. stop - 1 of one Philox block (stop at most the block's end).
FASTAXIAL_HOST_DEVICE inline void dropout_block_part(const DropoutParams& d, uint64_t e, uint64_t stop, uint64_t e0,
                                                     float* out) {
  const unsigned bits = dropout_keep4(d, e / 4);
  for (; e < stop; ++e) out[e - e0] = static_cast<float>((bits >> (e % 4)) & 1u) * d.scale;
}
}  // namespace detail

// The multipliers of `count` consecutive elements from e0: out[k] = scale when element e0 + k is
// kept, else 0. One Philox call per four elements. The elements of one (pass, sequence, head)
// are consecutive, (query, key) in row-major order: its whole (L, L) mask is
// dropout_row(d, dropout_element(d, pass, n, h, 0, 0), L * L, out).
FASTAXIAL_HOST_DEVICE inline void dropout_row(const DropoutParams& d, uint64_t e0, uint64_t count, float* out) {
  const uint64_t end = e0 + count;
  uint64_t e = e0;
#ifndef __CUDA_ARCH__
  // On the host, whole blocks 16 at a time: 16 independent Philox calls in one loop, which the
  // compiler vectorises, where one call after another would not.
  constexpr uint64_t kBatch = 16;
  if (d.threshold != 0 && count >= 4 * kBatch) {
    if (e % 4 != 0) {  // up to the first whole block
      const uint64_t stop = e + (4 - e % 4);
      detail::dropout_block_part(d, e, stop, e0, out);
      e = stop;
    }
    for (; end - e >= 4 * kBatch; e += 4 * kBatch) {
      uint32_t w[4][kBatch];
      for (uint64_t b = 0; b < kBatch; ++b) {
        const philox4x32_ctr_t r = dropout_words(d, e / 4 + b);
        for (int k = 0; k < 4; ++k) w[k][b] = r.v[k];
      }
      float* o = out + (e - e0);
      for (uint64_t b = 0; b < kBatch; ++b)
        for (int k = 0; k < 4; ++k)  // branch-free: a kept element's draw is unpredictable
          o[4 * b + k] = static_cast<float>(static_cast<uint64_t>(w[k][b]) >= d.threshold) * d.scale;
    }
  }
#endif
  while (e < end) {
    const uint64_t room = 4 - e % 4;  // elements left in e's block
    const uint64_t stop = end - e > room ? e + room : end;
    detail::dropout_block_part(d, e, stop, e0, out);
    e = stop;
  }
}

namespace detail {
// The keep bits of Philox block b (bit k: element 4b + k), without dropout_keep4's shortcut for
// threshold 0: for the kernels that draw only where threshold != 0.
FASTAXIAL_HOST_DEVICE FASTAXIAL_DROPOUT_INLINE unsigned dropout_block_bits(const DropoutParams& d, uint64_t block) {
  const philox4x32_ctr_t w = dropout_words(d, block);
  unsigned bits = 0;
  for (int k = 0; k < 4; ++k) bits |= (static_cast<uint64_t>(w.v[k]) >= d.threshold ? 1u : 0u) << k;
  return bits;
}
}  // namespace detail

// The keep bits of the four consecutive elements e .. e + 3: bit k set when e + k is kept. One
// Philox call where e % 4 == 0, two otherwise; drawn whatever the threshold (no shortcut for 0).
FASTAXIAL_HOST_DEVICE FASTAXIAL_DROPOUT_INLINE unsigned dropout_keep_run4(const DropoutParams& d, uint64_t e) {
  const unsigned shift = static_cast<unsigned>(e % 4);
  unsigned bits = detail::dropout_block_bits(d, e / 4);
  if (shift != 0) bits |= detail::dropout_block_bits(d, e / 4 + 1) << 4;
  return (bits >> shift) & 0xFu;
}

// Whether element e is kept, drawn whatever the threshold (dropout_keep without its shortcut
// for 0): for kernels that draw only where threshold != 0.
FASTAXIAL_HOST_DEVICE FASTAXIAL_DROPOUT_INLINE bool dropout_keep_drawn(const DropoutParams& d, uint64_t e) {
  return (detail::dropout_block_bits(d, e / 4) >> (e % 4)) & 1u;
}

// Whether this build draws the mask (Random123 found).
inline constexpr bool kDropoutAvailable = true;

#else  // a build without Random123: validate() refuses dropout > 0, so no mask is ever drawn

FASTAXIAL_HOST_DEVICE inline void dropout_row(const DropoutParams&, uint64_t, uint64_t, float*) {}
FASTAXIAL_HOST_DEVICE inline unsigned dropout_keep_run4(const DropoutParams&, uint64_t) { return 0xFu; }
FASTAXIAL_HOST_DEVICE inline bool dropout_keep_drawn(const DropoutParams&, uint64_t) { return true; }
inline constexpr bool kDropoutAvailable = false;

#endif  // FASTAXIAL_NO_RANDOM123

// ---- The mask in the CUDA attention kernels -----------------------------------------------------

// What a kernel of one pass needs of the mask, as a kernel parameter of its own (the kernels'
// argument structs stay within 128 bytes: beyond, the compiler handles a struct parameter
// differently, and the kernels without dropout would take other registers). Seed and offset
// are in device memory, written by an earlier kernel on the stream.
struct DropoutPass {
  const uint64_t* philox = nullptr;  // {seed, offset}
  uint64_t base = 0;                 // base[pass]
  uint64_t threshold = 0;
  float scale = 1.0f;
};

// Pass `pass` (0 or 1) of d, seed and offset at philox.
inline DropoutPass dropout_pass(const DropoutParams& d, int pass, const uint64_t* philox) {
  DropoutPass p;
  p.philox = philox;
  p.base = d.base[pass == 0 ? 0 : 1];
  p.threshold = d.threshold;
  p.scale = d.scale;
  return p;
}

// Where dropout applies to a pass: the {seed, offset} pair given, and the mask's sizes those of
// the pass (its elements are numbered by them). Always true without dropout.
inline bool dropout_pass_args_ok(const DropoutParams& d, int pass, const uint64_t* philox, int64_t len, int64_t heads) {
  if (d.threshold == 0) return true;
  return kDropoutAvailable && philox != nullptr && (pass == 0 || pass == 1) && d.len[pass] == (uint64_t)len &&
         d.heads == (uint64_t)heads;
}

#if defined(__CUDACC__)
// The mask's draw parameters, seed and offset read from p.philox: after the kernel's wait for
// the grid before it. heads, len and base are left at their defaults (the kernel numbers the
// elements itself, from p.base).
__device__ __forceinline__ DropoutParams dropout_read(const DropoutPass& p) {
  DropoutParams d;
  d.seed = p.philox[0];
  d.offset = p.philox[1];
  d.threshold = p.threshold;
  d.scale = p.scale;
  return d;
}
#endif

// The mask in a warp's tensor-core fragments.
// An mma.sync m16n8k8 C fragment: lane 4 g + t (g < 8, t < 4) holds c[0] = (row g, column 2t),
// c[1] = (g, 2t + 1), c[2] = (g + 8, 2t), c[3] = (g + 8, 2t + 1) of a 16 x 8 tile. A thread's four
// elements lie in two to four Philox blocks, each block's other elements in other lanes; so four
// lanes share their draws: each draws one run of four consecutive elements (dropout_keep_run4,
// at dropout_run_rows or dropout_run_cols) and two shuffles (dropout_share16) give each of them
// the 16 bits of all four runs, c[k]'s at dropout_bit_rows or dropout_bit_cols. One Philox call a
// lane and tile where the runs start at multiples of 4 (L and base multiples of 4), else two;
// against four with a draw per element.

// Rows of the tile are queries, columns keys (S = q k^T); e_tile: the element of (row 0,
// column 0). The four lanes of g (t = 0..3, lane bits 0 and 1) draw rows g, g + 8 by columns
// 0..3 and 4..7; lane t the run that starts at this element (c = t in dropout_share16<1>).
FASTAXIAL_HOST_DEVICE inline uint64_t dropout_run_rows(uint64_t e_tile, uint64_t L, int g, int t) {
  return e_tile + static_cast<uint64_t>(g + 8 * (t >> 1)) * L + static_cast<uint64_t>(4 * (t & 1));
}

// c[k]'s bit of the 16: the column (0..7), plus 8 for row g + 8.
FASTAXIAL_HOST_DEVICE constexpr int dropout_bit_rows(int t, int k) { return 8 * (k >> 1) + 2 * t + (k & 1); }

// Rows of the tile are keys, columns queries (S^T = k q^T); e_tile: the element of (query of
// column 0, key of row 0). The four lanes of (g / 4, t) (c = g % 4, lane bits 2 and 3) draw
// keys 4 (g / 4) .. + 3 and 4 (g / 4) + 8 .. + 11 (rows) of queries 2t and 2t + 1 (columns);
// lane c the run of query 2t + c % 2, keys from 4 (g / 4) + 8 (c / 2) (c in dropout_share16<4>).
FASTAXIAL_HOST_DEVICE inline uint64_t dropout_run_cols(uint64_t e_tile, uint64_t L, int g, int t) {
  return e_tile + static_cast<uint64_t>(2 * t + (g & 1)) * L + static_cast<uint64_t>(4 * (g >> 2) + 8 * ((g >> 1) & 1));
}

// c[k]'s bit of the 16: c[k] lies in the run of the lane with c = k, at its position g % 4.
FASTAXIAL_HOST_DEVICE constexpr int dropout_bit_cols(int g, int k) { return 4 * k + (g & 3); }

#if defined(__CUDACC__)
// The four runs of the lanes that differ from this one in lane bits kStride and 2 kStride, this
// lane's (run, c = its index among them) at bits 4c .. 4c + 3. The whole warp takes part.
template <int kStride>
__device__ __forceinline__ unsigned dropout_share16(unsigned run, int c) {
  unsigned x = run << (4 * c);
  x |= __shfl_xor_sync(0xffffffffu, x, kStride);
  x |= __shfl_xor_sync(0xffffffffu, x, 2 * kStride);
  return x;
}

// The keep bits of a warp's score tile of 16 rows (queries) by 8 NT columns (keys) in C
// fragments (S = q k^T): n-tiles jn and jn + 1 in keep[jn / 2], 16 bits each, c[k]'s at
// dropout_bit_rows. e_row: the element of (row 0, key 0); key0: the tile's first key; L: the
// mask's row length.
template <int NT>
__device__ __forceinline__ void dropout_keep_rows(uint32_t (&keep)[NT / 2], const DropoutParams& d, uint64_t e_row,
                                                  int key0, uint64_t L, int g, int t) {
  static_assert(NT % 2 == 0, "n-tiles in pairs");
#pragma unroll
  for (int jn = 0; jn < NT; jn += 2) {
    const uint64_t e = e_row + static_cast<uint64_t>(key0 + 8 * jn);
    const unsigned b0 = dropout_share16<1>(dropout_keep_run4(d, dropout_run_rows(e, L, g, t)), t);
    const unsigned b1 = dropout_share16<1>(dropout_keep_run4(d, dropout_run_rows(e + 8, L, g, t)), t);
    keep[jn / 2] = b0 | b1 << 16;
  }
}
#endif

}  // namespace fastaxial
