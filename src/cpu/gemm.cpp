// gemm.h's products: the BLAS set with set_cpu_sgemm where there is one, else Eigen. (The BLAS
// itself is kept in dispatch.cpp: one for the process, whichever copy of this file runs.)
#include "gemm.h"

#include <climits>

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

}  // namespace

void gemm(const Operand& a, const Operand& b, float beta, float* c, int64_t ldc) {
  const int64_t m = a.op_rows(), n = b.op_cols(), k = a.op_cols();
  if (m == 0 || n == 0) return;
  Strided cm(c, m, n, Stride(ldc));
  if (k == 0) {  // no terms: c = beta c (a BLAS would refuse the zero strides of empty operands)
    if (beta == 0.0f) cm.setZero(); else cm *= beta;
    return;
  }
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
