// The backward's products on cuBLAS, in fp32 (no TF32, no reduced-precision
// reductions), and the 16-bit products (bf16, fp16; fp32 accumulation), for
// row-major matrices. cuBLAS is column-major: a row-major
// (r, c) matrix is its column-major transpose, so C = op(A) op(B) is asked of
// it as C^T = op(B)^T op(A)^T with the operands swapped.
// Deterministic: cuBLAS gives bitwise identical results for the same call on
// the same GPU, and these calls use no atomics mode.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../common/plan.h"  // Products
#include "fastaxial/fastaxial.h"

namespace fastaxial::cuda {

// A cuBLAS handle for the current device and thread, bound to `stream` and to
// `workspace` (the plan's region of `workspace_bytes`), in fp32 math.
// Created on the first use in a thread and kept for the thread's life.
Status blas_handle(cudaStream_t stream, void* workspace, size_t workspace_bytes, cublasHandle_t* handle);

// The caller's handle for one training call: checked to be bound to `stream`, its math mode set
// to fp32 (a framework may have allowed TF32 on it) until the object is destroyed, when the
// caller's mode comes back.
class CallerBlas {
 public:
  CallerBlas() = default;
  CallerBlas(const CallerBlas&) = delete;
  CallerBlas& operator=(const CallerBlas&) = delete;
  ~CallerBlas();
  Status bind(cublasHandle_t h, cudaStream_t stream);

 private:
  cublasHandle_t h_ = nullptr;
  cublasMath_t mode_ = CUBLAS_DEFAULT_MATH;
};

// Row-major C (M, N) = op(A) op(B) + beta C, op(A) (M, K), op(B) (K, N);
// trans_a: A is stored (K, M), trans_b: B is stored (N, K); lda, ldb, ldc are
// the row strides as stored.
Status gemm(cublasHandle_t h, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
            int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const char* what);

// The same product with A and B in a 16-bit type (type: Products::kBf16 or kFp16), C in fp32: the
// tensor cores' 16-bit products with fp32 accumulation (CUBLAS_COMPUTE_32F), as PyTorch's
// Linear layers run under autocast on the same library. Deterministic as above. Strides and
// sizes count elements.
Status gemm_16bit(cublasHandle_t h, Products type, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                  const void* A, int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc,
                  const char* what);
// The same with C = op(A) op(B) rounded to `type` (C: 16-bit values, no beta): the QKV product of
// a pass whose attention reads q, k and v in 16 bits (FlashArgs::qkv16).
Status gemm_16bit_rounded(cublasHandle_t h, Products type, bool trans_a, bool trans_b, int64_t M, int64_t N,
                          int64_t K, const void* A, int64_t lda, const void* B, int64_t ldb, void* C, int64_t ldc,
                          const char* what);

// y (n) = x (n) rounded to `type` (bf16 or fp16: nearest, ties to even, as PyTorch's conversions;
// fp16 overflows to infinity), on stream: the fp32 operands of gemm_16bit.
cudaError_t round_to_16bit(const float* x, void* y, int64_t n, Products type, const DeviceCaps& dev,
                           cudaStream_t stream);

}  // namespace fastaxial::cuda
