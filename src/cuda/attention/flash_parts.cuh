// Parts shared by the wgmma flash kernels (flash_attention_wgmma*.cu): the
// unit scheduler. A block takes units in turn, u = blockIdx.x, + gridDim.x,
// ... (one block an SM, so that the steps of consecutive units form one
// stream); unit u is query tile u % q_tiles of split (u / q_tiles) % S of
// item u / (q_tiles S) = n heads + h.
#pragma once

#include <cstdint>

#include "../detail/kernel_args.h"

namespace fastaxial::cuda {

// A unit: its item, split, first query and the split's key tiles j0 .. j1 -
// 1 (of `tiles`: S contiguous ranges); seq, the row of its sequence's
// position 0; col = h hd; qg, its q columns in row 0 (k at + D, v at + 2D).
struct FlashUnit {
  int64_t item;
  int split, q0, j0, j1;
  int64_t seq;
  int col;
  const float* qg;
};

// The units a block takes of `units`.
__device__ __forceinline__ int64_t flash_block_units(int64_t units) {
  return (units - blockIdx.x + gridDim.x - 1) / gridDim.x;
}

// Unit i of this block (u = blockIdx.x + i gridDim.x): BM queries a tile, S splits of `tiles` key tiles.
template <int BM>
__device__ __forceinline__ FlashUnit flash_unit(const AttentionKernelArgs& a, int64_t i, int q_tiles, int S, int tiles,
                                                int hd, int64_t row_words) {
  const int64_t u = blockIdx.x + i * gridDim.x;
  FlashUnit x;
  x.q0 = (int)(u % q_tiles) * BM;
  const int64_t rest = u / q_tiles;
  x.split = (int)(rest % S);
  x.item = rest / S;
  x.j0 = (int)((int64_t)tiles * x.split / S);
  x.j1 = (int)((int64_t)tiles * (x.split + 1) / S);
  const int h = (int)(x.item % a.heads);
  x.seq = a.pos.offset(x.item / a.heads, 0);
  x.col = h * hd;
  x.qg = a.qkv + x.seq * row_words + x.col;
  return x;
}

}  // namespace fastaxial::cuda
