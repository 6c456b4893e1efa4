// What the CPU forward (axial_cpu.cpp) and backward (backward_cpu.cpp) share:
// Eigen's row-major matrix types over the library's row-major buffers, the
// threads a pass takes (team_for; the regions themselves: team.h), and a (sequence, head)'s dropout multipliers.
//
// Everything here and in the kernel files is in fastaxial::cpu::FASTAXIAL_CPU_COPY, an inline
// namespace (code says cpu::gemm, cpu::Mat): the copy of the kernels the file is compiled into.
// A build compiles them once (`single`: -march=native in a development build), or twice where the
// CPU is picked at run time (`baseline` and `avx2`, src/cpu/dispatch.cpp; cmake/CpuDispatch.cmake
// keeps each copy's instantiations of Eigen and the standard library private to it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../common/dropout.h"
#include "entries.h"
#include "fastaxial/fastaxial.h"
#include "team.h"

#ifndef FASTAXIAL_CPU_COPY
#define FASTAXIAL_CPU_COPY single
#endif
namespace fastaxial::cpu {
inline namespace FASTAXIAL_CPU_COPY {}
}  // namespace fastaxial::cpu
FASTAXIAL_CPU_ENTRIES(FASTAXIAL_CPU_COPY)

namespace fastaxial::cpu::FASTAXIAL_CPU_COPY {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const Mat>;
using MatMap = Eigen::Map<Mat>;
using ConstVec = Eigen::Map<const Eigen::RowVectorXf>;
using VecMap = Eigen::Map<Eigen::RowVectorXf>;
// Floats on Eigen's alignment (64 bytes: CMakeLists.txt), for buffers that products read or write.
using AlignedFloats = std::vector<float, Eigen::aligned_allocator<float>>;
// The same, but resize() leaves new floats unset: for a buffer whose parts the threads zero
// themselves (in parallel, where each part is about to be used) instead of one thread zeroing all.
template <class T>
struct NoInitAllocator : Eigen::aligned_allocator<T> {
  template <class U>
  struct rebind {
    using other = NoInitAllocator<U>;
  };
  NoInitAllocator() = default;
  template <class U>
  NoInitAllocator(const NoInitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U*) noexcept {}  // default-initialisation: nothing for floats
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using UnsetFloats = std::vector<float, NoInitAllocator<float>>;

// Fewest floating-point operations a thread of a backward team is given: a backward pass with
// little work ran slower on 16 threads than on 4 (docs/perf-notes.md, v67), so such a pass takes
// fewer threads than it may. (The forward's one region a pass kept gaining up to 16 threads.)
constexpr double kFlopsPerThread = 4e6;
// The same for a weight gradient's product alone (tiles of one product, no softmax or copies): a
// thread a 1e6 operations. At 4e6 a small shape's products ran on one thread of two: (2, 16, 16,
// 48, 2)'s backward took 0.536 ms at 2 threads, 0.468 at 1e6 (perf notes v110).
constexpr double kProductFlopsPerThread = 1e6;

// The threads a region of `tasks` tasks and `flops` operations in all takes: at most max_threads()
// and tasks, and no more than one a `per_thread` operations of work; at least one.
inline int team_for(int64_t tasks, double flops, double per_thread = kFlopsPerThread) {
  const double by_work = std::min(flops / per_thread, 1e9);
  const int64_t team = std::min<int64_t>(std::min<int64_t>(max_threads(), tasks), (int64_t)by_work);
  return (int)std::max<int64_t>(1, team);
}

// Operations of one pass's forward over T positions of dim D in sequences of L: the QKV and output
// products (8 D^2 a position) and the two attention products (4 L D).
inline double pass_flops(int64_t T, int64_t L, int64_t D) { return (double)T * (8.0 * D * D + 4.0 * L * D); }

// Whether a pass of sequences of L positions keeps its attention output for the backward
// (AxialParams::saved_o): where running p v again (2 L hd operations an element) costs more than
// writing the element once and reading it back. At short sequences the write into fresh memory
// cost more than the product saved (perf notes v68), so such a pass takes no room there
// (saved_o_floats).
constexpr int64_t kKeepAttentionOutputMinLen = 128;
inline bool keeps_attention_output(int64_t L) { return L >= kKeepAttentionOutputMinLen; }

// Where each pass's attention output lies in p.saved_o: the keeping passes' outputs one after
// another, the row pass's (sequences of W) first, then the column pass's (of H). Null for a pass
// that does not keep it, and for both without saved_o; `floats`, what the kept ones take.
struct KeptOutputs {
  float* row = nullptr;
  float* col = nullptr;
  int64_t floats = 0;
};
inline KeptOutputs kept_outputs(const AxialParams& p) {
  const int64_t pass_floats = p.batch * p.height * p.width * p.dim;
  const bool row = keeps_attention_output(p.width), col = keeps_attention_output(p.height);
  KeptOutputs k;
  k.floats = ((int64_t)row + (int64_t)col) * pass_floats;
  if (p.saved_o != nullptr) {
    if (row) k.row = p.saved_o;
    if (col) k.col = p.saved_o + (row ? pass_floats : 0);
  }
  return k;
}

// Whether a pass of sequences of L positions keeps its softmax probabilities for the backward
// (AxialParams::saved_p): those of 2 to 127 positions (those that do not keep o; at L = 1 no product
// runs: single_key_forward, single_key_backward). There the backward takes a sequence's queries as
// one range (query_ranges) and the forward as one tile, so the forward's (L, L) scores are the
// products the backward would run and its P the backward's (bit for bit on the register tiles; on a
// BLAS, attention_on_blas, up to its rounding at other operand addresses; and where the caller passes
// saved_p without saved_qkv, up to the QKV product's rounding on a BLAS, !projections_on_tiles, whose
// choice of tiles or BLAS for a small product depends on the rows a call gets); the backward then runs neither
// the scores nor the softmax again (an eighth of its thread time at (4, 32, 32, 64, 4): perf notes v99).
// heads L floats a position, what an eager backward keeps of its softmax too.
inline bool keeps_probabilities(int64_t L) { return L > 1 && !keeps_attention_output(L); }

// Where each pass's probabilities lie in p.saved_p, as kept_outputs: the row pass's (B H W heads W
// floats) first, then the column pass's (B H W heads H).
inline KeptOutputs kept_probabilities(const AxialParams& p) {
  const int64_t positions = p.batch * p.height * p.width;
  const int64_t row_floats = keeps_probabilities(p.width) ? positions * p.heads * p.width : 0;
  const int64_t col_floats = keeps_probabilities(p.height) ? positions * p.heads * p.height : 0;
  KeptOutputs k;
  k.floats = row_floats + col_floats;
  if (p.saved_p != nullptr) {
    if (row_floats > 0) k.row = p.saved_p;
    if (col_floats > 0) k.col = p.saved_p + row_floats;
  }
  return k;
}

// exp(x) for a packet of x <= 0 (the softmax's (score - max) * scale): the polynomial of Eigen's
// pexp (cephes), with 2^m built from its exponent bits in place of Eigen's general ldexp, three
// dependent multiplies a packet that bound the softmax (perf notes v70). x is clamped at -87.33, so
// m >= -126 and 2^m is a normal float: below it exp(x) < 1.2e-38, which no fp32 row sum holding
// its max's 1 can see. NaN stays NaN (through the polynomial).
template <class P>
inline P pexp_nonpositive(const P& x_in) {
  namespace ei = Eigen::internal;
  using PI = typename ei::unpacket_traits<P>::integer_packet;
  const P x = ei::pmax(x_in, ei::pset1<P>(-87.33f));  // (x_in first: a NaN x_in stays)
  const P m = ei::pfloor(ei::pmadd(x, ei::pset1<P>(1.44269504088896341f), ei::pset1<P>(0.5f)));
  P r = ei::pmadd(m, ei::pset1<P>(-0.693359375f), x);
  r = ei::pmadd(m, ei::pset1<P>(2.12194440e-4f), r);
  const P r2 = ei::pmul(r, r), r3 = ei::pmul(r2, r);
  P y = ei::pmadd(ei::pset1<P>(1.9875691500e-4f), r, ei::pset1<P>(1.3981999507e-3f));
  P y1 = ei::pmadd(ei::pset1<P>(4.1665795894e-2f), r, ei::pset1<P>(1.6666665459e-1f));
  const P y2 = ei::padd(r, ei::pset1<P>(1.0f));
  y = ei::pmadd(y, r, ei::pset1<P>(8.3334519073e-3f));
  y1 = ei::pmadd(y1, r, ei::pset1<P>(5.0000001201e-1f));
  y = ei::pmadd(y, r3, y1);
  y = ei::pmadd(y, r2, y2);
  const PI e = ei::padd(ei::pcast<P, PI>(m), ei::pset1<PI>(127));
  return ei::pmul(y, ei::preinterpret<P>(ei::plogical_shift_left<23>(e)));
}

// row[j] = exp((row[j] - max) * scale) for j < n, max at least every row[j]; returns their sum, in
// an order that depends on n alone.
inline float exp_and_sum(float* row, int64_t n, float max, float scale) {
  namespace ei = Eigen::internal;
  using P = ei::packet_traits<float>::type;
  using H = typename ei::unpacket_traits<P>::half;
  constexpr int64_t W = ei::packet_traits<float>::size, HW = ei::unpacket_traits<H>::size;
  // The packet (of type Q) of row[j ..] written as its exponentials, and returned.
  const auto exp_at = [&](auto packet, int64_t j) {
    using Q = decltype(packet);
    const Q e = pexp_nonpositive(ei::pmul(ei::psub(ei::ploadu<Q>(row + j), ei::pset1<Q>(max)), ei::pset1<Q>(scale)));
    ei::pstoreu(row + j, e);
    return e;
  };
  P acc0 = ei::pset1<P>(0.0f), acc1 = acc0;
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {  // two packets at a time, then one more
    acc0 = ei::padd(acc0, exp_at(P(), j));
    acc1 = ei::padd(acc1, exp_at(P(), j + W));
  }
  if (n - j >= W) {
    acc0 = ei::padd(acc0, exp_at(P(), j));
    j += W;
  }
  float sum = ei::predux(ei::padd(acc0, acc1));
  // Then a half packet where the packet has one (AVX-512's 16 floats: the 8 of a row of 24 or 8),
  // so that short rows do not fall to the scalar exp; then one by one.
  if constexpr (HW < W) {
    if (n - j >= HW) {
      sum += ei::predux(exp_at(H(), j));
      j += HW;
    }
  }
  for (; j < n; ++j) {
    row[j] = std::exp((row[j] - max) * scale);
    sum += row[j];
  }
  return sum;
}

// Attention over one key (sequences of length 1, the other axis of a 1-D input): the softmax of a
// single score s is exp(s - s) = 1 where s is finite and NaN where it is not, so a head's output is
// P v, and in the backward dv = P dO and dS = P (dP - P dP) = 0 where dP is finite (NaN where not).
// single_key_* compute these as the general code's per-(sequence, head) products do (a zero
// accumulator plus each term: +0 for -0; the scores' and dP's FMA chains), without the products'
// calls, a dozen per position and head. Rows r of qkv (rows, 3D), o (rows, D), dO and dqkv.
inline float single_key_dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) s = std::fma(a[j], b[j], s);
  return s;
}
inline float single_key_p(const float* q, const float* k, int64_t hd) {
  const float s = single_key_dot(q, k, hd);
  return s - s == 0.0f ? 1.0f : std::numeric_limits<float>::quiet_NaN();
}
// o = P v for every head of row r.
template <class Qkv, class O>
void single_key_forward(const Qkv& qkv, int64_t r, int64_t D, int64_t heads, O& o) {
  const int64_t hd = D / heads;
  for (int64_t h = 0; h < heads; ++h) {
    const float* q = &qkv(r, h * hd);
    const float p = single_key_p(q, q + D, hd);
    for (int64_t j = 0; j < hd; ++j) o(r, h * hd + j) = p * q[2 * D + j] + 0.0f;
  }
}
// dqkv's row r (dq, dk, dv) from dO's, and o's where `o` is not null; scale = 1 / sqrt(hd).
template <class Qkv, class DO, class Dqkv, class O>
void single_key_backward(const Qkv& qkv, const DO& dO, int64_t r, int64_t D, int64_t heads, float scale,
                         Dqkv& dqkv, O* o) {
  const int64_t hd = D / heads;
  for (int64_t h = 0; h < heads; ++h) {
    const float *q = &qkv(r, h * hd), *k = q + D, *v = q + 2 * D, *g = &dO(r, h * hd);
    const float p = single_key_p(q, k, hd);
    const float dp = single_key_dot(g, v, hd);
    const float ds = (dp - p * dp) * p * scale;
    for (int64_t j = 0; j < hd; ++j) {
      if (o != nullptr) (*o)(r, h * hd + j) = p * v[j] + 0.0f;
      dqkv(r, h * hd + j) = ds * k[j] + 0.0f;
      dqkv(r, D + h * hd + j) = q[j] * ds + 0.0f;
      dqkv(r, 2 * D + h * hd + j) = g[j] * p + 0.0f;
    }
  }
}

// The dropout multipliers (0 or 1 / (1 - p)) of sequence n, head h of `pass` (0 rows, 1
// columns), queries r0 .. r0 + rows - 1 (all L keys), into m, (rows, L): row-major, so the
// mask's consecutive elements.
inline void fill_mask(const DropoutParams& d, int pass, int64_t n, int64_t h, int64_t L, int64_t r0, int64_t rows,
                      Mat& m) {
  m.resize(rows, L);
  dropout_row(d, dropout_element(d, pass, n, h, r0, 0), rows * L, m.data());
}

}  // namespace fastaxial::cpu::FASTAXIAL_CPU_COPY
