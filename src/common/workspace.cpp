// Device scratch of forward_cuda, the same with or without CUDA in the build.
#include "fastaxial/fastaxial.h"

#include "dispatch.h"

namespace fastaxial {

// The row pass's output, (B, H, W, D) floats, read by the column pass; plus
// the staged path's intermediates when either pass may take it (the choice
// also depends on the device, which this function does not see).
size_t cuda_workspace_bytes(const AxialParams& p) {
  const int64_t tokens = p.batch * p.height * p.width;
  int64_t floats = tokens * p.dim;
  if (p.dim >= 1 && p.heads >= 1 && p.dim % p.heads == 0 && tokens > 0 &&
      (staged_possible(p.width, p.dim, p.heads) || staged_possible(p.height, p.dim, p.heads)))
    floats += staged_workspace_floats(tokens, p.dim);
  return static_cast<size_t>(floats) * sizeof(float);
}

}  // namespace fastaxial
