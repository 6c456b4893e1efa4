// gemm.h's products: small ones on register tiles; the rest on the BLAS set with set_cpu_sgemm where
// there is one, else Eigen. (The BLAS itself is kept in dispatch.cpp: one for the process,
// whichever copy of this file runs.)
#include "gemm.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "fastaxial/fastaxial.h"

namespace fastaxial::cpu::FASTAXIAL_CPU_COPY {
namespace {

using Stride = Eigen::OuterStride<>;
using ConstStrided = Eigen::Map<const Mat, Eigen::Unaligned, Stride>;
using Strided = Eigen::Map<Mat, Eigen::Unaligned, Stride>;

template <class A, class B>
void eigen_product(const A& a, const B& b, float beta, Strided& c) {
  if (beta == 0.0f) {
    c.noalias() = a * b;
  } else {
    if (beta != 1.0f) c *= beta;
    c.noalias() += a * b;
  }
}

bool fits_int(int64_t v) { return v <= INT_MAX; }

// The small products (kSmallProduct) on tiles of c held in registers, Eigen's packets of this copy's
// instruction set: no packing, each element summed over k in order, kDepth terms at a time.
namespace ei = Eigen::internal;
using Packet = ei::packet_traits<float>::type;
constexpr int64_t kW = ei::packet_traits<float>::size;
// A tile of up to kRows rows by up to kPackets packets of c, its accumulators in registers beside one
// row of b's packets and a's broadcast value: 6 x 4 + 5 of AVX-512's 32 registers, 6 x 2 + 3 of AVX2's
// 16 (as MKL's AVX2 kernel). Never 3 packets on 16 registers: there the compiler took b from memory in
// every FMA, 16 loads for 12 FMAs (perf notes v115, v116). A tile's shape changes no bit, each element
// summed in its own register lane.
constexpr int kRows = 6;
constexpr int kPackets = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 4 : 2;
// The registers sum kDepth terms of k, then add that block into c, as a BLAS blocks k: one chain
// over a long k (a weight gradient's positions, hundreds) would round at the whole sum's magnitude
// every step, its error then past the BLAS's that the reference runs on.
constexpr int64_t kDepth = 64;

// c (MR rows, NP packets) = a b + beta x (+ bias): a(i, p) at a[i ars + p acs] (acs 1 where kUnitA: a
// compile-time stride), b's row p at b + p ldb (NP packets readable), x c itself where null (row
// stride ldx, else ldc), bias NP packets or null. Each element is summed over p in order; the bias
// added after the rest. Whole packets only (small_product pads a partial tile): with a partial
// tile's buffer in here, whose stores take the accumulators' address, GCC kept them on the stack
// around the loop, some 30 cycles of a tile whose loop is 96 at k 16 (perf notes v117).
template <int MR, int NP, bool kUnitA>
void small_tile(const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, int64_t k, float beta,
                const float* x, int64_t ldx, const float* bias, float* c, int64_t ldc) {
  if constexpr (kUnitA) acs = 1;
  Packet acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = ei::pset1<Packet>(0.0f);
  int64_t p = 0;
  do {  // (k >= 1: a loop that may run no step left the accumulators on the stack)
    Packet bp[NP];
    for (int j = 0; j < NP; ++j) bp[j] = ei::ploadu<Packet>(b + p * ldb + j * kW);
    for (int i = 0; i < MR; ++i) {
      const Packet ai = ei::pset1<Packet>(a[i * ars + p * acs]);
      for (int j = 0; j < NP; ++j) acc[i][j] = ei::pmadd(ai, bp[j], acc[i][j]);
    }
  } while (++p < k);
  if (x == nullptr) {
    x = c;
    ldx = ldc;
  }
  // One pass over the accumulators, the branches outside it: a pass a term kept them on the stack.
  const auto store = [&](auto with_beta, auto with_bias) {
    const Packet vbeta = ei::pset1<Packet>(beta);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NP; ++j) {
        Packet v = acc[i][j];
        if constexpr (decltype(with_beta)::value) v = ei::pmadd(vbeta, ei::ploadu<Packet>(x + i * ldx + j * kW), v);
        if constexpr (decltype(with_bias)::value) v = ei::padd(v, ei::ploadu<Packet>(bias + j * kW));
        ei::pstoreu(c + i * ldc + j * kW, v);
      }
  };
  using std::false_type, std::true_type;
  if (beta == 0.0f) {
    if (bias == nullptr) store(false_type(), false_type());
    else store(false_type(), true_type());
  } else {
    if (bias == nullptr) store(true_type(), false_type());
    else store(true_type(), true_type());
  }
}

using SmallTile = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, const float*,
                           int64_t, const float*, float*, int64_t);
template <bool kUnitA, int... I>
constexpr std::array<SmallTile, sizeof...(I)> small_tiles(std::integer_sequence<int, I...>) {
  return {&small_tile<I / kPackets + 1, I % kPackets + 1, kUnitA>...};
}
// small_tile<rows, packets, unit> at [unit][(rows - 1) kPackets + packets - 1].
constexpr std::array<std::array<SmallTile, kRows * kPackets>, 2> kSmallTiles = {
    small_tiles<false>(std::make_integer_sequence<int, kRows * kPackets>()),
    small_tiles<true>(std::make_integer_sequence<int, kRows * kPackets>())};

// c (m, n) = op(a) op(b) + beta x (+ bias) on small_tile (x: c where null): op(b) read as rows of
// whole packets, from b where it lies so (not transposed, n a multiple of the packet), else from a
// copy; c in tiles of at most kPackets packets and kRows rows, both as even as they go (32 rows are
// 6, 6, 5, 5, 5, 5, not five of 6 and one of 2, whose 4 FMAs a step cover no load); k in blocks of
// kDepth, the first adding beta x, the last the bias, each block over every tile of c before the next
// (an element's blocks still added in k's order: the same bits in any loop order).
void small_product(const Operand& a, const Operand& b, float beta, float* c, int64_t ldc, const float* x = nullptr,
                   int64_t ldx = 0, const float* bias = nullptr) {
  const int64_t m = a.op_rows(), n = b.op_cols(), k = a.op_cols(), packets = (n + kW - 1) / kW;
  const float* bp = b.data;
  int64_t ldb = b.ld;
  thread_local AlignedFloats copy;
  if (b.trans || n % kW != 0) {
    ldb = packets * kW;
    copy.assign(k * ldb, 0.0f);
    if (b.trans) {
      transpose(b.data, b.ld, n, k, copy.data(), ldb);
    } else {
      for (int64_t p = 0; p < k; ++p) std::copy_n(b.data + p * b.ld, n, copy.data() + p * ldb);
    }
    bp = copy.data();
  }
  const int64_t ars = a.trans ? 1 : a.ld, acs = a.trans ? a.ld : 1;
  const auto& tiles_of = kSmallTiles[acs == 1];
  const int64_t col_tiles = (packets + kPackets - 1) / kPackets, row_tiles = (m + kRows - 1) / kRows;
  // Column tiles of at most kPackets packets, as even as they go; only the last may be partial (n not
  // a multiple of the packet): it works in `pad`, x's columns copied in where beta is not 0 (zeros
  // after them, and after the bias's in pad_bias), its rows copied out at the end.
  thread_local AlignedFloats pad, pad_bias;
  // (Each tile takes the remaining packets over the remaining tiles, rounded up: the sizes differ by at
  // most one, the larger first, so the last has packets / col_tiles.)
  const auto tile_packets = [&](int64_t t, int64_t j0) { return (packets - j0 + (col_tiles - t) - 1) / (col_tiles - t); };
  const int64_t last_np = packets / col_tiles, last_j0 = packets - last_np;
  const int64_t last_cols = n - last_j0 * kW, ldp = last_np * kW;
  const bool partial = last_cols < ldp;
  const float* last_bias = bias != nullptr ? bias + last_j0 * kW : nullptr;
  if (partial) {
    pad.assign(m * ldp, 0.0f);
    if (beta != 0.0f) {
      const float* from = x != nullptr ? x + last_j0 * kW : c + last_j0 * kW;
      const int64_t ld_from = x != nullptr ? ldx : ldc;
      for (int64_t i = 0; i < m; ++i) std::copy_n(from + i * ld_from, last_cols, pad.data() + i * ldp);
    }
    if (bias != nullptr) {
      pad_bias.assign(ldp, 0.0f);
      std::copy_n(last_bias, last_cols, pad_bias.data());
      last_bias = pad_bias.data();
    }
  }
  // k's blocks outermost: a's block (m rows of kDepth) and b's (kDepth rows of n) stay in cache while
  // every tile of c reads them (with k's blocks innermost, a long k streamed both from L2 for each tile).
  for (int64_t p0 = 0; p0 < k; p0 += kDepth) {
    const int64_t depth = std::min(kDepth, k - p0);
    const float tile_beta = p0 == 0 ? beta : 1.0f;
    const bool last_block = p0 + kDepth >= k;
    for (int64_t t = 0, j0 = 0; t < col_tiles; ++t) {
      const int64_t np = tile_packets(t, j0);  // packets of this column tile
      const bool in_pad = partial && t == col_tiles - 1;
      float* cc = in_pad ? pad.data() : c + j0 * kW;
      const int64_t ldcc = in_pad ? ldp : ldc;
      const float* xc = p0 == 0 && x != nullptr && !in_pad ? x + j0 * kW : nullptr;
      const float* tile_bias = !last_block || bias == nullptr ? nullptr : in_pad ? last_bias : bias + j0 * kW;
      for (int64_t r = 0, i0 = 0; r < row_tiles; ++r) {
        const int64_t mr = (m - i0 + (row_tiles - r) - 1) / (row_tiles - r);  // rows of this row tile
        tiles_of[(mr - 1) * kPackets + np - 1](a.data + i0 * ars + p0 * acs, ars, acs, bp + p0 * ldb + j0 * kW, ldb,
                                               depth, tile_beta, xc != nullptr ? xc + i0 * ldx : nullptr, ldx,
                                               tile_bias, cc + i0 * ldcc, ldcc);
        i0 += mr;
      }
      j0 += np;
    }
  }
  if (partial)
    for (int64_t i = 0; i < m; ++i) std::copy_n(pad.data() + i * ldp, last_cols, c + i * ldc + last_j0 * kW);
}

}  // namespace

// Blocks of kW x kW in registers, the edges one by one.
void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  const int64_t rows_w = rows / kW * kW, cols_w = cols / kW * kW;
  for (int64_t r0 = 0; r0 < rows_w; r0 += kW)
    for (int64_t c0 = 0; c0 < cols_w; c0 += kW) {
      ei::PacketBlock<Packet, kW> block;
      for (int64_t i = 0; i < kW; ++i) block.packet[i] = ei::ploadu<Packet>(src + (r0 + i) * ld + c0);
      ei::ptranspose(block);
      for (int64_t i = 0; i < kW; ++i) ei::pstoreu(dst + (c0 + i) * ldd + r0, block.packet[i]);
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = r < rows_w ? cols_w : 0; c < cols; ++c) dst[c * ldd + r] = src[r * ld + c];
}

void tile_gemm(const Operand& a, const Operand& b, float beta, float* c, int64_t ldc) {
  if (a.op_rows() == 0 || b.op_cols() == 0) return;
  if (a.op_cols() == 0) {
    Strided cm(c, a.op_rows(), b.op_cols(), Stride(ldc));
    if (beta == 0.0f) cm.setZero(); else cm *= beta;
    return;
  }
  small_product(a, b, beta, c, ldc);
}

void tile_gemm_residual(const Operand& a, const Operand& b, const float* x, int64_t ldx, const float* bias, float* c,
                        int64_t ldc) {
  const int64_t m = a.op_rows(), n = b.op_cols();
  if (m == 0 || n == 0) return;
  if (a.op_cols() == 0) {
    Strided(c, m, n, Stride(ldc)) = ConstStrided(x, m, n, Stride(ldx)).rowwise() + ConstVec(bias, n);
    return;
  }
  small_product(a, b, 1.0f, c, ldc, x, ldx, bias);
}

int64_t tile_packet_floats() { return kW; }

bool projections_on_tiles(int64_t D) {
#if defined(__x86_64__) || defined(__i386__)
  if (D > kTileProjectionMaxDim) return false;
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return cpu_sgemm() == nullptr || tile_packet_floats() >= 16 ||
         (tile_packet_floats() == 8 && D <= kAvx2TileProjectionMaxDim && !intel);
#else
  return D <= kTileProjectionMaxDim;  // (measured on x86 alone; as attention_on_blas)
#endif
}

bool attention_on_blas() {
  static const int rule = [] {  // 1 blas, 0 tiles, -1 by the CPU
    const char* want = std::getenv("FASTAXIAL_CPU_ATTENTION");
    if (want != nullptr && std::strcmp(want, "blas") == 0) return 1;
    if (want != nullptr && std::strcmp(want, "tiles") == 0) return 0;
    if (want != nullptr && *want != '\0')
      std::fprintf(stderr, "fastaxial: FASTAXIAL_CPU_ATTENTION=%s is neither blas nor tiles: ignored\n", want);
#if defined(__x86_64__) || defined(__i386__)
    // The tiles win only where they are AVX-512's (16 floats a packet, 32 registers) and MKL is not on
    // its own AVX-512 code (perf notes v106); AVX2's tiles lost to MKL's AVX2 products on an AMD EPYC
    // (v115), as does the wheel's avx2 copy on any CPU.
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") || tile_packet_floats() < 16 ? -1 : 0;
#else
    return 0;
#endif
  }();
  return rule != 0 && cpu_sgemm() != nullptr;
}

void gemm(const Operand& a, const Operand& b, float beta, float* c, int64_t ldc) {
  const int64_t m = a.op_rows(), n = b.op_cols(), k = a.op_cols();
  if (m == 0 || n == 0) return;
  Strided cm(c, m, n, Stride(ldc));
  if (k == 0) {  // no terms: c = beta c (a BLAS would refuse the zero strides of empty operands)
    if (beta == 0.0f) cm.setZero(); else cm *= beta;
    return;
  }
  if (m * n * k <= kSmallProduct) return small_product(a, b, beta, c, ldc);
  const CpuSgemm sgemm = cpu_sgemm();
  if (sgemm != nullptr && fits_int(m) && fits_int(n) && fits_int(k) && fits_int(a.ld) && fits_int(b.ld) &&
      fits_int(ldc)) {
    // A row-major (r, c) matrix with row stride ld is the column-major (c, r) matrix with leading
    // dimension ld, its transpose. So row-major c = op(a) op(b) is column-major c^T = op(b)^T op(a)^T:
    // sgemm with the operands swapped, each transposed where it is used as stored.
    const char ta = b.trans ? 'T' : 'N', tb = a.trans ? 'T' : 'N';
    const int M = (int)n, N = (int)m, K = (int)k, lda = (int)b.ld, ldb = (int)a.ld, ldcc = (int)ldc;
    const float alpha = 1.0f;
    sgemm(&ta, &tb, &M, &N, &K, &alpha, b.data, &lda, a.data, &ldb, &beta, c, &ldcc);
    return;
  }
  const ConstStrided am(a.data, a.rows, a.cols, Stride(a.ld)), bm(b.data, b.rows, b.cols, Stride(b.ld));
  if (!a.trans && !b.trans) eigen_product(am, bm, beta, cm);
  else if (!a.trans) eigen_product(am, bm.transpose(), beta, cm);
  else if (!b.trans) eigen_product(am.transpose(), bm, beta, cm);
  else eigen_product(am.transpose(), bm.transpose(), beta, cm);
}

}  // namespace fastaxial::cpu::FASTAXIAL_CPU_COPY
