// Entry points of a build without CUDA: they say so instead of failing to link.
#include "../common/validate.h"
#include "fastaxial/fastaxial.h"

namespace fastaxial {
namespace {

Status no_cuda(const AxialParams& p, bool pointers = true) {
  if (Status s = pointers ? validate(p) : validate_sizes(p); !s.ok()) return s;
  return {StatusCode::kUnsupported, "fastaxial was built without CUDA"};
}

}  // namespace

bool cuda_compiled() { return false; }

Status plan_cuda(const AxialParams& p, CudaPlan*, bool) { return no_cuda(p, false); }

Status cuda_workspace_bytes(const AxialParams& p, size_t*) { return no_cuda(p, false); }

Status forward_cuda(const AxialParams& p, const CudaPlan&, void*, size_t, CUstream_st*, void*) { return no_cuda(p); }

Status forward_cuda(const AxialParams& p, void*, size_t, CUstream_st*) { return no_cuda(p); }

Status plan_backward_cuda(const AxialParams& p, CudaBackwardPlan*, bool) { return no_cuda(p, false); }

Status forward_cuda_training(const AxialParams& p, const CudaBackwardPlan&, void*, size_t, void*, size_t, CUstream_st*,
                             void*) {
  return no_cuda(p);
}

Status backward_cuda(const AxialParams& p, const AxialGrads&, const CudaBackwardPlan&, const void*, size_t, void*, size_t,
                     CUstream_st*, void*) {
  if (Status s = validate_inputs(p); !s.ok()) return s;
  return {StatusCode::kUnsupported, "fastaxial was built without CUDA"};
}

}  // namespace fastaxial
