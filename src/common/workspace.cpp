// Device scratch of forward_cuda, the same with or without CUDA in the build.
#include "fastaxial/fastaxial.h"

#include "dispatch.h"

namespace fastaxial {

// The row pass's output, (B, H, W, D) floats, read by the column pass; plus
// the staged path's intermediates when either pass may take it (the choice
// also depends on the device, which this function does not see).
size_t cuda_workspace_bytes(const AxialParams& p) {
  return static_cast<size_t>(staged_layout(p).floats) * sizeof(float);
}

}  // namespace fastaxial
