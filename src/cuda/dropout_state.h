// The dropout mask's seed and offset of one training call, resolved on the
// device: the training forward writes them into its saved buffer, and every
// kernel that draws the mask (the forward's flash attention, the attention
// backward) reads them from there. Read on the device rather than passed as
// kernel arguments so that a CUDA graph replays with the values of the
// replay: PyTorch's generator, under capture, keeps its seed and offset in
// device memory that it updates before each replay.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/plan.h"  // DeviceCaps

namespace fastaxial::cuda {

// state[0] = seed_device ? *seed_device : seed, state[1] = (offset_device ? *offset_device : 0) + offset,
// written by one thread on `stream` (a programmatic dependent of the stream's previous kernel).
cudaError_t write_dropout_state(uint64_t seed, uint64_t offset, const uint64_t* seed_device,
                                const uint64_t* offset_device, uint64_t* state, const DeviceCaps& dev,
                                cudaStream_t stream);

}  // namespace fastaxial::cuda
