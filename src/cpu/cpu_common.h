// What the CPU forward (axial_cpu.cpp) and backward (backward_cpu.cpp) share:
// Eigen's row-major matrix types over the library's row-major buffers, the
// OpenMP thread count, and a (sequence, head)'s dropout multipliers.
#pragma once

#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "../common/dropout.h"

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

// The dropout multipliers (0 or 1 / (1 - p)) of sequence n, head h of `pass` (0 rows, 1
// columns), queries r0 .. r0 + rows - 1 (all L keys), into m, (rows, L): row-major, so the
// mask's consecutive elements.
inline void fill_mask(const DropoutParams& d, int pass, int64_t n, int64_t h, int64_t L, int64_t r0, int64_t rows,
                      Mat& m) {
  m.resize(rows, L);
  dropout_row(d, dropout_element(d, pass, n, h, r0, 0), rows * L, m.data());
}

}  // namespace fastaxial::cpu
