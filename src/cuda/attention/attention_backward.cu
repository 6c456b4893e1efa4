// The backward of one attention pass, flash-style: for each sequence n and
// head h (q, k, v, o, d_o below are head h's (L, hd) slices of sequence n)
//   S  = scale q k^T              scale = 1 / sqrt(hd)
//   P  = 2^(S log2(e) - lse2)     lse2 from the forward (flash_attention), in
//                                 log2 units as two floats (detail/lse.cuh)
//   dv = P^T d_o
//   dP = d_o v^T
//   dS = P * (dP - delta)         delta = rowsum(d_o * o)
//   dq = scale dS k,  dk = scale dS^T q
// written into the (T, 3D) dqkv rows in qkv's layout. The (L, L) matrices
// never reach memory: P is recomputed from lse, tile by tile.
//
// Three kernels, each a programmatic dependent of the one before:
// 1. delta: a warp per position, its lanes over the row's D floats (reads
//    of consecutive floats), each head's products summed by a segmented
//    scan across the lanes.
// 2. dk, dv: a block per (sequence, head, key tile), keys and values held
//    in shared memory, looping over the query tiles (BM queries) in order.
// 3. dq: a block per (sequence, head, query tile), q and d_o held, looping
//    over the key tiles (BN keys) in order.
// dq could be summed in kernel 2 too, but only with atomics across its key
// blocks, whose order varies from run to run; recomputing S and dP in a
// kernel of its own keeps every output element a sum by one thread in a
// fixed order (queries, or keys, ascending), so the result is bitwise
// reproducible. 7 products of L^2 hd multiply-adds per (sequence, head),
// against 5 with atomics.
//
// Few long sequences (AttentionBackwardArgs::partials; the rule is
// smem_layout.h's attention_grad_splits): kernels 2 and 3 then take S
// blocks a tile, each streaming a contiguous range of the tiles and
// storing partial dk, dv (or dq), and a combine kernel after each adds an
// element's S partials in split order: five kernels, every output element
// still a sum in a fixed order.
//
// Where the caller gives scratch for dS^T (AttentionBackwardArgs::ds; the
// training path's plan does where it stays within a few activations:
// plan.h, attention_scores_bytes), kernel 2 also stores its dS^T tiles and
// kernel 3 is a product from them (query_grads_ds_kernel): dq = scale dS k,
// dS read rather than recomputed, 5 products a (sequence, head) in all. dS
// is the same fixed-order result either way, so dq stays reproducible.
//
// Kernel 3 has a third version on Hopper's wgmma for head dims 17 to 32
// (query_grads_wgmma.cu), which the tensor-core path takes where it applies.
//
// Kernels 2 and 3 come twice: on the tensor cores (mma.sync m16n8k8 with the
// 3xTF32 split, fp32-accurate as the forward; backward_parts.cuh describes
// them) by default, and on plain fp32 FFMA (backward_ffma.cu) where the
// tensor-core tiles do not fit the device's shared memory, or as a test hook
// (AttentionBackwardArgs::ffma).
//
// Files: this one sizes a call's launches and holds the small kernels
// (delta, the split's combine, sequences of one position); backward_dkdv.cu
// and backward_dq.cu the tensor-core kernels 2 and 3, backward_ffma.cu the
// FFMA ones, each with its launch (backward_launch.cuh); backward_parts.cuh
// the device parts they share.
//
// Head dims: templates on a padded head dim HDP (8, 16, 32, 48, 64, 96,
// 128, 192, 256, as the forward's flash kernel); columns hd..HDP-1 are zero
// in shared memory (they add nothing to S or dP; their gradient columns are
// not stored). Global loads are cp.async copies, double-buffered (the next
// tile in flight while this one is computed) where shared memory allows:
// 16 bytes where every head slice is 16-byte aligned (hd % 4 == 0 and
// 16-byte aligned qkv, d_o, dqkv), else 4 bytes an element (hd odd, say).
// Positions >= L are zero-filled by the copies and masked (P = dS = 0), and
// never read or written in global memory.
//
// Attention dropout (a second instantiation of kernels 2 and 3, kDropout):
// the forward's mask M drawn again (common/dropout.h), P -> P M scale for
// dv, and dS = P (dP M scale - delta) (dP = d_o v^T is the gradient of the
// dropped probabilities). On
// the tensor cores each lane draws one run of four elements per 16 x 8
// tile, shared by four lanes (dropout_share16): in kernel 2 (transposed
// scores) runs of 4 keys of one query, in kernel 3 runs of 4 keys of one
// query row, drawn before the tile's scores are live. The FFMA kernels draw
// each element on its own (a Philox call an element: the fallback).
#include "attention_backward.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../../common/smem_layout.h"
#include "../../common/validate.h"  // aligned16
#include "backward_launch.cuh"
#include "backward_parts.cuh"

namespace fastaxial::cuda {
namespace attention_backward_detail {
namespace {

// ---- delta ---------------------------------------------------------------------------------------

constexpr int kDeltaWarps = 8;

// delta[(n heads + h) L + l] = d_o_h . o_h at position l of sequence n: a
// warp per position (grid-stride), its lanes over the row in chunks of 32 W
// floats (W = 4: float4 reads, where every row and head starts 16-byte
// aligned), so a warp reads whole 128-byte lines. A lane's products (W of
// one head) are summed in order, then an inclusive scan across the lanes,
// segmented by head (shuffles in a fixed order: deterministic), leaves each
// head's sum in the lane holding its last element, which writes it; a head
// that runs past a chunk carries its partial sum into the next one's lane 0.
template <bool kVec>
__global__ void __launch_bounds__(32 * kDeltaWarps) delta_kernel(const AttentionBackwardKernelArgs a) {
  grid_dependency_wait();
  allow_dependent_launch();
  constexpr int W = kVec ? 4 : 1;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32, hd = a.D / a.heads;
  const int64_t L = a.pos.len, rows = a.pos.num_seq * L;
  for (int64_t w = (int64_t)blockIdx.x * kDeltaWarps + threadIdx.x / 32; w < rows;
       w += (int64_t)gridDim.x * kDeltaWarps) {
    const int64_t n = w / L, l = w % L;
    const int64_t at = a.pos.offset(n, l) * a.D;
    const float *x = a.d_o + at, *y = a.o + at;
    float carry = 0.0f;  // the sum so far of the head that the last chunk ended inside
    for (int c0 = 0; c0 < a.D; c0 += 32 * W) {
      const int c = c0 + W * lane;  // this lane's first element
      float s = 0.0f;
      int head = a.heads;  // past the row: a segment of its own, never written
      if (c < a.D) {
        if constexpr (kVec) {
          const float4 u = *reinterpret_cast<const float4*>(x + c), v = *reinterpret_cast<const float4*>(y + c);
          s = fmaf(u.w, v.w, fmaf(u.z, v.z, fmaf(u.y, v.y, u.x * v.x)));
        } else {
          s = x[c] * y[c];
        }
        head = c / hd;
      }
      if (lane == 0 && c0 % hd != 0) s = carry + s;  // head `head` began in an earlier chunk
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const float up = __shfl_up_sync(kAll, s, d);
        const int up_head = __shfl_up_sync(kAll, head, d);
        if (lane >= d && up_head == head) s += up;
      }
      if (c < a.D && (c + W) % hd == 0) a.delta[(n * a.heads + head) * L + l] = s;  // the head's last element
      carry = __shfl_sync(kAll, s, 31);
    }
  }
}

// ---- the split's combine -----------------------------------------------------------------------

// After a split launch of kernel 2 (parts 2, first part 1: dk, dv) or 3 (parts 1, first part 0:
// dq): each element of dqkv they own is the sum of its sp.splits partials (Split), added in split
// order. A thread an element (grid-stride), consecutive threads along a partial row's parts hd
// columns, so the partials are read coalesced. The partials number fewer than 2^31 floats
// (launch_tc splits only then): int indices.
__global__ void __launch_bounds__(256)
    combine_kernel(const AttentionBackwardKernelArgs a, const Split sp, int parts, int first_part) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int hd = a.D / a.heads, L = (int)a.pos.len, w = parts * hd;
  const int total = (int)(a.pos.num_seq * a.heads) * L * w;  // one split's floats
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
    float x = sp.partials[e];
    for (int s = 1; s < sp.splits; ++s) x += sp.partials[(int64_t)s * total + e];
    const int r = e / w, c = e % w;  // partial row r = item L + l, column c
    const int item = r / L, l = r % L, part = first_part + c / hd;
    const int64_t row = a.pos.offset(item / a.heads, l);
    a.dqkv[row * 3 * a.D + (int64_t)part * a.D + (int64_t)(item % a.heads) * hd + c % hd] = x;
  }
}

// ---- sequences of one position -----------------------------------------------------------------

// Sequences of one position: the softmax over one key is 1 whatever the
// score, so dS = P o (dP - rowsum(d_o o o)) = 0 exactly (o = v f, dP = d_o . v
// f, f the keep mask's scale or 0): dq = dk = 0 and dv = d_o f. A warp per
// item (n heads + h), lanes over its columns; the tiled kernels would run
// all their products on 1-row tiles (the column pass of a (B, 1, W) grid).
// Where dS^T scratch is given, its one element a row is stored (0), as the
// tiled kernels store theirs.
constexpr int kSingleKeyThreads = 256;

template <bool kDropout>
__global__ void __launch_bounds__(kSingleKeyThreads)
    single_key_backward_kernel(const AttentionBackwardKernelArgs a, const DropoutPass dpass) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int hd = a.D / a.heads, lane = threadIdx.x % 32;
  const int64_t item = (int64_t)blockIdx.x * (kSingleKeyThreads / 32) + threadIdx.x / 32;
  if (item >= a.pos.num_seq * a.heads) return;
  const int h = (int)(item % a.heads);
  const int64_t row = a.pos.offset(item / a.heads, 0);
  const float* d_o = a.d_o + row * a.D + (int64_t)h * hd;
  float* dq = a.dqkv + row * 3 * a.D + (int64_t)h * hd;  // dk at + D, dv at + 2D
  float f = 1.0f;
  if constexpr (kDropout) f = dropout_keep(dropout_read(dpass), dpass.base + (uint64_t)item) ? dpass.scale : 0.0f;
  for (int c = lane; c < hd; c += 32) {
    dq[c] = 0.0f;
    dq[a.D + c] = 0.0f;
    dq[2 * a.D + c] = d_o[c] * f;
  }
  // dS^T's one value (zero): a row of 16 bytes whether the values are floats or 16-bit, and zero
  // bits are 0 in every type.
  static_assert(attention_scores_stride(1, 4) * 4 == 16 && attention_scores_stride(1, 2) * 2 == 16, "16-byte rows");
  if (a.ds && lane == 0) static_cast<uint32_t*>(a.ds)[item * 4] = 0u;
}

// A template so that a build without Random123 never instantiates the dropout kernel.
template <typename = void>
cudaError_t launch_single_key(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  const AttentionBackwardKernelArgs k = {a.pos, a.qkv, a.o, a.d_o, a.lse, a.delta, a.dqkv, a.D, a.heads, a.ds};
  const int64_t items = a.pos.num_seq * a.heads;
  const int64_t blocks = (items + kSingleKeyThreads / 32 - 1) / (kSingleKeyThreads / 32);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)blocks);
  if constexpr (kDropoutAvailable)
    if (a.dropout.threshold != 0)
      return launch_kernel<single_key_backward_kernel<true>>(grid, dim3(kSingleKeyThreads), 0, stream, dev, k,
                                                             dropout_pass(a.dropout, a.pass, a.philox));
  return launch_kernel<single_key_backward_kernel<false>>(grid, dim3(kSingleKeyThreads), 0, stream, dev, k,
                                                          DropoutPass{});
}

// ---- sizing the launches -----------------------------------------------------------------------

// Warps along a tensor-core kernel's block rows (16 rows each), at most
// `most`: halved while half of them would still cover the sequence (no
// warp without rows), then while the grid (items x tiles) would not cover
// the device twice over (small blocks spread a small problem over more
// multiprocessors; each re-reads the streamed side, from L2).
int tc_row_warps(int most, int64_t L, int64_t items, int sms) {
  int w = most;
  while (w > 1 && 16 * (w / 2) >= L) w /= 2;
  while (w > 1 && items * ((L + 16 * w - 1) / (16 * w)) < 2 * (int64_t)sms) w /= 2;
  return w;
}

// combine_kernel after a split launch: enough blocks to cover the device a few times, grid-stride.
cudaError_t launch_combine(const AttentionBackwardKernelArgs& k, const Split& sp, int parts, int first_part,
                           const DeviceCaps& dev, cudaStream_t stream) {
  const int64_t floats = k.pos.num_seq * k.heads * k.pos.len * parts * (k.D / k.heads);
  const int64_t blocks = std::min<int64_t>((floats + 255) / 256, 8 * (int64_t)dev.sms);
  return launch_kernel<combine_kernel>(dim3((unsigned)blocks), dim3(256), 0, stream, dev, k, sp, parts, first_part);
}

// dk, dv then dq on the tensor cores for padded head dim HDP, as the variant v says; split over
// v.splits blocks a tile, with a combine after each side, where more than one.
template <int HDP>
cudaError_t launch_tc(const AttentionBackwardArgs& a, const AttentionGradVariant& v, const BackwardLaunch& s,
                      const DeviceCaps& dev, cudaStream_t stream) {
  using Kv = tc::KvTc<HDP>;
  using Q = tc::QTc<HDP>;
  using Ds = tc::DsTc<HDP>;
  const int64_t L = a.pos.len;
  const Split sp = {a.partials, v.splits};
  const bool split = sp.splits > 1;
  // A split launch keeps the largest blocks (the split gives the device its blocks), else
  // small problems take smaller ones (tc_row_warps).
  const int key_warps = split ? Kv::KW : tc_row_warps(Kv::KW, L, s.items, dev.sms),
            query_warps = split ? Q::QW : tc_row_warps(Q::QW, L, s.items, dev.sms);
  int key_tiles, query_tiles;
  if (!tile_counts(a.pos.num_seq, a.heads * sp.splits, L, 16 * key_warps, 16 * query_warps, &key_tiles,
                   &query_tiles))
    return cudaErrorInvalidValue;
  if (cudaError_t e = launch_delta(a, s, dev, stream); e != cudaSuccess) return e;
  // dq from kernel 2's dS^T, which kernel 2 stores where the variant says so.
  AttentionBackwardKernelArgs k = s.k;
  k.ds = v.dq == QueryGradKernel::kFromScores ? a.ds : nullptr;
  if (cudaError_t e = launch_key_grads_tc(s, k, {key_warps, key_tiles, sp}, dev, stream); e != cudaSuccess) return e;
  if (split)
    if (cudaError_t e = launch_combine(k, sp, 2, 1, dev, stream); e != cudaSuccess) return e;
  cudaError_t e;
  if (k.ds != nullptr) {
    const int ds_warps = split ? Ds::QW : tc_row_warps(Ds::QW, L, s.items, dev.sms);
    const int ds_tiles = (int)((L + 16 * ds_warps - 1) / (16 * ds_warps));  // <= query_tiles: tile_counts bounds it
    e = launch_query_grads_ds(s, k, {ds_warps, ds_tiles, sp}, dev, stream);
  } else if (HDP == 32 && v.dq == QueryGradKernel::kWgmma) {  // never with a split
    e = query_grads_wgmma(a, s.vec, s.scale, s.dpass, dev, stream);
  } else {
    e = launch_query_grads_tc(s, {query_warps, query_tiles, sp}, dev, stream);
  }
  if (e != cudaSuccess || !split) return e;
  return launch_combine(k, sp, 1, 0, dev, stream);
}

// The three launches for padded head dim HDP on the variant's path.
template <int HDP>
cudaError_t launch_backward(const AttentionBackwardArgs& a, const AttentionGradVariant& v, const DeviceCaps& dev,
                            cudaStream_t stream) {
  static_assert(attention_grad_tiles(HDP).kw > 0, "a tiling for HDP");
  const bool ffma = v.kernel == AttentionGradKernel::kFfma;
  if (ffma && ffma_smem_bytes(HDP) > (size_t)std::max(dev.smem_optin, 0)) return cudaErrorInvalidConfiguration;
  BackwardLaunch s;
  s.items = a.pos.num_seq * a.heads;
  s.hd = a.D / a.heads;
  s.hdp = HDP;
  // 16-byte copies and stores where every head slice of every row starts
  // 16-byte aligned: hd % 4 == 0 makes D % 4 == 0 too.
  s.vec = s.hd % 4 == 0 && aligned16(a.qkv) && aligned16(a.d_o) && aligned16(a.dqkv);
  s.dropout = kDropoutAvailable && a.dropout.threshold != 0;
  s.scale = 1.0f / sqrtf((float)s.hd);
  s.products = a.products;
  s.k = {a.pos, a.qkv, a.o, a.d_o, a.lse, a.delta, a.dqkv, a.D, a.heads, nullptr};
  if (s.dropout) s.dpass = dropout_pass(a.dropout, a.pass, a.philox);
  return ffma ? launch_ffma(a, s, dev, stream) : launch_tc<HDP>(a, v, s, dev, stream);
}

}  // namespace

bool tile_counts(int64_t num_seq, int64_t heads, int64_t L, int key_rows, int query_rows, int* key_tiles,
                 int* query_tiles) {
  *key_tiles = (int)((L + key_rows - 1) / key_rows);
  *query_tiles = (int)((L + query_rows - 1) / query_rows);
  return num_seq <= INT32_MAX / ((int64_t)heads * std::max(*key_tiles, *query_tiles));
}

// A warp a position: enough blocks to fill the device a few times over, grid-stride beyond.
cudaError_t launch_delta(const AttentionBackwardArgs& a, const BackwardLaunch& s, const DeviceCaps& dev,
                         cudaStream_t stream) {
  const int64_t rows = a.pos.num_seq * a.pos.len;
  const int64_t blocks = std::min<int64_t>((rows + kDeltaWarps - 1) / kDeltaWarps, 1 << 20);
  // float4 reads where every row of d_o and o starts 16-byte aligned and
  // heads start at multiples of 4 floats.
  const bool vec = s.hd % 4 == 0 && aligned16(a.d_o) && aligned16(a.o);
  return with_bools(
      [&](auto v) {
        return launch_kernel<delta_kernel<decltype(v)::value>>(dim3((unsigned)blocks), dim3(32 * kDeltaWarps), 0,
                                                               stream, dev, s.k);
      },
      vec);
}

}  // namespace attention_backward_detail

using namespace attention_backward_detail;

constexpr int kMaxLen = 1 << 30;  // L below this: positions and tile arithmetic in int

AttentionGradVariant attention_backward_variant(const AttentionBackwardArgs& a, const DeviceCaps& dev) {
  if (a.heads <= 0 || a.D <= 0 || a.D % a.heads != 0 || a.pos.len >= kMaxLen) return {};
  DeviceCaps d = dev;
#if !defined(FASTAXIAL_WGMMA)
  d.sm90a = false;  // no sm_90a code in this build: the wgmma kernel's body is a trap
#endif
  AttentionGradProblem g;
  g.num_seq = a.pos.num_seq, g.len = a.pos.len, g.head_dim = a.D / a.heads, g.heads = a.heads;
  g.scores = a.ds != nullptr;
  // The partials take float2 stores (16-byte aligned, as the plan's regions are).
  g.partials = a.partials != nullptr && reinterpret_cast<uintptr_t>(a.partials) % 16 == 0;
  g.partials_bytes = a.partials_bytes, g.splits = a.splits, g.ffma = a.ffma, g.mma_sync = a.mma_sync;
  g.products = a.products;
  return attention_grad_variant(g, d);
}

int attention_backward_splits(const AttentionBackwardArgs& a, const DeviceCaps& dev) {
  return attention_backward_variant(a, dev).splits;
}

bool query_grads_wgmma_can_run(const AttentionBackwardArgs& a, const DeviceCaps& dev) {
  AttentionBackwardArgs without_scores = a;
  without_scores.ds = nullptr;
  return attention_backward_variant(without_scores, dev).dq == QueryGradKernel::kWgmma;
}

size_t attention_backward_smem_bytes(int64_t head_dim, bool ffma) {
  const int hdp = flash_padded_head_dim(head_dim);
  return ffma ? ffma_smem_bytes(hdp) : attention_grad_smem_bytes(hdp);
}

cudaError_t attention_backward(const AttentionBackwardArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  if (a.heads <= 0 || a.D <= 0 || a.D % a.heads != 0 || a.pos.num_seq < 0 || a.pos.len < 0 || a.pos.len >= kMaxLen)
    return cudaErrorInvalidValue;
  const int hdp = flash_padded_head_dim(a.D / a.heads);
  if (hdp == 0 || !dropout_pass_args_ok(a.dropout, a.pass, a.philox, a.pos.len, a.heads)) return cudaErrorInvalidValue;
  if (a.pos.num_seq == 0 || a.pos.len == 0) return cudaSuccess;
  const AttentionGradVariant v = attention_backward_variant(a, dev);
  if (v.kernel == AttentionGradKernel::kNone) return cudaErrorInvalidValue;  // 16-bit products beyond the tc kernels
  if (v.kernel == AttentionGradKernel::kSingleKey) return launch_single_key(a, dev, stream);
  return with_padded_head_dim(
      hdp, [&](auto h) { return launch_backward<decltype(h)::value>(a, v, dev, stream); }, cudaErrorInvalidValue);
}

}  // namespace fastaxial::cuda
