// CPU backward of axial attention: the gradients of forward_cpu's input and ten weights.
//
// The forward is x1 = x + RowPass(x), out = x1 + ColPass(x1), a pass on each sequence
// (L, D) being  y = LayerNorm(x), qkv = y Wqkv^T, o_h = softmax(q_h k_h^T / sqrt(hd)) v_h,
// x + concat(o_h) Wout^T + bout. The backward runs it in reverse:
//   1. the row pass's forward again, for x1 (the column pass's input), unless the caller kept the
//      forward's (AxialParams::row_out);
//   2. the column pass backward on x1 with dOut = grad_out, giving dx1 = dOut + dLN;
//   3. the row pass backward on x with dOut = dx1, giving grad_x.
// Of the forward, the caller may keep x1, each pass's q, k, v, its attention output o (sequences of
// 128 or more) and its probabilities P (shorter ones) (AxialParams::row_out, saved_qkv, saved_o,
// saved_p); the rest each pass backward recomputes, per block of sequences: LayerNorm, qkv (where
// not kept; the products in row tiles, row_tile) and per sequence and head the scores and softmax
// (max-subtracted exp, as the forward) where P is not kept, and O = P V where o is not kept; then:
//   dbout = colsum(dOut), dWout = dOut^T O, dO = dOut Wout,
//   per head dV = P^T dO_h, dP = dO_h V^T, dS = P o (dP - rowsum(P o dP)),
//            dQ = dS K / sqrt(hd), dK = dS^T Q / sqrt(hd),
//   dWqkv = [dQ|dK|dV]^T y, dy = [dQ|dK|dV] Wqkv, dg = colsum(dy o xhat), db = colsum(dy),
//   dx = dOut + rstd (dxhat - mean(dxhat) - xhat mean(dxhat o xhat)), dxhat = dy o g.
// With attention dropout (p.dropout > 0; common/dropout.h), M the keep mask and c = 1 / (1 - p):
//   O = Pd V with Pd = P o M c;  dV = Pd^T dO_h,  dP = (dO_h V^T) o M c,  dS = P o (dP - rowsum(P o dP))
// (rowsum(P o dP) = rowsum(Pd o dO_h V^T) = rowsum(dO_h o O_h), the form the CUDA kernels use; the CPU
// sums P o dP, an (n, L) product per range, small beside the (n, L, hd) ones, and exact where P is one-hot).
// The mask is drawn again from (seed, offset, element), the forward's: nothing of it is stored.
// With p.dropout = 0 none of this code runs.
// Where P is not kept (sequences of 128 positions or more), recomputing the scores costs one
// (L, L, hd) product per head more than keeping P would, but keeps the scratch per thread at one
// block's worth and one (queries, L) tile of a head.
//
// Weight gradients are sums over every position. For determinism without atomics the
// sequences are cut into at most kMaxChunks chunks of consecutive blocks; one thread walks
// a chunk's blocks in order, adding into the chunk's own partial (4D^2 floats of the two
// products' gradients, 3D doubles of the column sums: the LayerNorm weight and shift and the
// output bias, sums of a term per position, added in fp64 and rounded once, as on CUDA), and
// after the parallel loop each weight element sums the chunks' partials in chunk order.
// Where the pass's activations take no more memory than those partials (few positions, a wide
// dim: T <= 2/3 chunks D), the two products' gradients are instead one product each over the
// whole pass after the loop (dWqkv = dqkv^T y, dWout = dOut^T o, K = T), from the activations
// the blocks keep (whole_pass_products): per-block products of few rows into partials of 4 D^2
// floats are a read-modify-write of partials far larger than the cache (perf notes v54).
// Block and chunk sizes depend on the shape alone, not on the thread count, so the result
// does not depend on how many threads run it or which thread takes which chunk. The threads take
// the chunks; where a pass has fewer chunks than threads and more (sequence, head, query range)
// pairs a block than chunks (few long sequences), they take each block's pairs and row tiles
// instead, the blocks one after another: the same products, so the same bits. A block of several
// row tiles (a long sequence) is worked a tile at a time in each row-by-row step (gathers,
// LayerNorm, its products, the column sums, LayerNorm's backward), its column sums as one fp64
// partial a tile added in tile order, and its partial products in tiles of the weights' rows
// (weight_tile): tiles of the shape alone, whichever threads take them.
//
// Memory beyond the gradients: x1 (B H W D floats, without row_out); dx1 (B H W D) only when grad_x is null
// but row weight gradients are wanted (otherwise dx1 lives in grad_x, and the row pass
// backward runs in place there); the chunk partials (at most kMaxChunks (4D^2 floats + 3D
// doubles), reused by both passes), dx1 and the partials kept by the calling thread for its next
// call up to 32 MB (kKeptStateFloats); and per thread one block's scratch, which the thread keeps
// for the next call up to 32 MB (and a range's tiles up to 16: dynamic_tasks_kept).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include <Eigen/Core>

#include "../common/axis.h"
#include "../common/dropout.h"
#include "../common/validate.h"
#include "cpu_common.h"
#include "gemm.h"
#include "fastaxial/fastaxial.h"

namespace fastaxial {
namespace {

using namespace cpu;

constexpr int64_t kMaxChunks = 64;    // weight-gradient partials per pass
constexpr int64_t kTargetBlocks = 32; // blocks per pass when the sequences allow

Status invalid(const std::string& what) { return {StatusCode::kInvalidArgument, what}; }

// How a pass cuts its N sequences: blocks of seq_per_block sequences (about 128 rows for
// the products, yet kTargetBlocks blocks where N allows), grouped into chunks.
struct Blocking {
  int64_t seq_per_block, num_blocks, num_chunks;
  int64_t chunk_begin(int64_t c) const { return c * num_blocks / num_chunks; }
};

Blocking blocking(const AxisView& v) {
  Blocking b;
  b.seq_per_block = std::max<int64_t>(1, std::min<int64_t>(128 / std::max<int64_t>(v.len, 1), v.num_seq / kTargetBlocks));
  b.num_blocks = (v.num_seq + b.seq_per_block - 1) / b.seq_per_block;
  b.num_chunks = std::min(b.num_blocks, kMaxChunks);
  return b;
}

// Per-thread scratch of one (sequence, head).
struct HeadScratch {
  Mat s, dp;
  Mat part_t;  // one query range's part of dk or dv, transposed (hd, L), as its product writes it
  Mat acc_v, acc_k;  // an item's dv and dk transposed, over its ranges where they run in order
  Mat m, pd;  // dropout: the (L, L) multipliers M c of one (sequence, head), and Pd = P o M c
  Eigen::VectorXf delta;
  // Whether a thread keeps it for the next call (dynamic_tasks_kept): up to 16 MB (a sequence of
  // 4096 positions' two (256, 4096) tiles take 8 MB).
  int64_t floats() const { return s.size() + dp.size() + part_t.size() + acc_v.size() + acc_k.size() + m.size() + pd.size(); }
  bool small_enough() const { return floats() <= kKeptStateFloats / 2; }
};

// How a block's (item, query range) pairs run: one after another on the calling thread; the
// items across the threads, each item's ranges in order; or the pairs across the threads, each
// range keeping its parts of the item's sums (dk, dv) for the caller to add in range order.
enum class Spread { kNone, kItems, kPairs };

// Pairs spread where the block loop runs on one thread (`outer_team` == 1: few sequences, one
// long one say), the pass's work takes `threads` >= 2 and there are several; items alone where
// the parts the pairs keep (pair_bytes each: the backward's two (L, hd) matrices, none in the
// forward) would pass 64 MB. The results are the same bits in every mode.
Spread spread_ranges(int outer_team, int threads, int64_t items, int64_t R, int64_t pair_bytes) {
  if (outer_team > 1 || threads < 2 || items * R < 2) return Spread::kNone;
  if (R > 1 && items * R * pair_bytes <= (int64_t{64} << 20)) return Spread::kPairs;
  return items > 1 ? Spread::kItems : Spread::kNone;
}

// Runs body(i, r, scratch) for the query ranges r = 0..R-1 (query_ranges) of items i = 0..n-1
// (a block's (sequence, head) pairs) as `spread` says, on up to `threads` threads, each with a
// scratch of its own. Ranges write disjoint rows, so the results do not depend on the thread count.
template <class Body>
void for_ranges(int64_t n, int64_t R, Spread spread, int threads, HeadScratch& own, const Body& body) {
  if (spread == Spread::kNone) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < R; ++r) body(i, r, own);
    return;
  }
  const int64_t tasks = spread == Spread::kPairs ? n * R : n;
  dynamic_tasks_kept<HeadScratch>(
      tasks, (int)std::min<int64_t>(threads, tasks),
      [&](int64_t task, HeadScratch& mine) {
        if (spread == Spread::kPairs) {
          body(task / R, task % R, mine);
        } else {
          for (int64_t r = 0; r < R; ++r) body(task, r, mine);
        }
      },
      [](const HeadScratch& hs) { return hs.small_enough(); });
}

// Per-thread scratch of one block.
struct Scratch {
  Mat x, xhat, y, qkv, o, g, dO, dqkv, dy;
  Mat kT, vT;  // the block's k and v transposed, (D, rows): the right operands of the scores and of dP
  HeadScratch head;
  std::vector<Mat> parts;  // dv and dk parts of each (item, query range), transposed, where the ranges run side by side
  std::vector<double> tile_cols;  // a block's column sums, a partial a row tile, where it has several
  Eigen::VectorXf rstd;
  // Whether a thread keeps it for the next call (dynamic_tasks_kept): up to 32 MB (a sequence of
  // 4096 positions at D 32 takes 22 MB, 16 of them its 32 parts).
  bool small_enough() const {
    int64_t floats = x.size() + xhat.size() + y.size() + qkv.size() + o.size() + g.size() + dO.size() + dqkv.size() +
                     dy.size() + kT.size() + vT.size() + head.floats() + 2 * (int64_t)tile_cols.size();
    for (const Mat& part : parts) floats += part.size();
    return floats <= kKeptStateFloats;
  }
};

// Runs body(i, scratch) for i = 0..n-1 on a team of `team` threads (dynamic schedule), each with
// a Scratch of its own, which its thread keeps for the next call where it is small enough. A team
// of one runs on the calling thread outside any parallel region: the regions for_ranges opens
// inside must not be nested in another (nested, they cost more than the threads gained: perf notes v57).
template <class Body>
void for_blocks(int64_t n, int team, const Body& body) {
  dynamic_tasks_kept<Scratch>(n, team, body, [](const Scratch& t) { return t.small_enough(); });
}

// f(i) for i = 0..count-1: in order on the calling thread where `threads` is 1, else across a
// team of up to `threads` (outside any other region: for_blocks' team of one runs there).
template <class F>
void for_tasks(int64_t count, int threads, const F& f) {
  on_team((int)std::min<int64_t>(threads, count), [&](int worker, int workers) {
    const StaticShare mine(count, worker, workers);
    for (int64_t i = mine.begin; i < mine.end; ++i) f(i);
  });
}

// Rows a tile of a block's row-by-row work (the activations' products, the LayerNorm backward):
// a block of up to 2 kRowTile rows (short sequences) is one tile, so that its products are few
// calls; a taller one (a long sequence) is cut into tiles of kRowTile that threads can share. A
// function of the rows alone, so what a product sums does not depend on the thread count.
constexpr int64_t kRowTile = 64;
int64_t row_tile(int64_t rows) { return rows <= 2 * kRowTile ? std::max<int64_t>(rows, 1) : kRowTile; }

// Rows of a weight gradient (M of them: 3D for dWqkv, D for dWout) a tile of a block's partial
// products (dW += dqkv^T y, dOut^T o) takes: the block's rows alone where it is one row tile (short
// sequences: few calls); where it is several (a long sequence, whose block the team shares), D / 4
// (at least 16): the two products in 16 tiles for the team where D >= 64, fewer below (8 at D 32).
// A rule of the shape alone.
int64_t weight_tile(int64_t rows, int64_t M, int64_t D) {
  return rows <= 2 * kRowTile ? row_tile(M) : std::max<int64_t>(16, D / 4);
}

// f(r0, n) for the tiles of `rows` rows, `tile` rows each (for_tasks: a team of up to `threads`).
template <class F>
void for_row_tiles(int64_t rows, int64_t tile, int threads, const F& f) {
  for_tasks((rows + tile - 1) / tile, threads, [&](int64_t i) { f(i * tile, std::min(tile, rows - i * tile)); });
}

// Sizes t's LayerNorm rows for a block of `rows` positions (norm_rows fills them).
void size_norm(Scratch& t, int64_t rows, int64_t D) {
  t.x.resize(rows, D);
  t.xhat.resize(rows, D);
  t.y.resize(rows, D);
  t.rstd.resize(rows);
}

// Rows r0 .. r0 + n - 1 of the block whose sequences start at n0: src's rows into t.x, LayerNormed
// into t.xhat (normalised), t.y (affine), t.rstd. Each row on its own, so the rows may be shared out.
void norm_rows(const AxisView& v, int64_t n0, int64_t D, float eps, const AxisWeights& w, const float* src,
               Scratch& t, int64_t r0, int64_t n) {
  const int64_t L = v.len;
  const ConstVec gamma(w.norm_weight, D), beta(w.norm_bias, D);
  for (int64_t r = r0; r < r0 + n; ++r) {
    t.x.row(r) = ConstVec(src + v.offset(n0 + r / L, r % L), D);
    const float mean = t.x.row(r).mean();
    const float var = (t.x.row(r).array() - mean).square().sum() / static_cast<float>(D);
    const float rstd = 1.0f / std::sqrt(var + eps);
    t.rstd(r) = rstd;
    t.xhat.row(r) = ((t.x.row(r).array() - mean) * rstd).matrix();
    t.y.row(r) = (t.xhat.row(r).array() * gamma.array() + beta.array()).matrix();
  }
}

// Rows r0 .. r0 + n - 1 of the block whose sequences start at n0, of a tensor the forward kept,
// m.cols() floats a position at the position's row index (row_indices: AxialParams::saved_qkv,
// saved_o), into the same rows of m.
void gather_kept(const AxisView& v, int64_t D, int64_t n0, int64_t r0, int64_t n, const float* kept, Mat& m) {
  const AxisView at = row_indices(v, D);
  const int64_t L = v.len, width = m.cols();
  for (int64_t r = r0; r < r0 + n; ++r) m.row(r) = ConstVec(kept + at.offset(n0 + r / L, r % L) * width, width);
}

// Query ranges a (sequence, head) of length L is taken in: (rows, L) score tiles that stay in
// cache where a whole (L, L) one would not, and units that the threads can share when a pass has
// one long sequence. A function of L alone, so that what is summed in which order (dk and dv add
// the ranges' parts in range order) does not depend on the thread count: ranges of 32 queries or
// more, at most 16 (a sequence of 512 has 16 units for 16 threads); one below 128 positions.
int64_t query_ranges(int64_t L) { return L < 128 ? 1 : std::min<int64_t>(16, L / 32); }

// softmax(scale * t.s) row by row, in place, each row less its max (the forward subtracts its
// running max over key blocks past 512 positions: the same probabilities, not the same bits), then
// times 1 / sum: one division a row, not one a score (a packet division costs several products'
// worth of a core's cycles).
void softmax_rows(Mat& s, float scale) {
  for (int64_t i = 0; i < s.rows(); ++i) {
    auto row = s.row(i);
    row.array() *= 1.0f / exp_and_sum(row.data(), row.size(), row.maxCoeff(), scale);
  }
}

// The row pass's forward, src -> dst (x -> x1), block by block as forward_cpu does it. drop: the
// dropout mask (null: none), pass: 0 rows, 1 columns.
void forward_pass(const AxisView& v, int64_t D, int64_t heads, float eps, const AxisWeights& w, const float* src,
                  float* dst, const DropoutParams* drop, int pass) {
  const int64_t L = v.len, N = v.num_seq, hd = D / heads;
  if (N == 0 || L == 0) return;
  const Projections proj(w.qkv_weight, w.out_weight, D);
  const ConstVec bout(w.out_bias, D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const Blocking bk = blocking(v);
  const int threads = max_threads();
  const int team = (int)std::min<int64_t>(threads, bk.num_blocks);
  for_blocks(bk.num_blocks, team, [&](int64_t blk, Scratch& t) {
    const int64_t n0 = blk * bk.seq_per_block, ns = std::min(bk.seq_per_block, N - n0), rows = ns * L;
    size_norm(t, rows, D);
    norm_rows(v, n0, D, eps, w, src, t, 0, rows);
    proj.qkv_product(t.qkv, t.y);
    t.o.resize(rows, D);
    const int64_t R = query_ranges(L);
    const Spread spread = spread_ranges(team, threads, ns * heads, R, 0);  // (no parts kept)
    if (L == 1 && drop == nullptr) {  // one key: no products (single_key_forward)
      for (int64_t r = 0; r < rows; ++r) single_key_forward(t.qkv, r, D, heads, t.o);
    } else {
      t.kT.resize(D, rows);
      transpose_part(t.qkv, 1, 0, rows, t.kT);
      for_ranges(ns * heads, R, spread, threads, t.head, [&](int64_t i, int64_t r, HeadScratch& hs) {
        const int64_t s = i / heads, h = i % heads;
        const int64_t r0 = r * L / R, n = (r + 1) * L / R - r0;  // the range's queries
        attention_product(hs.s, in(t.qkv.block(s * L + r0, h * hd, n, hd)), in(t.kT.block(h * hd, s * L, hd, L)));
        softmax_rows(hs.s, scale);
        if (drop) {
          fill_mask(*drop, pass, n0 + s, h, L, r0, n, hs.m);
          hs.s.array() *= hs.m.array();  // Pd
        }
        attention_product(t.o.block(s * L + r0, h * hd, n, hd), in(hs.s), in(t.qkv.block(s * L, 2 * D + h * hd, L, hd)));
      });
    }
    project_out(proj, v, n0, ns, t.o, t.x, bout.data(), dst);
  });
}

// Where a chunk's partial weight gradients lie in its slice of the partials buffers: the
// products' (floats) and the column sums' (doubles).
struct PartialLayout {
  int64_t qkv, out, size;  // floats
  int64_t g, b, bout, col_size;  // doubles
  explicit PartialLayout(int64_t D)
      : qkv(0), out(3 * D * D), size(4 * D * D), g(0), b(D), bout(2 * D), col_size(3 * D) {}
};

// acc[j] += row[j], j < n, in fp64 and in row order (the same on every build).
template <class Row>
void add_row(double* acc, const Row& row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<double>(row(j));
}

// Whether a pass takes its product weight gradients over the whole pass (header comment): its
// activations y, o, dOut (T, D) and dqkv (T, 3D), 6 T D floats, no more than the chunks' partials,
// 4 D^2 floats each. A rule of the shape alone, so the result does not depend on the thread count.
bool whole_pass_products(int64_t T, int64_t D, int64_t chunks) { return T <= 4 * chunks * D / 6; }

// dst (M, D) = a^T b for a (T, M) and b (T, D), row-major, in tiles of kRowTile rows of dst across the
// threads: each element from one product of fixed shape, whichever thread takes its tile.
void product_over_positions(float* dst, const Mat& a, const Mat& b, int64_t M, int64_t D) {
  for_row_tiles(M, kRowTile, team_for(M, 2.0 * (double)M * D * a.rows(), kProductFlopsPerThread), [&](int64_t r0, int64_t n) {
    gemm(MatMap(dst, M, D).middleRows(r0, n), tr(a.middleCols(r0, n)), in(b));
  });
}

// One pass backward. src: the pass's input; dout: the gradient of its output; dsrc (or null):
// where the gradient of its input goes (may equal dout: each block reads its rows of dout
// before it writes them, and blocks hold disjoint sequences). Weight gradients into gw.
// drop: the dropout mask (null: none), pass: 0 rows, 1 columns; qkv_in: the forward's q, k, v
// of the pass (3D floats a position: AxialParams::saved_qkv), or null to run the QKV product;
// o_in: its attention output (D floats a position: AxialParams::saved_o), or null to run p v;
// p_in: its probabilities ((L, L) a sequence and head: AxialParams::saved_p, one query range at
// these lengths), or null to run the scores and the softmax.
void backward_pass(const AxisView& v, int64_t D, int64_t heads, float eps, const AxisWeights& w, const float* src,
                   const float* dout, float* dsrc, const AxisGrads& gw, UnsetFloats& partials,
                   std::vector<double>& col_partials, const DropoutParams* drop, int pass, const float* qkv_in,
                   const float* o_in, const float* p_in) {
  const int64_t L = v.len, N = v.num_seq, hd = D / heads;
  const bool want_qkv = gw.qkv_weight, want_out = gw.out_weight, want_bout = gw.out_bias;
  const bool want_g = gw.norm_weight, want_b = gw.norm_bias, want_dx = dsrc != nullptr;
  const bool want_dy = want_dx || want_g || want_b;        // the gradient of LayerNorm's output
  const bool want_dqkv = want_dy || want_qkv;              // the attention backward
  const bool want_o = want_dqkv || want_out;               // the attention's P (and O for dWout)
  const bool any_weight = want_qkv || want_out || want_bout || want_g || want_b;
  if (!want_o && !want_bout) return;

  const Projections proj(w.qkv_weight, w.out_weight, D);
  const ConstVec gamma(w.norm_weight, D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const Blocking bk = blocking(v);
  const PartialLayout lay(D);
  const bool whole = (want_qkv || want_out) && whole_pass_products(N * L, D, bk.num_chunks);
  Mat all_y, all_dqkv, all_g, all_o;  // the pass's activations, rows in sequence order, where whole
  if (whole && want_qkv) all_y.resize(N * L, D), all_dqkv.resize(N * L, 3 * D);
  if (whole && want_out) all_g.resize(N * L, D), all_o.resize(N * L, D);
  if (any_weight) {
    if (!whole) partials.clear(), partials.resize(bk.num_chunks * lay.size);  // unset: each chunk zeroes its own (below)
    col_partials.assign(bk.num_chunks * lay.col_size, 0.0);
  }

  // The backward's work: about three forwards (the products' two gradients, the scores again).
  const int threads = team_for(N * L, 3 * pass_flops(N * L, L, D));
  // The chunks across the threads; or, where they are fewer than the threads and a block has more
  // (sequence, head, query range) pairs than there are chunks (few long sequences), the blocks
  // one after another, each one's pairs and row tiles across the threads (`inner`). The same
  // products and sums either way, so the bits do not depend on which.
  int team = (int)std::min<int64_t>(threads, bk.num_chunks);
  if (team < threads && bk.seq_per_block * heads * query_ranges(L) > team) team = 1;
  const int inner = team == 1 ? threads : 1;
  for_blocks(bk.num_chunks, team, [&](int64_t c, Scratch& t) {
    float* part = any_weight && !whole ? partials.data() + c * lay.size : nullptr;
    if (part != nullptr) std::fill_n(part, lay.size, 0.0f);
    double* col = any_weight ? col_partials.data() + c * lay.col_size : nullptr;
    for (int64_t blk = bk.chunk_begin(c); blk < bk.chunk_begin(c + 1); ++blk) {
      const int64_t n0 = blk * bk.seq_per_block, ns = std::min(bk.seq_per_block, N - n0), rows = ns * L;
      const int64_t tile = row_tile(rows), tiles = (rows + tile - 1) / tile;
      // The column sums' partial a tile of rows adds into: the chunk's own where the block is one tile;
      // else the tile's own, added into the chunk's in tile order after the tiles (add_tile_sums).
      if (any_weight && tiles > 1) t.tile_cols.assign(tiles * lay.col_size, 0.0);
      const auto tile_col = [&](int64_t r0) { return tiles > 1 ? t.tile_cols.data() + r0 / tile * lay.col_size : col; };
      const auto add_tile_sums = [&](int64_t off) {
        for (int64_t i = 0; i < tiles && tiles > 1; ++i)
          for (int64_t e = 0; e < D; ++e) col[off + e] += t.tile_cols[i * lay.col_size + off + e];
      };
      const bool run_pv = want_out && o_in == nullptr;  // O, for dWout alone
      const bool attend = want_dqkv || run_pv;          // P is needed
      t.g.resize(rows, D);  // the gradient of the block's outputs
      if (attend) size_norm(t, rows, D), t.qkv.resize(rows, 3 * D);
      t.o.resize(rows, D);
      if (want_dqkv) t.dO.resize(rows, D), t.dqkv.resize(rows, 3 * D);
      // The products' transposed operands: k for the scores (where P is not kept), v for dP.
      const bool products = attend && (L > 1 || drop != nullptr);  // (one key: single_key_backward)
      const bool need_kT = products && p_in == nullptr, need_vT = products && want_dqkv;
      if (need_kT) t.kT.resize(D, rows);
      if (need_vT) t.vT.resize(D, rows);
      // Row by row, a tile of rows at a time: dOut's rows, their column sums, LayerNorm, q, k, v
      // (and k and v transposed) and dO.
      for_row_tiles(rows, tile, inner, [&](int64_t r0, int64_t n) {
        for (int64_t r = r0; r < r0 + n; ++r) t.g.row(r) = ConstVec(dout + v.offset(n0 + r / L, r % L), D);
        // Column sums row by row, each element in row order (add_row; Eigen's colwise().sum()
        // picks scalar or packet code by the destination's alignment, and the two add in
        // different orders, which would make the result depend on where malloc put the partials).
        if (want_bout)
          for (int64_t r = r0; r < r0 + n; ++r) add_row(tile_col(r0) + lay.bout, t.g.row(r), D);
        if (attend) {
          norm_rows(v, n0, D, eps, w, src, t, r0, n);
          if (qkv_in != nullptr) gather_kept(v, D, n0, r0, n, qkv_in, t.qkv);
          else proj.qkv_product(t.qkv.middleRows(r0, n), t.y.middleRows(r0, n));
          if (need_kT) transpose_part(t.qkv, 1, r0, n, t.kT);
          if (need_vT) transpose_part(t.qkv, 2, r0, n, t.vT);
        }
        if (want_out && o_in != nullptr) gather_kept(v, D, n0, r0, n, o_in, t.o);
        if (want_dqkv) proj.by_out(t.dO.middleRows(r0, n), t.g.middleRows(r0, n));
      });
      if (want_bout) add_tile_sums(lay.bout);
      if (whole && want_out) all_g.middleRows(n0 * L, rows) = t.g;  // (t.g becomes dsrc below)
      if (!want_o) continue;

      // Each (sequence, head) writes its own columns of o and dqkv, its queries a range at a time
      // (query_ranges): o and dq row by row; dk and dv, sums over the queries, as the ranges'
      // parts added in range order. Where the pairs run side by side (Spread::kPairs), each
      // range keeps its parts in t.parts, added in range order after them.
      const int64_t R = query_ranges(L), items = ns * heads;
      const Spread spread =
          spread_ranges(team, threads, items, R, want_dqkv ? 2 * L * hd * (int64_t)sizeof(float) : 0);
      const bool keep = spread == Spread::kPairs && want_dqkv;  // the ranges keep their parts
      if (keep) t.parts.resize(2 * items * R);
      if (attend && L == 1 && drop == nullptr) {  // one key: no products (single_key_backward)
        for (int64_t r = 0; r < rows; ++r) {
          if (want_dqkv) single_key_backward(t.qkv, t.dO, r, D, heads, scale, t.dqkv, run_pv ? &t.o : nullptr);
          else single_key_forward(t.qkv, r, D, heads, t.o);
        }
      } else if (attend) for_ranges(items, R, spread, threads, t.head, [&](int64_t i, int64_t r, HeadScratch& hs) {
        const int64_t s = i / heads, h = i % heads;
        const auto k = t.qkv.block(s * L, D + h * hd, L, hd);
        const auto val = t.qkv.block(s * L, 2 * D + h * hd, L, hd);
        const int64_t r0 = r * L / R, n = (r + 1) * L / R - r0;  // the range's queries
        const auto q = t.qkv.block(s * L + r0, h * hd, n, hd);
        auto o = t.o.block(s * L + r0, h * hd, n, hd);
        if (p_in == nullptr) {
          attention_product(hs.s, in(q), in(t.kT.block(h * hd, s * L, hd, L)));
          softmax_rows(hs.s, scale);
        }
        const ConstMap P(p_in != nullptr ? p_in + ((n0 + s) * heads + h) * L * L : hs.s.data(), n, L);
        if (drop) {
          fill_mask(*drop, pass, n0 + s, h, L, r0, n, hs.m);
          hs.pd = (P.array() * hs.m.array()).matrix();  // Pd = P o M c
        }
        if (run_pv) attention_product(o, drop ? in(hs.pd) : in(P), in(val));
        if (!want_dqkv) return;
        auto dk = t.dqkv.block(s * L, D + h * hd, L, hd);  // (dqkv is sized only where wanted)
        auto dv = t.dqkv.block(s * L, 2 * D + h * hd, L, hd);
        // The range's part of dv (which 0) or dk (1), in hs.part_t, transposed (hd, L). The parts add
        // up transposed (contiguous) and the sum is written transposed once: where the ranges run
        // side by side (keep), each keeps its part in t.parts for the in-order sum below; where they
        // run in order on this thread, they add up in hs's accumulator, written after the last
        // range. The same additions in the same order either way.
        auto place = [&](auto&& sum, int64_t which, Mat& acc) {
          if (keep) {
            std::swap(t.parts[2 * (i * R + r) + which], hs.part_t);
          } else if (R == 1) {
            sum = hs.part_t.transpose();
          } else {
            if (r == 0) acc = hs.part_t;
            else acc += hs.part_t;
            if (r == R - 1) sum = acc.transpose();
          }
        };
        const auto dO = t.dO.block(s * L + r0, h * hd, n, hd);
        // The range's part of dV = P^T dO (Pd with dropout), computed as dV^T = dO^T P (hd, L) and added
        // transposed: MKL ran P^T dO at half the rate of dO^T P with a narrow head (hd 16; perf notes v69),
        // and on the register tiles the wide result fills whole packets.
        attention_product(hs.part_t, tr(dO), drop ? in(hs.pd) : in(P));
        place(dv, 0, hs.acc_v);
        attention_product(hs.dp, in(dO), in(t.vT.block(h * hd, s * L, hd, L)));  // dP = dO V^T (dPd with dropout)
        if (drop) hs.dp.array() *= hs.m.array();  // dP = dPd o M c
        // delta = rowsum(P o dP), from the very P and dP of dS below (not the equal rowsum(dO_h o O_h)):
        // where the softmax is one-hot (P = 1 in fp32), delta is then dP's own element and dS 0, as in
        // the reference, where dO_h.o_h, summed in another order, would leave a rounding residue
        // that dQ = dS K multiplies by |K| (scores of 1e4: 5000x the fp32 reference's error).
        hs.delta = (P.array() * hs.dp.array()).rowwise().sum();
        // dS (of the scaled scores) times the scale: both dQ and dK carry it. Row by row: Eigen
        // broadcasts a column over a row-major matrix column by column, strided, at 4x this loop's
        // time (perf notes v107).
        for (int64_t qi = 0; qi < n; ++qi)
          hs.dp.row(qi).array() = (hs.dp.row(qi).array() - hs.delta(qi)) * P.row(qi).array() * scale;
        attention_product(t.dqkv.block(s * L + r0, h * hd, n, hd), in(hs.dp), in(k));  // dQ
        attention_product(hs.part_t, tr(q), in(hs.dp));  // dK = dS^T Q as dK^T = Q^T dS (hd, L), as dV
        place(dk, 1, hs.acc_k);
      });
      if (keep) {  // each element's parts in range order, (item, key tile) pairs across the threads
        const int64_t key_tiles = (L + kRowTile - 1) / kRowTile;
        for_tasks(items * key_tiles, inner, [&](int64_t task) {
          const int64_t i = task / key_tiles, s = i / heads, h = i % heads;
          const int64_t l0 = task % key_tiles * kRowTile, n = std::min(kRowTile, L - l0);
          for (int64_t which = 0; which < 2; ++which) {  // dv (columns 2D + h hd), dk (D + h hd)
            Mat sum = t.parts[2 * i * R + which].middleCols(l0, n);  // (hd, n)
            for (int64_t r = 1; r < R; ++r) sum += t.parts[2 * (i * R + r) + which].middleCols(l0, n);
            t.dqkv.block(s * L + l0, (2 - which) * D + h * hd, n, hd) = sum.transpose();
          }
        });
      }
      if (whole) {
        if (want_out) all_o.middleRows(n0 * L, rows) = t.o;
        if (want_qkv) all_y.middleRows(n0 * L, rows) = t.y, all_dqkv.middleRows(n0 * L, rows) = t.dqkv;
      } else {
        // The chunk's partials += the block's sums, tiles of their rows (weight_tile) across the team.
        const int64_t wt_qkv = weight_tile(rows, 3 * D, D), wt_out = weight_tile(rows, D, D);
        const int64_t qkv_tiles = want_qkv ? (3 * D + wt_qkv - 1) / wt_qkv : 0;
        const int64_t out_tiles = want_out ? (D + wt_out - 1) / wt_out : 0;
        for_tasks(qkv_tiles + out_tiles, inner, [&](int64_t i) {
          const bool qkv = i < qkv_tiles;
          const int64_t M = qkv ? 3 * D : D, wt = qkv ? wt_qkv : wt_out, r0 = (qkv ? i : i - qkv_tiles) * wt;
          const int64_t n = std::min(wt, M - r0);
          gemm(MatMap(part + (qkv ? lay.qkv : lay.out), M, D).middleRows(r0, n),
               tr((qkv ? t.dqkv : t.g).middleCols(r0, n)), in(qkv ? t.y : t.o), 1.0f);
        });
      }
      if (!want_dy) continue;
      t.dy.resize(rows, D);
      // dy = dqkv Wqkv, its column sums and LayerNorm's backward: row by row, a tile of rows at a time.
      const float inv_d = 1.0f / static_cast<float>(D);
      for_row_tiles(rows, tile, inner, [&](int64_t r0, int64_t n) {
        proj.by_qkv(t.dy.middleRows(r0, n), t.dqkv.middleRows(r0, n));
        for (int64_t r = r0; r < r0 + n; ++r) {
          if (want_g) add_row(tile_col(r0) + lay.g, t.dy.row(r).array() * t.xhat.row(r).array(), D);
          if (want_b) add_row(tile_col(r0) + lay.b, t.dy.row(r), D);
        }
        if (!want_dx) return;
        // dx = dOut + rstd (dxhat - mean(dxhat) - xhat mean(dxhat o xhat)), dxhat = dy o g.
        for (int64_t r = r0; r < r0 + n; ++r) {
          auto dxhat = t.dy.row(r);
          dxhat.array() *= gamma.array();
          const float m1 = dxhat.sum() * inv_d;
          const float m2 = dxhat.dot(t.xhat.row(r)) * inv_d;
          t.g.row(r).array() += t.rstd(r) * (dxhat.array() - m1 - t.xhat.row(r).array() * m2);
          VecMap(dsrc + v.offset(n0 + r / L, r % L), D) = t.g.row(r);
        }
      });
      if (want_g) add_tile_sums(lay.g);
      if (want_b) add_tile_sums(lay.b);
    }
  });
  if (!any_weight) return;

  // Each wanted element: the chunks' partials summed in chunk order. A tile of elements at a time,
  // each chunk's part of it read as one run: an element's chunks lie 4 D^2 floats apart, and
  // walking them element by element touched a page a read (perf notes v69).
  auto reduce = [&](float* dst, int64_t off, int64_t n) {
    if (dst == nullptr) return;
    const int64_t chunks = bk.num_chunks, stride = lay.size, tile = 2048, tiles = (n + tile - 1) / tile;
    const float* base = partials.data() + off;
    const int rteam = (int)std::min<int64_t>(max_threads(), std::max<int64_t>(1, n * chunks / 65536));
    for_tasks(tiles, rteam, [&](int64_t i) {
      const int64_t e0 = i * tile, m = std::min(tile, n - e0);
      float* out = dst + e0;
      std::memcpy(out, base + e0, m * sizeof(float));
      for (int64_t c = 1; c < chunks; ++c) {
        const float* in = base + c * stride + e0;
        for (int64_t e = 0; e < m; ++e) out[e] += in[e];
      }
    });
  };
  if (whole) {
    if (want_qkv) product_over_positions(gw.qkv_weight, all_dqkv, all_y, 3 * D, D);
    if (want_out) product_over_positions(gw.out_weight, all_g, all_o, D, D);
  } else {
    reduce(gw.qkv_weight, lay.qkv, 3 * D * D);
    reduce(gw.out_weight, lay.out, D * D);
  }
  // The column sums: the chunks' fp64 partials in chunk order, rounded once.
  auto reduce_columns = [&](float* dst, int64_t off) {
    if (dst == nullptr) return;
    for (int64_t e = 0; e < D; ++e) {
      double acc = 0.0;
      for (int64_t c = 0; c < bk.num_chunks; ++c) acc += col_partials[c * lay.col_size + off + e];
      dst[e] = static_cast<float>(acc);
    }
  };
  reduce_columns(gw.norm_weight, lay.g);
  reduce_columns(gw.norm_bias, lay.b);
  reduce_columns(gw.out_bias, lay.bout);
}

void zero_weights(const AxisGrads& a, int64_t D) {
  const std::pair<float*, int64_t> outs[] = {
      {a.norm_weight, D}, {a.norm_bias, D}, {a.qkv_weight, 3 * D * D}, {a.out_weight, D * D}, {a.out_bias, D}};
  for (const auto& [ptr, n] : outs)
    if (ptr) std::fill(ptr, ptr + n, 0.0f);
}

}  // namespace

namespace cpu::FASTAXIAL_CPU_COPY {

Status backward(const AxialParams& p, const AxialGrads& g) {
  if (Status s = validate_inputs(p); !s.ok()) return s;
  const int64_t T = p.batch * p.height * p.width, D = p.dim;
  if (T == 0) {  // no position: every weight gradient is an empty sum
    zero_weights(g.row, D);
    zero_weights(g.col, D);
    return Status::Ok();
  }
  if (g.grad_out == nullptr) return invalid("grad_out is null");
  if (g.grad_x != nullptr && g.grad_x == p.x) return invalid("grad_x must not alias x");
  for (const float* kept : {static_cast<const float*>(p.row_out), static_cast<const float*>(p.saved_qkv),
                            static_cast<const float*>(p.saved_o), static_cast<const float*>(p.saved_p)})
    if (kept != nullptr && (kept == p.x || kept == g.grad_out || kept == g.grad_x))
      return invalid("row_out, saved_qkv, saved_o and saved_p must not alias x, grad_out or grad_x");
  if (p.row_out != nullptr && p.row_out == p.saved_qkv) return invalid("saved_qkv must not alias row_out");
  if (p.saved_o != nullptr && (p.saved_o == p.row_out || p.saved_o == p.saved_qkv))
    return invalid("saved_o must not alias row_out or saved_qkv");
  if (p.saved_p != nullptr && (p.saved_p == p.row_out || p.saved_p == p.saved_qkv || p.saved_p == p.saved_o))
    return invalid("saved_p must not alias row_out, saved_qkv or saved_o");

  const bool want_row = g.grad_x != nullptr || any(g.row);
  if (!want_row && !any(g.col)) return Status::Ok();

  const AxisView rv = row_view(p), cv = col_view(p);
  const DropoutParams drop = make_dropout(p);
  const DropoutParams* mask = p.dropout > 0.0f ? &drop : nullptr;  // null: no dropout
  // x1: the forward's (row_out), else the row pass run again.
  std::unique_ptr<float[]> x1_scratch;
  const float* x1 = p.row_out;
  if (x1 == nullptr) {
    x1_scratch.reset(new float[T * D]);
    forward_pass(rv, D, p.heads, p.eps, p.row, p.x, x1_scratch.get(), mask, 0);
    x1 = x1_scratch.get();
  }

  // The call's scratch, kept by the calling thread for its next call up to kKeptStateFloats: freed,
  // glibc hands megabytes back to the system, and the next call faults them in and zeroes them
  // again page by page (perf notes v108).
  struct Kept {
    UnsetFloats dx1;          // dx1 where grad_x is not asked for
    UnsetFloats partials;     // products' partials: 64-byte aligned, as Eigen's scratch (gemm.h)
    std::vector<double> col_partials;
    int64_t floats() const {  // what is held: a smaller pass's resize keeps the larger allocation
      return (int64_t)(dx1.capacity() + partials.capacity() + 2 * col_partials.capacity());
    }
  };
  Kept& kept = thread_state<Kept>();
  // dx1: in grad_x when there is one (the row pass backward then runs in place there).
  float* dx1 = nullptr;
  if (want_row) {
    dx1 = g.grad_x;
    if (dx1 == nullptr) {
      kept.dx1.clear();  // (growing copies nothing then)
      kept.dx1.resize(T * D);
      dx1 = kept.dx1.data();
    }
  }
  UnsetFloats& partials = kept.partials;
  std::vector<double>& col_partials = kept.col_partials;
  // The forward's q, k, v of each pass, where kept (the row pass's first).
  const float* const row_qkv = p.saved_qkv;
  const float* const col_qkv = p.saved_qkv != nullptr ? p.saved_qkv + 3 * T * D : nullptr;
  const KeptOutputs o = kept_outputs(p);  // and their attention outputs, where kept
  const KeptOutputs probs = kept_probabilities(p);  // and their probabilities, where kept
  backward_pass(cv, D, p.heads, p.eps, p.col, x1, g.grad_out, dx1, g.col, partials, col_partials, mask, 1, col_qkv,
                o.col, probs.col);
  x1_scratch.reset();
  if (want_row)
    backward_pass(rv, D, p.heads, p.eps, p.row, p.x, dx1, g.grad_x, g.row, partials, col_partials, mask, 0, row_qkv,
                  o.row, probs.row);
  if (kept.floats() > kKeptStateFloats) kept = Kept();
  return Status::Ok();
}

}  // namespace cpu::FASTAXIAL_CPU_COPY
}  // namespace fastaxial
