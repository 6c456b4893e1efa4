// Every branch of the CPU forward's and backward's dispatch, at 1 thread and at several, each
// against the float64 reference under the accuracy rule (util/reference.h); and what the thread
// count may change (ThreadCountPromise).
//
// The test sets the thread count itself (omp_set_num_threads), so that a path that runs only with
// more threads than blocks (the forward's few-sequences path) is tested on a one-core machine
// and whatever OMP_NUM_THREADS says.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "util/backward_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial::test {
namespace {

#ifdef _OPENMP

// ---- the dispatch rules, as the tests see them ------------------------------------------------
// The CPU code has no describe() to ask which branch served a pass, so these are copies of its
// rules; the cases below state which branch each pass takes, checked against the copies, and
// CoversEveryBranch checks that together they take each one, at 1 thread and at several.

// src/cpu/axial_cpu.cpp, axis_pass: blocks of sequences (about 128 rows, yet 4 blocks a thread
// where the sequences allow); fewer blocks than threads and sequences longer than one row tile
// (64): the team shares each sequence (few_sequences_pass); else a team of min(threads, blocks)
// takes the blocks (block_pass), one thread where that is 1.
enum class Fwd { kOneThread, kBlocks, kFewSequences };

Fwd forward_branch(int64_t L, int64_t N, int threads) {
  int64_t per_block = std::max<int64_t>(1, 128 / L);
  per_block = std::min(per_block, std::max<int64_t>(1, N / (4 * threads)));
  const int64_t blocks = (N + per_block - 1) / per_block;
  if (blocks < threads && L > 64) return Fwd::kFewSequences;
  return std::min<int64_t>(threads, blocks) > 1 ? Fwd::kBlocks : Fwd::kOneThread;
}

// src/cpu/backward_cpu.cpp, blocking, team_for and spread_ranges: blocks of about 128 rows, yet
// 32 blocks where the sequences allow, in at most 64 chunks. The pass takes a thread per 4 MFLOP
// of its work at most (3 T (8 D^2 + 4 L D)), and a team of that many or fewer takes the chunks;
// where the chunks are fewer than its threads and a block has more (sequence, head, query range)
// triples than there are chunks, or where the team is one thread, the blocks run one after
// another and each block's triples and row tiles go to the threads (ranges), where the pass takes
// two or more. A head of 128 positions or more is taken in query ranges (min(16, L / 32)).
enum class Bwd { kOneThread, kChunks, kRanges };

Bwd backward_branch(int64_t L, int64_t N, int64_t D, int64_t heads, int threads) {
  const int64_t per_block = std::max<int64_t>(1, std::min<int64_t>(128 / L, N / 32));
  const int64_t blocks = (N + per_block - 1) / per_block, chunks = std::min<int64_t>(blocks, 64);
  const int64_t ranges = L < 128 ? 1 : std::min<int64_t>(16, L / 32);
  const double flops = 3.0 * (double)(N * L) * (8.0 * D * D + 4.0 * L * D);
  const int64_t pass_threads =
      std::max<int64_t>(1, std::min<int64_t>(std::min<int64_t>(threads, N * L), (int64_t)(flops / 4e6)));
  int64_t team = std::min(pass_threads, chunks);
  if (team < pass_threads && per_block * heads * ranges > team) team = 1;
  if (team > 1) return Bwd::kChunks;
  return pass_threads >= 2 ? Bwd::kRanges : Bwd::kOneThread;
}

// src/cpu/backward_cpu.cpp, whole_pass_products: a pass takes its product weight gradients as one
// product over all its T positions where its activations (6 T D floats) take no more memory than
// the chunks' partials (4 D^2 floats a chunk), else per chunk into partials.
bool weights_whole_pass(int64_t L, int64_t N, int64_t D) {
  const int64_t per_block = std::max<int64_t>(1, std::min<int64_t>(128 / L, N / 32));
  const int64_t chunks = std::min<int64_t>((N + per_block - 1) / per_block, 64);
  return N * L <= 4 * chunks * D / 6;
}

const char* name(Fwd f) {
  return f == Fwd::kOneThread ? "one thread" : f == Fwd::kBlocks ? "blocks" : "few sequences";
}
const char* name(Bwd b) { return b == Bwd::kOneThread ? "one thread" : b == Bwd::kChunks ? "chunks" : "ranges"; }

// A case: a shape at a thread count, and the branch each pass takes (row pass: B H sequences of
// W; column pass: B W sequences of H).
struct PathCase {
  Shape shape;
  int threads;
  Fwd row_fwd, col_fwd;
  Bwd row_bwd, col_bwd;
};

void PrintTo(const PathCase& c, std::ostream* os) {
  PrintTo(c.shape, os);
  *os << " at " << c.threads << " threads";
}

std::string case_name(const ::testing::TestParamInfo<PathCase>& info) {
  return shape_name(info.param.shape) + "_threads" + std::to_string(info.param.threads);
}

using F = Fwd;
using B = Bwd;
const PathCase kCases[] = {
    // Short sequences, many of them: one thread, then a team over the blocks (chunks).
    {{2, 5, 9, 64, 8}, 1, F::kOneThread, F::kOneThread, B::kOneThread, B::kOneThread},
    {{2, 5, 9, 64, 8}, 3, F::kBlocks, F::kBlocks, B::kChunks, B::kChunks},
    {{3, 16, 16, 64, 4}, 2, F::kBlocks, F::kBlocks, B::kChunks, B::kChunks},
    // One long row (L = 130: the backward's two row tiles and a partial one of 2 rows, the forward's
    // four tiles of 32 and one of 2), 130 columns of one
    // (too little work for a second thread in the backward).
    {{1, 1, 130, 32, 2}, 1, F::kOneThread, F::kOneThread, B::kOneThread, B::kOneThread},
    {{1, 1, 130, 32, 2}, 3, F::kFewSequences, F::kBlocks, B::kRanges, B::kOneThread},
    // The shape: 200 rows of one position, one column of 200 (a partial tile of 8).
    {{1, 200, 1, 16, 2}, 1, F::kOneThread, F::kOneThread, B::kOneThread, B::kOneThread},
    {{1, 200, 1, 16, 2}, 2, F::kBlocks, F::kFewSequences, B::kOneThread, B::kRanges},
    {{1, 200, 1, 16, 2}, 8, F::kBlocks, F::kFewSequences, B::kOneThread, B::kRanges},
    // Two rows of 128 (the forward's four tiles of 32): the few-sequences path walks two sequences.
    {{1, 2, 128, 16, 2}, 3, F::kFewSequences, F::kBlocks, B::kOneThread, B::kOneThread},
    // One row of 64, a single block: one thread although three are there (a tile, not two).
    {{1, 1, 64, 32, 2}, 3, F::kOneThread, F::kBlocks, B::kOneThread, B::kOneThread},
    // One head of 65: a partial tile of one row.
    {{1, 1, 65, 16, 1}, 3, F::kFewSequences, F::kBlocks, B::kOneThread, B::kOneThread},
    // Two rows of 100 at 2 threads: a block each (a team of two); at 3, the few-sequences path
    // forward, and backward the two blocks one after another, their three heads across the threads.
    {{1, 2, 100, 48, 3}, 2, F::kBlocks, F::kBlocks, B::kChunks, B::kChunks},
    {{1, 2, 100, 48, 3}, 3, F::kFewSequences, F::kBlocks, B::kRanges, B::kChunks},
    // A head of 520 positions: the backward's 16 query ranges; nine row tiles in the forward.
    {{1, 1, 520, 16, 2}, 1, F::kOneThread, F::kOneThread, B::kOneThread, B::kOneThread},
    {{1, 1, 520, 16, 2}, 3, F::kFewSequences, F::kBlocks, B::kRanges, B::kOneThread},
    // One head of 600: its 16 query ranges go to the two threads.
    {{1, 1, 600, 16, 1}, 2, F::kFewSequences, F::kBlocks, B::kRanges, B::kOneThread},
    // Three rows of 600 at 2 threads: a block each, a team of two over the blocks, each head's
    // queries in tiles of 256 over two key blocks (kKeyBlock).
    {{1, 3, 600, 16, 1}, 2, F::kBlocks, F::kBlocks, B::kChunks, B::kChunks},
    // Two rows of 128 at dim 256: the row pass's weight gradients over the whole pass with its two
    // blocks one after another (eight (head, range) pairs each) and its row tiles across the threads.
    {{1, 2, 128, 256, 2}, 3, F::kFewSequences, F::kBlocks, B::kRanges, B::kChunks},
    // Few long sequences at 16 threads: four rows of 300 (the forward's tiles of 32; the backward's
    // blocks of five row tiles, nine query ranges a head), and eight columns of 600 (16 ranges).
    {{1, 4, 300, 32, 2}, 16, F::kFewSequences, F::kBlocks, B::kRanges, B::kChunks},
    {{1, 600, 8, 16, 2}, 16, F::kBlocks, F::kFewSequences, B::kChunks, B::kRanges},
    // Three rows of 300 at 16 threads: one group of three, or (CTest's "groups:" run, 130,000 floats
    // a group) a group of two and one of one.
    {{1, 3, 300, 32, 2}, 16, F::kFewSequences, F::kBlocks, B::kRanges, B::kChunks},
};

class ThreadCount {
 public:
  explicit ThreadCount(int n) : before_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(before_); }

 private:
  int before_;
};

class CpuPaths : public ::testing::TestWithParam<PathCase> {};

TEST_P(CpuPaths, TakesItsBranch) {
  const PathCase& c = GetParam();
  const Shape& s = c.shape;
  EXPECT_EQ(name(forward_branch(s.W, s.B * s.H, c.threads)), std::string(name(c.row_fwd))) << "row pass, forward";
  EXPECT_EQ(name(forward_branch(s.H, s.B * s.W, c.threads)), std::string(name(c.col_fwd))) << "column pass, forward";
  EXPECT_EQ(name(backward_branch(s.W, s.B * s.H, s.D, s.heads, c.threads)), std::string(name(c.row_bwd)))
      << "row pass, backward";
  EXPECT_EQ(name(backward_branch(s.H, s.B * s.W, s.D, s.heads, c.threads)), std::string(name(c.col_bwd)))
      << "column pass, backward";
}

TEST_P(CpuPaths, ForwardMatchesDoubleReference) {
  const PathCase& c = GetParam();
  const Problem p = random_problem(c.shape, 99u + static_cast<uint32_t>(c.shape.W * 7 + c.shape.H));
  ThreadCount threads(c.threads);
  std::vector<float> out(p.x.size(), kNaN);
  const Status st = forward_cpu(params(p, out.data()));
  ASSERT_TRUE(st.ok()) << st.message;
  expect_forward_within_rule(p, out);
}

TEST_P(CpuPaths, BackwardMatchesDoubleReference) {
  const PathCase& c = GetParam();
  const Shape& s = c.shape;
  const Problem p = random_problem(s, 77u + static_cast<uint32_t>(s.W * 7 + s.H));
  ThreadCount threads(c.threads);
  expect_cpu_backward_matches_reference(p, random_grad(s.B * s.H * s.W * s.D, 5));
}

INSTANTIATE_TEST_SUITE_P(Branches, CpuPaths, ::testing::ValuesIn(kCases), case_name);

// The cases take every branch of each pass, forward and backward, at 1 thread where the branch
// can run there (the few-sequences path and the backward's teams need two threads or more) and at
// several threads; and the backward's query ranges (L >= 128) at both.
TEST(CpuPaths, CoversEveryBranch) {
  std::set<std::string> seen;
  for (const PathCase& c : kCases) {
    const std::string at = c.threads == 1 ? " at 1 thread" : " at several threads";
    for (Fwd f : {c.row_fwd, c.col_fwd}) seen.insert(std::string("forward ") + name(f) + at);
    for (Bwd b : {c.row_bwd, c.col_bwd}) seen.insert(std::string("backward ") + name(b) + at);
    if (std::max(c.shape.H, c.shape.W) >= 128) seen.insert("backward query ranges" + at);
    const Shape& s = c.shape;
    for (bool whole : {weights_whole_pass(s.W, s.B * s.H, s.D), weights_whole_pass(s.H, s.B * s.W, s.D)})
      seen.insert(std::string("backward weights ") + (whole ? "over the whole pass" : "in chunk partials") + at);
  }
  for (const char* want :
       {"forward one thread at 1 thread", "forward one thread at several threads", "forward blocks at several threads",
        "forward few sequences at several threads", "backward one thread at 1 thread",
        "backward one thread at several threads", "backward chunks at several threads",
        "backward ranges at several threads", "backward query ranges at 1 thread",
        "backward query ranges at several threads", "backward weights over the whole pass at 1 thread",
        "backward weights over the whole pass at several threads", "backward weights in chunk partials at 1 thread",
        "backward weights in chunk partials at several threads"})
    EXPECT_TRUE(seen.count(want)) << "no case takes: " << want;
}

// ---- what the thread count may change ---------------------------------------------------------
// The backward: nothing. Its blocks and chunks depend on the shape alone, so the thread count
// changes who computes a chunk, never what is summed in which order: the gradients are bitwise
// the same at any thread count (test_backward_cpu.cpp, ThreadCountDoesNotChangeTheResult; with
// dropout, test_dropout_cpu.cpp).
// The forward: its last bits. Its blocks of sequences depend on the thread count (enough blocks
// for the threads), and with more threads than blocks a long sequence is shared by the threads
// in row tiles of 64 (few_sequences_pass): other matrix shapes for Eigen's products, so other
// summation orders. Measured on (1, 200, 1, 16, 2), the shape: at 2 threads 170 of 3200
// elements differ from 1 thread's, by at most 2.4e-7 (one or two units in the last place;
// ||out2 - out1|| / ||out1|| = 1.2e-8), 590 at 8 threads; on (1, 1, 129, 48, 3) about 1100 of
// 6192 at any count above 1; where every pass keeps its path and blocking, none ((2, 16, 24, 32,
// 2), (3, 16, 16, 64, 4)). (The counts are test properties of ThreadCountPromise.) So the promise is: at any thread count the forward is within the accuracy
// rule, and at a given count it is bitwise the same from call to call; across thread counts it
// need not be bitwise the same.
TEST(CpuThreads, ThreadCountPromise) {
  for (const Shape s : {Shape{1, 200, 1, 16, 2}, Shape{1, 1, 129, 48, 3}, Shape{2, 16, 24, 32, 2}}) {
    const Problem p = random_problem(s, 5);
    const std::vector<double> ref = reference_forward(p);
    const double err32 = rel_err(reference_forward_as<float>(p), ref);
    std::vector<float> one;
    for (int n : {1, 2, 3, 8}) {
      ThreadCount threads(n);
      std::vector<float> out(p.x.size(), kNaN), again(p.x.size(), kNaN);
      ASSERT_TRUE(forward_cpu(params(p, out.data())).ok());
      ASSERT_TRUE(forward_cpu(params(p, again.data())).ok());
      EXPECT_TRUE(same_bits(out, again)) << shape_name(s) << ", " << n << " threads: not the same from call to call";
      const ForwardAccuracy acc{rel_err(out, ref), err32};
      EXPECT_TRUE(acc.ok()) << shape_name(s) << ", " << n << " threads: " << acc;
      if (n == 1) one = out;
      int64_t differ = 0;
      for (size_t i = 0; i < out.size(); ++i) differ += out[i] != one[i];
      ::testing::Test::RecordProperty(shape_name(s) + "_threads" + std::to_string(n),
                                      std::to_string(differ) + " of " + std::to_string(out.size()) +
                                          " elements differ from 1 thread's");
    }
  }
}

#else
TEST(CpuPaths, NeedsOpenMP) { GTEST_SKIP() << "built without OpenMP: one thread, one path a pass"; }
#endif

}  // namespace
}  // namespace fastaxial::test
