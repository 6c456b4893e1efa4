// Constants and kernel argument structs shared by the attention kernels: what
// every forward and backward kernel receives by value, defined once.
#pragma once

#include "../../common/axis.h"

namespace fastaxial::cuda {

// Scores are scaled by log2(e) / sqrt(hd) so that the softmax runs on exp2.
constexpr float kLog2e = 1.4426950408889634f;

// A flash forward kernel's tensors. qkv is (T, 3D), o is (T, D) and lse is
// (2, num_seq, heads, L): the log-sum-exp as two floats (detail/lse.cuh),
// or null where it is not kept. o16, where not null (the mma.sync kernel on
// 16-bit products, unsplit), takes o rounded to the products' type in place
// of o: (T, D) 16-bit values.
struct AttentionKernelArgs {
  AxisView pos;
  const float* qkv;
  float* o;
  float* lse;
  int D, heads;
  void* o16 = nullptr;
};

// An attention backward kernel's tensors: the forward's qkv (T, 3D), o and
// d_o (T, D) and lse; delta (num_seq, heads, L) = rowsum(d_o * o); dqkv
// (T, 3D) out; ds, dS^T where the dk, dv kernel stores it for the dq
// product (floats, or the 16-bit products' type: AttentionBackwardArgs::ds), else null.
struct AttentionBackwardKernelArgs {
  AxisView pos;
  const float* qkv;
  const float* o;
  const float* d_o;
  const float* lse;
  float* delta;
  float* dqkv;
  int D, heads;
  void* ds;
};

}  // namespace fastaxial::cuda
