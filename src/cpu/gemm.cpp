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

// c (MR rows, NP packets: `cols` of them written) = a b + beta x (+ bias): a(i, p) at a[i ars + p acs],
// b's row p at b + p ldb (NP packets readable), x c itself where null (row stride ldx, else ldc), bias
// `cols` floats or null. Each element is summed over p in order; the bias added after the rest.
template <int MR, int NP>
void small_tile(const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb, int64_t k, float beta,
                const float* x, int64_t ldx, const float* bias, float* c, int64_t ldc, int64_t cols) {
  Packet acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = ei::pset1<Packet>(0.0f);
  for (int64_t p = 0; p < k; ++p) {
    Packet bp[NP];
    for (int j = 0; j < NP; ++j) bp[j] = ei::ploadu<Packet>(b + p * ldb + j * kW);
    for (int i = 0; i < MR; ++i) {
      const Packet ai = ei::pset1<Packet>(a[i * ars + p * acs]);
      for (int j = 0; j < NP; ++j) acc[i][j] = ei::pmadd(ai, bp[j], acc[i][j]);
    }
  }
  const Packet vbeta = ei::pset1<Packet>(beta);
  if (x == nullptr) {
    x = c;
    ldx = ldc;
  }
  if (cols == NP * kW) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NP; ++j) {
        Packet cij = beta == 0.0f ? acc[i][j] : ei::pmadd(vbeta, ei::ploadu<Packet>(x + i * ldx + j * kW), acc[i][j]);
        if (bias != nullptr) cij = ei::padd(cij, ei::ploadu<Packet>(bias + j * kW));
        ei::pstoreu(c + i * ldc + j * kW, cij);
      }
    return;
  }
  alignas(64) float rest[NP * kW];  // a partial last tile: through a buffer, its columns
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NP; ++j) ei::pstore(rest + j * kW, acc[i][j]);
    const float* xi = x + i * ldx;
    float* ci = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) {
      const float cij = beta == 0.0f ? rest[j] : rest[j] + beta * xi[j];
      ci[j] = bias != nullptr ? cij + bias[j] : cij;
    }
  }
}

using SmallTile = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, const float*,
                           int64_t, const float*, float*, int64_t, int64_t);
template <int... I>
constexpr std::array<SmallTile, sizeof...(I)> small_tiles(std::integer_sequence<int, I...>) {
  return {&small_tile<I / kPackets + 1, I % kPackets + 1>...};
}
// small_tile<rows, packets> at [(rows - 1) kPackets + packets - 1].
constexpr auto kSmallTiles = small_tiles(std::make_integer_sequence<int, kRows * kPackets>());

// c (m, n) = op(a) op(b) + beta x (+ bias) on small_tile (x: c where null): op(b) read as rows of
// whole packets, from b where it lies so (not transposed, n a multiple of the packet), else from a
// copy; c's columns in tiles of at most kPackets packets, as even as they go, and kRows rows; k in
// blocks of kDepth, the first adding beta x, the last the bias.
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
  const int64_t tiles = (packets + kPackets - 1) / kPackets;
  for (int64_t t = 0, j0 = 0; t < tiles; ++t) {
    const int64_t np = (packets - j0 + (tiles - t) - 1) / (tiles - t);  // packets of this column tile
    const int64_t cols = std::min(np * kW, n - j0 * kW);
    for (int64_t i0 = 0; i0 < m; i0 += kRows) {
      const int64_t mr = std::min<int64_t>(kRows, m - i0);
      for (int64_t p0 = 0; p0 < k; p0 += kDepth)
        kSmallTiles[(mr - 1) * kPackets + np - 1](
            a.data + i0 * ars + p0 * acs, ars, acs, bp + p0 * ldb + j0 * kW, ldb, std::min(kDepth, k - p0),
            p0 == 0 ? beta : 1.0f, p0 == 0 && x != nullptr ? x + i0 * ldx + j0 * kW : nullptr, ldx,
            p0 + kDepth >= k && bias != nullptr ? bias + j0 * kW : nullptr, c + i0 * ldc + j0 * kW, ldc, cols);
    }
    j0 += np;
  }
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
  return D <= kTileProjectionMaxDim && (cpu_sgemm() == nullptr || tile_packet_floats() >= 16);
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
