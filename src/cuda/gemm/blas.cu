// cuBLAS calls of the backward, and of the 16-bit products with the rounding of their fp32
// operands (blas.h).
#include "blas.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "../detail/launch.cuh"
#include "../detail/round16.cuh"

namespace fastaxial::cuda {
namespace {

Status blas_error(cublasStatus_t s, const char* what) {
  return {StatusCode::kCudaError, std::string(what) + ": " + cublasGetStatusName(s) + " (" +
                                      cublasGetStatusString(s) + ")"};
}

constexpr int kRoundThreads = 256;

// Four elements a thread where x and y allow 16- and 8-byte accesses (vec), else one; a grid-stride loop.
template <class T, bool kVec>
__global__ void __launch_bounds__(kRoundThreads) round_kernel(const float* __restrict__ x, T* __restrict__ y,
                                                             int64_t n) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int64_t stride = (int64_t)gridDim.x * kRoundThreads;
  int64_t i = (int64_t)blockIdx.x * kRoundThreads + threadIdx.x;
  if constexpr (kVec) {
    for (; 4 * i < n; i += stride) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      Pair16<T>* out = reinterpret_cast<Pair16<T>*>(y) + 2 * i;
      out[0] = round16x2<T>(v.x, v.y), out[1] = round16x2<T>(v.z, v.w);
    }
  } else {
    for (; i < n; i += stride) y[i] = round16<T>(x[i]);
  }
}

template <class T>
cudaError_t launch_round(const float* x, void* y, int64_t n, const DeviceCaps& dev, cudaStream_t stream) {
  const bool vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 8 == 0;
  const int64_t items = vec ? n / 4 : n;
  const unsigned blocks = (unsigned)std::min<int64_t>((items + kRoundThreads - 1) / kRoundThreads, 65535);
  T* out = static_cast<T*>(y);
  return vec ? launch_kernel<round_kernel<T, true>>(dim3(blocks), dim3(kRoundThreads), 0, stream, dev, x, out, n)
             : launch_kernel<round_kernel<T, false>>(dim3(blocks), dim3(kRoundThreads), 0, stream, dev, x, out, n);
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

namespace fastaxial::cuda {

namespace {

// gemm_16bit with C in fp32, or with c16 in the operands' 16-bit type.
Status gemm_16bit_to(cublasHandle_t h, Products type, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                     const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, bool c16,
                     int64_t ldc, const char* what) {
  if (type != Products::kBf16 && type != Products::kFp16)
    return {StatusCode::kInvalidArgument, std::string(what) + ": gemm_16bit takes bf16 or fp16 operands"};
  if (M == 0 || N == 0) return Status::Ok();
  const float one = 1.0f;
  const cudaDataType_t ab = type == Products::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  // Column-major C^T (N, M) = op(B)^T (N, K) op(A)^T (K, M), as gemm.
  const cublasStatus_t s =
      cublasGemmEx_64(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &one, B,
                      ab, ldb, A, ab, lda, &beta, C, c16 ? ab : CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) return blas_error(s, what);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {StatusCode::kCudaError, std::string(what) + ": CUDA error after cuBLAS: " + cudaGetErrorString(e)};
  return Status::Ok();
}

}  // namespace

Status gemm_16bit(cublasHandle_t h, Products type, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  const void* A, int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc,
                  const char* what) {
  return gemm_16bit_to(h, type, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, false, ldc, what);
}

Status gemm_16bit_rounded(cublasHandle_t h, Products type, bool trans_a, bool trans_b, int64_t M, int64_t N,
                          int64_t K, const void* A, int64_t lda, const void* B, int64_t ldb, void* C, int64_t ldc,
                          const char* what) {
  return gemm_16bit_to(h, type, trans_a, trans_b, M, N, K, A, lda, B, ldb, 0.0f, C, true, ldc, what);
}

cudaError_t round_to_16bit(const float* x, void* y, int64_t n, Products type, const DeviceCaps& dev,
                           cudaStream_t stream) {
  if (n < 0 || (n > 0 && (x == nullptr || y == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (type == Products::kBf16) return launch_round<__nv_bfloat16>(x, y, n, dev, stream);
  if (type == Products::kFp16) return launch_round<__half>(x, y, n, dev, stream);
  return cudaErrorInvalidValue;
}

}  // namespace fastaxial::cuda
