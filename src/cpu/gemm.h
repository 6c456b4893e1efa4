// The CPU kernels' matrix products: c = op(a) op(b) (+ beta c) on row-major blocks.
//
// Every product of the CPU forward and backward goes through gemm() below. A small one (at most
// kSmallProduct multiply-adds), and where attention_on_blas() and projections_on_tiles() say so the
// attention's (attention_product) and the projections of narrow dims (Projections) at every size,
// run on gemm.cpp's own register tiles; a larger one on the BLAS set with
// fastaxial::set_cpu_sgemm (the torch module sets the one PyTorch runs on: MKL's AVX2 and AVX-512
// kernels, picked at run time), else on Eigen's own GEMM, whose speed depends on the instruction
// set this file was compiled for (docs/cpu-blas.md). Operands are Eigen row-major matrices, maps
// or blocks of them: their data pointer, sizes and row stride.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/axis.h"
#include "cpu_common.h"

namespace fastaxial::cpu::FASTAXIAL_CPU_COPY {

// One operand of a product: a row-major (rows, cols) matrix with row stride ld, used as is or
// transposed (trans).
struct Operand {
  const float* data;
  int64_t rows, cols, ld;
  bool trans;
  int64_t op_rows() const { return trans ? cols : rows; }
  int64_t op_cols() const { return trans ? rows : cols; }
};

// x as it is, and x transposed; x is a row-major Eigen matrix, map or block (unit column stride).
template <class E>
Operand in(const E& x) {
  static_assert(std::decay_t<E>::IsRowMajor, "row-major operands only");
  return {x.data(), x.rows(), x.cols(), x.outerStride(), false};
}
template <class E>
Operand tr(const E& x) {
  Operand o = in(x);
  o.trans = true;
  return o;
}

// Products of at most this many multiply-adds (m n k) take the register tiles: a BLAS call costs its
// thread setting, checks and the packing of both operands, a good part of a product this small
// (perf notes v78). A rule of the shape alone, so the bits do not depend on the thread count.
constexpr int64_t kSmallProduct = int64_t{1} << 19;

// c (m, n) = op(a) op(b) + beta c, c row-major with row stride ldc; with beta 0 c is not read.
void gemm(const Operand& a, const Operand& b, float beta, float* c, int64_t ldc);

// c = op(a) op(b) + beta c on gemm.cpp's register tiles whatever its size: each element summed over k
// in blocks of 64 terms, as every small product is, so its bits depend on k and the inputs alone (not
// on m, n or how the rows are split among calls). For the attention's products (where
// attention_on_blas() is false) and the projections of narrow dims (where projections_on_tiles()).
void tile_gemm(const Operand& a, const Operand& b, float beta, float* c, int64_t ldc);

// c = op(a) op(b) + x + bias on the register tiles, as tile_gemm with beta 1 onto c = x and then the
// bias added (the same bits), x read in the products' stores: x (m, n) with row stride ldx, c itself
// or another matrix; bias n floats. A projection's residual and bias without a pass of their own.
void tile_gemm_residual(const Operand& a, const Operand& b, const float* x, int64_t ldx, const float* bias, float* c,
                        int64_t ldc);

// dst (cols, rows), row stride ldd = src (rows, cols), row stride ld, transposed.
void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst, int64_t ldd);

// The same into an Eigen row-major destination: a Mat is resized to (op(a) rows, op(b) cols)
// where beta is 0 (else it keeps what it adds to, at that size); a block or map must have that size already.
// tiles: on the register tiles (tile_gemm), else gemm's choice.
template <class C>
void gemm(C&& c, const Operand& a, const Operand& b, float beta = 0.0f, bool tiles = false) {
  if constexpr (std::is_same_v<std::decay_t<C>, Mat>)
    if (beta == 0.0f) c.resize(a.op_rows(), b.op_cols());
  eigen_assert(c.rows() == a.op_rows() && c.cols() == b.op_cols() && a.op_cols() == b.op_rows());
  if (tiles) tile_gemm(a, b, beta, c.data(), c.outerStride());
  else gemm(a, b, beta, c.data(), c.outerStride());
}

// The floats in one packet of the register tiles: 16 in a copy built for AVX-512, 8 for AVX2, 4 for SSE2.
int64_t tile_packet_floats();

// Whether the attention's products take gemm's rule (the BLAS past kSmallProduct) rather than the
// register tiles at every size: where a BLAS is set, unless the tiles are AVX-512's on a CPU that is
// not Intel's. One thread a call, MKL's products beat the tiles on a Xeon, and on an AMD EPYC lose
// to AVX-512 tiles (MKL runs its AVX2 or generic code there) but beat AVX2 ones (perf notes v106,
// v107, v115).
// FASTAXIAL_CPU_ATTENTION=blas or tiles, read once, picks either way (tests, measurements).
bool attention_on_blas();

// The attention's products (the scores q k^T, P v, and the backward's dP, dQ, dK and dV): k and v
// read transposed from a copy made once a block (transpose_part) where they are the right operand,
// on the BLAS or the register tiles (attention_on_blas). The products are thin (k or n is the head
// dim), and a BLAS call packs both operands for each.
template <class C>
void attention_product(C&& c, const Operand& a, const Operand& b, float beta = 0.0f) {
  gemm(std::forward<C>(c), a, b, beta, !attention_on_blas());
}

// Columns r0 .. r0 + rows - 1 of dst (D, all rows) = part `part` (1: k, 2: v) of qkv's rows r0 ..,
// (rows, 3D), transposed: the scores' (and dP's) right operand, rows of whole packets in place.
template <class Qkv>
void transpose_part(const Qkv& qkv, int part, int64_t r0, int64_t rows, Mat& dst) {
  const int64_t D = dst.rows();
  transpose(&qkv(r0, part * D), qkv.outerStride(), rows, D, &dst(0, r0), dst.outerStride());
}

// p where it lies on a 64-byte boundary, else a copy of its n floats in `copy`, which does. A
// BLAS may round differently for an operand at another alignment (MKL's kernels can), so the
// weights reach the products at one alignment whatever the caller's buffers. (The backward's
// whole-pass products write the caller's weight-gradient buffers directly: the torch module's are
// fresh, 64-byte aligned tensors.)
inline const float* aligned(const float* p, int64_t n, AlignedFloats& copy) {
  if (reinterpret_cast<uintptr_t>(p) % 64 == 0) return p;
  copy.assign(p, p + n);
  return copy.data();
}

// Dims up to this many may run the projections (y Wqkv^T, o Wout^T and the backward's products by the
// weights) on the register tiles (tile_gemm), whatever the rows: there a BLAS call's packing and setup
// cost a good part of a product of k = D terms.
constexpr int64_t kTileProjectionMaxDim = 128;
// Where the tiles are AVX2's (8 floats a packet, 16 registers) and a BLAS is set, dims up to this
// many on a CPU that is not Intel's: since v117 these tiles match or beat MKL's products on an AMD
// EPYC (Zen 3) at those dims for 16 to 256 rows, and at 128 MKL wins from 128 rows, the forward's
// blocks (perf notes v119). On Intel's CPUs MKL runs its own AVX-512 or AVX2 code: not measured
// against the tiles, so the BLAS keeps them there.
constexpr int64_t kAvx2TileProjectionMaxDim = 96;

// Whether a dim's projections run on the register tiles (on x86): dims up to kTileProjectionMaxDim
// where no BLAS is set or the tiles are AVX-512's, up to kAvx2TileProjectionMaxDim where they are
// AVX2's on a CPU that is not Intel's; elsewhere at dims up to kTileProjectionMaxDim always.
bool projections_on_tiles(int64_t D);

// One axis's projection weights as the products read them, qkv (3D, D) and out (D, D), each the
// caller's buffer or its aligned() copy; where projections_on_tiles(D), also both transposed, (D, 3D)
// and (D, D), which the register tiles read in place.
struct Projections {
  AlignedFloats qkv_copy, out_copy;  // (before the maps: built first)
  ConstMap qkv, out;
  const bool on_tiles;
  AlignedFloats qkv_t, out_t;
  Projections(const float* qkv_weight, const float* out_weight, int64_t D)
      : qkv(aligned(qkv_weight, 3 * D * D, qkv_copy), 3 * D, D), out(aligned(out_weight, D * D, out_copy), D, D),
        on_tiles(projections_on_tiles(D)) {
    if (!on_tiles) return;
    qkv_t.resize(3 * D * D);
    out_t.resize(D * D);
    // (on the register blocks: Eigen's element-by-element transpose took 6x as long, 42 µs at D 128,
    // on one thread before each pass's region: perf notes v106)
    transpose(qkv.data(), D, 3 * D, D, qkv_t.data(), 3 * D);
    transpose(out.data(), D, D, D, out_t.data(), D);
  }
  Projections(const Projections&) = delete;  // (the maps may point into the copies)
  // c = y Wqkv^T, y (rows, D).
  template <class C, class Y>
  void qkv_product(C&& c, const Y& y) const {
    const int64_t D = out.rows();
    gemm(std::forward<C>(c), in(y), on_tiles ? in(ConstMap(qkv_t.data(), D, 3 * D)) : tr(qkv), 0.0f, on_tiles);
  }
  // c = x + o Wout^T + bias, o (rows, D), c and x rows with strides ldc and ldx (x may be c): on the
  // tiles in the product's stores; else x copied to c first, the product added to it, then the bias.
  template <class O>
  void out_residual(float* c, int64_t ldc, const O& o, const float* x, int64_t ldx, const float* bias) const {
    const int64_t D = out.rows(), rows = o.rows();
    if (on_tiles) return tile_gemm_residual(in(o), in(ConstMap(out_t.data(), D, D)), x, ldx, bias, c, ldc);
    using Stride = Eigen::OuterStride<>;
    Eigen::Map<Mat, Eigen::Unaligned, Stride> cm(c, rows, D, Stride(ldc));
    if (x != c) cm = Eigen::Map<const Mat, Eigen::Unaligned, Stride>(x, rows, D, Stride(ldx));
    gemm(in(o), tr(out), 1.0f, c, ldc);
    cm.rowwise() += ConstVec(bias, D);
  }
  // The backward's products with the weights as they lie: c = a Wqkv, a (rows, 3D); c = a Wout, a (rows, D).
  template <class C, class A>
  void by_qkv(C&& c, const A& a) const {
    gemm(std::forward<C>(c), in(a), in(qkv), 0.0f, on_tiles);
  }
  template <class C, class A>
  void by_out(C&& c, const A& a) const {
    gemm(std::forward<C>(c), in(a), in(out), 0.0f, on_tiles);
  }
};

// dst's rows of sequences n0 .. n0 + ns - 1 of view v = x + o Wout^T + bias, x and o (ns L, D) in the
// sequences' order, written where they go: on the tiles one product a run of sequences that lies as
// one strided matrix in dst (a row pass's block is one run; a column pass's sequences one each). A
// BLAS takes the block's rows in one product onto x, scattered after: a sequence's rows alone (a
// column pass's) ran slower there (perf notes v104).
template <class O>
void project_out(const Projections& proj, const AxisView& v, int64_t n0, int64_t ns, const O& o, Mat& x,
                 const float* bias, float* dst) {
  const int64_t L = v.len, D = x.cols();
  const auto run_end = [&](int64_t s0) {  // the sequence after s0's run
    int64_t s1 = s0 + 1;
    while (s1 < ns && v.offset(n0 + s1, 0) == v.offset(n0 + s0, 0) + (s1 - s0) * L * v.pos_stride) ++s1;
    return s1;
  };
  if (!proj.on_tiles && run_end(0) < ns) {
    proj.out_residual(x.data(), D, o, x.data(), D, bias);
    for (int64_t s = 0; s < ns; ++s)
      for (int64_t l = 0; l < L; ++l) VecMap(dst + v.offset(n0 + s, l), D) = x.row(s * L + l);
    return;
  }
  for (int64_t s0 = 0, s1; s0 < ns; s0 = s1) {
    s1 = run_end(s0);
    const int64_t rows = (s1 - s0) * L;
    proj.out_residual(dst + v.offset(n0 + s0, 0), v.pos_stride, o.middleRows(s0 * L, rows), &x(s0 * L, 0), D, bias);
  }
}

}  // namespace fastaxial::cpu::FASTAXIAL_CPU_COPY
