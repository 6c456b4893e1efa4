// One launch splits up to four weight matrices into (hi, lo) TF32 planes
// (weight_planes.h): a thread per element of the flat list of jobs
// (weight_planes.cuh). The matrices are D^2 to 3 D^2 floats: the launch is
// short, and runs once per call.
#include "weight_planes.h"

#include <algorithm>

#include "../detail/launch.cuh"
#include "weight_planes.cuh"

namespace fastaxial::cuda {
namespace {

__global__ void split_planes_kernel(const PlaneJobs jobs, int64_t total) {
  grid_dependency_wait();
  allow_dependent_launch();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
    split_plane_element<true>(jobs, i);
}

}  // namespace

cudaError_t split_weight_planes(const PlaneJobs& jobs, const DeviceCaps& dev, cudaStream_t stream) {
  const int64_t total = jobs.elements();
  if (total == 0) return cudaSuccess;
  const unsigned blocks = (unsigned)std::min<int64_t>((total + 255) / 256, 8 * (int64_t)std::max(dev.sms, 1));
  return launch_kernel<split_planes_kernel>(blocks, 256, 0, stream, dev, jobs, total);
}

}  // namespace fastaxial::cuda
