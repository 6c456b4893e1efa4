// CPU forward of axial attention.
//
// One pass per axis. A pass walks its N sequences in blocks of a few
// sequences per OpenMP task: gather the block's rows (strided for columns, so
// no permuted copy), LayerNorm, one QKV matrix product for the whole block,
// softmax attention per sequence and head, one output-projection product, add
// the residual, scatter back. Memory per thread is one block's worth
// ((rows, 3D) and one (L, L) score matrix), never a tensor of the whole input.
//
// The matrix products go through Eigen: its blocked, vectorised GEMM beats
// hand loops at these sizes and is header-only. Each sequence is read whole
// before it is written and sequences are disjoint, so the column pass can run
// in place on the row pass's output.
//
// Attention dropout (p.dropout > 0): each head's unnormalised probabilities are multiplied
// by the mask's multipliers (0 or 1 / (1 - p), common/dropout.h) after their row sums are
// taken, before the product with v. With p.dropout = 0 none of this code runs.
#include <algorithm>
#include <cmath>
#include <vector>

#include <Eigen/Core>

#include "../common/axis.h"
#include "../common/dropout.h"
#include "fastaxial/fastaxial.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial {
namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const Mat>;
using ConstVec = Eigen::Map<const Eigen::RowVectorXf>;

struct Scratch {
  Mat x, y, qkv, o, s;
  Mat m;  // dropout multipliers of one (sequence, head): (L, L)
  Eigen::VectorXf sum;  // softmax denominators, one per query
};

// One axis: src -> dst (dst may equal src). view says where sequences lie. drop: the dropout
// mask (null: none), pass: 0 rows, 1 columns.
void axis_pass(const AxisView& v, int64_t D, int64_t heads, float eps, const AxisWeights& w,
               const float* src, float* dst, const DropoutParams* drop, int pass) {
  const int64_t L = v.len, N = v.num_seq, hd = D / heads;
  if (N == 0 || L == 0) return;
  const ConstMap wqkv(w.qkv_weight, 3 * D, D);  // (3D, D)
  const ConstMap wout(w.out_weight, D, D);      // (D, D)
  const ConstVec gamma(w.norm_weight, D), beta(w.norm_bias, D), bout(w.out_bias, D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  // Enough rows per block for an efficient GEMM, enough blocks for the threads.
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  int64_t seq_per_block = std::max<int64_t>(1, 128 / L);
  seq_per_block = std::min(seq_per_block, std::max<int64_t>(1, N / (4 * threads)));
  const int64_t num_blocks = (N + seq_per_block - 1) / seq_per_block;

  // No more threads than blocks: a team's start costs microseconds, more
  // than a small pass's work.
  const int team = (int)std::min<int64_t>(threads, num_blocks);
#pragma omp parallel num_threads(team) if (team > 1)
  {
    Scratch t;
#pragma omp for schedule(dynamic)
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      const int64_t n0 = blk * seq_per_block;
      const int64_t ns = std::min(seq_per_block, N - n0);
      const int64_t rows = ns * L;
      t.x.resize(rows, D);
      t.y.resize(rows, D);
      // x is (rows, D): gather the block's positions, LayerNorm each into y.
      for (int64_t s = 0; s < ns; ++s)
        for (int64_t l = 0; l < L; ++l) {
          const int64_t r = s * L + l;
          t.x.row(r) = ConstVec(src + v.offset(n0 + s, l), D);
          const float mean = t.x.row(r).mean();
          const float var = (t.x.row(r).array() - mean).square().sum() / static_cast<float>(D);
          const float rstd = 1.0f / std::sqrt(var + eps);
          t.y.row(r) = ((t.x.row(r).array() - mean) * rstd * gamma.array() + beta.array()).matrix();
        }
      // qkv is (rows, 3D): [q | k | v], head h at columns h*hd of each part.
      t.qkv.noalias() = t.y * wqkv.transpose();
      t.o.resize(rows, D);
      t.s.resize(L, L);
      t.sum.resize(L);
      for (int64_t s = 0; s < ns; ++s)
        for (int64_t h = 0; h < heads; ++h) {
          const auto q = t.qkv.block(s * L, h * hd, L, hd);
          const auto k = t.qkv.block(s * L, D + h * hd, L, hd);
          const auto val = t.qkv.block(s * L, 2 * D + h * hd, L, hd);
          // p = exp((q k^T - rowmax) / sqrt(hd)); o_h = (p v) / rowsum(p): the
          // scale rides in the exponent and the division on the (L, hd) result.
          t.s.noalias() = q * k.transpose();  // (L, L) unscaled scores
          for (int64_t i = 0; i < L; ++i) {
            auto row = t.s.row(i).array();
            row = ((row - row.maxCoeff()) * scale).exp();
            t.sum(i) = row.sum();
          }
          if (drop) {  // the sums are of the undropped probabilities: P = exp / sum, then P o M / (1 - p)
            t.m.resize(L, L);  // row-major: the (pass, sequence, head)'s L^2 consecutive elements
            dropout_row(*drop, dropout_element(*drop, pass, n0 + s, h, 0, 0), L * L, t.m.data());
            t.s.array() *= t.m.array();
          }
          auto o = t.o.block(s * L, h * hd, L, hd);
          o.noalias() = t.s * val;
          o.array().colwise() /= t.sum.array();
        }
      // x += o Wout^T + bout, then scatter.
      t.x.noalias() += t.o * wout.transpose();
      t.x.rowwise() += bout;
      for (int64_t s = 0; s < ns; ++s)
        for (int64_t l = 0; l < L; ++l)
          Eigen::Map<Eigen::RowVectorXf>(dst + v.offset(n0 + s, l), D) = t.x.row(s * L + l);
    }
  }
}

}  // namespace

Status forward_cpu(const AxialParams& p) {
  if (Status s = validate(p); !s.ok()) return s;
  const DropoutParams drop = make_dropout(p);
  const DropoutParams* mask = p.dropout > 0.0f ? &drop : nullptr;  // null: no dropout
  axis_pass(row_view(p), p.dim, p.heads, p.eps, p.row, p.x, p.out, mask, 0);
  axis_pass(col_view(p), p.dim, p.heads, p.eps, p.col, p.out, p.out, mask, 1);  // in place
  return Status::Ok();
}

}  // namespace fastaxial
