// The staged pass's whole-sequence attention kernel (pass.h: step 3), for
// the passes whose sequences its shared memory holds (the plan decides, and
// gives the others to the flash kernel): for every sequence n and head h,
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h              (T, D)
// from the (T, 3D) qkv rows that the QKV product wrote, on the tensor cores
// with the 3xTF32 split.
//
// The kernel works on one (sequence, head) item at a time: the head's keys
// and values of the whole sequence are split into shared memory once (keys
// (Lp, hd), values transposed (hd, Lp), Lp = L rounded up to 16), and each
// warp owns 16 queries at a time, going over the keys 32 (hd 32) or 64 at a
// time with an online softmax (running max and sum per row), scores in
// registers and P fed to P @ V from the score registers as in the fused
// kernel. Its blocks stay resident and loop over items; where shared memory
// holds a raw copy beside the split one, the next item's keys and values
// arrive by cp.async while the current item computes (a block that fetched
// them only when it started would leave the SM idle for that global-memory
// round trip, all its warps waiting at the barrier).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../../common/plan.h"
#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/kernel_args.h"
#include "../detail/launch.cuh"
#include "../detail/host.h"  // with_int
#include "../detail/tf32x3.cuh"
#include "whole_sequence.h"

namespace fastaxial::cuda {
namespace {

struct AttnArgs {
  AxisView pos;  // sequence n, position l -> row of qkv and o
  int D, heads;
  float scale_log2;  // log2(e) / sqrt(hd)
  const float* qkv;  // (T, 3D): [q | k | v], heads side by side in each
  float* o;          // (T, D)
};

template <int HD>
constexpr int max_warps() {
  return HD >= 64 ? 8 : 16;  // 64: q fragments alone take 64 registers
}

// What the attention kernel's steps read, computed once at the kernel's top.
// The warp's next query tile, raw, is not a member: it is carried in
// registers from one tile (and item) to the next, and the steps that load
// and split it take it as an argument (a member array indexed in unrolled
// loops would keep the whole object out of registers until unrolling, and
// with it these values' 32-bit arithmetic).
template <int HD, bool kPrefetch>
struct StagedAttention {
  static constexpr int KS = HD / 8;                                 // 8-feature steps of a head
  static constexpr int kLdk = StagedAttentionLayout(16, HD).ldk;    // rows of split pairs (common/smem_layout.h)
  static constexpr int kChunk = HD == 32 ? 4 : 8;  // 8-key groups per online-softmax step (fewer: 128 registers at 16 warps)

  const AttnArgs& a;
  int L, Lp, ldv;
  int64_t items;      // (sequence, head) pairs; gridDim.x <= items
  int64_t row_words;  // floats in a row of qkv
  float* ks;          // (Lp, kLdk) keys of this head, split pairs
  float* vt;          // (HD, ldv) values, transposed, split pairs
  float4* raw;        // kPrefetch: next item's keys, then values, (Lp, HD) each
  int warp, warps, g, t;
  int elems;  // float4s of keys (and of values)

  __device__ __forceinline__ explicit StagedAttention(const AttnArgs& a_) : a(a_) {
    L = (int)a.pos.len, Lp = (L + 15) / 16 * 16, ldv = StagedAttentionLayout(Lp, HD).ldv;
    items = a.pos.num_seq * a.heads;
    row_words = 3 * (int64_t)a.D;
    extern __shared__ float4 smem4[];
    ks = reinterpret_cast<float*>(smem4);
    vt = ks + Lp * kLdk;
    raw = reinterpret_cast<float4*>(vt + HD * ldv);
    warp = threadIdx.x / 32, warps = blockDim.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    elems = Lp * (HD / 4);
  }

  // Row of position l of the sequence whose first row is seq (offset()
  // divides by the batch's sequence count, a 64-bit division: once per item,
  // not per row).
  __device__ __forceinline__ int64_t row(int64_t seq, int l) const { return seq + l * a.pos.pos_stride; }

  __device__ __forceinline__ void locate(int64_t item, int64_t& seq, int& hc) const {
    seq = a.pos.offset(item / a.heads, 0);
    hc = (int)(item % a.heads) * HD;
  }

  // Query fragments of the 16-row tile at r0, k permuted as the split keys
  // (detail/tf32x3.cuh): this thread holds features 2t, 2t + 1 of each 8 for rows
  // r0 + g and r0 + g + 8. The softmax scale, times log2(e), is applied to q
  // when it is split, once, rather than to each score: scores come out in
  // base 2 for exp2f. Raw values: the split waits until they are used.
  __device__ __forceinline__ void load_q(float2 (&qr)[KS][2], int r0, int64_t seq, int hc) const {
    const bool in0 = r0 + g < L, in1 = r0 + g + 8 < L;
    const float* q0 = a.qkv + (in0 ? row(seq, r0 + g) * row_words : 0) + hc + 2 * t;
    const float* q1 = a.qkv + (in1 ? row(seq, r0 + g + 8) * row_words : 0) + hc + 2 * t;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      qr[s][0] = in0 ? *reinterpret_cast<const float2*>(q0 + 8 * s) : make_float2(0.0f, 0.0f);
      qr[s][1] = in1 ? *reinterpret_cast<const float2*>(q1 + 8 * s) : make_float2(0.0f, 0.0f);
    }
  }

  // The keys and values of an item into raw by cp.async (kPrefetch), to
  // arrive while the block computes the item before it.
  __device__ __forceinline__ void fetch(int64_t seq, int hc) const {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(raw);
    for (int e = threadIdx.x; e < elems; e += blockDim.x) {
      const int l = e / (HD / 4), f = 4 * (e % (HD / 4));
      const bool valid = l < L;
      const float* kv_row = a.qkv + (valid ? row(seq, l) * row_words : 0) + hc + f;
      copy_async16(dst + 16 * e, kv_row + a.D, valid ? 16 : 0);
      copy_async16(dst + 16 * (elems + e), kv_row + 2 * a.D, valid ? 16 : 0);
    }
  }

  // Keys and values of the item at (seq, hc) split into ks and vt, from raw
  // (kPrefetch) or from memory. Positions >= L are zero (and masked below). A
  // thread's global loads go out four at a time before any of them is split
  // and stored: with one block an SM at L = 256 nothing else hides their
  // latency.
  __device__ __forceinline__ void fill(int64_t seq, int hc) const {
    constexpr int kBatch = 4;
    for (int e0 = threadIdx.x; e0 < elems; e0 += kBatch * blockDim.x) {
      float4 kv[kBatch], vv[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * blockDim.x, l = e / (HD / 4), f = 4 * (e % (HD / 4));
        kv[u] = vv[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if constexpr (kPrefetch) {
          if (e < elems) kv[u] = raw[e], vv[u] = raw[elems + e];
        } else if (e < elems && l < L) {
          const float* kv_row = a.qkv + row(seq, l) * row_words + hc + f;
          kv[u] = *reinterpret_cast<const float4*>(kv_row + a.D);
          vv[u] = *reinterpret_cast<const float4*>(kv_row + 2 * a.D);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * blockDim.x, l = e / (HD / 4), f = 4 * (e % (HD / 4));
        if (e >= elems) break;
        *reinterpret_cast<float4*>(ks + l * kLdk + 2 * f) = split_pairs(kv[u].x, kv[u].y);
        *reinterpret_cast<float4*>(ks + l * kLdk + 2 * f + 4) = split_pairs(kv[u].z, kv[u].w);
        *reinterpret_cast<float2*>(vt + (f + 0) * ldv + 2 * l) = split_pair(vv[u].x);
        *reinterpret_cast<float2*>(vt + (f + 1) * ldv + 2 * l) = split_pair(vv[u].y);
        *reinterpret_cast<float2*>(vt + (f + 2) * ldv + 2 * l) = split_pair(vv[u].z);
        *reinterpret_cast<float2*>(vt + (f + 3) * ldv + 2 * l) = split_pair(vv[u].w);
      }
    }
  }

  // qr, scaled, split into A fragments.
  __device__ __forceinline__ void split_queries(FragA (&qa)[KS], const float2 (&qr)[KS][2]) const {
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      split(qr[s][0].x * a.scale_log2, qa[s].hi[0], qa[s].lo[0]);
      split(qr[s][1].x * a.scale_log2, qa[s].hi[1], qa[s].lo[1]);
      split(qr[s][0].y * a.scale_log2, qa[s].hi[2], qa[s].lo[2]);
      split(qr[s][1].y * a.scale_log2, qa[s].hi[3], qa[s].lo[3]);
    }
  }

  // s (16, 8 kChunk) = q k^T for keys c0 ..; this thread: keys c0 + 8j + 2t
  // (+1), keys >= L masked. cm0, cm1: this thread's max of rows g, g + 8.
  __device__ __forceinline__ void chunk_scores(float (&s)[kChunk][4], const FragA (&qa)[KS], int c0, float& cm0,
                                               float& cm1) const {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
      const int key0 = c0 + 8 * j;
      if (key0 < Lp) {
        const float* kj = ks + key0 * kLdk;
        if constexpr (KS == 1) {
          mma_3xtf32(s[j], qa[0], load_bt_split(kj, kLdk));
        } else {  // runs of two steps per fresh accumulator (detail/tf32x3.cuh)
#pragma unroll
          for (int kk = 0; kk < KS; kk += 2)
            mma_3xtf32_x2(s[j], qa[kk], load_bt_split(kj + 16 * kk, kLdk), qa[kk + 1],
                          load_bt_split(kj + 16 * kk + 16, kLdk));
        }
      }
      if (c0 + 8 * kChunk > L) {  // the chunk holding key L - 1: mask keys >= L
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool valid = key0 + 2 * t + e < L;
          s[j][e] = valid ? s[j][e] : -INFINITY;
          s[j][2 + e] = valid ? s[j][2 + e] : -INFINITY;
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        cm0 = fmaxf(cm0, s[j][e]);
        cm1 = fmaxf(cm1, s[j][2 + e]);
      }
    }
  }

  // acc += p v for the chunk at c0, p = 2^(s - m) (into s), its row sums into
  // l0, l1. Groups in pairs (j, j + 1), one fresh accumulator per pair; Lp is
  // a multiple of 16, so both groups of a pair lie below it or neither.
  __device__ __forceinline__ void accumulate_pv(float (&acc)[KS][4], float (&s)[kChunk][4], int c0, float m0,
                                                float m1, float& l0, float& l1) const {
#pragma unroll
    for (int j = 0; j < kChunk; j += 2) {
      const int key0 = c0 + 8 * j;
      if (key0 >= Lp) continue;
#pragma unroll
      for (int jj = j; jj < j + 2; ++jj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[jj][e] = exp2f(s[jj][e] - m0);  // 2^-inf = 0 for masked keys
          s[jj][2 + e] = exp2f(s[jj][2 + e] - m1);
          l0 += s[jj][e];
          l1 += s[jj][2 + e];
        }
      // A column t of group j stands for key 2t, column t + 4 for key 2t + 1:
      // the score registers are the A fragment, and the transposed values'
      // pairs at 2t, 2t + 1 are the B fragment.
      const FragA pa = make_a(s[j][0], s[j][2], s[j][1], s[j][3]);
      const FragA pb = make_a(s[j + 1][0], s[j + 1][2], s[j + 1][1], s[j + 1][3]);
#pragma unroll
      for (int f = 0; f < KS; ++f) {
        const float* vf = vt + 8 * f * ldv + 2 * key0;
        mma_3xtf32_x2(acc[f], pa, load_bt_split(vf, ldv), pb, load_bt_split(vf + 16, ldv));
      }
    }
  }

  // o_h rows r0 + g (in0: below L), r0 + g + 8 (in1) = acc / row sums.
  __device__ __forceinline__ void store_rows(const float (&acc)[KS][4], float l0, float l1, int r0, bool in0, bool in1,
                                             int64_t seq, int hc) const {
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, m);
      l1 += __shfl_xor_sync(0xffffffffu, l1, m);
    }
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
#pragma unroll
    for (int f = 0; f < KS; ++f) {
      const int col = hc + 8 * f + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (!(half ? in1 : in0)) continue;
        const float inv = half ? inv1 : inv0;
        *reinterpret_cast<float2*>(a.o + row(seq, r0 + g + 8 * half) * a.D + col) =
            make_float2(acc[f][2 * half] * inv, acc[f][2 * half + 1] * inv);
      }
    }
  }

  // o_h for the 16 queries at r0 of the item at (seq, hc): over the keys
  // 8 kChunk at a time with an online softmax (running max and sum per row).
  __device__ __forceinline__ void attend_tile(float2 (&qr)[KS][2], int r0, int64_t seq, int hc) const {
    const bool in0 = r0 + g < L, in1 = r0 + g + 8 < L;
    FragA qa[KS];
    split_queries(qa, qr);
    // The warp's next tile's queries (L > 16 * warps only) arrive during this one.
    if (r0 + 16 * warps < Lp) load_q(qr, r0 + 16 * warps, seq, hc);

    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // rows g, g + 8
    float acc[KS][4];
#pragma unroll
    for (int j = 0; j < KS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

    // Every chunk starts below L (c0 <= Lp - 16 < L), so its row max is finite.
    for (int c0 = 0; c0 < Lp; c0 += 8 * kChunk) {
      float s[kChunk][4];
      float cm0 = -INFINITY, cm1 = -INFINITY;
      chunk_scores(s, qa, c0, cm0, cm1);
#pragma unroll
      for (int m = 1; m <= 2; m <<= 1) {  // a row's scores are spread over a quad
        cm0 = fmaxf(cm0, __shfl_xor_sync(0xffffffffu, cm0, m));
        cm1 = fmaxf(cm1, __shfl_xor_sync(0xffffffffu, cm1, m));
      }
      const float mn0 = fmaxf(m0, cm0), mn1 = fmaxf(m1, cm1);
      const float corr0 = exp2f(m0 - mn0), corr1 = exp2f(m1 - mn1);  // 0 on the first chunk
      m0 = mn0, m1 = mn1;
      l0 *= corr0, l1 *= corr1;
#pragma unroll
      for (int j = 0; j < KS; ++j) acc[j][0] *= corr0, acc[j][1] *= corr0, acc[j][2] *= corr1, acc[j][3] *= corr1;
      accumulate_pv(acc, s, c0, m0, m1, l0, l1);
    }
    store_rows(acc, l0, l1, r0, in0, in1, seq, hc);
  }
};

template <int HD, bool kPrefetch>
__global__ void __launch_bounds__(32 * max_warps<HD>()) attention_kernel(const AttnArgs a) {
  const StagedAttention<HD, kPrefetch> b(a);
  float2 qr[StagedAttention<HD, kPrefetch>::KS][2];  // the warp's next query tile, raw (load_q)
  grid_dependency_wait();
  allow_dependent_launch();

  // A block loops over items blockIdx.x, + gridDim.x, ... (as many blocks as
  // fit the device at once). With kPrefetch the next item's keys and values
  // are copied into raw while this one computes, so only the split into ks
  // and vt, shared memory to shared memory, stands between two items.
  int64_t item = blockIdx.x, seq, next_seq = 0;
  int hc, next_hc = 0;
  b.locate(item, seq, hc);
  if constexpr (kPrefetch) {
    b.fetch(seq, hc);
    copy_async_commit();
  }
  // The first tile's queries are in flight during the fill.
  if (16 * b.warp < b.Lp) b.load_q(qr, 16 * b.warp, seq, hc);
  if constexpr (kPrefetch) {
    copy_async_wait<0>();
    __syncthreads();  // every thread's copies are in
  }
  b.fill(seq, hc);
  __syncthreads();

  for (;;) {
    const int64_t next = item + gridDim.x;
    if (next < b.items) {
      b.locate(next, next_seq, next_hc);
      if constexpr (kPrefetch) b.fetch(next_seq, next_hc);
    }
    if constexpr (kPrefetch) copy_async_commit();
    for (int r0 = 16 * b.warp; r0 < b.Lp; r0 += 16 * b.warps) b.attend_tile(qr, r0, seq, hc);

    if (next >= b.items) break;
    item = next, seq = next_seq, hc = next_hc;
    if (16 * b.warp < b.Lp) b.load_q(qr, 16 * b.warp, seq, hc);
    if constexpr (kPrefetch) copy_async_wait<0>();
    __syncthreads();  // ks and vt are read by all (and, with kPrefetch, raw holds every thread's copies)
    b.fill(seq, hc);
    __syncthreads();
  }
}

// Shared memory of the attention kernel with kPrefetch: the split keys and
// values, and one item's raw keys and values beside them.
size_t attention_prefetch_smem_bytes(int64_t len, int head_dim) {
  return staged_attention_smem_bytes(len, head_dim) + 2 * (size_t)((len + 15) / 16 * 16) * head_dim * sizeof(float);
}

template <int HD, bool kPrefetch>
cudaError_t launch_attention(const AttnArgs& a, size_t smem, const DeviceCaps& dev, cudaStream_t stream) {
  constexpr auto kernel = attention_kernel<HD, kPrefetch>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int64_t lp = (a.pos.len + 15) / 16;
  const int warps = (int)std::min<int64_t>(lp, max_warps<HD>());
  int per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * warps, smem);
      e != cudaSuccess)
    return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;  // the plan checked the shared memory
  const int64_t blocks = std::min<int64_t>(a.pos.num_seq * a.heads, (int64_t)dev.sms * per_sm);
  return launch_kernel<kernel>((unsigned)blocks, 32 * warps, smem, stream, dev, a);
}

// The prefetching kernel where its shared memory fits the device, else the
// one that fills from memory.
template <int HD>
cudaError_t launch_attention(const AttnArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  const size_t prefetch = attention_prefetch_smem_bytes(a.pos.len, HD);
  if (prefetch <= (size_t)dev.smem_optin) return launch_attention<HD, true>(a, prefetch, dev, stream);
  return launch_attention<HD, false>(a, staged_attention_smem_bytes(a.pos.len, HD), dev, stream);
}

}  // namespace

cudaError_t staged_attention(const AxisView& pos, const float* qkv, float* o, int D, int heads, const DeviceCaps& dev,
                             cudaStream_t stream) {
  AttnArgs a;
  a.pos = pos;
  a.D = D, a.heads = heads;
  const int hd = D / heads;
  a.scale_log2 = kLog2e / sqrtf((float)hd);
  a.qkv = qkv, a.o = o;
  return with_int<8, 16, 32, 64>(
      hd, [&](auto h) { return launch_attention<decltype(h)::value>(a, dev, stream); }, cudaErrorInvalidValue);
}

}  // namespace fastaxial::cuda
