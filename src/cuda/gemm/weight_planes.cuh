// The device side of a weight split (weight_planes.h), for the kernels that
// run one: split_weight_planes' own, and the LayerNorm that splits the
// weights in blocks of its launch (norm/norm.cu).
#pragma once

#include <cstdint>

#include "../detail/tf32x3.cuh"
#include "weight_planes.h"

namespace fastaxial::cuda {

// Element i of the flat list of the jobs' elements split into its job's
// planes: the element's (row, column) of the output plane read from the
// source straight or, with kTransposes and the job's transpose, transposed
// (a kernel whose jobs are all straight leaves out the transposed read's
// 64-bit division). Each kernel loops over the elements its threads own.
template <bool kTransposes>
__device__ __forceinline__ void split_plane_element(const PlaneJobs& jobs, int64_t i) {
  int64_t e = i;
  // Unrolled, so each job is read from the parameters by a constant index
  // (a runtime index would copy the jobs to local memory in every thread).
#pragma unroll
  for (int j = 0; j < PlaneJobs::kMax; ++j) {
    if (j >= jobs.count) break;
    const PlaneJobs::Job& b = jobs.job[j];
    const int64_t size = b.n * b.k;
    if (e < size) {
      float x;
      if constexpr (kTransposes) {
        const int64_t r = e / b.k, c = e % b.k;  // of the (n, k) plane
        x = b.transpose ? b.src[c * b.n + r] : b.src[e];
      } else {
        x = b.src[e];
      }
      const float2 v = split_pair<true>(x);
      b.dst[e] = v.x;
      b.dst[size + e] = v.y;
      break;
    }
    e -= size;
  }
}

}  // namespace fastaxial::cuda
