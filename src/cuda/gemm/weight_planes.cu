// One launch splits up to four weight matrices into (hi, lo) TF32 planes
// (weight_planes.h): a thread per element of the flat list of jobs, the
// element's (row, column) of the output plane read from the source straight
// or transposed. The matrices are D^2 to 3 D^2 floats: the launch costs a
// few microseconds, once per call.
#include "weight_planes.h"

#include <algorithm>

#include "../detail/launch.cuh"
#include "../detail/tf32x3.cuh"

namespace fastaxial::cuda {
namespace {

__global__ void split_planes_kernel(const PlaneJobs jobs, int64_t total) {
  grid_dependency_wait();
  allow_dependent_launch();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = i;
    // Unrolled, so each job is read from the parameters by a constant index.
#pragma unroll
    for (int j = 0; j < PlaneJobs::kMax; ++j) {
      if (j >= jobs.count) break;
      const PlaneJobs::Job& b = jobs.job[j];
      const int64_t size = b.n * b.k;
      if (e < size) {
        const int64_t r = e / b.k, c = e % b.k;  // of the (n, k) plane
        const float2 v = split_pair(b.transpose ? b.src[c * b.n + r] : b.src[e]);
        b.dst[e] = v.x;
        b.dst[size + e] = v.y;
        break;
      }
      e -= size;
    }
  }
}

}  // namespace

cudaError_t split_weight_planes(const PlaneJobs& jobs, const DeviceCaps& dev, cudaStream_t stream) {
  int64_t total = 0;
  for (int j = 0; j < jobs.count; ++j) total += jobs.job[j].n * jobs.job[j].k;
  if (total == 0) return cudaSuccess;
  const unsigned blocks = (unsigned)std::min<int64_t>((total + 255) / 256, 8 * (int64_t)std::max(dev.sms, 1));
  return launch_kernel<split_planes_kernel>(blocks, 256, 0, stream, dev, jobs, total);
}

}  // namespace fastaxial::cuda
