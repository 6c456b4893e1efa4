// How one attention pass (the attention along one axis: pass 0 the rows, pass
// 1 the columns) sees the (B, H, W, D) grid: N independent sequences
// of L positions, each position D contiguous floats. Rows and columns differ
// only in these strides, so every kernel serves both without a permuted copy.
#pragma once

#include <cstdint>

#include "fastaxial/fastaxial.h"

#ifdef __CUDACC__
#define FASTAXIAL_HOST_DEVICE __host__ __device__
#else
#define FASTAXIAL_HOST_DEVICE
#endif

namespace fastaxial {

struct AxisView {
  int64_t num_seq;     // N: B*H for rows, B*W for columns
  int64_t len;         // L: W for rows, H for columns
  int64_t inner;       // sequences per batch element along the other axis (H or W)
  int64_t seq_stride;  // offset between neighbouring sequences in one batch element
  int64_t pos_stride;  // offset between neighbouring positions of one sequence
  int64_t batch_stride;

  // Offset (in floats) of position l of sequence n.
  FASTAXIAL_HOST_DEVICE int64_t offset(int64_t n, int64_t l) const {
    return (n / inner) * batch_stride + (n % inner) * seq_stride + l * pos_stride;
  }
};

inline AxisView row_view(const AxialParams& p) {
  // sequence n = (b, h), position l = w
  return {p.batch * p.height, p.width, p.height, p.width * p.dim, p.dim, p.height * p.width * p.dim};
}

inline AxisView col_view(const AxialParams& p) {
  // sequence n = (b, w), position l = h
  return {p.batch * p.width, p.height, p.width, p.dim, p.width * p.dim, p.height * p.width * p.dim};
}

// The view with positions as rows of a (T, D) matrix (the staged and training paths' qkv, o):
// its strides in units of D, so offset() gives a row.
inline AxisView row_indices(const AxisView& v, int64_t D) {
  return {v.num_seq, v.len, v.inner, v.seq_stride / D, v.pos_stride / D, v.batch_stride / D};
}

}  // namespace fastaxial
