// Kernel 3 of the attention backward on the tensor cores (attention_backward.cu; the tiles,
// fragments and products: backward_parts.cuh): dq of a block's queries, streaming the key tiles
// in order, either with S = q k^T and dP = d_o v^T recomputed a tile at a time
// (query_grads_kernel) or as one product from kernel 2's dS^T (query_grads_ds_kernel, with the
// two parts only it uses here: dS^T's copy, copy_scores_t, and the product, stored_grad_tiles).
#include <cuda_runtime.h>

#include <cstdint>

#include "backward_launch.cuh"
#include "backward_parts.cuh"
#include "flash_parts.cuh"  // UnitDropout

namespace fastaxial::cuda::attention_backward_detail {
namespace {

using namespace tc;

// dq of one query tile (hp.tile) of one (sequence, head): 16 queries for
// each of the block's blockDim.x / 32 <= QW warps (the launch takes fewer
// for short sequences and small grids); warp w owns queries 16 w .. 16 w +
// 15 of the tile. Shared memory as QTiling lays it out for QW warps.
// T: the tiling, QTc<HDP> or, for sequences of at most kShortGradLen
// positions, QTcShort<HDP>. kDropout: dpass applies (threshold != 0). Elem: the products'
// element traits (backward_parts.cuh).
template <class Elem, class T, bool kVec, bool kDropout>
__global__ void __launch_bounds__(T::threads, T::min_blocks)
    query_grads_kernel(const AttentionBackwardKernelArgs a, float scale, float scale_log2, int query_tiles,
                       const Split sp, const DropoutPass dpass) {
  constexpr int HDP = T::HDP, BN = T::BN, ST = T::ST, LD = T::ld;
  constexpr int NK = BN / 8, NF = HDP / 8;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int threads = blockDim.x, BM = threads / 32 * 16;  // queries a tile
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const Head hp = block_head(a, query_tiles, sp.splits);
  const int q0 = hp.tile * BM, m0 = q0 + 16 * warp;          // the tile's first query, the warp's
  float* const q_sm = sm;                                    // (BM, HDP), then d_o (BM, HDP)
  float* const k_sm = sm + T::k(BM);                         // stage s at + s stage: k (BN, HDP), then v (BN, HDP)
  zero_padding<LD, HDP>(q_sm, 2 * BM, hp.hd, threads);       // q, d_o
  zero_padding<LD, HDP>(k_sm, 2 * ST * BN, hp.hd, threads);  // every stage's k, v

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;
  const float* qg = a.qkv + (int64_t)hp.h * hp.hd;  // head h's q columns; k at + D, v at + 2D
  const auto load_keys = [&](int stage, int k0) {
    float* ks = k_sm + stage * T::stage;
    copy_rows<LD, HDP, kVec>(ks, qg + a.D, W, hp, k0, BN, threads);
    copy_rows<LD, HDP, kVec>(ks + BN * LD, qg + 2 * a.D, W, hp, k0, BN, threads);
  };
  // The key tiles this block streams: all of them, or its split's range.
  const int2 range = split_range((hp.L + BN - 1) / BN, hp.split, sp.splits);
  copy_rows<LD, HDP, kVec>(q_sm, qg, W, hp, q0, BM, threads);
  copy_rows<LD, HDP, kVec>(q_sm + T::d_o(BM), a.d_o + (int64_t)hp.h * hp.hd, a.D, hp, q0, BM, threads);
  load_keys(0, range.x * BN);
  copy_async_commit();

  float hi[2], lo[2], dl[2];  // lse2 and delta of this thread's rows, m0 + g and m0 + g + 8
  query_row_stats(hi, lo, dl, a, hp, m0, g);
  UnitDropout<kDropout> drop(dpass);
  drop.start(dpass, hp.item, m0, hp.L);
  const float* qs = q_sm + 16 * warp * LD;  // the warp's queries (16, HDP)
  const float* dos = q_sm + T::d_o(BM) + 16 * warp * LD;
  const bool active = m0 < hp.L;  // a warp whose queries are all >= L only copies
  float dq[NF][4];
  zero_tiles(dq);
  stream_tiles<ST>(range, [&](int stage, int j) { load_keys(stage, j * BN); }, [&](int j, int st) {
    const float* k = k_sm + st * T::stage;  // k is (BN, HDP), v (BN, HDP) after it
    const float* v = k + BN * LD;
    if (active) {
      const int k0 = j * BN;
      uint32_t keep[NK / 2];  // dropout's keep bits, drawn before s and dp are live
      drop.template keep_bits<NK>(keep, k0, hp.L, g, t);
      float s[NK][4], dp[NK][4];
      score_tiles<Elem, HDP, NK, LD>(s, qs, k, g, t);    // S = q k^T
      score_tiles<Elem, HDP, NK, LD>(dp, dos, v, g, t);  // dP = d_o v^T
      tile_softmax_grad_rows<NK, kDropout>(s, dp, hi, lo, dl, scale_log2, k0, hp.L, t, keep, dpass.scale);
      grad_tiles<Elem, NK, NF, LD>(dq, dp, k, g, t);  // dq += dS k
    }
  });
  if (active) store_query_grads<NF, kVec>(a, sp, hp, dq, scale, m0, g, t);
}

// acc[f] (16 x 8) += dS . rows 0 .. 8 NK - 1, columns 8f .. 8f + 7 of k (rows of LD floats):
// grad_tiles's product and order with dS's A fragments read from dS^T in shared memory (rows
// of LS values of S a key, load_a_cols) instead of a score tile in registers. Rolled beyond HDP 32,
// as in score_tiles: unrolled, the hoisted fragment loads spill next to acc.
template <class Elem, int HDP, int NK, int NF, int LS, int LD, class S>
__device__ __forceinline__ void stored_grad_tiles(float (&acc)[NF][4], const S* dst, const float* k, int g, int t) {
  constexpr int kUnroll = HDP > 32 ? 1 : NK / 2;
#pragma unroll kUnroll
  for (int j = 0; j < NK; j += 2) {
    const typename Elem::FragA a0 = load_a_cols<Elem, LS>(dst + 8 * j * LS, g, t),
                               a1 = load_a_cols<Elem, LS>(dst + 8 * (j + 1) * LS, g, t);
    const float* bj = k + 8 * j * LD;  // rows 8j .. 8j + 15
#pragma unroll
    for (int f = 0; f < NF; ++f)
      Elem::template run<true>(acc[f], a0, load_b_cols<Elem, LD>(bj + 8 * f, g, t), a1,
                               load_b_cols<Elem, LD>(bj + 8 * LD + 8 * f, g, t));
  }
}

// Keys k0 .. k0 + rows - 1 of dS^T (ds: the (sequence, head)'s first row, rows of Lp values of S,
// a column a query), its queries q0 .. q0 + BM - 1, into stage `stage` of sm (STAGE floats apart)
// as (rows, LS) values: 16-byte copies of V values (q0 a multiple of 16), keys and queries >= L as
// zeros. A row's BM / V copies are a power of two (BM = 16 warps, warps 1, 2 or 4), c_shift its
// log2: shifts, not divisions by a runtime value.
template <int LS, int STAGE, class S>
__device__ __forceinline__ void copy_scores_t(float* sm, int stage, const S* ds, int Lp, int L, int k0, int q0,
                                              int rows, int BM, int c_shift, int threads) {
  constexpr int V = 16 / sizeof(S);
  S* dst = reinterpret_cast<S*>(sm + stage * STAGE);
#pragma unroll 1
  for (int e = threadIdx.x; e < rows * (BM / V); e += threads) {
    const int r = e >> c_shift, c = V * (e & (BM / V - 1)), key = k0 + r, q = q0 + c;
    const bool valid = key < L && q < L;
    copy_async16(smem_addr(dst + r * LS + c), valid ? ds + (int64_t)key * Lp + q : ds,
                 valid ? (int)sizeof(S) * min(V, L - q) : 0);
  }
}

// dq of one query tile (hp.tile) of one (sequence, head) from kernel 2's
// dS^T (AttentionBackwardKernelArgs::ds): dq = scale dS k, the products and their order as
// query_grads_kernel's last one. 16 queries for each of the block's
// blockDim.x / 32 <= DsTc::QW warps; key tiles of BN streamed through ST
// stages, each dS^T's (BN keys, the block's queries) piece and k's (BN,
// HDP) rows. No scores, exponentials or mask: dS holds them. Elem: the products' element traits,
// which also give dS^T's stored type (StoredScores).
template <class Elem, int HDP, bool kVec>
__global__ void __launch_bounds__(DsTc<HDP>::threads, DsTc<HDP>::min_blocks)
    query_grads_ds_kernel(const AttentionBackwardKernelArgs a, float scale, int query_tiles, const Split sp) {
  using S = typename StoredScores<Elem>::type;
  using T = DsTc<HDP, sizeof(S)>;
  static_assert(T::threads == DsTc<HDP>::threads && T::min_blocks == DsTc<HDP>::min_blocks, "the launch bounds");
  constexpr int BN = T::BN, LD = T::ld, LS = T::ls;
  constexpr int NK = BN / 8, NF = HDP / 8;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);  // stage s at + s stage: dS^T (BN, LS) S, then k (BN, LD)
  const int threads = blockDim.x, BM = threads / 32 * 16;  // queries a tile
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const Head hp = block_head(a, query_tiles, sp.splits);
  const int q0 = hp.tile * BM, m0 = q0 + 16 * warp;  // the tile's first query, the warp's
#pragma unroll
  for (int st = 0; st < T::ST; ++st) zero_padding<LD, HDP>(sm + st * T::stage + T::ds_floats, BN, hp.hd, threads);

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;
  const int Lp = (int)attention_scores_stride(hp.L, sizeof(S));
  const S* dsg = static_cast<const S*>(a.ds) + hp.item * (int64_t)hp.L * Lp;  // (L, Lp): row key, column query
  const float* kg = a.qkv + a.D + (int64_t)hp.h * hp.hd;                      // head h's k columns
  const int c_shift = 31 - __clz(BM / (16 / (int)sizeof(S)));  // log2 of a dS^T row's 16-byte copies
  const auto load_keys = [&](int stage, int k0) {               // keys k0 .. k0 + BN - 1: dS^T's and k's rows
    float* ss = sm + stage * T::stage;
    copy_scores_t<LS, T::stage>(sm, stage, dsg, Lp, hp.L, k0, q0, BN, BM, c_shift, threads);
    copy_rows<LD, HDP, kVec>(ss + T::ds_floats, kg, W, hp, k0, BN, threads);
  };
  // The key tiles this block streams: all of them, or its split's range.
  const int2 range = split_range((hp.L + BN - 1) / BN, hp.split, sp.splits);
  load_keys(0, range.x * BN);
  copy_async_commit();

  const bool active = m0 < hp.L;  // a warp whose queries are all >= L only copies
  float dq[NF][4];
  zero_tiles(dq);
  for (int j = range.x; j < range.y; ++j) {
    copy_async_wait<0>();
    __syncthreads();  // tile j in, tile j - 1 done (its stage is copied next)
    const int st = (j - range.x) & 1;
    if (j + 1 < range.y) {
      load_keys(st ^ 1, (j + 1) * BN);
      copy_async_commit();
    }
    const S* dst = reinterpret_cast<const S*>(sm + st * T::stage) + 16 * warp;  // the warp's queries of dS^T
    const float* k = sm + st * T::stage + T::ds_floats;
    if (active) stored_grad_tiles<Elem, HDP, NK, NF, LS, LD>(dq, dst, k, g, t);  // dq += dS k
  }
  if (active) store_query_grads<NF, kVec>(a, sp, hp, dq, scale, m0, g, t);
}

}  // namespace

cudaError_t launch_query_grads_tc(const BackwardLaunch& s, const TcBlocks& b, const DeviceCaps& dev,
                                  cudaStream_t stream) {
  // Short sequences take 16 keys a step (QTcShort), where the general step is longer (padded head
  // dims 8 to 96). They never split (plan.cpp: at most one split a streamed tile).
  const bool short_tiles = s.k.pos.len <= kShortGradLen;
  return with_kernel_params(s, [&](auto hdp, auto vec, auto dropout) {
    constexpr int H = decltype(hdp)::value;
    return with_elem(s.products, [&](auto elem) {
      const auto launch = [&](auto tiling) {
        using Q = decltype(tiling);
        return launch_grid<query_grads_kernel<decltype(elem), Q, decltype(vec)::value, decltype(dropout)::value>>(
            s.items * b.tiles * b.sp.splits, 32 * b.warps, Q::bytes(16 * b.warps), dev, stream, s.k, s.scale,
            s.scale * kLog2e, b.tiles, b.sp, s.dpass);
      };
      if constexpr (QTc<H>::BN > QTcShort<H>::BN)
        if (short_tiles) return launch(QTcShort<H>());
      return launch(QTc<H>());
    });
  });
}

// No dropout parameter: dS^T holds the mask.
cudaError_t launch_query_grads_ds(const BackwardLaunch& s, const AttentionBackwardKernelArgs& k, const TcBlocks& b,
                                  const DeviceCaps& dev, cudaStream_t stream) {
  return with_kernel_params(s, [&](auto hdp, auto vec, auto) {
    return with_elem(s.products, [&](auto elem) {
      using Ds = DsTc<decltype(hdp)::value, sizeof(typename StoredScores<decltype(elem)>::type)>;
      return launch_grid<query_grads_ds_kernel<decltype(elem), Ds::HDP, decltype(vec)::value>>(
          s.items * b.tiles * b.sp.splits, 32 * b.warps, Ds::bytes, dev, stream, k, s.scale, b.tiles, b.sp);
    });
  });
}

}  // namespace fastaxial::cuda::attention_backward_detail
