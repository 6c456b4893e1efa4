// fastaxial: fused axial attention, forward pass, fp32.
//
// Axial attention on a (B, H, W, D) grid: self-attention along each row
// (sequences of length W), added to the input, then along each column
// (sequences of length H), added again. Per axis, on a sequence x of shape
// (L, D):
//   y   = LayerNorm(x)                       (eps, affine)
//   qkv = y @ Wqkv^T                         Wqkv is (3D, D), rows [q | k | v]
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h  per head h, hd = D / heads
//   x  += concat_h(o_h) @ Wout^T + bout      Wout is (D, D)
//
// This header knows nothing of PyTorch or of CUDA's headers: plain pointers,
// sizes and a status. All tensors are contiguous, row-major, float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

struct CUstream_st;  // cudaStream_t is CUstream_st*; declared so this header needs no CUDA

namespace fastaxial {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a size, pointer or option is out of range
  kUnsupported,      // valid input this build or device cannot run
  kCudaError,        // a CUDA call or kernel launch failed
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;  // empty when ok

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
};

// The five parameter tensors of one axis (row or column).
struct AxisWeights {
  const float* norm_weight = nullptr;  // (D)      LayerNorm gain
  const float* norm_bias = nullptr;    // (D)      LayerNorm shift
  const float* qkv_weight = nullptr;   // (3D, D)  no bias
  const float* out_weight = nullptr;   // (D, D)
  const float* out_bias = nullptr;     // (D)
};

struct AxialParams {
  int64_t batch = 0;   // B
  int64_t height = 0;  // H: column sequence length
  int64_t width = 0;   // W: row sequence length
  int64_t dim = 0;     // D: features per position
  int64_t heads = 0;   // D % heads == 0
  float eps = 1e-5f;   // LayerNorm epsilon

  const float* x = nullptr;  // (B, H, W, D) input
  float* out = nullptr;      // (B, H, W, D) output; may not alias x
  AxisWeights row;           // attention along W
  AxisWeights col;           // attention along H
};

// Checks sizes and pointers; the entry points below call it first.
Status validate(const AxialParams& p);

// CPU forward. Threads over sequences with OpenMP.
Status forward_cpu(const AxialParams& p);

// True when this build contains the CUDA kernels.
bool cuda_compiled();

// Bytes of device scratch forward_cuda needs: the row pass's output, plus the
// intermediates of the staged kernels (about 4x the input) for shapes that may
// take them on some GPU (sequences the fused kernel cannot hold: longer than
// 128 positions, or too wide for one block's shared memory; and dims above 64,
// where the choice also depends on the GPU; see the README). Depends on the
// shape alone.
size_t cuda_workspace_bytes(const AxialParams& p);

// CUDA forward on `stream` (nullptr: the default stream). All pointers are
// device pointers; `workspace` holds cuda_workspace_bytes(p) bytes. Launches
// only: no allocation, no synchronisation, so it can be captured in a graph.
// Precision: fp32 inputs, outputs and accumulation. With dim a multiple of 8
// and head_dim 8, 16, 32 or 64, sequences of up to 128 positions (and on
// compute capability 9.0 with an sm_90a build, longer ones) use the tensor
// cores, each fp32 operand split into two TF32 parts (3xTF32): error against
// float64 within twice that of plain fp32 arithmetic in the tests, though not
// bit-identical to it. Other shapes use fp32 FMA. PyTorch's TF32 switches do
// not apply.
Status forward_cuda(const AxialParams& p, void* workspace, CUstream_st* stream);

}  // namespace fastaxial
