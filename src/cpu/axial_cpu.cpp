// CPU forward of axial attention.
//
// One pass per axis. Where a pass has sequences enough for the threads, it
// walks them in blocks of a few sequences per OpenMP task: gather the
// block's rows (strided for columns, so no permuted copy), LayerNorm, one QKV
// matrix product for the whole block, softmax attention per sequence and
// head, one output-projection product that adds the residual and bias as
// it stores each row where it goes (no scatter pass). Memory per thread
// is one block's worth ((rows, 3D) and one score tile),
// never a tensor of the whole input (few_sequences_pass's shared rows, a
// group of sequences', are kept by the calling thread for its next call up to 32 MB).
// Where it has fewer (one long sequence, say), the threads share a group of sequences at a time:
// its row tiles, then its (sequence, head, query tile) tasks, then its row tiles again. A score tile is (L, L)
// up to 512 positions; longer sequences are attended 512 keys at a time with
// each query's running max and sum (online softmax, attend), in tiles of at
// most (256, 512) that stay in cache.
//
// The matrix products go through gemm.h (PyTorch's MKL where the torch
// module set it, else Eigen's GEMM); the attention's products, k transposed once
// a block, on gemm.cpp's register tiles where they are AVX-512's on a CPU that is
// not Intel's or no BLAS is set, else on the BLAS (attention_product); the projections
// at dims up to kTileProjectionMaxDim on the tiles where they are AVX-512's or no BLAS
// is set, with the weights transposed once a pass (Projections). Each sequence is read whole
// before it is written and sequences are disjoint, so the column pass can run
// in place on the row pass's output.
//
// For training it may also keep what backward_cpu reads (AxialParams::row_out, saved_qkv, saved_o,
// saved_p): x1, each pass's q, k, v, the attention output of long sequences and the softmax
// probabilities of short ones.
//
// Attention dropout (p.dropout > 0): each head's unnormalised probabilities are multiplied
// by the mask's multipliers (0 or 1 / (1 - p), common/dropout.h) after their row sums are
// taken, before the product with v. With p.dropout = 0 none of this code runs.
#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <memory>
#include <vector>

#include <Eigen/Core>

#include "../common/axis.h"
#include "../common/dropout.h"
#include "cpu_common.h"
#include "gemm.h"
#include "fastaxial/fastaxial.h"

namespace fastaxial {
namespace {

using namespace cpu;

struct Scratch {
  Mat x, y, qkv, kT, o, s;  // kT: the block's k transposed, (D, rows): the scores' right operand
  Mat m;  // dropout multipliers of one (sequence, head, query range): (queries, L)
  Eigen::VectorXf sum, max;  // softmax denominators and running maxima, one per query
};

// What a pass needs besides its rows.
struct PassArgs {
  const AxisView& v;
  int64_t D, heads, hd;
  float eps, scale;  // scale = 1 / sqrt(hd)
  const Projections& proj;  // wqkv (3D, D), wout (D, D)
  ConstVec gamma, beta, bout;
  const DropoutParams* drop;  // null: no dropout
  int pass;  // 0 rows, 1 columns
  float* qkv_out;  // where the pass's q, k, v are kept for backward_cpu (3D floats a position), or null
  float* o_out;    // where its attention output o is kept (D floats a position), or null
  float* p_out;    // where its probabilities P are kept ((L, L) a sequence and head), or null
};

// Keeps rows r0 .. r0 + rows - 1 of a sequence n's m (rows of m.cols() floats, from row `from` of
// m) at their positions' rows of `kept` (row_indices), where the caller keeps them (kept: a.qkv_out
// for q, k, v; a.o_out for the attention output; null: nothing kept).
void keep_rows(const PassArgs& a, float* kept, const Mat& m, int64_t from, int64_t n, int64_t r0, int64_t rows) {
  if (kept == nullptr) return;
  const AxisView at = row_indices(a.v, a.D);
  const int64_t width = m.cols();
  for (int64_t r = 0; r < rows; ++r) VecMap(kept + at.offset(n, r0 + r) * width, width) = m.row(from + r);
}

// x = the D floats at src, y = LayerNorm(x).
template <class RowX, class RowY>
void layer_norm_row(const PassArgs& a, const float* src, RowX&& x, RowY&& y) {
  x = ConstVec(src, a.D);
  const float mean = x.mean();
  const float var = (x.array() - mean).square().sum() / static_cast<float>(a.D);
  const float rstd = 1.0f / std::sqrt(var + a.eps);
  y = ((x.array() - mean) * rstd * a.gamma.array() + a.beta.array()).matrix();
}

// Keys a score tile holds. A longer sequence is attended kKeyBlock keys at a time, each query
// keeping its running max and sum (the online softmax): its (queries, kKeyBlock) tiles stay in
// cache where a (queries, L) one would not, and each product packs a block of k and v where it
// packed all of them. Up to kKeyBlock keys the code below is the one-block case.
constexpr int64_t kKeyBlock = 512;

// Rows i0 .. i1 - 1 of head h of o = softmax(q k^T / sqrt(hd)) v for sequence n, whose (L, 3D)
// qkv rows ([q | k | v], head h at columns h hd of each part) start at row `base` of qkv, and whose
// k, transposed, starts at column `base` of kT (D, rows), into the same rows of o. Both products are
// attention_product's. p = exp((q k^T - rowmax) / sqrt(hd)): the scale rides
// in the exponent, the division by the row sums on the (rows, hd) result. Over key blocks (kKeyBlock), a block
// whose scores raise a query's max rescales that query's sum and output so far by
// exp((old max - new max) / sqrt(hd)) first. With dropout the sums are of the undropped
// probabilities: P = exp / sum, then P o M / (1 - p), M drawn from element (query, key) on
// (row-major: the (pass, sequence, head)'s L^2 consecutive elements).
void attend(const PassArgs& a, const Mat& qkv, const Mat& kT, int64_t base, int64_t L, int64_t n, int64_t h,
            int64_t i0, int64_t i1, Scratch& t, Mat& o) {
  const int64_t rows = i1 - i0, hd = a.hd;
  const auto q = qkv.block(base + i0, h * hd, rows, hd);
  auto ob = o.block(base + i0, h * hd, rows, hd);
  t.sum.setZero(rows);
  t.max.resize(rows);
  for (int64_t j0 = 0; j0 < L; j0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, L - j0);
    const auto kt = kT.block(h * hd, base + j0, hd, keys);
    const auto val = qkv.block(base + j0, 2 * a.D + h * hd, keys, hd);
    attention_product(t.s, in(q), in(kt));  // (rows, keys) unscaled scores
    for (int64_t i = 0; i < rows; ++i) {
      auto row = t.s.row(i).array();
      const float block_max = row.maxCoeff();
      const float m = j0 == 0 ? block_max : std::max(t.max(i), block_max);
      if (j0 > 0 && m > t.max(i)) {  // rescale what the earlier blocks summed
        const float c = std::exp((t.max(i) - m) * a.scale);
        t.sum(i) *= c;
        ob.row(i) *= c;
      }
      t.sum(i) += exp_and_sum(t.s.row(i).data(), keys, m, a.scale);
      t.max(i) = m;
      // P kept for the backward (one key block: L < 128), times 1 / sum as the backward's softmax_rows.
      if (a.p_out != nullptr)
        VecMap(a.p_out + ((n * a.heads + h) * L + i0 + i) * L, L) = t.s.row(i) * (1.0f / t.sum(i));
    }
    if (a.drop) {
      if (keys == L) {
        fill_mask(*a.drop, a.pass, n, h, L, i0, rows, t.m);
      } else {
        t.m.resize(rows, keys);
        for (int64_t i = 0; i < rows; ++i)
          dropout_row(*a.drop, dropout_element(*a.drop, a.pass, n, h, i0 + i, j0), keys, t.m.row(i).data());
      }
      t.s.array() *= t.m.array();
    }
    attention_product(ob, in(t.s), in(val), j0 == 0 ? 0.0f : 1.0f);
  }
  for (int64_t i = 0; i < rows; ++i) ob.row(i) /= t.sum(i);  // (row by row: see backward_cpu.cpp's dS)
}

// Queries a score tile of block_pass holds where the keys come in blocks: each product packs its
// block of k and v once for that many queries.
constexpr int64_t kQueryTile = 256;

// Rows ahead of the one being read that block_pass's gather prefetches (perf notes v104).
constexpr int64_t kGatherAhead = 8;

// Many sequences: the team takes blocks of a few sequences, one block a task: gather the block's
// rows, LayerNorm, one QKV product for the block, attention per sequence and head, the output
// product with the residual and bias into dst (project_out).
void block_pass(const PassArgs& a, const float* src, float* dst, int64_t seq_per_block, int team) {
  const AxisView& v = a.v;
  const int64_t L = v.len, N = v.num_seq, D = a.D;
  const int64_t num_blocks = (N + seq_per_block - 1) / seq_per_block;
  const auto run_block = [&](int64_t blk, Scratch& t) {
    const int64_t n0 = blk * seq_per_block;
    const int64_t ns = std::min(seq_per_block, N - n0);
    const int64_t rows = ns * L;
    t.x.resize(rows, D);  // x is (rows, D): the block's positions; y their LayerNorm
    t.y.resize(rows, D);
    for (int64_t r = 0; r < rows; ++r) {
      // A column pass's rows lie W D floats apart, much of them in the other core's cache (the row
      // pass wrote them): asked for kGatherAhead rows before they are read.
      if (r + kGatherAhead < rows) {
        const float* ahead = src + v.offset(n0 + (r + kGatherAhead) / L, (r + kGatherAhead) % L);
        for (int64_t j = 0; j < D; j += 16) __builtin_prefetch(ahead + j);  // a 64-byte line each
      }
      layer_norm_row(a, src + v.offset(n0 + r / L, r % L), t.x.row(r), t.y.row(r));
    }
    a.proj.qkv_product(t.qkv, t.y);  // (rows, 3D)
    for (int64_t s = 0; s < ns; ++s) keep_rows(a, a.qkv_out, t.qkv, s * L, n0 + s, 0, L);
    t.o.resize(rows, D);
    // Queries in tiles of kQueryTile where keys come in blocks: a (kQueryTile, kKeyBlock) score tile.
    const int64_t qt = L > kKeyBlock ? kQueryTile : L;
    if (L == 1 && a.drop == nullptr) {
      for (int64_t r = 0; r < rows; ++r) single_key_forward(t.qkv, r, D, a.heads, t.o);
    } else {
      t.kT.resize(D, rows);
      transpose_part(t.qkv, 1, 0, rows, t.kT);
      for (int64_t s = 0; s < ns; ++s)
        for (int64_t h = 0; h < a.heads; ++h)
          for (int64_t i0 = 0; i0 < L; i0 += qt)
            attend(a, t.qkv, t.kT, s * L, L, n0 + s, h, i0, std::min(i0 + qt, L), t, t.o);
    }
    for (int64_t s = 0; s < ns; ++s) keep_rows(a, a.o_out, t.o, s * L, n0 + s, 0, L);
    // x + o Wout^T + bout, written where it goes.
    project_out(a.proj, v, n0, ns, t.o, t.x, a.bout.data(), dst);
  };
  dynamic_tasks<Scratch>(num_blocks, team, run_block);
}

// Rows a task of few_sequences_pass (few_tile): LayerNorm and the products a tile of rows at a time,
// the attention a tile of queries of one head at a time (a score tile of (rows, min(L, kKeyBlock))).
// Fixed, so the result does not depend on the number of threads.
constexpr int64_t kRowTile = 64;
// The rows of few_sequences_pass's tasks: kRowTile; half that from 128 positions up to one key
// block, twice the tasks for the team (16 a step for a sequence of 512), where the products stay
// large enough for the BLAS. (Below 128 the tiles stay those whose P the backward reads:
// keeps_probabilities.)
int64_t few_tile(int64_t L) { return L >= 128 && L <= kKeyBlock ? kRowTile / 2 : kRowTile; }

// Floats few_sequences_pass keeps for a group of sequences (x, qkv, kT, o: 6 L D a sequence): the
// group is as many sequences as fit (at least one), and the calling thread keeps them for its next
// call up to this size (fresh, they are faulted in page by page at every call: perf notes v106).
// kKeptStateFloats by default; FASTAXIAL_CPU_GROUP_FLOATS, read once, sets another (tests: groups of a few
// sequences and a last one short, at shapes small enough to test).
int64_t few_sequences_floats() {
  static const int64_t floats = [] {
    const char* env = std::getenv("FASTAXIAL_CPU_GROUP_FLOATS");
    const long long v = env != nullptr ? std::atoll(env) : 0;
    return v > 0 ? static_cast<int64_t>(v) : kKeptStateFloats;
  }();
  return floats;
}

// Fewer blocks than threads (a few long sequences, say): the sequences a group at a time (as many as
// few_sequences_floats() holds), the team spread over the group's row tiles (LayerNorm, QKV product),
// then its (sequence, head, query tile) tasks (attention), then its row tiles again (the output
// product with the residual and bias, into dst). Two barriers a group, not a sequence: at each
// barrier the threads that ran out of a sequence's tasks wait (perf notes v107, v109). A group
// is gathered whole before any of it is written, so the column pass may run in place. Each sequence's
// tiles and products are the same whatever the group: on the register tiles the bits do not depend
// on it (on a BLAS, attention_on_blas or !projections_on_tiles, a sequence's operands lie elsewhere in
// a group's rows).
void few_sequences_pass(const PassArgs& a, const float* src, float* dst, int team) {
  const AxisView& v = a.v;
  const int64_t L = v.len, N = v.num_seq, D = a.D;
  const int64_t tile_rows = few_tile(L), tiles = (L + tile_rows - 1) / tile_rows;
  // Groups as even as the cap allows (9 sequences where 8 fit: 5 and 4, not 8 and 1).
  const int64_t fit = std::clamp<int64_t>(few_sequences_floats() / (6 * L * D), 1, N);
  const int64_t groups = (N + fit - 1) / fit, G = (N + groups - 1) / groups;
  // The group's rows, shared by the team (row g L + r: sequence g's row r), kept by the calling
  // thread as the backward's scratch is.
  struct Shared {
    Mat x, qkv, kT, o;
  };
  Shared& kept = thread_state<Shared>();
  Mat &x = kept.x, &qkv = kept.qkv, &kT = kept.kT, &o = kept.o;
  x.resize(G * L, D), qkv.resize(G * L, 3 * D), kT.resize(D, G * L), o.resize(G * L, D);
  // Each group's (sequence, head, query tile) tasks: a queue of their own (the steps are apart by barriers).
  std::vector<std::unique_ptr<TaskQueue>> attention(groups);
  for (int64_t gi = 0; gi < groups; ++gi)
    attention[gi] = std::make_unique<TaskQueue>(std::min(G, N - gi * G) * a.heads * tiles);
  on_team(team, [&](int worker, int workers) {
    Scratch t;
    // The same share of G tiles' rows in every group, the last one's missing sequences skipped:
    // f(g, r0, rows, gr) for each of this thread's tiles of a group of ng sequences (sequence g's
    // rows r0 .., row gr of the group's matrices).
    const StaticShare mine(G * tiles, worker, workers);
    const auto my_tiles = [&](int64_t ng, const auto& f) {
      for (int64_t u = mine.begin; u < mine.end; ++u) {
        const int64_t g = u / tiles, r0 = u % tiles * tile_rows;
        if (g >= ng) break;
        f(g, r0, std::min(tile_rows, L - r0), g * L + r0);
      }
    };
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t n0 = gi * G, ng = std::min(G, N - n0);
      my_tiles(ng, [&](int64_t g, int64_t r0, int64_t rows, int64_t gr) {
        t.y.resize(rows, D);
        for (int64_t r = 0; r < rows; ++r)
          layer_norm_row(a, src + v.offset(n0 + g, r0 + r), x.row(gr + r), t.y.row(r));
        a.proj.qkv_product(qkv.middleRows(gr, rows), t.y);
        transpose_part(qkv, 1, gr, rows, kT);
        keep_rows(a, a.qkv_out, qkv, gr, n0 + g, r0, rows);
      });
      if (workers > 1) barrier();  // (all threads alike: workers is the region's)
      for (int64_t task; worker < workers && attention[gi]->next(&task);) {
        const int64_t g = task / (a.heads * tiles), h = task / tiles % a.heads, i0 = task % tiles * tile_rows;
        attend(a, qkv, kT, g * L, L, n0 + g, h, i0, std::min(i0 + tile_rows, L), t, o);
      }
      if (workers > 1) barrier();
      my_tiles(ng, [&](int64_t g, int64_t r0, int64_t rows, int64_t gr) {
        keep_rows(a, a.o_out, o, gr, n0 + g, r0, rows);
        a.proj.out_residual(dst + v.offset(n0 + g, r0), v.pos_stride, o.middleRows(gr, rows), &x(gr, 0), D,
                            a.bout.data());
      });
      // No barrier here: a thread's output tiles are the rows its LayerNorm tiles wrote (the same
      // share in every group), so the next group's first step overwrites only rows this thread is
      // done with, and o only after that step's barrier.
    }
  });
  if (6 * L * D * G > few_sequences_floats()) kept = Shared();
}

// One axis: src -> dst (dst may equal src). view says where sequences lie. drop: the dropout
// mask (null: none), pass: 0 rows, 1 columns; qkv_out, o_out, p_out: where the pass's q, k, v, its
// attention output and its probabilities are kept (or null).
void axis_pass(const AxisView& v, int64_t D, int64_t heads, float eps, const AxisWeights& w, const float* src,
               float* dst, const DropoutParams* drop, int pass, float* qkv_out, float* o_out, float* p_out) {
  const int64_t L = v.len, N = v.num_seq, hd = D / heads;
  if (N == 0 || L == 0) return;
  const Projections proj(w.qkv_weight, w.out_weight, D);
  const PassArgs a = {v,
                      D,
                      heads,
                      hd,
                      eps,
                      1.0f / std::sqrt(static_cast<float>(hd)),
                      proj,
                      ConstVec(w.norm_weight, D),
                      ConstVec(w.norm_bias, D),
                      ConstVec(w.out_bias, D),
                      drop,
                      pass,
                      qkv_out,
                      o_out,
                      p_out};

  // Enough rows per block for an efficient GEMM, enough blocks for the threads.
  const int threads = max_threads();
  int64_t seq_per_block = std::max<int64_t>(1, 128 / L);
  seq_per_block = std::min(seq_per_block, std::max<int64_t>(1, N / (4 * threads)));
  const int64_t num_blocks = (N + seq_per_block - 1) / seq_per_block;
  // Fewer blocks than threads and sequences of two row tiles or more: spread each sequence.
  if (num_blocks < threads && L > kRowTile) return few_sequences_pass(a, src, dst, threads);
  // No more threads than blocks: a team's start costs microseconds, more than a small pass's work.
  block_pass(a, src, dst, seq_per_block, (int)std::min<int64_t>(threads, num_blocks));
}

}  // namespace

namespace cpu::FASTAXIAL_CPU_COPY {

int64_t saved_o_floats(const AxialParams& p) { return kept_outputs(p).floats; }
int64_t saved_p_floats(const AxialParams& p) { return kept_probabilities(p).floats; }

Status forward(const AxialParams& p) {
  if (Status s = validate(p); !s.ok()) return s;
  const DropoutParams drop = make_dropout(p);
  const DropoutParams* mask = p.dropout > 0.0f ? &drop : nullptr;  // null: no dropout
  // x1 in row_out where the caller keeps it for backward_cpu, else in out (the column pass in place).
  float* const x1 = p.row_out != nullptr ? p.row_out : p.out;
  const int64_t qkv_floats = 3 * p.batch * p.height * p.width * p.dim;  // a pass's
  float* const col_qkv = p.saved_qkv != nullptr ? p.saved_qkv + qkv_floats : nullptr;
  const KeptOutputs o = kept_outputs(p), probs = kept_probabilities(p);
  axis_pass(row_view(p), p.dim, p.heads, p.eps, p.row, p.x, x1, mask, 0, p.saved_qkv, o.row, probs.row);
  axis_pass(col_view(p), p.dim, p.heads, p.eps, p.col, x1, p.out, mask, 1, col_qkv, o.col, probs.col);
  return Status::Ok();
}

}  // namespace cpu::FASTAXIAL_CPU_COPY
}  // namespace fastaxial
