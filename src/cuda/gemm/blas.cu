// cuBLAS calls of the backward (blas.h).
#include "blas.h"

#include <string>

namespace fastaxial::cuda {
namespace {

Status blas_error(cublasStatus_t s, const char* what) {
  return {StatusCode::kCudaError, std::string(what) + ": " + cublasGetStatusName(s) + " (" +
                                      cublasGetStatusString(s) + ")"};
}

}  // namespace

Status blas_handle(cudaStream_t stream, void* workspace, size_t workspace_bytes, cublasHandle_t* handle) {
  constexpr int kMaxDevices = 64;
  // Never destroyed: a handle destroyed at thread or process exit may outlive
  // its CUDA context; the driver frees it with the context.
  thread_local cublasHandle_t handles[kMaxDevices] = {};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    return {StatusCode::kCudaError, std::string("cudaGetDevice: ") + cudaGetErrorString(e)};
  if (device < 0 || device >= kMaxDevices)
    return {StatusCode::kUnsupported, "device ordinal " + std::to_string(device) + " is beyond the backward's " +
                                          std::to_string(kMaxDevices) + " devices"};
  cublasHandle_t& h = handles[device];
  if (h == nullptr) {
    if (cublasStatus_t s = cublasCreate(&h); s != CUBLAS_STATUS_SUCCESS) {
      h = nullptr;
      return blas_error(s, "cublasCreate");
    }
    // fp32 products at fp32 precision: the default math mode never trades precision for speed
    // (no TF32); PyTorch's TF32 switches do not reach this handle.
    if (cublasStatus_t s = cublasSetMathMode(h, CUBLAS_DEFAULT_MATH); s != CUBLAS_STATUS_SUCCESS)
      return blas_error(s, "cublasSetMathMode");
  }
  if (cublasStatus_t s = cublasSetStream(h, stream); s != CUBLAS_STATUS_SUCCESS)
    return blas_error(s, "cublasSetStream");
  // The plan's workspace: cuBLAS allocates nothing itself during the call (graph capture stays
  // within the caller's memory), and the scratch is ordered with the rest of the stream's work.
  if (cublasStatus_t s = cublasSetWorkspace(h, workspace, workspace_bytes); s != CUBLAS_STATUS_SUCCESS)
    return blas_error(s, "cublasSetWorkspace");
  *handle = h;
  return Status::Ok();
}

Status CallerBlas::bind(cublasHandle_t h, cudaStream_t stream) {
  cudaStream_t bound = nullptr;
  if (cublasStatus_t s = cublasGetStream(h, &bound); s != CUBLAS_STATUS_SUCCESS) return blas_error(s, "cublasGetStream");
  if (bound != stream)
    return {StatusCode::kInvalidArgument, "the caller's cuBLAS handle is bound to another stream than the call's"};
  if (cublasStatus_t s = cublasGetMathMode(h, &mode_); s != CUBLAS_STATUS_SUCCESS)
    return blas_error(s, "cublasGetMathMode");
  if (cublasStatus_t s = cublasSetMathMode(h, CUBLAS_DEFAULT_MATH); s != CUBLAS_STATUS_SUCCESS)
    return blas_error(s, "cublasSetMathMode");
  h_ = h;
  return Status::Ok();
}

CallerBlas::~CallerBlas() {
  if (h_ != nullptr) cublasSetMathMode(h_, mode_);  // the caller's mode back (nothing to report to)
}

Status gemm(cublasHandle_t h, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
            int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const char* what) {
  if (M == 0 || N == 0) return Status::Ok();
  const float one = 1.0f;
  // Column-major C^T (N, M) = op(B)^T (N, K) op(A)^T (K, M).
  const cublasStatus_t s = cublasSgemm_64(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                          N, M, K, &one, B, ldb, A, lda, &beta, C, ldc);
  if (s != CUBLAS_STATUS_SUCCESS) return blas_error(s, what);
  // A launch that cuBLAS did not report would otherwise surface in whatever checks the
  // CUDA error state next.
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {StatusCode::kCudaError, std::string(what) + ": CUDA error after cuBLAS: " + cudaGetErrorString(e)};
  return Status::Ok();
}

}  // namespace fastaxial::cuda
