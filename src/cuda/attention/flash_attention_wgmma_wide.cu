// The flash attention step (flash_attention.h) on Hopper's warpgroup
// products (wgmma, sm_90a) for padded head dims 64, 96 and 128: for each
// sequence n and head h,
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h
// with the per-row log-sum-exp, attention dropout and split-KV partials as
// the mma.sync kernel of flash_attention.cu computes them (the same splits
// into TF32 planes, runs of two 8-deep steps into fresh accumulators, the
// same online softmax and mask).
//
// Why a third kernel. The mma.sync kernel builds every B fragment from
// shared memory, split on the fly, in each warp, which bounds its rate at
// head dim 128 well below the wgmma products'. The head
// dim 32 wgmma kernel (flash_attention_wgmma.cu) holds q's split fragments
// in registers and double-buffers raw rows and q; at head dim 128 neither
// fits: q's fragments would be 128 registers a thread, and two buffers of
// everything 330 KB of shared memory. So here:
//   - q stays raw in shared memory (128-byte rows XOR-swizzled by row, so
//     the fragment reads hit 32 banks without padding) and each run of the
//     score product reads and splits its two steps' fragments;
//   - keys come 32 a step (one 128-byte atom of keys in v^T's planes);
//   - one raw stage and one q buffer, hence two barriers a step (below).
// Shared memory at head dim 128: k (hi, lo) planes 64 KB and v^T planes
// 64 KB (two buffers each), the raw stage 33 KB, q 64 KB: 226 KB.
//
// Shape of the work. A block (two warpgroups of 64 queries: 128 queries, a
// unit) takes units in turn, one block an SM: unit u = blockIdx.x, +
// gridDim.x, ... is query tile u % q_tiles of split (u / q_tiles) % S of
// item u / (q_tiles S) = n heads + h. A unit streams its keys (all, or its
// split's contiguous range) 32 at a time; the steps of a block's units form
// one stream. Step s, its k and v^T planes split and visible, the raw stage
// holding step s + 1's rows:
//   1. s (64, 32) = q k^T per warpgroup: HDP / 16 runs of two 8-deep steps,
//      alternating two fresh accumulators; between the runs, step s + 1's
//      split (raw stage -> the other plane buffer).
//   2. barrier; step s + 2's raw rows (and with a unit's last step, the next
//      unit's q) copied into the stage and the q buffer, both now free.
//   3. the online softmax on s in registers (flash_attention.cu's).
//   4. o (64, HDP) += p v: for each half of o's columns (one for HDP 64),
//      runs of two key groups into one fresh accumulator.
//   5. wait for the copies; barrier: step s + 2's rows in, step s's planes free.
// 3xTF32 throughout (the element traits Tf32x3 of detail/tf32x3.cuh, the
// mainloop's Elem). The kernel drives its parts:
// WideSmem (the layout), WidePipeline (copies and barriers), WideSplit (the
// split), wide_scores and wide_pv (the mainloop), and flash_parts.cuh's
// BlockUnits, StepCursor, FlashRows and UnitDropout.
//
// Positions >= L are zero-filled by the copies and their scores set to
// -inf; columns hd..HDP-1 of q and of the raw stage are zeroed once and
// never copied, so the splits carry zeros into the planes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/lse.cuh"
#include "../detail/online_softmax.cuh"
#include "../detail/split_planes.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"
#include "flash_attention.h"
#include "flash_parts.cuh"
#include "pipeline_wide.cuh"

namespace fastaxial::cuda {
namespace {

// Sizes and byte offsets of a block's shared memory (see the header comment).
template <int HDP>
struct WideTile {
  static_assert(HDP == 64 || HDP == 96 || HDP == 128, "padded head dims 64, 96, 128");
  static constexpr int kHdp = HDP;
  static constexpr int BM = 128, BN = 32, kThreads = 256;  // two warpgroups of 64 queries; keys a step
  using Elem = Tf32x3;  // fp32 on the 3xTF32 products (detail/tf32x3.cuh): B operands in Elem::kPlanes planes
  static constexpr int ld = HDP + 4;                       // raw rows: conflict-free transposing reads
  static constexpr int chunk = BN * 128;                   // k's features 32c..32c + 31 for the step's keys
  static constexpr int k_plane = (HDP / 32) * chunk;
  static constexpr int vt_plane = HDP * 128;  // one atom: the step's 32 keys of every feature
  static constexpr int PN = HDP <= 64 ? HDP : HDP / 2;  // o's columns a p v product (n64, n48)
  static constexpr int k_buf = Elem::kPlanes * k_plane, vt_buf = Elem::kPlanes * vt_plane;  // a buffer's planes
  static constexpr int k_off = 0;                            // k's planes, buffer b at + b k_buf
  static constexpr int vt_off = k_off + 2 * k_buf;
  static constexpr int raw_off = vt_off + 2 * vt_buf;        // k's rows, then v's, (BN, HDP) at stride ld
  static constexpr int q_off = raw_off + 2 * BN * ld * 4;    // (BM, HDP), rows swizzled
  static constexpr int bytes = q_off + BM * HDP * 4 + 1024;  // + room to align the base
  static constexpr int runs = HDP / 16;                      // runs of the score product
  static_assert(bytes <= 232448, "an H200 block's shared memory (227 KB)");
  static_assert(BM == kFlashWgmmaQueryTile && bytes == flash_wgmma_smem_bytes(HDP), "common/smem_layout.h's sizes");
  static_assert(chunk % 1024 == 0 && vt_plane % 1024 == 0 && (PN * 128) % 1024 == 0 && q_off % 16 == 0,
                "swizzled planes on 1024-byte boundaries, cp.async rows on 16-byte ones");
  static_assert(BN * (HDP / 4) == (runs / 2) * kThreads && BN * HDP == 2 * runs * kThreads,
                "a step's split in `runs` parts: a piece of k on every other part, two elements of v on each");
};

#if FASTAXIAL_SM90A_DEVICE
// The mainloop's products (wgmma) for a warpgroup's 64 queries and a step of
// BN = 32 keys, in element type Elem's runs (Tf32x3: 3xTF32).

// s (64, 32) = q k^T: HDP / 16 runs of two 8-deep steps, alternating two
// fresh accumulators; q_frag(kk) reads q's A fragment of step kk (Elem::a);
// between(r) runs once run r is issued (the next step's split goes there).
// k's planes at kb: chunks of 32 features, Tile::chunk bytes apart.
template <class Elem, int HDP, class QFrag, class Between>
__device__ __forceinline__ void wide_scores(float (&s)[WideTile<HDP>::BN / 2], uint32_t kb, QFrag&& q_frag,
                                            Between&& between) {
  using Tile = WideTile<HDP>;
  constexpr int N = Tile::BN;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s[i] = 0.0f;
  float acc[2][N / 2];
  typename Elem::FragA f[2][2];
#pragma unroll
  for (int r = 0; r < Tile::runs; ++r) {
    f[r % 2][0] = q_frag(2 * r), f[r % 2][1] = q_frag(2 * r + 1);
    uint64_t d[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int kk = 2 * r + k;
      d[k] = desc_sw128(kb + (kk / 4) * Tile::chunk + (kk % 4) * 32);
    }
    Elem::template wgmma_run<N>(acc[r % 2], f[r % 2], d, Tile::k_plane >> 4);
    between(r);
    if (r > 0) {
      wgmma_wait<1>();
      Elem::fence(f[(r - 1) % 2]);
      add_to(s, acc[(r - 1) % 2]);
    }
  }
  wgmma_wait<0>();
  Elem::fence(f[(Tile::runs - 1) % 2]);
  add_to(s, acc[(Tile::runs - 1) % 2]);
}

// o (64, HDP) += p v, PN columns at a time: runs of two key groups into a
// fresh accumulator, v^T's planes at vb (one atom: the step's 32 keys of
// every feature).
template <class Elem, int HDP>
__device__ __forceinline__ void wide_pv(float (&o)[HDP / 2], float (&s)[WideTile<HDP>::BN / 2], uint32_t vb) {
  using Tile = WideTile<HDP>;
  constexpr int PN = Tile::PN;
#pragma unroll
  for (int hh = 0; hh < HDP / PN; ++hh)
#pragma unroll
    for (int rr = 0; rr < Tile::BN / 16; ++rr) {
      typename Elem::FragA f[2];
      uint64_t d[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int jg = 2 * rr + k;  // keys 8 jg .. 8 jg + 7
        f[k] = Elem::a(s[4 * jg], s[4 * jg + 2], s[4 * jg + 1], s[4 * jg + 3]);
        d[k] = desc_sw128(vb + hh * PN * 128 + jg * 32);
      }
      float acc[PN / 2];
      Elem::template wgmma_run<PN>(acc, f, d, Tile::vt_plane >> 4);
      wgmma_wait<0>();
      Elem::fence(f);
      fence_regs(acc);
#pragma unroll
      for (int i = 0; i < PN / 2; ++i) o[hh * (PN / 2) + i] += acc[i];
    }
}

// The A fragment of q's step kk for a warp's 16 rows at qw (q's buffer + 16
// warp HDP), read and made (Elem::a): (g, t), (g + 8, t), (g, t + 4),
// (g + 8, t + 4); the swizzle's row % 8 is g.
template <int HDP>
__device__ __forceinline__ typename WideTile<HDP>::Elem::FragA wide_q_frag(const float* qw, int kk, int g, int t) {
  const int c0 = (8 * kk + t) ^ (g << 2), c1 = (8 * kk + t + 4) ^ (g << 2);
  return WideTile<HDP>::Elem::a(qw[g * HDP + c0], qw[(g + 8) * HDP + c0], qw[g * HDP + c1], qw[(g + 8) * HDP + c1]);
}

// A step's split, raw stage -> plane buffer b, in Tile::runs parts so that
// they go between the score product's runs: k's rows into straight planes,
// v's transposed (detail/split_planes.cuh), both 3xTF32's hi and lo. Its
// own struct, apart from WidePipeline: in one struct with the copies' sizes
// the compiler computes the stage's address ahead of the loops that use it.
template <int HDP>
struct WideSplit {
  using Tile = WideTile<HDP>;
  static constexpr int BN = Tile::BN, kThreads = Tile::kThreads, LD = Tile::ld;
  char* sm;
  const float* raws;
  int tid;
  int v_raw, v_plane;  // v: this thread's key kv is fixed, its features 8 i' + tid % 8

  __device__ __forceinline__ WideSplit(char* sm_, const float* raws_, int tid_) : sm(sm_), raws(raws_), tid(tid_) {
    const int kv = 8 * ((tid >> 6) & 3) + 2 * ((tid >> 3) & 3) + ((tid >> 5) & 1);
    v_raw = kv * LD + (tid & 7), v_plane = transposed_word<HDP>(kv, tid & 7);
  }

  // Part i: k's piece i / 2 on even parts, two of v's elements on each.
  // k: piece e = tid + 256 p is row e / (HDP / 4), features 4 (e % (HDP / 4)) + 0..3.
  __device__ __forceinline__ void part(int i, int b) const {
    if (i % 2 == 0) {
      const int e = tid + kThreads * (i / 2);
      const int r = e / (HDP / 4), c = e % (HDP / 4);
      const float4 x = *reinterpret_cast<const float4*>(raws + r * LD + 4 * c);
      uint32_t h0, h1, h2, h3, w0, w1, w2, w3;
      split(x.x, h0, w0), split(x.y, h1, w1), split(x.z, h2, w2), split(x.w, h3, w3);
      char* at = sm + Tile::k_off + b * Tile::k_buf + (c / 8) * Tile::chunk + r * 128 + ((((c % 8) ^ r) & 7) << 4);
      *reinterpret_cast<uint4*>(at) = make_uint4(h0, h1, h2, h3);
      *reinterpret_cast<uint4*>(at + Tile::k_plane) = make_uint4(w0, w1, w2, w3);
    }
    float* vp = reinterpret_cast<float*>(sm + Tile::vt_off + b * Tile::vt_buf);
    const float* vr = raws + BN * LD;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int f = 2 * i + k;  // features 8 f + tid % 8
      uint32_t hv, lv;
      split(vr[v_raw + 8 * f], hv, lv);
      vp[v_plane + 256 * f] = __uint_as_float(hv);
      vp[Tile::vt_plane / 4 + v_plane + 256 * f] = __uint_as_float(lv);
    }
  }
};

// A unit's end, the warp's rows r0 = q0 + 16 warp + g and r0 + 8: o / l
// (times num) and the lse out, or with kSplit the split's partials.
template <bool kSplit, class Rows>
__device__ __forceinline__ void wide_unit_end(Rows& rows, const AttentionKernelArgs& a, float num,
                                              const FlashPartials& sp, const FlashUnit& cur, int warp, int g, int L,
                                              int hd, int t) {
  const int r0 = cur.q0 + 16 * warp + g;
  if constexpr (kSplit)
    rows.store_partials(sp, cur.split, cur.item, r0, L, hd, t);
  else
    rows.store(a, num, cur.seq, cur.col, cur.item, r0, L, hd, t);
}

#endif  // FASTAXIAL_SM90A_DEVICE

// kVec: 16-byte copies. kDropout: dpass applies. kSplit: units carry a split
// of their keys and write unnormalised o, m and l to sp.partials.
template <int HDP, bool kVec, bool kDropout, bool kSplit>
__global__ void __launch_bounds__(256, 1)
    flash_wgmma_wide_kernel(const AttentionKernelArgs a, float scale_log2, int q_tiles, const DropoutPass dpass,
                            const FlashPartials sp) {
#if FASTAXIAL_SM90A_DEVICE
  using Tile = WideTile<HDP>;
  using Elem = typename Tile::Elem;
  constexpr int BM = Tile::BM, BN = Tile::BN, NT = BN / 8;  // key n-tiles
  static_assert(!(kSplit && kDropout), "splits only without dropout");
  const int hd = a.D / a.heads, L = (int)a.pos.len;
  const WideSmem<Tile> smem;
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;
  smem.zero_padding(hd, tid);

  grid_dependency_wait();
  allow_dependent_launch();

  // Unit i of this block: unit_at(i) (flash_parts.cuh); its split's key tiles are j0 .. j1 - 1.
  const BlockUnits<BM, AttentionKernelArgs> unit_at(a, q_tiles, kSplit ? sp.splits : 1, BN);
  const int64_t my_units = unit_at.count;
  const WidePipeline<Tile, kVec> pipe(a, unit_at, smem.base, L, hd, tid);
  StepCursor copy(unit_at);  // the next step to copy
  const WideSplit<HDP> split(smem.sm, smem.raws, tid);
  pipe.prologue(a, copy, unit_at, [&](int b) {
#pragma unroll
    for (int i = 0; i < Tile::runs; ++i) split.part(i, b);
  });

  StepCursor step(unit_at);  // the step in the products
  int64_t st = 0;
  UnitDropout<kDropout> dropout(dpass);
  FlashRows<HDP / 8> rows;  // the warp's 16 rows of o
  const float* qw = smem.qs + 16 * warp * HDP;
  const auto q_frag = [&](int kk) { return wide_q_frag<HDP>(qw, kk, g, t); };

  // Step st = tile step.j of unit step.ui: its planes (buffer st % 2) split
  // and visible; the raw stage holds step st + 1's rows, landed.
  while (true) {
    const bool last = step.last();
    const bool has_next = !last || step.ui + 1 < my_units;  // a step st + 1
    if (step.first()) {
      dropout.start(dpass, step.cur.item, step.cur.q0 + 16 * warp, L);
      rows.reset();
    }
    const int b = (int)(st & 1);

    // s (64, BN) = q k^T, step st + 1's split between its runs; step st + 2's
    // rows and, with a unit's last step, the next unit's q into the free buffers.
    float s[BN / 2];
    wide_scores<Elem, HDP>(s, smem.k_planes(b), q_frag, [&](int r) {
      if (has_next) split.part(r, b ^ 1);
    });
    pipe.refill_step(a, copy, unit_at, step);

    // Scores in base 2, keys >= L at -inf, the online softmax; dropped p
    // zeroed after the row sums. Then o (64, HDP) += p v.
    softmax_tile<NT>(rows, dropout, [&](int jn, int e) -> float& { return s[4 * jn + e]; }, scale_log2, step.j * BN, L,
                     g, t);
    wide_pv<Elem, HDP>(rows.o, s, smem.vt_planes(b));

    if (last) wide_unit_end<kSplit>(rows, a, kDropout ? dpass.scale : 1.0f, sp, step.cur, warp, g, L, hd, t);
    if (!has_next) break;
    pipe.landed();
    ++st;
    step.advance(unit_at, my_units);
  }
#else
  (void)a, (void)scale_log2, (void)q_tiles, (void)dpass, (void)sp;
  __trap();  // built without sm_90a: flash_attention_variant never picks it there
#endif
}

template <int HDP, bool kVec, bool kDropout, bool kSplit>
cudaError_t launch(const FlashArgs& a, float scale_log2, const FlashPartials& sp, const DeviceCaps& dev,
                   cudaStream_t stream) {
  using Tile = WideTile<HDP>;
  constexpr auto kernel = flash_wgmma_wide_kernel<HDP, kVec, kDropout, kSplit>;
  if ((size_t)Tile::bytes > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int L = (int)a.pos.len;
  const int q_tiles = (L + Tile::BM - 1) / Tile::BM;
  const int64_t units = a.pos.num_seq * a.heads * q_tiles * (int64_t)sp.splits;
  const int64_t blocks = std::min<int64_t>(units, std::max(dev.sms, 1));  // a block an SM, taking units in turn
  const AttentionKernelArgs k = flash_kernel_args(a);
  const DropoutPass dpass = kDropout ? dropout_pass(a.dropout, a.pass, a.philox) : DropoutPass{};
  return launch_kernel<kernel>(dim3((unsigned)blocks), dim3(Tile::kThreads), Tile::bytes, stream, dev, k, scale_log2,
                               q_tiles, dpass, sp);
}

// The instantiation for a's flags: 16-byte copies (vec), dropout, split (no dropout there).
template <int HDP>
cudaError_t launch(const FlashArgs& a, bool vec, float scale_log2, const FlashPartials& sp, const DeviceCaps& dev,
                   cudaStream_t stream) {
  const bool split = sp.splits > 1;
  return with_bools(
      [&](auto v, auto d, auto s) {
        constexpr bool kDropout = decltype(d)::value, kSplit = decltype(s)::value;
        if constexpr (kDropout && (kSplit || !kDropoutAvailable))
          return cudaErrorInvalidValue;  // never asked for
        else
          return launch<HDP, decltype(v)::value, kDropout, kSplit>(a, scale_log2, sp, dev, stream);
      },
      vec, kDropoutAvailable && !split && a.dropout.threshold != 0, split);
}

}  // namespace

cudaError_t flash_attention_wgmma_wide(const FlashArgs& a, bool vec, float scale_log2, float* partials, int splits,
                                       const DeviceCaps& dev, cudaStream_t stream) {
  if (a.heads <= 0 || a.D % a.heads != 0 || splits < 1 ||
      (splits > 1 && (partials == nullptr || a.dropout.threshold != 0)))
    return cudaErrorInvalidValue;
  if (a.pos.num_seq <= 0) return a.pos.num_seq == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const FlashPartials sp = {partials, a.pos.num_seq * a.heads * a.pos.len, splits};
  return with_padded_head_dim(
      flash_padded_head_dim(a.D / a.heads),
      [&](auto h) {
        constexpr int H = decltype(h)::value;
        if constexpr (H == 64 || H == 96 || H == 128)
          return launch<H>(a, vec, scale_log2, sp, dev, stream);
        else
          return cudaErrorInvalidValue;
      },
      cudaErrorInvalidValue);
}

}  // namespace fastaxial::cuda
