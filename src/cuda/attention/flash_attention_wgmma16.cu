// The flash attention step (flash_attention.h) on 16-bit products (bf16 or
// fp16 operands, fp32 accumulation) on Hopper's warpgroup products (wgmma,
// sm_90a), on tiles of head dim 32 and 128 (padded head dims 32, 96 and
// 128): for each sequence n and head h,
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h
// with the per-row log-sum-exp and attention dropout as the other flash
// kernels compute them (flash_parts.cuh's FlashRows and UnitDropout: the same
// online softmax in fp32, the same mask).
//
// Why a kernel of its own. The mma.sync kernel's 16-bit instance reads q, k
// and v as fp32 from shared memory and rounds each fragment as it makes it,
// in every warp: at head dim 128 it ran at about a tenth of the tensor cores'
// 16-bit rate (perf notes v95). Here k and v are rounded once a step for the
// whole block, into the 16-bit K-major operands that wgmma reads from shared
// memory, while the step before is in the products; q is rounded once a unit
// into registers (the A operand).
//
// Shape of the work: the wide 3xTF32 kernel's (flash_attention_wgmma_wide.cu),
// whose copy pipeline it shares (pipeline_wide.cuh): a block of two
// warpgroups (128 queries, a unit) takes units in turn, one block an SM (two
// at head dim 32), and streams a unit's keys 64 at a time (a step). Step s,
// its operands rounded and visible, the raw stage holding step s + 1's fp32
// rows:
//   1. s (64, 64) = q k^T per warpgroup: HDP / 16 products of 16 features
//      into one accumulator, issued at once;
//   2. while they run, step s + 1's rows rounded into the other buffers
//      (k as rows of keys, v transposed: rows of features);
//   3. barrier; step s + 2's rows (and with a unit's last step, the next
//      unit's q) copied into the free stage and q buffer;
//   4. the online softmax on s in registers (wgmma's accumulator is mma.sync's
//      C layout per warp), dropped p zeroed;
//   5. o (64, HDP) += p v: p rounded from s's registers as the A operand (the
//      accumulator's layout is the 16-deep A fragment's), v^T as B, 4
//      products of 16 keys straight into o's registers;
//   6. wait for the copies; barrier: step s + 2's rows in, step s's buffers free.
//
// Shared memory at head dim 128 (199 KB): k, two buffers of 16 KB (two
// chunks of features, each 64 rows of 128 bytes, the 128-byte swizzle of
// detail/wgmma.cuh); v^T, two buffers of 16 KB (128 rows of the step's 64
// keys); the raw stage, (64, 128) fp32 rows of k then of v at stride 132; q,
// (128, 128) fp32 with q_word's swizzled rows. At head dim 32 a key's k row
// is 64 bytes (the 64-byte swizzle), and two blocks share an SM (52 KB each).
// Positions >= L are zero-filled by the copies and their scores set to -inf;
// columns hd..HDP-1 of q and of the raw stage are zeroed once and never
// copied, so the operands carry zeros there.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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
#include "pipeline_wide.cuh"

namespace fastaxial::cuda {
namespace {

// Sizes and byte offsets of a block's shared memory (see the header comment).
template <int HDP>
struct Wg16Tile {
  static_assert(HDP == 32 || HDP == 128, "head dims 32 (64-byte k rows) and 128 (128-byte chunks)");
  static constexpr int kHdp = HDP;
  static constexpr int BM = 128, BN = 64, kThreads = 256;  // two warpgroups of 64 queries; keys a step
  // Blocks an SM: two at head dim 32 (52 KB of shared memory and at most 128 registers a thread
  // each), so that one block's barriers and copies overlap the other's products.
  static constexpr int kBlocksPerSm = HDP == 32 ? 2 : 1;
  static constexpr int ld = HDP + 4;                       // raw rows: conflict-free transposing reads
  static constexpr int k_row = HDP >= 64 ? 128 : 64;       // bytes of a key's row in a chunk: its swizzle
  static constexpr int chunk = BN * k_row;                 // k's features (k_row / 2) c .. for the step's keys
  static constexpr int k_buf = 2 * HDP * BN;               // a buffer of k (16-bit): HDP / (k_row / 2) chunks
  static constexpr int vt_buf = HDP * 128;                 // a buffer of v^T: a feature's 64 keys a row
  static constexpr int k_off = 0;                          // k, buffer b at + b k_buf
  static constexpr int vt_off = k_off + 2 * k_buf;
  static constexpr int raw_off = vt_off + 2 * vt_buf;      // k's rows, then v's, (BN, HDP) at stride ld
  static constexpr int q_off = raw_off + 2 * BN * ld * 4;  // (BM, HDP), rows swizzled
  static constexpr int bytes = q_off + BM * HDP * 4 + 1024;  // + room to align the base
  static constexpr int quads = BN * HDP / 4 / kThreads;      // k's 4-feature pieces a thread a step
  static constexpr int octets = BN * HDP / 8 / kThreads;     // v's 8-key pieces a thread a step
  static_assert(bytes <= 232448, "an H200 block's shared memory (227 KB)");
  static_assert(BM == kFlashWgmmaQueryTile && (size_t)bytes == flash_wgmma16_smem_bytes(HDP),
                "common/smem_layout.h's sizes");
  static_assert(chunk % 1024 == 0 && vt_buf % 1024 == 0 && q_off % 16 == 0,
                "swizzled operands on 1024-byte boundaries, cp.async rows on 16-byte ones");
  static_assert(quads * 4 * kThreads == BN * HDP && octets * 8 * kThreads == BN * HDP, "whole pieces a thread");
};

#if FASTAXIAL_SM90A_DEVICE
// A step's rounding, raw stage -> operand buffer b, T the 16-bit type:
//   k: piece e = tid + 256 i is key r = e / (HDP / 4), features 4c .. 4c + 3
//      (c = e % (HDP / 4)): one 16-byte read, 8 bytes written into its chunk's
//      row r at the swizzled 16-byte piece: (c / 2) % 8 ^ r % 8 in rows of 128
//      bytes, (c / 2) ^ (r / 2) % 4 in rows of 64 (detail/wgmma.cuh);
//   v: piece e is feature f = e % HDP, keys 8 kg .. 8 kg + 7 (kg = e / HDP):
//      eight 4-byte reads down the raw rows (a warp's 32 features side by
//      side: 32 banks), one 16-byte write into v^T's row f at piece kg ^ f % 8.
template <class Tile, class T>
struct Wg16Split {
  static constexpr int HDP = Tile::kHdp, BN = Tile::BN, LD = Tile::ld, kThreads = Tile::kThreads;
  char* sm;
  const float* raws;
  int tid;

  __device__ __forceinline__ void operator()(int b) const {
    char* kp = sm + Tile::k_off + b * Tile::k_buf;
#pragma unroll
    for (int i = 0; i < Tile::quads; ++i) {
      const int e = tid + kThreads * i;
      const int r = e / (HDP / 4), c = e % (HDP / 4);
      const float4 x = *reinterpret_cast<const float4*>(raws + r * LD + 4 * c);
      constexpr int per_row = Tile::k_row / 8;  // pieces of 4 features a chunk's row
      const int lc = c % per_row;
      const int piece = Tile::k_row == 128 ? ((lc / 2) ^ r) & 7 : ((lc / 2) ^ (r >> 1)) & 3;
      char* at = kp + (c / per_row) * Tile::chunk + r * Tile::k_row + (piece << 4) + (lc % 2) * 8;
      *reinterpret_cast<uint2*>(at) = make_uint2(pack16<T>(x.x, x.y), pack16<T>(x.z, x.w));
    }
    char* vp = sm + Tile::vt_off + b * Tile::vt_buf;
    const float* vr = raws + BN * LD;
#pragma unroll
    for (int i = 0; i < Tile::octets; ++i) {
      const int e = tid + kThreads * i;
      const int f = e % HDP, kg = e / HDP;
      const float* col = vr + 8 * kg * LD + f;
      uint4 w;
      w.x = pack16<T>(col[0], col[LD]);
      w.y = pack16<T>(col[2 * LD], col[3 * LD]);
      w.z = pack16<T>(col[4 * LD], col[5 * LD]);
      w.w = pack16<T>(col[6 * LD], col[7 * LD]);
      *reinterpret_cast<uint4*>(vp + f * 128 + (((kg ^ f) & 7) << 4)) = w;
    }
  }
};

// q's A operands of a warp's 16 rows at qw (q's buffer + 16 warp HDP), rounded to T: for each
// 16-deep step kk, rows g and g + 8 at features 16 kk + 2t (+ 1) and 16 kk + 8 + 2t (+ 1), each
// pair one 8-byte read (q_word's swizzle keeps a pair in one 16-byte piece).
template <class T, int HDP>
__device__ __forceinline__ void load_q16(uint32_t (&qf)[HDP / 16][4], const float* qw, int g, int t) {
#pragma unroll
  for (int kk = 0; kk < HDP / 16; ++kk)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c = (16 * kk + 8 * half + 2 * t) ^ (g << 2);
      const float2 lo = *reinterpret_cast<const float2*>(qw + g * HDP + c);
      const float2 hi = *reinterpret_cast<const float2*>(qw + (g + 8) * HDP + c);
      qf[kk][2 * half] = pack16<T>(lo.x, lo.y);
      qf[kk][2 * half + 1] = pack16<T>(hi.x, hi.y);
    }
}
#endif  // FASTAXIAL_SM90A_DEVICE

// kVec: 16-byte copies. kDropout: dpass applies.
template <class T, int HDP, bool kVec, bool kDropout>
__global__ void __launch_bounds__(256, Wg16Tile<HDP>::kBlocksPerSm)
    flash_wgmma16_kernel(const AttentionKernelArgs a, float scale_log2, int q_tiles, const DropoutPass dpass) {
#if FASTAXIAL_SM90A_DEVICE
  using Tile = Wg16Tile<HDP>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int BM = Tile::BM, BN = Tile::BN, NT = BN / 8;  // key n-tiles
  const int hd = a.D / a.heads, L = (int)a.pos.len;
  const WideSmem<Tile> smem;
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;
  smem.zero_padding(hd, tid);

  grid_dependency_wait();
  allow_dependent_launch();

  const BlockUnits<BM, AttentionKernelArgs> unit_at(a, q_tiles, 1, BN);
  const int64_t my_units = unit_at.count;
  const WidePipeline<Tile, kVec> pipe(a, unit_at, smem.base, L, hd, tid);
  StepCursor copy(unit_at);  // the next step to copy
  const Wg16Split<Tile, T> split{smem.sm, smem.raws, tid};
  pipe.prologue(a, copy, unit_at, split);

  StepCursor step(unit_at);  // the step in the products
  int64_t st = 0;
  UnitDropout<kDropout> dropout(dpass);
  FlashRows<HDP / 8> rows;  // the warp's 16 rows of o: wgmma's accumulator of o (64, HDP)
  const float* qw = smem.qs + 16 * warp * HDP;
  uint32_t qf[HDP / 16][4];
  float s[BN / 2] = {};

  while (true) {
    const bool last = step.last();
    const bool has_next = !last || step.ui + 1 < my_units;  // a step st + 1
    if (step.first()) {
      dropout.start(dpass, step.cur.item, step.cur.q0 + 16 * warp, L);
      rows.reset();
      load_q16<T, HDP>(qf, qw, g, t);
    }
    const int b = (int)(st & 1);

    // s (64, BN) = q k^T; step st + 1's rounding while it runs.
    const uint32_t kb = smem.k_planes(b);
    // The operands' registers settled before the fence (wgmma reads them asynchronously: no write
    // the compiler moved past the fence may reach them), and again after the wait.
    fence_regs(s);
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) fence_regs(qf[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) {
      const uint64_t kd = Tile::k_row == 128 ? desc_sw128(kb + (kk / 4) * Tile::chunk + (kk % 4) * 32)
                                             : desc_sw64(kb + kk * 32);
      wgmma_m64k16_rs<kBf16, BN>(s, qf[kk], kd, kk > 0);
    }
    wgmma_commit();
    if (has_next) split(b ^ 1);
    wgmma_wait<0>();
    fence_regs(s);
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) fence_regs(qf[kk]);
    // Step st + 2's rows and, with a unit's last step, the next unit's q into the free buffers.
    pipe.refill_step(a, copy, unit_at, step);

    // Scores in base 2, keys >= L at -inf, the online softmax; dropped p
    // zeroed after the row sums. Then o (64, HDP) += p v.
    softmax_tile<NT>(rows, dropout, [&](int jn, int e) -> float& { return s[4 * jn + e]; }, scale_log2, step.j * BN, L,
                     g, t);
    uint32_t pf[BN / 16][4];  // p's A operand of keys 16 kk .. 16 kk + 15: key groups 2 kk, 2 kk + 1
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) pf[kk][i] = pack16<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
    const uint32_t vb = smem.vt_planes(b);
    fence_regs(rows.o);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) fence_regs(pf[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_m64k16_rs<kBf16, HDP>(rows.o, pf[kk], desc_sw128(vb + kk * 32), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(rows.o);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) fence_regs(pf[kk]);

    if (last) {  // o / l (times dropout's scale) into o and/or o16 rounded, the lse
      const FlashUnit& u = step.cur;
      const float num = kDropout ? dpass.scale : 1.0f;
      rows.template store_16bit<T>(a, num, u.seq, u.col, u.item, u.q0 + 16 * warp + g, L, hd, t);
    }
    if (!has_next) break;
    pipe.landed();
    ++st;
    step.advance(unit_at, my_units);
  }
#else
  (void)a, (void)scale_log2, (void)q_tiles, (void)dpass;
  __trap();  // built without sm_90a: flash_attention_variant never picks it there
#endif
}

template <class T, int HDP, bool kVec, bool kDropout>
cudaError_t launch(const FlashArgs& a, float scale_log2, const DeviceCaps& dev, cudaStream_t stream) {
  using Tile = Wg16Tile<HDP>;
  constexpr auto kernel = flash_wgmma16_kernel<T, HDP, kVec, kDropout>;
  if ((size_t)Tile::bytes > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int L = (int)a.pos.len;
  const int q_tiles = (L + Tile::BM - 1) / Tile::BM;
  const int64_t units = a.pos.num_seq * a.heads * q_tiles;
  // kBlocksPerSm blocks an SM, taking units in turn.
  const int64_t blocks = std::min<int64_t>(units, (int64_t)std::max(dev.sms, 1) * Tile::kBlocksPerSm);
  const AttentionKernelArgs k = flash_kernel_args(a);
  const DropoutPass dpass = kDropout ? dropout_pass(a.dropout, a.pass, a.philox) : DropoutPass{};
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(Tile::kThreads), Tile::bytes, stream, dev, k, scale_log2,
                               q_tiles, dpass);
}

// The instantiation for a's flags: 16-byte copies (vec), dropout.
template <class T, int HDP>
cudaError_t launch(const FlashArgs& a, bool vec, float scale_log2, const DeviceCaps& dev, cudaStream_t stream) {
  return with_bools(
      [&](auto v, auto d) {
        constexpr bool kDropout = decltype(d)::value;
        if constexpr (kDropout && !kDropoutAvailable)
          return cudaErrorInvalidValue;  // never asked for
        else
          return launch<T, HDP, decltype(v)::value, kDropout>(a, scale_log2, dev, stream);
      },
      vec, kDropoutAvailable && a.dropout.threshold != 0);
}

}  // namespace

cudaError_t flash_attention_wgmma16(const FlashArgs& a, bool vec, float scale_log2, const DeviceCaps& dev,
                                    cudaStream_t stream) {
  if (a.heads <= 0 || a.D % a.heads != 0 || a.products == Products::kFp32) return cudaErrorInvalidValue;
  if (a.pos.num_seq <= 0) return a.pos.num_seq == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const int tile_hd = flash_wgmma16_tile_head_dim(flash_padded_head_dim(a.D / a.heads));
  const bool bf16 = a.products == Products::kBf16;
  if (tile_hd == 32)
    return bf16 ? launch<__nv_bfloat16, 32>(a, vec, scale_log2, dev, stream)
                : launch<__half, 32>(a, vec, scale_log2, dev, stream);
  if (tile_hd == 128)
    return bf16 ? launch<__nv_bfloat16, 128>(a, vec, scale_log2, dev, stream)
                : launch<__half, 128>(a, vec, scale_log2, dev, stream);
  return cudaErrorInvalidValue;
}

}  // namespace fastaxial::cuda
