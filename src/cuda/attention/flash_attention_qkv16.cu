// The flash attention step (flash_attention.h) on q, k and v stored in 16
// bits (bf16 or fp16: the QKV product wrote them so, FlashArgs::qkv16), on
// Hopper's warpgroup products (wgmma, sm_90a), fp32 accumulation, on tiles of
// head dims 32, 64 and 128: for each sequence n and head h,
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h
// with the online softmax of the other flash kernels (flash_parts.cuh's
// FlashRows: the same fp32 arithmetic). No dropout (the inference pass).
//
// Why a kernel of its own. flash_attention_wgmma16.cu reads fp32 rows and
// rounds k and v into wgmma's operands once a step: 64 KB of fp32 rows a
// step through shared memory at head dim 128, more than its products read.
// Rows already in 16 bits need no rounding: cp.async puts each 16-byte piece
// (8 values) of q, k and v straight where wgmma reads it, and v needs no
// transposing pass either, since a 16-bit B operand may be MN-major
// (wgmma's tnsp-b): v's rows as they are stored serve as B of p v.
//
// Shape of the work: a block of two warpgroups takes one unit (128 queries
// of one sequence and head; 64 a warpgroup) and walks its keys 64 at a time
// (a step), through kStages buffers of k and v rows, kStages - 2 steps ahead
// of the products. Step j (its buffer and step j + 1's landed):
//   1. barrier; step j + kStages - 1's rows copied into the buffer step j - 1
//      left;
//   2. s' = q k_{j+1}^T issued (the scores of the next step: q's operands in
//      registers, loaded once a unit by ldmatrix, k from shared memory), then
//      o += p_j v_j (p_j in registers, rounded);
//   3. the online softmax of s' while p v runs, giving p_{j+1} and the
//      factor 2^(m_old - m_new); then, p v done, o rescaled by it.
// So each warpgroup's softmax runs under its own products (at the last step
// the scores of a stale buffer are issued and left unread: no branch between
// the products, which would serialize them).
//
// Shared memory (kStages = 4; head dim 128: 161 KB; 64: 81 KB and 32: 41 KB,
// two blocks an SM): q, (128, HDP) 16-bit; a buffer, k's (64, HDP) then v's.
// Each is stored as chunks of 64 values of a row (128 bytes; at head dim 32 one
// chunk of 32 values, 64 bytes), in detail/wgmma.cuh's 128-byte swizzle (16-byte
// piece c of row r at piece c ^ r % 8; 64-byte rows: c ^ (r / 2) % 4), a
// chunk's rows consecutive: k and q K-major for the scores (desc_sw128,
// desc_sw64), v MN-major for p v (desc_sw128_mn, desc_sw64_mn: a chunk is v's
// features for the step's keys).
// Positions >= L and features >= hd are zero-filled by the copies; scores of
// keys >= L are set to -inf.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/mma16.cuh"
#include "../detail/online_softmax.cuh"
#include "../detail/wgmma.cuh"
#include "flash_attention.h"
#include "flash_parts.cuh"

namespace fastaxial::cuda {
namespace {

// Sizes and byte offsets of a block's shared memory (see the header comment).
template <int HDP>
struct Qkv16Tile {
  static constexpr int kHdp = HDP;
  static_assert(HDP == 32 || HDP == 64 || HDP == 128, "head dims 32 (a 64-byte chunk), 64 and 128 (128-byte ones)");
  static constexpr int BM = 128, BN = 64, kThreads = 256;
  static constexpr int kStages = 4;
  static constexpr int kBlocksPerSm = HDP == 128 ? 1 : 2;
  static constexpr int row = HDP == 32 ? 64 : 128;  // bytes of a chunk's row: its swizzle
  static constexpr int chunks = 2 * HDP / row;      // chunks a row
  static constexpr int q_chunk = BM * row;          // q's 128 rows of a chunk
  static constexpr int kv_chunk = BN * row;         // a step's 64 rows of a chunk
  static_assert(chunks * row == 2 * kHdp, "whole chunks a row");
  static constexpr int k_bytes = chunks * kv_chunk;
  static constexpr int stage_bytes = 2 * k_bytes;  // k's rows, then v's
  static constexpr int stages_off = chunks * q_chunk;
  static constexpr int bytes = stages_off + kStages * stage_bytes + 1024;  // + room to align the base
  static_assert((size_t)bytes == flash_qkv16_smem_bytes(HDP), "common/smem_layout.h's sizes");
  static_assert(kStages >= 3, "two steps' buffers in the products, one more in the copies");
};

#if FASTAXIAL_SM90A_DEVICE
// Rows p0 .. p0 + rows - 1 of one head's slice (src: position 0's, row l at src + l * row_stride
// values) into chunked swizzled rows at dst (Tile's chunk rows); positions >= L and features >= hd
// as zeros. Thread tid of 256 takes every 256th 16-byte piece.
template <class Tile, class T>
__device__ __forceinline__ void copy_rows16(uint32_t dst, int chunk_bytes, const T* src, int64_t row_stride, int p0,
                                            int rows, int L, int hd, int tid) {
  constexpr int P = Tile::kHdp / 8, per_chunk = Tile::row / 16;  // pieces a row, a chunk's row
#pragma unroll 4
  for (int e = tid; e < rows * P; e += 256) {
    const int r = e / P, c = e % P, l = p0 + r;
    const bool in = l < L && 8 * c < hd;
    const T* from = in ? src + l * row_stride + 8 * c : src;
    const int piece = Tile::row == 128 ? (c % 8) ^ (r % 8) : (c % 4) ^ ((r / 2) % 4);
    copy_async16(dst + (c / per_chunk) * chunk_bytes + r * Tile::row + (piece << 4), from, in ? 16 : 0);
  }
}
#endif  // FASTAXIAL_SM90A_DEVICE

template <class T, int HDP>
__global__ void __launch_bounds__(256, Qkv16Tile<HDP>::kBlocksPerSm)
    flash_qkv16_kernel(const AttentionKernelArgs a, const T* qkv, float scale_log2, int q_tiles) {
#if FASTAXIAL_SM90A_DEVICE
  using Tile = Qkv16Tile<HDP>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int BM = Tile::BM, BN = Tile::BN, NT = BN / 8, S = Tile::kStages;
  const int hd = a.D / a.heads, L = (int)a.pos.len;
  uint32_t base;
  aligned_smem(base);
  const uint32_t q_s = base, stages = base + Tile::stages_off;
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;
  const BlockUnit u = flash_block_unit<false>(q_tiles, 1, a.heads, BM);
  const int64_t seq = a.pos.offset(u.n, 0);
  const int col = u.h * hd;
  const int64_t row_stride = a.pos.pos_stride * 3 * (int64_t)a.D;  // values from a position's row to the next's
  const T* q_g = qkv + seq * 3 * a.D + col;
  const int steps = (L + BN - 1) / BN;

  grid_dependency_wait();
  allow_dependent_launch();

  const auto stage = [&](int j) { return stages + (uint32_t)((j % S) * Tile::stage_bytes); };
  const auto copy_step = [&](int j) {  // step j's rows where there is one, a group either way
    if (j < steps) {
      copy_rows16<Tile>(stage(j), Tile::kv_chunk, q_g + a.D, row_stride, j * BN, BN, L, hd, tid);
      copy_rows16<Tile>(stage(j) + Tile::k_bytes, Tile::kv_chunk, q_g + 2 * a.D, row_stride, j * BN, BN, L, hd, tid);
    }
    copy_async_commit();
  };
  copy_rows16<Tile>(q_s, Tile::q_chunk, q_g, row_stride, u.q0, BM, L, hd, tid);
#pragma unroll
  for (int j = 0; j < S - 1; ++j) copy_step(j);  // q in step 0's group

  const UnitDropout<false> dropout(DropoutPass{});
  FlashRows<HDP / 8> rows;  // the warp's 16 rows of o: wgmma's accumulator of o (64, HDP)
  rows.reset();
  float s[BN / 2];
  uint32_t pf[BN / 16][4];  // p's A operand of keys 16 kk .. 16 kk + 15
  const auto sc = [&](int jn, int e) -> float& { return s[4 * jn + e]; };
  // q's A operands, the warp's 16 rows (mma.m16n8k16's A fragment), by ldmatrix from the swizzled
  // rows once a unit: the scores then read only k from shared memory.
  uint32_t qf[HDP / 16][4];
  const auto load_q = [&] {
    const int lane = tid % 32, m = lane / 8, r = 16 * warp + (m % 2) * 8 + lane % 8;
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) {
      const int c = (kk * 32 % Tile::row) / 16 + m / 2;  // the 16-byte piece of the chunk's row
      const int piece = Tile::row == 128 ? c ^ (r % 8) : c ^ ((r / 2) % 4);
      ldmatrix_x4(qf[kk], q_s + (kk * 32 / Tile::row) * Tile::q_chunk + r * Tile::row + (piece << 4));
    }
  };
  const auto scores = [&](int j) {  // s = q k_j^T, issued
    const uint32_t kb = stage(j);
    fence_regs(s);
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) fence_regs(qf[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) {  // 16 features: 32 bytes of a chunk's row
      const uint32_t ka = kb + (kk * 32 / Tile::row) * Tile::kv_chunk + kk * 32 % Tile::row;
      if constexpr (Tile::row == 128)
        wgmma_m64k16_rs<kBf16, BN>(s, qf[kk], desc_sw128(ka), kk > 0);
      else
        wgmma_m64k16_rs<kBf16, BN>(s, qf[kk], desc_sw64(ka), kk > 0);
    }
    wgmma_commit();
  };
  const auto round_p = [&] {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) pf[kk][i] = pack16<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  };

  // Step 0's scores and probabilities.
  copy_async_wait<S - 2>();
  fence_async_smem();
  __syncthreads();
  load_q();
  scores(0);
  wgmma_wait<0>();
  fence_regs(s);
  softmax_tile<NT>(rows, dropout, sc, scale_log2, 0, L, g, t);
  round_p();

  for (int j = 0; j < steps; ++j) {
    copy_async_wait<S - 3>();  // step j + 1's rows in
    fence_async_smem();
    __syncthreads();  // and every warpgroup done with step j - 1's buffer
    copy_step(j + S - 1);
    const bool more = j + 1 < steps;
    scores(j + 1);
    {  // o += p v_j
      const uint32_t vb = stage(j) + Tile::k_bytes;
      fence_regs(rows.o);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) fence_regs(pf[kk]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {  // 16 keys: 16 rows
        const uint32_t va = vb + kk * 16 * Tile::row;
        if constexpr (Tile::row == 128)
          wgmma_m64k16_rs_tb<kBf16, HDP>(rows.o, pf[kk], desc_sw128_mn(va, Tile::kv_chunk), 1);
        else
          wgmma_m64k16_rs_tb<kBf16, HDP>(rows.o, pf[kk], desc_sw64_mn(va), 1);
      }
      wgmma_commit();
    }
    wgmma_wait<1>();  // the scores
    fence_regs(s);
    const float m0 = rows.softmax.m0, m1 = rows.softmax.m1;
    if (more)  // o's rescale waits for p v: no o groups (NF = 0) here
      rows.softmax.template step<NT, 0>(sc, [&](int f, int e) -> float& { return rows.at(f, e); }, scale_log2,
                                        (j + 1) * BN, L, t);
    wgmma_wait<0>();  // p v
    fence_regs(rows.o);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) fence_regs(pf[kk]);
    if (more) {
      const float c0 = exp2f(m0 - rows.softmax.m0), c1 = exp2f(m1 - rows.softmax.m1);
#pragma unroll
      for (int f = 0; f < HDP / 8; ++f) rows.at(f, 0) *= c0, rows.at(f, 1) *= c0, rows.at(f, 2) *= c1, rows.at(f, 3) *= c1;
      round_p();
    }
  }
  // o / l into o and/or o16 rounded, the lse.
  rows.template store_16bit<T>(a, 1.0f, seq, col, u.item, u.q0 + 16 * warp + g, L, hd, t);
#else
  (void)a, (void)qkv, (void)scale_log2, (void)q_tiles;
  __trap();  // built without sm_90a: flash_attention_variant never picks it there
#endif
}

template <class T, int HDP>
cudaError_t launch(const FlashArgs& a, float scale_log2, const DeviceCaps& dev, cudaStream_t stream) {
  using Tile = Qkv16Tile<HDP>;
  constexpr auto kernel = flash_qkv16_kernel<T, HDP>;
  if ((size_t)Tile::bytes > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int q_tiles = (int)((a.pos.len + Tile::BM - 1) / Tile::BM);
  const int64_t blocks = a.pos.num_seq * a.heads * q_tiles;  // flash_attention bounds it by 2^31 - 1
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(Tile::kThreads), Tile::bytes, stream, dev,
                               flash_kernel_args(a), static_cast<const T*>(a.qkv16), scale_log2, q_tiles);
}

}  // namespace

cudaError_t flash_attention_qkv16(const FlashArgs& a, float scale_log2, const DeviceCaps& dev, cudaStream_t stream) {
  if (a.heads <= 0 || a.D % a.heads != 0 || a.qkv16 == nullptr || a.products == Products::kFp32 ||
      a.dropout.threshold != 0)
    return cudaErrorInvalidValue;
  if (a.pos.num_seq <= 0) return a.pos.num_seq == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const int hd = a.D / a.heads;
  if (hd % 8 != 0 || (reinterpret_cast<uintptr_t>(a.qkv16) & 15) != 0) return cudaErrorInvalidValue;
  const int tile_hd = flash_qkv16_tile_head_dim(hd);
  const bool bf16 = a.products == Products::kBf16;
  if (tile_hd == 32)
    return bf16 ? launch<__nv_bfloat16, 32>(a, scale_log2, dev, stream) : launch<__half, 32>(a, scale_log2, dev, stream);
  if (tile_hd == 64)
    return bf16 ? launch<__nv_bfloat16, 64>(a, scale_log2, dev, stream) : launch<__half, 64>(a, scale_log2, dev, stream);
  if (tile_hd == 128)
    return bf16 ? launch<__nv_bfloat16, 128>(a, scale_log2, dev, stream)
                : launch<__half, 128>(a, scale_log2, dev, stream);
  return cudaErrorInvalidValue;
}

}  // namespace fastaxial::cuda
