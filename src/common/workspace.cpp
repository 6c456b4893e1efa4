// Device scratch of forward_cuda, the same with or without CUDA in the build.
#include "fastaxial/fastaxial.h"

namespace fastaxial {

// The row pass's output, (B, H, W, D) floats, read by the column pass.
size_t cuda_workspace_bytes(const AxialParams& p) {
  return static_cast<size_t>(p.batch * p.height * p.width * p.dim) * sizeof(float);
}

}  // namespace fastaxial
