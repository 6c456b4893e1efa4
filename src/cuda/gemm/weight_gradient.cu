// The weight gradients of the backward (weight_gradient.h): C (N, K) = A^T B,
// A (T, N) and B (T, K) row-major, summed over the T rows, on the tensor
// cores with the 3xTF32 split of detail/tf32x3.cuh.
//
//   C[n][k] = sum over t < T of A[t][n] B[t][k]
//   d_Wo   (D, D)  = dy^T o       A = dy (T, D),    B = o (T, D)
//   d_Wqkv (3D, D) = dqkv^T xn    A = dqkv (T, 3D), B = xn (T, D)
//
// Why a kernel of its own: T is every position of the grid (up to millions),
// N and K are D or 3D, so the product is a long reduction into a small
// output. cuBLAS runs it in fp32 on the FFMA units (its TF32 modes lose
// precision), a large share of a backward. Two kernels: 3xTF32 on wgmma
// (sm_90a, below) where the build, the device and the operands allow it,
// else 3xTF32 on mma.sync (compute capability 8.0), which runs at about
// cuBLAS's rate (docs/perf-notes.md); both keep the backward off cuBLAS, so
// that a training call can be replayed as a CUDA graph (graph_replay.h).
// Both are short bodies driving the parts of weight_gradient_parts.cuh (the
// scheduler, a mainloop per instruction family, the epilogues); what is here
// is each kernel's own: tile shape, shared memory, copies and pipeline.
// Asked for (WeightGradientArgs::a_sums), both also take A's column sums per
// chunk (ASums: the bias gradient where A is a layer's output gradient) from
// the A tiles they stream anyway, in instances of their own (kSums), so that
// the plain ones keep their code.
//
// ---- The mma.sync kernel ----
// Shape. A block owns a 128 x 64 tile of C (kWeightGradTileN x
// kWeightGradTileK: rows over N, columns over K) and one chunk of rows
// (positions); grid (tiles, S), blockIdx.x the tile, blockIdx.y the chunk,
// so the blocks that share a chunk's rows run together and read them from L2.
// 256 threads, 8 warps as 4 (rows) x 2 (columns), each warp a 32 x 32 piece:
// 2 x 4 mma tiles of 16 x 8, 32 accumulators a thread, 32 more for the fresh
// accumulator of a run (below), 32 for one step's split fragments; so 128
// registers hold it and two blocks fit an SM (__launch_bounds__(256, 2)), the
// second hiding the first's barrier waits (with a stage's two runs in a loop
// rather than unrolled, so that it fits without spills). Why 128 x 64: each row of a chunk is read once per
// tile, so the loads per product fall as the tile grows (192 floats a row for
// 8192 outputs, against 128 for 4096 at 64 x 64: a quarter less L2 traffic),
// and N (D or 3D) is the larger side of d_Wqkv; 128 x 128 would need 16 warps
// at these registers, one block an SM, and half as many tiles to fill the
// device with. Larger warp pieces (64 x 32) would cut the splits and fragment
// loads per mma but need 64 more registers than two blocks allow. Small N or
// K waste no tensor-core time on empty rows: a warp whose piece starts past N
// or K only copies.
//
// Rows reach shared memory through a ring of 3 stages of 32 rows (cp.async,
// two stages in flight while one is computed): a stage is A (32, 128) and
// B (32, 64), each row padded by 8 floats (row strides 136 and 72 words, 8 mod
// 32), 26 KB; 78 KB for the ring (kWeightGradSmemBytes). 16-byte copies where
// A and B are 16-byte aligned with row strides a multiple of 4 floats; else
// 4-byte copies (any stride or offset). Rows past the chunk and columns past N
// or K are zero-filled by the copies (zero products), never read.
//
// The mma operands, reducing over rows: mma.m16n8k8's A operand is 16 x 8
// (m x k) = rows m of C, 8 positions, read from the A tile stored [k][m]; its
// B operand is 8 x 8 (k x n) read from the B tile stored [k][n]. The m and n
// indices are permuted within a warp's piece (a product is the same under any
// relabelling of C's rows and columns, undone at the store): lane (g, t),
// g = lane / 4, t = lane % 4, reads rows t and t + 4 of each tile and, of
// each, the 4 consecutive floats at 4g of the warp's 32 columns, one 16-byte
// load, which feed both its m tiles (fragment rows g, g + 8 of m tile i are
// C rows 4g + 2i, 4g + 2i + 1) or all four of its n tiles (fragment column g
// of n tile j is C column 4g + j). With the strides 8 mod 32 a quarter warp's
// 16-byte loads (t = 0..3, g = 2q, 2q + 1) cover the 32 banks once. In the C
// fragments a lane then holds rows 4g .. 4g + 3 and columns 8t .. 8t + 7 of
// the piece: two 16-byte stores a row.
//
// ---- The wgmma kernel (sm_90a) ----
// wgmma reads a TF32 operand from shared memory only K-major, K being the
// reduction, here the positions t, while A and B both have their rows along
// t. So:
//   - wgmma's A operand (64 x 8: rows n of C by positions) is A^T, taken from
//     registers: A's rows reach shared memory as they are ([t][n], cp.async
//     into the mma.sync kernel's padded tile), and each thread loads its
//     fragment elements and splits them, as gemm.cu does;
//   - wgmma's B operand (8 x BN: positions by columns k of C) is B itself and
//     must lie [k][t] in shared memory: the tile is transposed on its way in,
//     through registers (16-byte loads along k), split there, and stored as a
//     hi and a lo plane in the 128-byte swizzled K-major layout (desc_sw128:
//     rows of 32 positions, 16-byte piece c of row r at piece c ^ (r % 8)).
//     The B stores cannot be cp.async: the data changes places on the way.
//
// Shape. A block of two warpgroups (256 threads) owns a 128 x 128 tile of C
// (kWeightGradWgmmaTileN x kWeightGradWgmmaTileK; 128 x 64 where K <= 64, the
// same count of tiles at half the tensor work), warpgroup wg its rows 64 wg ..
// 64 wg + 63: one wgmma.m64n128k8 per product. Registers a thread: 64 for the
// running sum, 64 for the fresh accumulator of a run, 16 + 16 for the split A
// fragments of two runs (the next run's are loaded while one runs), 16 for the
// B block in flight (below): 176, plus addresses and the copies' set-up
// (ptxas takes what the bound allows, as for gemm.cu's kernels; no spills),
// so one block an SM (__launch_bounds__(256, 1)), as the shared memory below
// wants anyway. gemm.cu alternates two fresh accumulators per warpgroup, one
// run's products going on while the other's are added; with the B block on top
// that would be 240 registers before any address. Here the two warpgroups
// alternate instead: while one waits for its run and adds it (64 fp32 adds a
// thread), the tensor cores run the other's (6 wgmma, 384 cycles at BN 128),
// two warps a sub-partition, one of each warpgroup; both of a step's barriers
// come with a run of each warpgroup in flight. Why 128 x 128: the largest tile
// these registers allow, and each row of a chunk is read once per tile (256
// floats a row for 16384 outputs, against 192 for 8192 in the mma.sync
// kernel).
//
// Stages of 32 positions (four 8-deep k-steps, two runs). A: a ring of
// kWeightGradWgmmaStagesA = 4 tiles of 32 rows of 136 floats (cp.async, three
// stages ahead). B: two stages in shared memory (hi and lo planes of BN rows
// of 32 positions, 16 KB each at BN 128, 1024-byte aligned) and a third in
// registers. 133 KB in all (kWeightGradWgmmaSmemBytes). Step i:
//   run 0 (k-steps 0-1) issued on fragments loaded before; run 1's fragments
//   loaded; barrier: every product of step i - 1 has completed, so its B
//   stage and A tile are free; the B block of step i + 1 (loaded during step
//   i - 1) split and stored into that stage, step i + 2's block loaded, step
//   i + 3's A copies issued; wait for run 0, add it; run 1 issued; step
//   i + 1's A copies waited for, the B stores fenced for the async proxy
//   (fence.proxy.async), barrier; step i + 1's run-0 fragments loaded; wait
//   for run 1, add it. Nothing is in flight across a loop turn. A block's B
//   loads thus have a whole step to arrive, its A copies three.
//
// The B transpose. Thread x (x < 128 at BN 64) owns a 4 x 4 block of each
// stage's B tile: positions 4 tb .. 4 tb + 3 and columns 4 kb .. 4 kb + 3,
// with warp w and lane 8 q + r: tb = 4 (w % 2) + r / 2, kb = 8 (w / 2) + 2 q
// + r % 2. It loads the block as 4 float4, one a position, so that a warp's
// load instruction reads 4 rows x 128 contiguous bytes; for each column
// k = 4 kb + kk it stores the 4 positions' hi values as one 16-byte piece,
// piece tb of plane row k, at its swizzled place tb ^ (k % 8), then their lo
// values likewise in the lo plane. In one store instruction a quarter warp
// (q and kk fixed, r = 0..7) has k % 8 = 4 (r % 2) + kk and tb = 4 (w % 2) +
// r / 2, so its 8 pieces go to the 8 distinct places (r / 2 + 4 (r % 2 ^ w % 2))
// ^ kk of rows 128 bytes apart: the 32 banks once. (Had a warp's lanes one tb
// each, one row a load instruction, a quarter warp's 8 pieces would fall on 2
// places: 4-way conflicts.)
//
// The A fragments. Fragment rows g and g + 8 of warp w of a warpgroup
// (detail/wgmma.cuh, g = lane / 4, t = lane % 4) stand for its tile rows
// 16 w + 2 g and 16 w + 2 g + 1 (a relabelling of C's rows, undone at the
// store), so a thread's two values at a position are one 8-byte load, two a
// k-step; with the row stride 8 mod 32 words a half warp's (t = 0..3,
// g = 4 h .. 4 h + 3) cover the 32 banks once. The positions keep their
// order: k-step s reads positions 8 s + t and 8 s + t + 4 of the stage, and
// its B operand starts 32 bytes into the planes' rows per step.
//
// Where it runs: an sm_90a build on a compute-capability 9.0 GPU with the
// shared memory (weight_gradient_wgmma_can_run), A and B 16-byte aligned with row
// strides and K multiples of 4 (16-byte loads; a float4 of B lies wholly
// inside K or outside): weight_gradient_wgmma. N is free (the A copies
// zero-fill the columns past N, the B blocks past K are stored as zeros, rows
// past the chunk both); a warpgroup whose rows start past N only copies.
//
// ---- Both ----
// Accuracy (tf32x3.cuh): each element is split in registers as it is loaded
// (hi + lo); per run of two 8-row steps the six products go into a fresh
// accumulator (mma.sync: lo*hi, hi*lo, hi*hi a step; wgmma: both steps'
// lo*hi and hi*lo, then both hi*hi, detail/wgmma.cuh), which is then added in
// fp32 to the running sum:
// the tensor core truncates its own adds, so its chains stay short, and a
// position's terms are summed as an fp32 dot product would (the sum of the
// chunk's runs in order). Error: the split's (at most about 3 2^-22 of each
// term, typically far less) plus that of fp32 sums of T / 16 runs, against T
// terms for a plain fp32 loop (test_weight_gradient.cpp bounds it by that
// loop's error plus the split's). The two kernels sum the same runs, each
// run's terms in another order inside the tensor cores, and split the rows
// into other chunks: their results differ in the last bits, each call of one
// kernel gives the same bits.
//
// Split over rows, for the device's sake and determinism: with few tiles
// (D 64: one tile for d_Wo, two for d_Wqkv) one block a tile would leave the
// device idle, so the rows are cut into S chunks, S from (T, N, K, the
// kernel, SMs, shared memory) alone (plan.h's weight_gradient_split: for
// mma.sync tiles x S about two waves of the resident blocks, for wgmma one
// wave of one block an SM; chunks of at least 256 rows). S = 1: the
// blocks store C. S > 1: each stores its partial tile into partials [S][N][K]
// and a second kernel adds each element's S partials: 8 lanes, lane l adding
// chunks l, l + 8, ... in order, then the lanes' sums in lane order. Every
// sum has an order fixed by S, no atomics: the same bits on every call.
#include "weight_gradient.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../../common/validate.h"
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/tf32x3.cuh"
#include "../detail/wgmma.cuh"
#include "weight_gradient_parts.cuh"

namespace fastaxial::cuda {
namespace {
using namespace weight_gradient_detail;  // Product, BK, LDA, LDB and the parts

constexpr int BM = kWeightGradTileN, BN = kWeightGradTileK;  // a block's tile of C: 128 x 64
constexpr int kStages = kWeightGradStages;                   // the ring of stages of BK rows
constexpr int kWarpsN = 2, kThreads = 256;                   // warps 4 (rows) x 2 (columns)
constexpr int WM = 32, WN = 32;                              // a warp's piece of the tile
constexpr int kStageFloats = BK * (LDA + LDB);               // A (BK, LDA), then B (BK, LDB)
static_assert(BM == 4 * WM && BN == kWarpsN * WN && kThreads == 32 * 4 * kWarpsN, "8 warps of 32 x 32");
static_assert(LDA % 32 == 8 && LDB % 32 == 8, "fragment loads on distinct banks");
static_assert(BK % 16 == 0, "stages of whole runs of two 8-row steps");
static_assert((size_t)kStages * kStageFloats * sizeof(float) == kWeightGradSmemBytes, "plan.h's size");

constexpr int kSumCols = 32, kSumLanes = 8;  // the partials' total: a block of 32 elements x 8 lanes

// ---- The mma.sync kernel -----------------------------------------------------

// COLS columns from col0 of rows row .. row + BK - 1 of m (stride ld) into s (BK, LD): rows
// from `end` on and columns from `width` on zero-filled, never read. kVec: 16-byte copies (m and
// ld 16-byte aligned), else 4-byte ones. A thread copies one column (or 16-byte piece) of every
// kRowStep-th row, so its column, bounds and addresses are worked out once a stage.
template <int COLS, int LD, bool kVec>
__device__ __forceinline__ void copy_tile(float* s, const float* m, int64_t ld, int row, int end, int col0,
                                          int width) {
  constexpr int kFloats = kVec ? 4 : 1;         // floats a copy
  constexpr int kPerRow = COLS / kFloats;       // copies a row
  constexpr int kRowStep = kThreads / kPerRow;  // rows between a thread's copies
  static_assert(kThreads % kPerRow == 0 && BK % kRowStep == 0, "whole rows a pass of the block");
  const int r = threadIdx.x / kPerRow, c = threadIdx.x % kPerRow * kFloats;
  const int left = width - col0 - c;  // floats of the row from the thread's column on
  const int bytes = left <= 0 ? 0 : 4 * min(kFloats, left);
  const int rows = min(end - row, BK) - r;  // the thread's rows before `end`, from r
  const float* src = m + (int64_t)(row + r) * ld + col0 + c;
  const uint32_t dst = smem_addr(s + r * LD + c);
#pragma unroll
  for (int i = 0; i < BK / kRowStep; ++i) {
    const bool in = bytes > 0 && i * kRowStep < rows;
    const float* from = in ? src + i * kRowStep * ld : m;  // a valid address where nothing is read
    if constexpr (kVec)
      copy_async16(dst + i * kRowStep * LD * 4, from, in ? bytes : 0);
    else
      copy_async4(dst + i * kRowStep * LD * 4, from, in ? 4 : 0);
  }
}

// The block's tile of C (blockIdx.x) over its chunk of rows (blockIdx.y), into p.out: C itself
// (one chunk) or the chunk's partial tile. kVec: 16-byte copies. kSums: also A's column sums
// (ASums) into p.a_sums.
template <bool kVec, bool kSums>
__global__ void __launch_bounds__(kThreads, 2) chunk_product_kernel(const Product p) {
  extern __shared__ float4 smem4[];
  float* const sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  // Warp w: rows 32 (w / 2), columns 32 (w % 2). Where N <= 64 the working warps are 0..3, one
  // on each of the SM's sub-partitions (warp w on w % 4), not two on each of two.
  const int wm = warp / kWarpsN * WM, wn = warp % kWarpsN * WN;
  const ChunkTile tile = chunk_tile<BM, BN>(p);
  const int rows = tile.rows, steps = tile.steps;
  const bool active = tile.m0 + wm < p.N && tile.n0 + wn < p.K;  // else the warp's piece is all padding

  grid_dependency_wait();
  allow_dependent_launch();

  const auto copy_stage = [&](int stage, int step) {
    float* sa = sm + stage * kStageFloats;
    copy_tile<BM, LDA, kVec>(sa, tile.a, p.lda, step * BK, rows, tile.m0, p.N);
    copy_tile<BN, LDB, kVec>(sa + BK * LDA, tile.b, p.ldb, step * BK, rows, tile.n0, p.K);
  };
  float acc[2][4][4];
  zero_piece(acc);
  const bool sums = kSums && tile.n0 == 0;  // the chunk's first tile column takes A's column sums
  ASums a_sums;

  // The ring: stages 0 .. kStages - 2 in flight first; a group committed every step, empty or
  // not, so that wait<kStages - 2> always means "this step's copies are in".
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) copy_stage(s, s);
    copy_async_commit();
  }
  int read = 0, write = kStages - 1;
  for (int i = 0; i < steps; ++i) {
    copy_async_wait<kStages - 2>();  // this thread's copies of step i
    // Every thread's copies of step i are in, and every warp is done with step i - 1, whose
    // stage is copied into next.
    __syncthreads();
    if (i + kStages - 1 < steps) copy_stage(write, i + kStages - 1);
    copy_async_commit();
    if (active) {
      const float* sa = sm + read * kStageFloats;
      stage_products(acc, sa, sa + BK * LDA, wm, wn, g, t);
    }
    if (sums) a_sums.add(sm + read * kStageFloats);
    read = read == kStages - 1 ? 0 : read + 1;
    write = write == kStages - 1 ? 0 : write + 1;
  }

  if (sums) a_sums.store(p, tile, reinterpret_cast<double*>(sm));
  if (!active) return;
  store_piece(acc, p, tile.m0 + wm, tile.n0 + wn, g, t);
}

// ---- The wgmma kernel --------------------------------------------------------

constexpr int kStagesA = kWeightGradWgmmaStagesA;  // the A ring
constexpr int kWgBM = kWeightGradWgmmaTileN;        // two warpgroups of 64 rows
static_assert(kWgBM == 128 && kThreads == 256, "two warpgroups, one 64-row wgmma each");

// The shared memory of a block whose tiles are BN (128 or 64) columns wide: two B stages (hi
// plane, then lo plane, each BN rows of 32 positions), then the ring of A tiles.
template <int BN_>
struct WgTiling {
  static constexpr int BN = BN_;
  using Elem = Tf32x3;  // fp32 on the 3xTF32 products (detail/tf32x3.cuh): B stages of Elem::kPlanes planes
  static constexpr int kBPlane = BN * BK * 4;              // bytes: BN rows of 128
  static constexpr int kBStage = Elem::kPlanes * kBPlane;  // hi, lo
  static constexpr int kATile = BK * LDA * 4;              // bytes: 32 rows of 136 floats
  static constexpr int kBBlocks = BN * BK / 16;            // 4 x 4 blocks of a stage's B tile, one a thread
  static constexpr size_t kSmemBytes = 1024 + 2 * (size_t)kBStage + (size_t)kStagesA * kATile;
};
static_assert(WgTiling<128>::kSmemBytes == kWeightGradWgmmaSmemBytes, "plan.h's size");
#if FASTAXIAL_SM90A_DEVICE
static_assert(WgRows<Tf32x3, 128>::kBPlane == WgTiling<128>::kBPlane &&
                  WgRows<Tf32x3, 64>::kBPlane == WgTiling<64>::kBPlane,
              "the products read the planes where the stages hold them");
#endif
static_assert(WgTiling<128>::kBBlocks == kThreads && WgTiling<64>::kBBlocks == kThreads / 2,
              "BN 128: a block a thread; BN 64: a block a thread of warps 0-3");
static_assert(BK == 32 && WgTiling<64>::kBStage % 1024 == 0 && WgTiling<128>::kATile % 16 == 0,
              "rows of 32 positions (128 bytes); planes 1024-byte aligned; A tiles 16");

#if FASTAXIAL_SM90A_DEVICE
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}

// This thread's share of the A tiles' copies: the 16-byte piece at column c = 4 (x % 32) of rows
// x / 32 + 8 u (u < 4) of each stage, x = threadIdx.x. Set up once; a step's copies then cost an
// add an address, in step order.
struct ACopies {
  const float* next;  // A at the next step's row x / 32, column m0 + c
  int64_t ld8, step;  // 8 rows of A; a step's BK rows
  int left;           // the chunk's rows from the next step's row x / 32 on
  int bytes;          // of the piece inside N: 16, fewer at N's edge, 0 past it
  uint32_t dst;       // bytes into an A tile

  __device__ __forceinline__ ACopies(const float* a, int64_t lda, int m0, int N, int rows) {
    const int r = threadIdx.x / 32, c = threadIdx.x % 32 * 4;
    const int in_n = N - m0 - c;
    next = a + r * lda + m0 + c;
    ld8 = 8 * lda, step = BK * lda;
    left = rows - r;
    bytes = in_n <= 0 ? 0 : 4 * min(4, in_n);
    dst = (uint32_t)(r * LDA + c) * 4;
  }
  // The next step's rows into the A tile at shared address tile: rows past the chunk and columns
  // past N zero-filled (`any`: an address the copies that read nothing may name).
  __device__ __forceinline__ void copy(uint32_t tile, const float* any) {
    static_assert(kThreads == 8 * 32 && BK == 4 * 8 && kWgBM == 32 * 4, "a warp a row, 4 passes");
    const float* p = next;
#pragma unroll
    for (int u = 0; u < 4; ++u, p += ld8) {
      const bool in = bytes > 0 && 8 * u < left;
      copy_async16(tile + dst + u * 8 * LDA * 4, in ? p : any, in ? bytes : 0);
    }
    next += step, left -= BK;
  }
};

// This thread's share of the B tiles (the header): the 4 x 4 block of positions 4 tb .. 4 tb + 3
// of each stage and columns 4 kb .. 4 kb + 3 of the tile. Loaded a step at a time, in step order.
struct BBlock {
  const float* next;  // B at the next step's row 4 tb, column n0 + 4 kb
  int64_t ld, step;   // B's row stride; a step's BK rows
  int left;           // the chunk's rows from the next step's row 4 tb on
  bool in;            // a thread with a block, its columns inside K (K % 4 = 0: all four or none)
  uint32_t row;       // bytes into a plane of row 4 kb (its 8-row group, then row 4 (kb % 2) of it)
  int piece;          // tb ^ (4 kb) % 8: the swizzled piece of row 4 kb; row 4 kb + kk's is piece ^ kk

  template <int BN>
  __device__ __forceinline__ void init(const float* b, int64_t ldb, int n0, int K, int rows) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tb = 4 * (warp % 2) + lane % 8 / 2, kb = 8 * (warp / 2) + 2 * (lane / 8) + lane % 2;
    next = b + (int64_t)(4 * tb) * ldb + n0 + 4 * kb;
    ld = ldb, step = BK * ldb;
    left = rows - 4 * tb;
    in = threadIdx.x < WgTiling<BN>::kBBlocks && n0 + 4 * kb < K;
    row = (uint32_t)(kb / 2 * 1024 + kb % 2 * 512);
    piece = tb ^ (4 * (kb % 2));
  }
  // The next step's block into v: positions past the chunk, and columns past K, as zeros.
  __device__ __forceinline__ void load(float4 (&v)[4]) {
    const float* p = next;
#pragma unroll
    for (int i = 0; i < 4; ++i, p += ld)
      v[i] = in && i < left ? *reinterpret_cast<const float4*>(p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    next += step, left -= BK;
  }
};

__device__ __forceinline__ float element(const float4& v, int kk) {
  return kk == 0 ? v.x : kk == 1 ? v.y : kk == 2 ? v.z : v.w;
}

// v split into the B stage at shared address stage: for each column 4 kb + kk of the block, its 4
// positions' hi values as one 16-byte piece of the hi plane's row 4 kb + kk, the lo values at the
// same place of the lo plane.
template <int BN>
__device__ __forceinline__ void store_b(const float4 (&v)[4], const BBlock& s, uint32_t stage) {
  if (threadIdx.x >= WgTiling<BN>::kBBlocks) return;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) split<true>(element(v[i], kk), hi[i], lo[i]);
    const uint32_t at = stage + s.row + kk * 128 + ((uint32_t)(s.piece ^ kk) << 4);
    st_shared_v4(at, hi[0], hi[1], hi[2], hi[3]);
    st_shared_v4(at + WgTiling<BN>::kBPlane, lo[0], lo[1], lo[2], lo[3]);
  }
}

// The block's copy and split pipeline, a step at a time (the header's step i): the A tiles
// through cp.async into the ring, kStagesA - 1 steps ahead; the B blocks through registers (v),
// split into the two B stages a step ahead. B planes must start on 1024-byte boundaries (the
// swizzle): the B stages from base, then the ring.
template <int BN>
struct WgPipeline {
  using Tl = WgTiling<BN>;
  uint32_t base;       // the B stages (shared-space address)
  float* ring;         // the A tiles
  uint32_t ring_addr;  // ring as a shared-space address
  int steps;           // the chunk's
  const float* any;    // in A: an address the copies that read nothing may name
  ACopies ac;          // this thread's share of the A copies
  BBlock bb;           // and of the B blocks
  // The B block in flight: the kernel's array, not a member (in the struct, the compiler would
  // place the set-up above before the grid dependency wait).
  float4 (&v)[4];

  __device__ __forceinline__ WgPipeline(float* sm, const Product& p, const ChunkTile& tile, float4 (&v_)[4])
      : base(align_1024(smem_addr(sm))),
        ring(sm + (base - smem_addr(sm) + 2 * Tl::kBStage) / 4),
        ring_addr(smem_addr(ring)),
        steps(tile.steps),
        any(p.a),
        ac(tile.a, p.lda, tile.m0, p.N, tile.rows),
        v(v_) {
    bb.init<BN>(tile.b, p.ldb, tile.n0, p.K, tile.rows);
  }
  __device__ __forceinline__ const float* a_tile(int step) const { return ring + step % kStagesA * (Tl::kATile / 4); }
  __device__ __forceinline__ uint32_t b_stage(int step) const { return base + (uint32_t)(step % 2) * Tl::kBStage; }
  // Step `step`'s A copies; steps in order.
  __device__ __forceinline__ void copy_a(int step) {
    ac.copy(ring_addr + (uint32_t)(step % kStagesA) * Tl::kATile, any);
  }

  // Before the steps: the A copies of steps 0 .. kStagesA - 2, a group each, empty or not (as in
  // the mma.sync kernel); step 0's B block stored, step 1's loaded; step 0 in for all.
  __device__ __forceinline__ void fill() {
#pragma unroll
    for (int s = 0; s < kStagesA - 1; ++s) {
      if (s < steps) copy_a(s);
      copy_async_commit();
    }
    bb.load(v);
    store_b<BN>(v, bb, b_stage(0));
    bb.load(v);
    arrive();
  }
  // Step i, once every product of step i - 1 has completed: its B stage takes step i + 1's block,
  // step i + 2's is loaded, its A tile takes step i + kStagesA - 1's copies.
  __device__ __forceinline__ void refill(int i) {
    store_b<BN>(v, bb, b_stage(i + 1));
    bb.load(v);
    if (i + kStagesA - 1 < steps) copy_a(i + kStagesA - 1);
    copy_async_commit();
  }
  // The next step in for all, A and B: this thread's copies waited for, the B stores fenced for
  // the async proxy (generic-proxy stores before wgmma reads them), barrier.
  __device__ __forceinline__ void arrive() {
    copy_async_wait<kStagesA - 2>();
    fence_async_smem();
    __syncthreads();
  }
};
#endif  // FASTAXIAL_SM90A_DEVICE

// The block's tile of C (blockIdx.x) over its chunk of rows (blockIdx.y), into p.out, on wgmma.
// A and B 16-byte aligned, lda, ldb and K multiples of 4 (weight_gradient_wgmma). kSums: also
// A's column sums (ASums) into p.a_sums.
template <int BN, bool kSums>
__global__ void __launch_bounds__(kThreads, 1) chunk_product_wgmma_kernel(const Product p) {
#if FASTAXIAL_SM90A_DEVICE
  extern __shared__ float4 smem4[];
  // The warpgroup, through a shuffle so that ptxas sees it uniform in the warp: branches on it
  // around wgmma are then not divergent (else ptxas serialises the wgmma, warning C7518).
  const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0), g = threadIdx.x % 32 / 4;
  const int a_row = 64 * wg + 16 * (threadIdx.x % 128 / 32) + 2 * g;  // fragment rows g, g + 8 (the permutation)
  const ChunkTile tile = chunk_tile<kWgBM, BN>(p);
  const bool active = tile.m0 + 64 * wg < p.N;  // else the warpgroup's rows are all padding: it only copies
  float4 v[4];  // the B block in flight
  WgPipeline<BN> pipe(reinterpret_cast<float*>(smem4), p, tile, v);

  grid_dependency_wait();
  allow_dependent_launch();

  WgRows<typename WgTiling<BN>::Elem, BN> r;  // zeroed
  const bool sums = kSums && tile.n0 == 0;     // the chunk's first tile column takes A's column sums
  ASums a_sums;
  pipe.fill();
  if (active && tile.steps > 0) r.load(r.fa, pipe.a_tile(0), a_row, 0);

  // The steps, in one loop for working warpgroups and one for those that only copy: with one loop
  // and branches on `active` around the wgmma, ptxas sees a path (its analysis ignores that both
  // branches take the same side) where a run is still in flight at the loop's back edge, and waits
  // there (warning C7517).
  const auto all_steps = [&](auto working) {
    constexpr bool kWork = decltype(working)::value;
    for (int i = 0; i < tile.steps; ++i) {
      const float* const sa = pipe.a_tile(i);
      const uint32_t sb = pipe.b_stage(i);
      if constexpr (kWork) {
        r.issue(r.fa, sb, 0);  // run 0
        r.load(r.fb, sa, a_row, 2);
      }
      // Every product of step i - 1 has completed (each warpgroup waited for its runs before
      // this): its B stage and A tile are free.
      __syncthreads();
      pipe.refill(i);
      if constexpr (kWork) {
        r.add(r.fa);
        r.issue(r.fb, sb, 2);  // run 1
      }
      if (sums) a_sums.add(sa);  // while run 1 is on the tensor cores
      pipe.arrive();  // step i + 1 is in for all
      if constexpr (kWork) {
        if (i + 1 < tile.steps) r.load(r.fa, pipe.a_tile(i + 1), a_row, 0);
        r.add(r.fb);
      }
    }
  };
  if (active)
    all_steps(std::true_type{});
  else
    all_steps(std::false_type{});
  copy_async_wait<0>();  // the empty groups of the last steps
  if (sums) a_sums.store(p, tile, reinterpret_cast<double*>(pipe.ring));

  if (!active) return;
  r.store(p, tile, a_row);
#else
  (void)p;
  __trap();  // built without sm_90a: weight_gradient_variant never picks it there
#endif
}

// c (N, K, stride ldc) = the sum of the `splits` partial tiles [splits][N][K]. Element e (of N K,
// row-major) by threadIdx.x of a block of 32 elements, lane threadIdx.y adding partials y,
// y + 8, ... in order, then lane 0 the 8 lanes' sums in order. Lanes rather than one thread an
// element: with a small C (D 64: 4096 elements) and hundreds of chunks, one thread would wait
// out a memory latency for every few chunks.
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    split_total_kernel(const float* __restrict__ partials, int64_t splits, int N, int K, float* __restrict__ c,
                       int64_t ldc) {
  grid_dependency_wait();
  allow_dependent_launch();
  __shared__ float lane_sums[kSumLanes][kSumCols];
  const int64_t nk = (int64_t)N * K, e = (int64_t)blockIdx.x * kSumCols + threadIdx.x;
  float sum = 0.0f;
  if (e < nk) {
#pragma unroll 4
    for (int64_t s = threadIdx.y; s < splits; s += kSumLanes) sum += partials[s * nk + e];
  }
  lane_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || e >= nk) return;
  float total = 0.0f;
#pragma unroll
  for (int l = 0; l < kSumLanes; ++l) total += lane_sums[l][threadIdx.x];
  c[e / K * ldc + e % K] = total;
}

template <bool kVec, bool kSums>
cudaError_t launch_chunks(const Product& p, unsigned tiles, unsigned splits, const DeviceCaps& dev,
                          cudaStream_t stream) {
  constexpr auto kernel = chunk_product_kernel<kVec, kSums>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;  // 78 KB: past the default 48
  return launch_kernel<kernel>(dim3(tiles, splits), dim3(kThreads), kWeightGradSmemBytes, stream, dev, p);
}

template <int BN, bool kSums>
cudaError_t launch_wgmma(const Product& p, unsigned tiles, unsigned splits, const DeviceCaps& dev,
                         cudaStream_t stream) {
  constexpr auto kernel = chunk_product_wgmma_kernel<BN, kSums>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  return launch_kernel<kernel>(dim3(tiles, splits), dim3(kThreads), WgTiling<BN>::kSmemBytes, stream, dev, p);
}

}  // namespace

WeightGradVariant weight_gradient_variant(const WeightGradientArgs& g, const DeviceCaps& dev) {
  DeviceCaps d = dev;
#if !defined(FASTAXIAL_WGMMA)
  d.sm90a = false;  // no sm_90a code in this build: the wgmma kernel's body is a trap
#endif
  WeightGradProblem p;
  p.T = g.T, p.N = g.N, p.K = g.K, p.mma_sync = g.mma_sync;
  p.aligned = aligned16(g.a) && aligned16(g.b) && g.lda % 4 == 0 && g.ldb % 4 == 0;
  return fastaxial::weight_gradient_variant(p, d);
}

bool weight_gradient_wgmma(const WeightGradientArgs& g, const DeviceCaps& dev) {
  return weight_gradient_variant(g, dev).kernel == WeightGradKernel::kWgmma;
}

cudaError_t weight_gradient(const WeightGradientArgs& g, float* partials, size_t partials_bytes, const DeviceCaps& dev,
                            cudaStream_t stream) {
  if (g.T < 0 || g.N < 0 || g.K < 0 || g.ldc < g.K) return cudaErrorInvalidValue;
  if (g.N == 0 || g.K == 0) return cudaSuccess;
  if (g.c == nullptr) return cudaErrorInvalidValue;
  if (g.T > 0 && (g.a == nullptr || g.b == nullptr || g.lda < g.N || g.ldb < g.K)) return cudaErrorInvalidValue;
  const WeightGradVariant v = weight_gradient_variant(g, dev);
  const bool wgmma = v.kernel == WeightGradKernel::kWgmma;
  const WeightGradSplit split = v.split;
  if (split.splits > 1 &&
      (partials == nullptr || partials_bytes / sizeof(float) / (size_t)g.N / (size_t)g.K < (size_t)split.splits))
    return cudaErrorInvalidValue;
  const int bn = v.tile_cols;
  const int64_t tiles_k = (g.K + bn - 1) / bn, tiles = (g.N + BM - 1) / BM * tiles_k;
  if (tiles > INT_MAX) return cudaErrorInvalidValue;  // grid.x
  static_assert(BM == kWgBM, "both kernels' tiles have 128 rows");

  Product p;
  p.a = g.a, p.b = g.b, p.lda = g.lda, p.ldb = g.ldb;
  p.T = g.T, p.rows = split.rows, p.N = g.N, p.K = g.K, p.tiles_k = (int)tiles_k;
  p.out = split.splits > 1 ? partials : g.c;
  p.ld_out = split.splits > 1 ? g.K : g.ldc;
  p.vec_out = aligned16(p.out) && p.ld_out % 4 == 0;
  p.a_sums = g.a_sums;
  const bool vec = aligned16(g.a) && aligned16(g.b) && g.lda % 4 == 0 && g.ldb % 4 == 0;
  const auto tiles_u = (unsigned)tiles, splits_u = (unsigned)split.splits;
  const cudaError_t e = with_bools(
      [&](auto vec_c, auto sums_c) {
        constexpr bool kVec = decltype(vec_c)::value, kSums = decltype(sums_c)::value;
        if (!wgmma) return launch_chunks<kVec, kSums>(p, tiles_u, splits_u, dev, stream);
        return bn == 64 ? launch_wgmma<64, kSums>(p, tiles_u, splits_u, dev, stream)
                        : launch_wgmma<128, kSums>(p, tiles_u, splits_u, dev, stream);
      },
      vec, g.a_sums != nullptr);
  if (e != cudaSuccess) return e;
  if (split.splits == 1) return cudaSuccess;
  const int64_t blocks = ((int64_t)g.N * g.K + kSumCols - 1) / kSumCols;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;  // not reached: S > 1 only for small products
  return launch_kernel<split_total_kernel>(dim3((unsigned)blocks), dim3(kSumCols, kSumLanes), 0, stream, dev,
                                           static_cast<const float*>(partials), split.splits, g.N, g.K, g.c, g.ldc);
}

}  // namespace fastaxial::cuda
