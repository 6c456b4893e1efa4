// Kernel 2 of the attention backward on the tensor cores (attention_backward.cu; the tiles,
// fragments and products: backward_parts.cuh): dk and dv of a block's keys, streaming the
// query tiles in order, S^T = k q^T and dP^T = v d_o^T recomputed a tile at a time and P^T,
// dS^T kept in the score products' registers; where kernel 3 reads it, dS^T also goes to the
// scratch (AttentionBackwardArgs::ds).
#include <cuda_runtime.h>

#include <cstdint>

#include "backward_launch.cuh"
#include "backward_parts.cuh"

namespace fastaxial::cuda::attention_backward_detail {
namespace {

using namespace tc;

// scale dk and dv of a warp's 16 keys from key0, features f0 + 8f + 2t, + 1, into the split's
// partials (dk, then dv, a row) or into head hp.h's k and v columns of dqkv.
template <int NF, bool kVec>
__device__ __forceinline__ void store_key_grads(const AttentionBackwardKernelArgs& a, const Split& sp, const Head& hp,
                                                const float (&dk)[NF][4], const float (&dv)[NF][4], float scale,
                                                int key0, int f0, int g, int t) {
  if (sp.splits > 1) {
    const Head pr = partial_rows(hp, a.pos.num_seq * a.heads);
    store_tiles<NF, kVec>(sp.partials, dk, scale, 2 * hp.hd, pr, key0, f0, g, t);
    store_tiles<NF, kVec>(sp.partials + hp.hd, dv, 1.0f, 2 * hp.hd, pr, key0, f0, g, t);
    return;
  }
  const int64_t W = 3 * (int64_t)a.D;           // floats a row of dqkv
  float* out = a.dqkv + (int64_t)hp.h * hp.hd;  // head h's dq columns; dk at + D, dv at + 2D
  store_tiles<NF, kVec>(out + a.D, dk, scale, W, hp, key0, f0, g, t);
  store_tiles<NF, kVec>(out + 2 * a.D, dv, 1.0f, W, hp, key0, f0, g, t);
}

// dk and dv of one key tile (hp.tile) of one (sequence, head): 16 keys for
// each of the block's blockDim.x / (32 FW) <= KW key groups (the launch
// takes fewer for short sequences and small grids); warp w owns keys
// 16 (w / FW) .. + 15 of the tile and features FP (w % FW) .. + FP - 1 of
// their gradients. Shared memory as KvTiling lays it out for KW groups.
// T: the tiling, KvTc<HDP> or, for sequences of at most kShortGradLen
// positions, KvTcShort<HDP>. kDropout: dpass applies (threshold != 0). Elem: the products'
// element traits (backward_parts.cuh).
template <class Elem, class T, bool kVec, bool kDropout>
__global__ void __launch_bounds__(T::threads, T::min_blocks)
    key_grads_kernel(const AttentionBackwardKernelArgs a, float scale, float scale_log2, int key_tiles, const Split sp,
                     const DropoutPass dpass) {
  constexpr int HDP = T::HDP, BM = T::BM, ST = T::ST, LD = T::ld;
  constexpr int NQ = BM / 8, NF = T::FP / 8;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int threads = blockDim.x, BN = threads / (32 * T::FW) * 16;  // keys a tile
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int kw = warp / T::FW, f0 = (warp % T::FW) * T::FP;
  const Head hp = block_head(a, key_tiles, sp.splits);
  using S = typename StoredScores<Elem>::type;               // dS^T's stored type, where stored
  const int Lp = (int)attention_scores_stride(hp.L, sizeof(S));  // its row stride
  const int k0 = hp.tile * BN, key0 = k0 + 16 * kw;          // the tile's first key, the warp's
  float* const k_sm = sm;                                    // (BN, HDP), then v (BN, HDP)
  float* const q_sm = sm + T::q(BN);                         // stage s at + s stage: q (BM, HDP), then d_o (BM, HDP)
  float* const vec_sm = sm + T::vec(BN);                     // stage s at + 3 BM s: lse hi, lo, delta (BM each)
  zero_padding<LD, HDP>(k_sm, 2 * BN, hp.hd, threads);       // k, v
  zero_padding<LD, HDP>(q_sm, 2 * ST * BM, hp.hd, threads);  // every stage's q, d_o

  grid_dependency_wait();
  allow_dependent_launch();

  const int64_t W = 3 * (int64_t)a.D;  // floats a row of qkv and dqkv
  const KeySideSlices in = key_side_slices(a, hp);
  const KeyDropout<kDropout> drop(dpass, hp.item, key0, hp.L);
  const auto load_queries = [&](int stage, int i) {  // query tile i: q, d_o, lse hi, lo, delta
    const int q0 = i * BM;
    float* qs = q_sm + stage * T::stage;
    float* vs = vec_sm + stage * 3 * BM;
    copy_rows<LD, HDP, kVec>(qs, in.q, W, hp, q0, BM, threads);
    copy_rows<LD, HDP, kVec>(qs + BM * LD, in.d_o, a.D, hp, q0, BM, threads);
    copy_positions(vs, in.lse, q0, BM, hp.L, threads);
    copy_positions(vs + BM, in.lse_lo, q0, BM, hp.L, threads);
    copy_positions(vs + 2 * BM, in.delta, q0, BM, hp.L, threads);
  };
  // The query tiles this block streams: all of them, or its split's range.
  const int2 range = split_range((hp.L + BM - 1) / BM, hp.split, sp.splits);
  copy_key_rows<LD, HDP, kVec>(k_sm, in.q, W, a.D, hp, k0, BN, threads);
  load_queries(0, range.x);
  copy_async_commit();

  const float* ks = k_sm + 16 * kw * LD;  // the warp's keys (16, HDP)
  const float* vs = k_sm + T::v(BN) + 16 * kw * LD;
  const bool active = key0 < hp.L;  // a warp whose keys are all >= L only copies
  float dk[NF][4], dv[NF][4];
  zero_tiles(dk);
  zero_tiles(dv);
  stream_tiles<ST>(range, load_queries, [&](int i, int st) {
    const float* q = q_sm + st * T::stage;  // q is (BM, HDP), d_o (BM, HDP) after it
    const float* d_o = q + BM * LD;
    const float* lse_s = vec_sm + st * 3 * BM;  // hi, then lo, then delta
    if (!active) return;
    const int q0 = i * BM;
    uint32_t keep[NQ / 2];
    drop.template keep_bits<NQ>(keep, q0, hp.L, g, t);
    float s[NQ][4], dp[NQ][4];
    score_tiles<Elem, HDP, NQ, LD>(s, ks, q, g, t);     // S^T = k q^T
    score_tiles<Elem, HDP, NQ, LD>(dp, vs, d_o, g, t);  // dP^T = v d_o^T
    tile_softmax_grad_cols<NQ, kDropout>(s, dp, lse_s, lse_s + BM, lse_s + 2 * BM,
                                         scale_log2, key0, q0, hp.L, g, t, keep, dpass.scale);
    // dS^T for kernel 3 where it reads it (one warp of the FW that share these keys).
    if (a.ds != nullptr && f0 == 0)
      store_scores_t<NQ>(static_cast<S*>(a.ds) + hp.item * (int64_t)hp.L * Lp, dp, hp.L, Lp, key0, q0, g, t);
    grad_tiles<Elem, NQ, NF, LD>(dv, s, d_o + f0, g, t);  // dv += P^T d_o
    grad_tiles<Elem, NQ, NF, LD>(dk, dp, q + f0, g, t);   // dk += dS^T q
  });
  if (active) store_key_grads<NF, kVec>(a, sp, hp, dk, dv, scale, key0, f0, g, t);
}

}  // namespace

cudaError_t launch_key_grads_tc(const BackwardLaunch& s, const AttentionBackwardKernelArgs& k, const TcBlocks& b,
                                const DeviceCaps& dev, cudaStream_t stream) {
  // Short sequences stream 16 queries a step (KvTcShort), where the general step is longer (padded
  // head dims 8 to 32). They never split (plan.cpp: at most one split a streamed tile).
  const bool short_tiles = s.k.pos.len <= kShortGradLen;
  return with_kernel_params(s, [&](auto hdp, auto vec, auto dropout) {
    constexpr int H = decltype(hdp)::value;
    return with_elem(s.products, [&](auto elem) {
      const auto launch = [&](auto tiling) {
        using Kv = decltype(tiling);
        return launch_grid<key_grads_kernel<decltype(elem), Kv, decltype(vec)::value, decltype(dropout)::value>>(
            s.items * b.tiles * b.sp.splits, 32 * Kv::FW * b.warps, Kv::bytes(16 * b.warps), dev, stream, k, s.scale,
            s.scale * kLog2e, b.tiles, b.sp, s.dpass);
      };
      if constexpr (KvTc<H>::BM > KvTcShort<H>::BM)
        if (short_tiles) return launch(KvTcShort<H>());
      return launch(KvTc<H>());
    });
  });
}

}  // namespace fastaxial::cuda::attention_backward_detail
