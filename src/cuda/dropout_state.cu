// One thread: the dropout state of a training call (dropout_state.h).
#include "dropout_state.h"

#include "detail/launch.cuh"

namespace fastaxial::cuda {
namespace {

__global__ void write_dropout_state_kernel(uint64_t seed, uint64_t offset, const uint64_t* seed_device,
                                           const uint64_t* offset_device, uint64_t* state) {
  grid_dependency_wait();
  allow_dependent_launch();
  state[0] = seed_device != nullptr ? *seed_device : seed;
  state[1] = (offset_device != nullptr ? *offset_device : 0) + offset;
}

}  // namespace

cudaError_t write_dropout_state(uint64_t seed, uint64_t offset, const uint64_t* seed_device,
                                const uint64_t* offset_device, uint64_t* state, const DeviceCaps& dev,
                                cudaStream_t stream) {
  return launch_kernel<write_dropout_state_kernel>(dim3(1), dim3(1), 0, stream, dev, seed, offset, seed_device,
                                                   offset_device, state);
}

}  // namespace fastaxial::cuda
