// C (M, N) = A (M, K) @ W (N, K)^T (+ bias) (+ residual) in fp32 accuracy on
// Hopper's warpgroup tensor-core instructions (wgmma, sm_90a), the 3xTF32
// split: W comes already split in global memory (two planes, hi then lo, of
// TF32 values: detail/tf32x3.cuh), A as plain fp32, split in registers.
//
// Shape: a block of two warpgroups computes 128 x 128 tiles of C, each
// warpgroup 64 rows (64 accumulators a thread); one block an SM, looping over
// tiles. Where 128-row tiles would leave half the SMs or more idle (the
// output product of a small pass), a block of one warpgroup computes 64-row
// tiles instead, twice as many; tiles are 96 columns wide (48 accumulators a
// thread) where N pads less to a multiple of 96 than of 128 (dim 96: N = 96,
// 288), or where they take fewer rounds of the SMs (common/plan.h:
// gemm_tiling). K advances 32 at a time through a 4-stage cp.async ring that runs
// on across tiles, so a tile's first copies overlap the previous tile's last
// products and its epilogue; a stage holds the fp32 A tile and the hi and lo
// planes of the W tile, each row 128 bytes in the 128-byte swizzled layout
// wgmma reads (16-byte piece c of row r stored at piece c ^ (r % 8)), so the
// copies, the tensor cores and the A fragment loads all meet distinct banks.
//
// Why A from registers: a thread loads its A fragment once per step (four
// 4-byte loads) and splits it itself, so the kernels before the product
// write A once, unsplit (the LayerNorm and the attention output moved two
// planes before), and the ring carries one A plane. The products ran no
// faster for it (docs/perf-notes.md): what bounds them is each warp's
// own instruction stream between its wgmma runs (copies, fragment loads and
// splits, the fp32 adds), which is why each thread's copies are set up once
// per tile rather than per k-step.
//
// Accuracy: the three products (lo*hi, hi*lo, hi*hi) of two 8-deep steps go
// into a fresh accumulator T, which is then added to C in fp32 (the tensor
// core truncates its own adds; a long chain drifts, while runs of two steps
// stay at an fp32 FMA chain's error: docs/perf-notes.md). Two T sets
// alternate, so one run's products go on while the other's T is added.
#include "gemm.h"

#include <algorithm>
#include <cstdint>

#include "../../common/smem_layout.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int BK = 32, kStages = 4;

// A block of WG warpgroups (1 or 2) and its BM x BN tiles (BN 128 or 96).
template <int WG, int BN_>
struct Tiling {
  static constexpr int BM = 64 * WG, BN = BN_;
  static constexpr int kThreads = 128 * WG;
  static constexpr int kATile = BM * BK * 4;    // an A tile: 8 or 16 KB
  static constexpr int kWTile = BN * BK * 4;    // one plane of a W tile: 16 or 12 KB
  static constexpr int kStageBytes = kATile + 2 * kWTile;  // A, W hi, W lo
  static constexpr size_t kSmemBytes = (size_t)kStages * kStageBytes + 1024;  // + room to align to 1024
};
// The plan (host) sizes the staged path by the largest tiling.
static_assert(Tiling<2, 128>::kSmemBytes == kStagedGemmSmemBytes, "common/smem_layout.h");

#if FASTAXIAL_SM90A_DEVICE
// A thread's share of the copies of an R-row tile of a (rows, K) matrix by
// the block's T threads: piece threadIdx.x % 8 (16 bytes) of rows
// threadIdx.x / 8 + u (T / 8), u < R * 8 / T. Set once per tile, so that a
// k-step's copies cost an add each: src points at the piece of the first
// such row, `valid` counts the rows u below `rows`.
struct TileCopies {
  const float* src;
  int valid;
};

template <int R, int T>
__device__ __forceinline__ TileCopies tile_copies(const float* g, int64_t row0, int64_t rows, int K) {
  const int64_t r = row0 + threadIdx.x / 8, left = rows - r;
  const int64_t n = (left + T / 8 - 1) / (T / 8);
  const int valid = left <= 0 ? 0 : n < R * 8 / T ? (int)n : R * 8 / T;
  return {g + r * K + 4 * (threadIdx.x % 8), valid};
}

// Columns k0 .. k0 + BK of the tile (plus `plane` floats: the lo plane) into
// the swizzled tile at shared address s: piece c of row r at c ^ (r % 8).
// Rows past the matrix and columns past K read as zero; g is any address
// the zero-byte copies may name.
template <int R, int T>
__device__ __forceinline__ void load_tile(uint32_t s, const TileCopies& tc, const float* g, int64_t plane, int k0,
                                          int K) {
  const int r = threadIdx.x / 8, piece = threadIdx.x % 8;
  const bool k_in = k0 + 4 * piece < K;
  const uint32_t dst = s + r * 128 + ((piece ^ (r % 8)) * 16);  // (r + u T / 8) % 8 = r % 8
  const float* src = tc.src + plane + k0;
#pragma unroll
  for (int u = 0; u < R * 8 / T; ++u) {
    const bool valid = k_in && u < tc.valid;
    copy_async16(dst + u * (T / 8) * 128, valid ? src + (int64_t)u * (T / 8) * K : g, valid ? 16 : 0);
  }
}

// This thread's A fragments (detail/wgmma.cuh) of steps ks and ks + 1 of the
// stage's A tile at a, for warpgroup wg, split: column t of a step is in
// piece 2 k of its row, column t + 4 in piece 2 k + 1; rows r and r + 8 share
// r % 8 = g, so both sit at the same swizzled place 1024 bytes apart.
__device__ __forceinline__ void load_a(FragA (&f)[2], const float* a, int wg, int ks) {
  const int warp = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const float* row = a + (wg * 64 + warp * 16 + g) * 32 + t;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float* c0 = row + ((2 * (ks + k)) ^ g) * 4;
    const float* c4 = row + ((2 * (ks + k) + 1) ^ g) * 4;
    f[k] = make_a(c0[0], c0[256], c4[0], c4[256]);
  }
}

// The three products of steps ks and ks + 1 of the stage at s into t
// (fresh), A from the fragments f of those steps, one commit group.
template <int WG, int BN>
__device__ __forceinline__ void run_products(float (&t)[BN / 2], FragA (&f)[2], uint32_t s, int ks) {
  using Tl = Tiling<WG, BN>;
  const uint32_t w_hi = s + Tl::kATile + ks * 32;  // W's hi plane at step ks; the lo plane kWTile on
  const uint64_t b[2] = {desc_sw128(w_hi), desc_sw128(w_hi + 32)};
  wgmma_3xtf32_run<BN>(t, f, b, Tl::kWTile >> 4);
}

// The ring's producer: the next k-step to load (its tile's copies, k index
// and stage), advanced in order over the block's tiles.
template <int WG, int BN>
struct StageLoader {
  using Tl = Tiling<WG, BN>;
  const GemmArgs& p;
  uint32_t base;    // the ring, as a shared address
  int ntiles, ktiles;
  int64_t w_plane;  // W's lo plane, after its hi plane
  int64_t tile_index;
  int kt, stage;
  TileCopies a_copies, w_copies;

  __device__ __forceinline__ StageLoader(const GemmArgs& p_, uint32_t base_, int ntiles_, int ktiles_)
      : p(p_), base(base_), ntiles(ntiles_), ktiles(ktiles_), w_plane((int64_t)p_.N * p_.K),
        tile_index(blockIdx.x), kt(0), stage(0) {
    start_tile();
  }
  __device__ __forceinline__ void start_tile() {
    a_copies = tile_copies<Tl::BM, Tl::kThreads>(p.a, tile_index / ntiles * Tl::BM, p.M, p.K);
    w_copies = tile_copies<BN, Tl::kThreads>(p.w, tile_index % ntiles * BN, p.N, p.K);
  }
  __device__ __forceinline__ void load_next() {
    const uint32_t s = base + stage * Tl::kStageBytes;
    const int k0 = kt * BK;
    load_tile<Tl::BM, Tl::kThreads>(s, a_copies, p.a, 0, k0, p.K);
    load_tile<BN, Tl::kThreads>(s + Tl::kATile, w_copies, p.w, 0, k0, p.K);
    load_tile<BN, Tl::kThreads>(s + Tl::kATile + Tl::kWTile, w_copies, p.w, w_plane, k0, p.K);
    stage = stage + 1 == kStages ? 0 : stage + 1;
    if (++kt == ktiles) {
      kt = 0;
      tile_index += gridDim.x;
      start_tile();
    }
  }
};

// One k-step on the stage at s (a_tile: its A plane as a pointer): two runs,
// A (steps 0-1 of the stage, into t0) and B (steps 2-3, into t1). Both
// block-wide barriers of a k-step have a run in flight, so the tensor cores
// wait only for the add of t1 between k-steps: the refill of the previous
// k-step's stage (refill: there is one) goes out while A runs, the next
// k-step's copies are waited for while B runs; B's A fragments are loaded
// while A runs. Nothing is in flight across a loop turn (ptxas would wait
// there anyway). A run's fragments stay untouched until the wait that
// completes it.
template <int WG, int BN>
__device__ __forceinline__ void k_step(float (&c)[BN / 2], float (&t0)[BN / 2], float (&t1)[BN / 2], FragA (&f0)[2],
                                       FragA (&f1)[2], uint32_t s, const float* a_tile, int wg, bool refill,
                                       StageLoader<WG, BN>& loader) {
  load_a(f0, a_tile, wg, 0);
  run_products<WG, BN>(t0, f0, s, 0);
  load_a(f1, a_tile, wg, 2);
  __syncthreads();  // every product of the previous k-step has completed: its stage may be refilled
  if (refill) loader.load_next();
  copy_async_commit();
  run_products<WG, BN>(t1, f1, s, 2);
  wgmma_wait<1>();
  fence_frags(f0);
  add_to(c, t0);
  copy_async_wait<kStages - 2>();
  fence_async_smem();
  __syncthreads();  // the next k-step is in for all
  wgmma_wait<0>();
  fence_frags(f1);
  add_to(c, t1);
}

// C's tile at (m0, n0) = c + bias + residual, rows < M and columns < N.
// Accumulator layout: warp w of the warpgroup holds rows 16 w + g and
// 16 w + g + 8; c[4 j .. 4 j + 3] are columns 8 j + 2t, 8 j + 2t + 1 of each.
// Bias and residual are all loaded before the first store: c may alias
// neither as far as the compiler knows, so loads after a store would wait
// for it, one global round trip per pair. The residual goes to t0, which
// is free here.
template <int BN>
__device__ __forceinline__ void store_tile(const GemmArgs& p, float (&c)[BN / 2], float (&t0)[BN / 2], int64_t m0,
                                           int n0, int wg) {
  const int warp = threadIdx.x % 128 / 32, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
  const int64_t row0 = m0 + wg * 64 + warp * 16 + g;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = n0 + 8 * j + 2 * tq;
    const float2 b = p.bias && col < p.N ? *reinterpret_cast<const float2*>(p.bias + col) : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + 8 * half;
      const int i = 4 * j + 2 * half;
      const float2 r = p.residual && col < p.N && row < p.M
                           ? *reinterpret_cast<const float2*>(p.residual + row * p.N + col)
                           : make_float2(0.0f, 0.0f);
      c[i] += b.x, c[i + 1] += b.y;
      t0[i] = r.x, t0[i + 1] = r.y;
    }
  }
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = n0 + 8 * j + 2 * tq;
    if (col >= p.N) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + 8 * half;
      if (row >= p.M) continue;
      const int i = 4 * j + 2 * half;
      *reinterpret_cast<float2*>(p.c + row * p.N + col) = make_float2(c[i] + t0[i], c[i + 1] + t0[i + 1]);
    }
  }
}

#endif  // FASTAXIAL_SM90A_DEVICE

template <int WG, int BN>
__global__ void __launch_bounds__(Tiling<WG, BN>::kThreads, 1) gemm_tf32x3_kernel(const GemmArgs p) {
#if FASTAXIAL_SM90A_DEVICE
  using Tl = Tiling<WG, BN>;
  constexpr int BM = Tl::BM, kStageBytes = Tl::kStageBytes;
  grid_dependency_wait();
  allow_dependent_launch();
  extern __shared__ float4 smem4[];
  // Swizzled tiles must start on 1024-byte boundaries: base as a shared
  // address (descriptors, copies) and as a pointer (A fragment loads).
  const uint32_t raw = (uint32_t)__cvta_generic_to_shared(smem4), base = (raw + 1023) & ~1023u;
  const float* base_ptr = reinterpret_cast<const float*>(smem4) + (base - raw) / 4;
  // Tile t is row tile t / ntiles, column tile t % ntiles: blocks that share
  // a row tile of A run side by side, so A comes from DRAM about once. A
  // block takes tiles blockIdx.x, + gridDim.x, ... and runs its k-steps on
  // flat across them: the ring already holds a tile's first stages when the
  // previous tile's products end, and their copies overlap its epilogue.
  const int ntiles = (p.N + BN - 1) / BN;
  const int64_t tiles = (p.M + BM - 1) / BM * ntiles;
  const int wg = threadIdx.x / 128;
  const int ktiles = (p.K + BK - 1) / BK;
  const int64_t iters = (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x * ktiles;
  StageLoader<WG, BN> loader(p, base, ntiles, ktiles);

  constexpr int kAcc = BN / 2;  // accumulators a thread
  float c[kAcc], t0[kAcc], t1[kAcc];
  FragA f0[2], f1[2];  // A fragments of runs A and B
#pragma unroll
  for (int i = 0; i < kAcc; ++i) c[i] = t0[i] = t1[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < iters) loader.load_next();
    copy_async_commit();
  }
  copy_async_wait<kStages - 2>();
  // cp.async wrote the tile through the generic proxy; wgmma reads it through the async one.
  fence_async_smem();
  __syncthreads();  // k-step 0 is in for all
  int64_t it = 0;   // k-steps done, over all of this block's tiles
  int stage = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      k_step<WG, BN>(c, t0, t1, f0, f1, base + stage * kStageBytes, base_ptr + stage * (kStageBytes / 4), wg,
                     it + kStages - 1 < iters, loader);
      stage = stage + 1 == kStages ? 0 : stage + 1;
    }
    store_tile<BN>(p, c, t0, tile / ntiles * BM, (int)(tile % ntiles) * BN, wg);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) c[i] = 0.0f;
  }
  copy_async_wait<0>();
#else
  (void)p;
  __trap();  // built without sm_90a: gemm_tf32x3_available() is false and nothing launches this
#endif
}

template <int WG, int BN>
cudaError_t launch_tiles(const GemmArgs& g, int64_t tiles, const DeviceCaps& dev, cudaStream_t stream) {
  using Tl = Tiling<WG, BN>;
  constexpr auto kernel = gemm_tf32x3_kernel<WG, BN>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int64_t blocks = std::min<int64_t>(tiles, dev.sms);
  return launch_kernel<kernel>((unsigned)blocks, Tl::kThreads, Tl::kSmemBytes, stream, dev, g);
}

}  // namespace

bool gemm_tf32x3_available(const DeviceCaps& dev) {
#if defined(FASTAXIAL_WGMMA)
  return dev.sm90a && (size_t)dev.smem_optin >= kStagedGemmSmemBytes;  // the largest tiling
#else
  (void)dev;
  return false;
#endif
}

cudaError_t gemm_tf32x3(const GemmArgs& g, const DeviceCaps& dev, cudaStream_t stream) {
  if (g.M == 0 || g.N == 0) return cudaSuccess;
  if (!gemm_tf32x3_available(dev)) return cudaErrorInvalidDeviceFunction;
  // One block an SM (the ring takes most of its shared memory), each looping over tiles whose
  // shape the plan's rule picks (common/plan.h: gemm_tiling) to waste the fewest rounds.
  const GemmTiling t = gemm_tiling(g.M, g.N, dev.sms);
  const int64_t tiles = (g.M + t.rows - 1) / t.rows * ((g.N + t.cols - 1) / t.cols);
  if (t.cols == 96)
    return t.rows == 128 ? launch_tiles<2, 96>(g, tiles, dev, stream) : launch_tiles<1, 96>(g, tiles, dev, stream);
  return t.rows == 128 ? launch_tiles<2, 128>(g, tiles, dev, stream) : launch_tiles<1, 128>(g, tiles, dev, stream);
}

}  // namespace fastaxial::cuda
