// C (M, N) = A (M, K) @ W (N, K)^T (+ bias) (+ residual) in fp32 accuracy on
// Hopper's warpgroup tensor-core instructions (wgmma, sm_90a), the 3xTF32
// split: W comes already split in global memory (two planes, hi then lo, of
// TF32 values: detail/tf32x3.cuh), A as plain fp32, split in registers. The
// products are the element traits' (Tf32x3, Tiling::Elem): its A fragments,
// its wgmma_step, its planes of W.
//
// Shape: a block computes 128 x 128 tiles of C with two consumer warpgroups
// of 64 rows each (64 accumulators a thread), one block an SM, looping over
// tiles. Where 128-row tiles would leave half the SMs or more idle (the
// output product of a small pass), one consumer warpgroup computes 64-row
// tiles instead, twice as many; tiles are 96 columns wide (48 accumulators a
// thread) where N pads less to a multiple of 96 than of 128 (dim 96: N = 96,
// 288), or where they take fewer rounds of the SMs (common/plan.h:
// gemm_tiling). K advances 32 at a time through a 4-stage ring that runs on
// across tiles; a stage holds the fp32 A tile and the hi and lo planes of the
// W tile, each row 128 bytes in the 128-byte swizzled layout wgmma reads
// (16-byte piece c of row r stored at piece c ^ (r % 8)), so the copies, the
// tensor cores and the A fragment loads all meet distinct banks.
//
// Warp roles. Producer warps after the consumers fill the ring with
// cp.async, each stage's copies completing a phase of its "full" mbarrier;
// the consumers wait on that, run the stage's products and arrive on its
// "empty" mbarrier, which the producers wait on before refilling it
// (detail/mbarrier.cuh). No block-wide barrier is left in the loop, so the
// consumer warpgroups' gaps between products do not line up.
//
// Why 192-row tiles (three consumer warpgroups) where M allows: the
// product is bound by the L2 -> shared memory traffic, not the tensor cores
// (docs/perf-notes.md). A tile's traffic per k-step is its A rows plus twice
// its W rows (two planes), so taller tiles read W fewer times.
//
// Why A from registers: a thread loads its A fragment once per step (four
// 4-byte loads) and splits it itself, so the kernels before the product
// write A once, unsplit (the LayerNorm and the attention output), and the
// ring carries one A plane.
//
// Accuracy: the three products (lo*hi, hi*lo, hi*hi) of each 8-deep step go
// into a fresh accumulator T, which is then added to C in fp32. The tensor
// core truncates its own adds toward zero: a long chain drifts, and even runs
// of two steps left an error with the sign of the run's sum, which a sum over
// positions of the product adds up (the backward's d_xn = d_qkv W_qkv, summed
// over every position into a LayerNorm bias's gradient, outside the accuracy
// rule with runs of two; docs/perf-notes.md, v64).
#include "gemm.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/mbarrier.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int BK = 32, kStages = 4;
constexpr int kProducerRegs = 56, kConsumerRegs = 152;  // a thread, with three consumer warpgroups

// A block of CW consumer warpgroups (1 to 3, warps 0 .. 4 CW - 1) and the
// producer warps after them: two, or beside three consumer warpgroups a
// warpgroup of producers, so that the registers can move from it to the
// consumers (setmaxnreg: kProducerRegs and kConsumerRegs a thread, the
// block's 65536); its BM x BN tiles (BN 128 or 96). With three, a run's
// products cover half the tile's columns at a time (NH = 2 halves), so the
// fresh accumulator is BN / 4 registers, not BN / 2.
template <int CW, int BN_>
struct Tiling {
  using Elem = Tf32x3;  // fp32 on the 3xTF32 products (detail/tf32x3.cuh): W in Elem::kPlanes planes
  static constexpr int BM = 64 * CW, BN = BN_;
  static constexpr int NH = CW == 3 ? 2 : 1;
  static constexpr int kConsumers = 128 * CW, kProducers = CW == 3 ? 128 : 64;
  static constexpr int kThreads = kConsumers + kProducers;
  static constexpr int kATile = BM * BK * 4;    // an A tile: 8, 16 or 24 KB
  static constexpr int kWTile = BN * BK * 4;    // one plane of a W tile: 16 or 12 KB
  static constexpr int kStageBytes = kATile + Elem::kPlanes * kWTile;  // A, W hi, W lo
  static constexpr int kBarriers = kStages * kStageBytes;  // full[kStages], then empty[kStages]: 8 bytes each
  static constexpr size_t kSmemBytes = (size_t)kBarriers + 2 * kStages * 8 + 1024;  // + room to align to 1024
};
// The plan (host) sizes the staged path by the largest tiling.
static_assert(Tiling<3, 128>::kSmemBytes == kStagedGemmSmemBytes, "common/smem_layout.h");
static_assert(Tiling<3, 128>::kProducers * kProducerRegs + Tiling<3, 128>::kConsumers * kConsumerRegs == 65536,
              "three consumer warpgroups and a producer one share the registers");

#if FASTAXIAL_SM90A_DEVICE
// A producer thread's share of the copies of an R-row tile of a (rows, K)
// matrix: piece tid % 8 (16 bytes) of rows tid / 8 + u (P / 8), u < R * 8 /
// P, for the P producer threads (tid: 0 .. P - 1). Set once per tile, so that
// a k-step's copies cost an add each: src points at the piece of the first
// such row, `valid` counts the rows u below `rows`.
struct TileCopies {
  const float* src;
  int valid;
};

template <int R, int P>
__device__ __forceinline__ TileCopies tile_copies(const float* g, int64_t row0, int64_t rows, int K, int tid) {
  const int64_t r = row0 + tid / 8, left = rows - r;
  const int64_t n = (left + P / 8 - 1) / (P / 8);
  const int valid = left <= 0 ? 0 : n < R * 8 / P ? (int)n : R * 8 / P;
  return {g + r * K + 4 * (tid % 8), valid};
}

// Columns k0 .. k0 + BK of the tile (plus `plane` floats: the lo plane) into
// the swizzled tile at shared address s: piece c of row r at c ^ (r % 8).
// Rows past the matrix and columns past K read as zero; g is any address
// the zero-byte copies may name.
template <int R, int P>
__device__ __forceinline__ void load_tile(uint32_t s, const TileCopies& tc, const float* g, int64_t plane, int k0,
                                          int K, int tid) {
  const int r = tid / 8, piece = tid % 8;
  const bool k_in = k0 + 4 * piece < K;
  const uint32_t dst = s + r * 128 + ((piece ^ (r % 8)) * 16);  // (r + u P / 8) % 8 = r % 8
  const float* src = tc.src + plane + k0;
#pragma unroll
  for (int u = 0; u < R * 8 / P; ++u) {
    const bool valid = k_in && u < tc.valid;
    copy_async16(dst + u * (P / 8) * 128, valid ? src + (int64_t)u * (P / 8) * K : g, valid ? 16 : 0);
  }
}

// This thread's A fragments (detail/wgmma.cuh) of steps ks and ks + 1 of the
// stage's A tile at a, for consumer warpgroup wg, made with lo rounded
// (Elem::a<true>: each is read by a row of products): column t of a step is
// in piece 2 k of its row, column t + 4 in piece 2 k + 1; rows r and r + 8
// share r % 8 = g, so both sit at the same swizzled place 1024 bytes apart.
template <class Elem>
__device__ __forceinline__ void load_a(typename Elem::FragA (&f)[2], const float* a, int wg, int ks) {
  const int warp = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const float* row = a + (wg * 64 + warp * 16 + g) * 32 + t;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float* c0 = row + ((2 * (ks + k)) ^ g) * 4;
    const float* c4 = row + ((2 * (ks + k) + 1) ^ g) * 4;
    f[k] = Elem::template a<true>(c0[0], c0[256], c4[0], c4[256]);
  }
}

// The products of step ks of the stage at s into t (fresh) for the tile's
// columns h BN / NH .. (h + 1) BN / NH - 1, A from the step's fragment f, one
// commit group (Elem::wgmma_step: a run of one step).
template <int CW, int BN>
__device__ __forceinline__ void step_products(float (&t)[BN / 2 / Tiling<CW, BN>::NH],
                                              typename Tiling<CW, BN>::Elem::FragA& f, uint32_t s, int ks, int h) {
  using Tl = Tiling<CW, BN>;
  // W's first plane at step ks and the half's first row (8-row groups 1024 bytes apart); the next kWTile on
  const uint32_t w_hi = s + Tl::kATile + h * (BN / Tl::NH) * 128 + ks * 32;
  Tl::Elem::template wgmma_step<BN / Tl::NH>(t, f, desc_sw128(w_hi), Tl::kWTile >> 4);
}

// c's registers of half h (columns h BN / NH ..: c[4 j ..] are columns 8 j ..) += t.
template <int NH, int N, int NT>
__device__ __forceinline__ void add_half(float (&c)[N], float (&t)[NT], int h) {
  static_assert(NT * NH == N, "t covers one half of c");
  fence_regs(t);
#pragma unroll
  for (int i = 0; i < NT; ++i) c[h * NT + i] += t[i];
}

// The producer warps: the block's k-steps in order over its tiles, stage
// it % kStages, each refill after the consumers emptied the stage's
// previous use (its empty barrier's phase of that use).
template <int CW, int BN>
__device__ __forceinline__ void produce(const GemmArgs& p, uint32_t base, uint32_t bars, int ntiles, int ktiles,
                                        int64_t tiles) {
  using Tl = Tiling<CW, BN>;
  constexpr int P = Tl::kProducers;
  const int tid = threadIdx.x - Tl::kConsumers;
  static_assert(Tl::Elem::kPlanes == 2, "W's hi and lo planes");
  const int64_t w_plane = (int64_t)p.N * p.K;  // W's lo plane, after its hi plane
  int stage = 0;
  uint32_t phase = 0;  // the parity of the stage's current use
  bool refill = false;  // from the ring's second round on
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const TileCopies a = tile_copies<Tl::BM, P>(p.a, tile / ntiles * Tl::BM, p.M, p.K, tid);
    const TileCopies w = tile_copies<BN, P>(p.w, tile % ntiles * BN, p.N, p.K, tid);
    for (int kt = 0; kt < ktiles; ++kt) {
      const uint32_t s = base + stage * Tl::kStageBytes;
      if (refill) mbarrier_wait(bars + 8 * (kStages + stage), phase ^ 1);
      load_tile<Tl::BM, P>(s, a, p.a, 0, kt * BK, p.K, tid);
      load_tile<BN, P>(s + Tl::kATile, w, p.w, 0, kt * BK, p.K, tid);                      // W's hi plane
      load_tile<BN, P>(s + Tl::kATile + Tl::kWTile, w, p.w, w_plane, kt * BK, p.K, tid);  // and its lo plane
      copy_async_arrive(bars + 8 * stage);
      if (++stage == kStages) stage = 0, phase ^= 1, refill = true;
    }
  }
  copy_async_commit();
  copy_async_wait<0>();  // nothing left in flight when the warp exits
}

// C's tile at (m0, n0) = c + bias + residual, rows < M and columns < N.
// Accumulator layout: warp w of the warpgroup holds rows 16 w + g and
// 16 w + g + 8; c[4 j .. 4 j + 3] are columns 8 j + 2t, 8 j + 2t + 1 of each.
// Bias and residual are all loaded before the first store: c may alias
// neither as far as the compiler knows, so loads after a store would wait
// for it, one global round trip per pair. The residual goes to t, which
// is free here (with halves, the residual is loaded a half at a time).
template <int BN, int NH>
__device__ __forceinline__ void store_part(const GemmArgs& p, float (&c)[BN / 2], float (&t)[BN / 2 / NH], int64_t m0,
                                           int n0, int wg, int h) {
  constexpr int J = BN / 8 / NH;  // 8-column groups of the part
  const int warp = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
  const int64_t row0 = m0 + wg * 64 + warp * 16 + g;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int col = n0 + 8 * (h * J + j) + 2 * tq;
    const float2 b = p.bias && col < p.N ? *reinterpret_cast<const float2*>(p.bias + col) : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + 8 * half;
      const int i = 4 * j + 2 * half;
      const float2 r = p.residual && col < p.N && row < p.M
                           ? *reinterpret_cast<const float2*>(p.residual + row * p.N + col)
                           : make_float2(0.0f, 0.0f);
      c[4 * h * J + i] += b.x, c[4 * h * J + i + 1] += b.y;
      t[i] = r.x, t[i + 1] = r.y;
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int col = n0 + 8 * (h * J + j) + 2 * tq;
    if (col >= p.N) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + 8 * half;
      if (row >= p.M) continue;
      const int i = 4 * j + 2 * half;
      *reinterpret_cast<float2*>(p.c + row * p.N + col) =
          make_float2(c[4 * h * J + i] + t[i], c[4 * h * J + i + 1] + t[i + 1]);
    }
  }
}

// A consumer warpgroup (wg of CW): per stage, wait for it, its four 8-deep
// steps one after another (each in NH parts of the columns) into the fresh
// accumulator t, each added to c after its wait, then release the stage. One
// step in flight a warpgroup: the others' steps fill the tensor cores
// meanwhile (the product is bound by the copies into shared memory, above).
template <int CW, int BN>
__device__ __forceinline__ void consume(const GemmArgs& p, uint32_t base, const float* base_ptr, uint32_t bars,
                                        int ntiles, int ktiles, int64_t tiles) {
  using Tl = Tiling<CW, BN>;
  using Elem = typename Tl::Elem;
  constexpr int NH = Tl::NH, kAcc = BN / 2;  // accumulators a thread
  const int wg = threadIdx.x / 128;
  float c[kAcc], t[kAcc / NH];
  typename Elem::FragA f[2][2];  // the A fragments of steps 0-1 and 2-3 (loaded two at a time)
#pragma unroll
  for (int i = 0; i < kAcc; ++i) c[i] = 0.0f;
  int stage = 0;
  uint32_t phase = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    for (int kt = 0; kt < ktiles; ++kt) {
      const uint32_t s = base + stage * Tl::kStageBytes;
      const float* a_tile = base_ptr + stage * (Tl::kStageBytes / 4);
      mbarrier_wait(bars + 8 * stage, phase);
      fence_async_smem();  // cp.async wrote the W planes through the generic proxy; wgmma reads the async one
      load_a<Elem>(f[0], a_tile, wg, 0);
      load_a<Elem>(f[1], a_tile, wg, 2);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          typename Elem::FragA& fk = f[ks / 2][ks % 2];
          step_products<CW, BN>(t, fk, s, ks, h);
          wgmma_wait<0>();
          Elem::fence(fk);
          add_half<NH>(c, t, h);
        }
      mbarrier_arrive(bars + 8 * (kStages + stage));  // the stage's products are done: it may be refilled
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    const int64_t m0 = tile / ntiles * Tl::BM;
    const int n0 = (int)(tile % ntiles) * BN;
#pragma unroll
    for (int h = 0; h < NH; ++h) store_part<BN, NH>(p, c, t, m0, n0, wg, h);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) c[i] = 0.0f;
  }
}

#endif  // FASTAXIAL_SM90A_DEVICE

template <int CW, int BN>
__global__ void __launch_bounds__(Tiling<CW, BN>::kThreads, 1) gemm_tf32x3_kernel(const GemmArgs p) {
#if FASTAXIAL_SM90A_DEVICE
  using Tl = Tiling<CW, BN>;
  extern __shared__ float4 smem4[];
  // Swizzled tiles start at base: a shared address (descriptors, copies) and a pointer (A fragment loads).
  const uint32_t raw = smem_addr(smem4), base = align_1024(raw);
  const float* base_ptr = reinterpret_cast<const float*>(smem4) + (base - raw) / 4;
  const uint32_t bars = base + Tl::kBarriers;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(bars + 8 * i, Tl::kProducers);              // full: every producer thread's copies
      mbarrier_init(bars + 8 * (kStages + i), Tl::kConsumers);  // empty: every consumer thread
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  grid_dependency_wait();
  allow_dependent_launch();
  // Tile t is row tile t / ntiles, column tile t % ntiles: blocks that share
  // a row tile of A run side by side, so A comes from DRAM about once. A
  // block takes tiles blockIdx.x, + gridDim.x, ...; the ring runs on across
  // them, so a tile's first stages are in when the previous tile's products
  // end, and their copies overlap its epilogue.
  const int ntiles = (p.N + BN - 1) / BN;
  const int64_t tiles = (p.M + Tl::BM - 1) / Tl::BM * ntiles;
  const int ktiles = (p.K + BK - 1) / BK;
  if (threadIdx.x >= Tl::kConsumers) {
    if constexpr (CW == 3) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    produce<CW, BN>(p, base, bars, ntiles, ktiles, tiles);
  } else {
    if constexpr (CW == 3) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    consume<CW, BN>(p, base, base_ptr, bars, ntiles, ktiles, tiles);
  }
#else
  (void)p;
  __trap();  // built without sm_90a: gemm_tf32x3_can_run() is false and nothing launches this
#endif
}

template <int CW, int BN>
cudaError_t launch_tiles(const GemmArgs& g, int64_t tiles, const DeviceCaps& dev, cudaStream_t stream) {
  using Tl = Tiling<CW, BN>;
  static_assert(BN % (8 * Tl::NH) == 0, "a run's columns are whole 8-column groups");
  constexpr auto kernel = gemm_tf32x3_kernel<CW, BN>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int64_t blocks = std::min<int64_t>(tiles, dev.sms);
  return launch_kernel<kernel>((unsigned)blocks, Tl::kThreads, Tl::kSmemBytes, stream, dev, g);
}

}  // namespace

bool gemm_tf32x3_can_run(const DeviceCaps& dev) {
#if defined(FASTAXIAL_WGMMA)
  return dev.sm90a && (size_t)dev.smem_optin >= kStagedGemmSmemBytes;  // the largest tiling
#else
  (void)dev;
  return false;
#endif
}

cudaError_t gemm_tf32x3(const GemmArgs& g, const DeviceCaps& dev, cudaStream_t stream) {
  if (g.M == 0 || g.N == 0) return cudaSuccess;
  if (!gemm_tf32x3_can_run(dev)) return cudaErrorInvalidDeviceFunction;
  // One block an SM (the ring takes most of its shared memory), each looping over tiles whose
  // shape the plan's rule picks (common/plan.h: gemm_tiling) to waste the fewest rounds.
  const GemmTiling t = gemm_tiling(g.M, g.N, dev.sms);
  const int64_t tiles = (g.M + t.rows - 1) / t.rows * ((g.N + t.cols - 1) / t.cols);
  const auto launch = [&](auto cols) {
    constexpr int BN = decltype(cols)::value;
    return t.rows == 192   ? launch_tiles<3, BN>(g, tiles, dev, stream)
           : t.rows == 128 ? launch_tiles<2, BN>(g, tiles, dev, stream)
                           : launch_tiles<1, BN>(g, tiles, dev, stream);
  };
  return t.cols == 96 ? launch(std::integral_constant<int, 96>()) : launch(std::integral_constant<int, 128>());
}

}  // namespace fastaxial::cuda
