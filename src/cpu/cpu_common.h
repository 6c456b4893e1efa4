// What the CPU forward (axial_cpu.cpp) and backward (backward_cpu.cpp) share:
// Eigen's row-major matrix types over the library's row-major buffers, the
// OpenMP thread count, and a (sequence, head)'s dropout multipliers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "../common/dropout.h"
#include "fastaxial/fastaxial.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastaxial::cpu {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const Mat>;
using MatMap = Eigen::Map<Mat>;
using ConstVec = Eigen::Map<const Eigen::RowVectorXf>;
using VecMap = Eigen::Map<Eigen::RowVectorXf>;
// Floats on Eigen's alignment (64 bytes: CMakeLists.txt), for buffers that products read or write.
using AlignedFloats = std::vector<float, Eigen::aligned_allocator<float>>;

// The threads an OpenMP parallel region gets by default; 1 in a build without OpenMP.
inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Fewest floating-point operations a thread of a backward team is given: a backward pass with
// little work ran slower on 16 threads than on 4 (docs/perf-notes.md, v67), so such a pass takes
// fewer threads than it may. (The forward's one region a pass kept gaining up to 16 threads.)
constexpr double kFlopsPerThread = 4e6;

// The threads a region of `tasks` tasks and `flops` operations in all takes: at most max_threads()
// and tasks, and no more than one a kFlopsPerThread of work; at least one.
inline int team_for(int64_t tasks, double flops) {
  const double by_work = std::min(flops / kFlopsPerThread, 1e9);
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

// The dropout multipliers (0 or 1 / (1 - p)) of sequence n, head h of `pass` (0 rows, 1
// columns), queries r0 .. r0 + rows - 1 (all L keys), into m, (rows, L): row-major, so the
// mask's consecutive elements.
inline void fill_mask(const DropoutParams& d, int pass, int64_t n, int64_t h, int64_t L, int64_t r0, int64_t rows,
                      Mat& m) {
  m.resize(rows, L);
  dropout_row(d, dropout_element(d, pass, n, h, r0, 0), rows * L, m.data());
}

}  // namespace fastaxial::cpu
