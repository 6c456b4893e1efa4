// Entry points of a build without CUDA: they say so instead of failing to link.
#include "fastaxial/fastaxial.h"

namespace fastaxial {

bool cuda_compiled() { return false; }

Status forward_cuda(const AxialParams& p, void*, CUstream_st*) {
  if (Status s = validate(p); !s.ok()) return s;
  return {StatusCode::kUnsupported, "fastaxial was built without CUDA"};
}

}  // namespace fastaxial
