// The staged path's attention step, flash-style: for each sequence n and
// head h,
//   o_h = softmax(q_h k_h^T / sqrt(hd)) v_h      q_h, k_h, v_h are (L, hd)
// read from the (T, 3D) qkv rows the QKV product wrote and written into the
// (T, D) o rows, with the per-row log-sum-exp on request (for a backward).
//
// Shape of the work. A block takes 64 queries (BM; 32 for a short sequence,
// below) of one (sequence, head): the grid is (query tile, head, sequence),
// flattened with the query tile fastest so that the blocks of one (sequence,
// head) run side by side and share its keys and values in L2, and so that a
// single long sequence still fills the device (L = 2048, 4 heads: 128
// blocks). Each of its 4 warps owns 16 query rows. The keys and values go
// through shared memory BN at a time, double-buffered where the sequence has
// more than one key tile: the copy of tile j + 1 (cp.async) is in flight
// while tile j is computed, one barrier per tile. Nothing of a whole sequence is held,
// so shared memory does not grow with L. A short sequence takes blocks of 1
// warp (L <= 16) or 2 (L <= 32), so that every warp has queries, with key
// tiles of at most 16 W keys, so that its products are not mostly padding,
// and one that is a single key tile one buffer: such blocks are
// latency-bound, and the registers and shared memory they no longer hold
// let more of them share an SM.
//
// Per tile and warp, all on the tensor cores with 3xTF32 (detail/tf32x3.cuh; or the 16-bit products below),
// the parts of flash_parts.cuh and mainloop_mma.cuh:
//   s (16, BN) = q (16, HDP) k^T (HDP, BN)       MmaMainloop::scores
//   online softmax on s in registers: running row max m and sum l (base 2:
//   s is scaled by log2(e) / sqrt(hd), p = exp2(s - m))    FlashRows::step
//   o (16, HDP) = o * exp2(m_old - m) + p (16, BN) v (BN, HDP)   MmaMainloop::pv
//   at the end, o / l and the lse, or a split's partials    FlashRows::store*
// v is stored as it comes, key-major, at a row stride that puts the pv
// product's B fragment loads in 32 distinct banks. The kernel's own parts,
// in this file, are what follows its tile shape and stages: the head
// padding's zeros (zero_block_padding), the head-row copies (HeadRows), a
// split's key tiles (split_key_tiles), the two-stage tile stream
// (stream_tile), a tile's products (tile_products), the epilogue
// (store_unit).
//
// common/plan.h's flash_variant picks the kernel of a pass: on sm_90a code,
// sequences longer than 64 go to wgmma versions of this kernel instead (head
// dims 17 to 32 to flash_attention_wgmma.cu, the same results; 49 to 128 to
// flash_attention_wgmma_wide.cu, split-KV there too), and sequences of
// kFlashShortMaxLen (4) positions or fewer to a warp-per-(sequence, head)
// kernel in plain fp32 (flash_short_kernel); FlashArgs::mma_sync keeps them
// all here.
//
// Products (FlashArgs::products): 3xTF32 (Tf32x3), or bf16 or fp16 with fp32
// accumulation (detail/mma16.cuh's traits: q, k, v and p rounded to the
// 16-bit type as fragments are made, as autocast computes the reference's
// products), the kernel's first template argument; 16-bit products never split.
//
// Head dims: the kernel is a template on a padded head dim HDP (8, 16, 32,
// 48, 64, 96, 128, 192, 256); columns hd..HDP-1 of q, k and v are zero in
// shared memory (they change no score, and the output columns they make are
// not stored). Registers per thread: o is 16 x HDP over 32 lanes (HDP / 2
// floats), s is 16 x BN (BN / 2 floats); BN shrinks as HDP grows (64 up to
// HDP 64, 32 up to 128, 16 beyond) so that nothing spills, and q's fragments
// are read from shared memory and split at each k-step rather than held.
// q, k and v stay raw fp32 in shared memory (cp.async copies them as they
// are) and are split into (hi, lo), or rounded to 16 bits, as fragments are loaded.
//
// Global loads: 16-byte cp.async where every head slice is 16-byte aligned
// (hd % 4 == 0 and qkv 16-byte aligned, hence D % 4 == 0), else 4-byte
// cp.async per element (hd odd, say). Positions >= L are zero-filled by the
// copies (a zero row of v times a zero probability stays zero; uninitialised
// shared memory could hold NaNs), and their scores are -inf before the row
// max; queries >= L are computed but not stored.
//
// Attention dropout (a second instantiation, kDropout, so that the kernel
// without it carries none of its code): after a tile's p enter the row sums l (so l and lse stay
// the undropped softmax's), each dropped p is zeroed before p v, and the
// kept ones' 1 / (1 - p) is applied with 1 / l to o at the end. The mask is
// common/dropout.h's, drawn a run of four keys per lane and n-tile and
// shared across the quad (dropout_share16): one Philox call a lane and
// n-tile where L and the pass's base are multiples of 4, two elsewhere.
//
// Split-KV (a third instantiation, kSplit; the forwards without dropout):
// where the blocks above are too few to fill the device (smem_layout.h's
// flash_kv_splits: (1, 1, 4096, 32, 1)'s row pass is 64 blocks of 64 key
// tiles each on 132 SMs; split 6 ways, 384 blocks of 10 or 11 key tiles,
// one round at three blocks an SM), the key tiles of each (item, query tile) are cut into S
// contiguous ranges, a block each, as blockIdx.x = ((n heads + h) S + split)
// q_tiles + query tile. A split block runs the loop above over its range
// only and writes its unnormalised o, m and l to the partials buffer; then
// flash_combine_kernel merges the S partials of each query row in split
// order (deterministic, no atomics):
//   M = max_s m_s, l = sum_s l_s 2^(m_s - M), o = sum_s o_s 2^(m_s - M) / l,
//   lse2 = M + log2 l (detail/lse.cuh: two floats, log2 units).
// Every split holds at least one key < L (S <= key tiles / 2), so m_s is
// finite.
#include "flash_attention.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../../common/smem_layout.h"
#include "../../common/validate.h"  // aligned16
#include "../detail/async_copy.cuh"
#include "../detail/host.h"
#include "../detail/launch.cuh"
#include "../detail/lse.cuh"
#include "../detail/mma16.cuh"
#include "../detail/online_softmax.cuh"
#include "../detail/tf32x3.cuh"
#include "flash_parts.cuh"
#include "mainloop_mma.cuh"

namespace fastaxial::cuda {
namespace {

// Warps a block, each owning 16 queries: 4 (64 queries) in general, 2 where
// the sequence has 32 positions or fewer, 1 where it has 16 or fewer, so that
// no warp of the block only copies and the registers and shared memory (q
// rows) of a block go to warps that compute: such blocks are latency-bound,
// and more of their (sequence, head) items then run side by side on an SM (a
// 3-warp block for L <= 48 gained nothing, so there is none).
constexpr int kWarps = 4;
constexpr int kBM = 16 * kWarps;  // queries a block of kWarps warps
static_assert(kBM == kFlashQueryTile, "smem_layout.h's split rule counts these query tiles");
// The warps a block for a sequence of length L (splits take kWarps).
constexpr int flash_warps(int64_t len) { return len <= 16 ? 1 : len <= 32 ? 2 : kWarps; }
// A sequence short enough for fewer warps is one query tile of kBM as well, so the grid-size
// check in flash_attention, which counts tiles of kBM, counts the blocks launched.
static_assert(flash_warps(kBM) == kWarps && flash_warps(kBM + 1) == kWarps, "short blocks: L < kBM only");
constexpr int kMaxLen = 1 << 30;  // L below this: tile arithmetic in int

// Shared memory of the kernel for padded head dim HDP and W warps, in floats:
//   q: (16 W, HDP) at row stride ldk
//   k: `stages` stages of (BN, HDP) at row stride ldk
//   v: `stages` stages of (BN, HDP) at row stride ldv
// Two stages (the next key tile's copy overlaps this one's work), or one
// where the sequence is a single key tile: less shared memory, more blocks
// an SM.
// q and k are read by 8-byte fragment loads (load_a_perm, load_bt_perm: a
// half warp reads words 2t, 2t + 1 of rows g = 0..3), so ldk is 8 or 24 mod
// 32 (common/smem_layout.h); v by 4-byte loads of rows 2t, 2t + 1 at column
// g (t = 0..3, g = 0..7), distinct banks when 2 ldv is 8 or 24 mod 32: ldv =
// HDP + 4 with HDP a multiple of 8. Both are multiples of 4 floats, so every
// row starts 16-byte aligned for cp.async.
template <int HDP, int W = kWarps>
struct FlashTile {
  static_assert(HDP % 8 == 0 && HDP >= 8 && HDP <= 256, "padded head dim");
  static_assert(W == 1 || W == 2 || W == kWarps, "warps a block: flash_warps");
  static constexpr int BM = 16 * W;  // queries a block
  // Keys a tile: 64 up to HDP 64, 32 up to 128, 16 beyond (flash_key_tile); at most BM, so that the
  // short blocks (L <= 16 W) take one tile of at most 16 W keys: at L = 16 a tile of 64 was three
  // quarters padding, every score and p v product of it computed.
  static constexpr int BN = flash_key_tile(HDP) < BM ? flash_key_tile(HDP) : BM;
  static constexpr int ldk = float2_row_words(HDP);
  static constexpr int ldv = HDP + 4;
  static constexpr int q_floats = BM * ldk;
  static constexpr int k_floats = BN * ldk;  // one stage
  static constexpr int v_floats = BN * ldv;  // one stage
  // Stages for a sequence of `len` positions; the bytes of q and `st` stages.
  __host__ __device__ static constexpr int stages(int len) { return len > BN ? 2 : 1; }
  static constexpr size_t bytes_of(int st) { return (size_t)(q_floats + st * (k_floats + v_floats)) * sizeof(float); }
  static constexpr size_t bytes = bytes_of(2);  // the most a launch takes
  static constexpr size_t bytes_for(int len) { return bytes_of(stages(len)); }
  static_assert(ldk % 32 == 8 || ldk % 32 == 24, "q, k rows: conflict-free 8-byte fragment loads");
  static_assert((2 * ldv) % 32 == 8 || (2 * ldv) % 32 == 24, "v rows: conflict-free 4-byte fragment loads");
  static_assert(ldk % 4 == 0 && ldv % 4 == 0 && q_floats % 4 == 0 && k_floats % 4 == 0 && v_floats % 4 == 0,
                "16-byte aligned rows and buffers");
  static_assert(BN % 16 == 0, "P @ V takes the key groups in pairs");
};

// ---- The kernel's parts ------------------------------------------------------
// Columns hd..HDP-1 of the block's buffers, zero for the whole block: the
// copies never write them, and zeros change no score. q's rows and k's
// `stages` stages are contiguous at qs (row stride ldk), v's stages at vs
// (ldv). Shared memory only, so the kernel runs it before its wait.
template <int HDP, int W>
__device__ __forceinline__ void zero_block_padding(float* qs, float* vs, int stages, int hd, int tid) {
  using Tile = FlashTile<HDP, W>;
  if (hd < HDP) {
    const int pad = HDP - hd;
    const int qk_rows = Tile::BM + stages * Tile::BN, rows = qk_rows + stages * Tile::BN;  // q, k's stages, v's
    for (int e = tid; e < rows * pad; e += 32 * W) {
      const int r = e / pad, c = hd + e % pad;
      float* p = r < qk_rows ? qs + r * Tile::ldk : vs + (r - qk_rows) * Tile::ldv;  // q and k share ldk
      p[c] = 0.0f;
    }
  }
}

// The block's cp.async copies of head rows (copy_head_rows): rows p0 .. of a
// head slice at src (row 0's columns; position l at seq + l ps rows of
// row_words floats) into shared memory, positions >= L as zeros (read from
// fill, any valid address). q's BM rows at row stride ldk; a key tile's BN
// rows of k (ldk) and of v (ldv) into a stage.
template <int HDP, int W, bool kVec>
struct HeadRows {
  using Tile = FlashTile<HDP, W>;
  int64_t seq, ps, row_words;
  int L, hd;
  const float* fill;
  int tid;

  template <int ROWS, int LD>
  __device__ __forceinline__ void copy(float* dst, const float* src, int p0) const {
    const auto at = [&](int l, int c) { return src + (seq + l * ps) * row_words + c; };
    copy_head_rows<HDP, kVec, 4>(dst, RowMajor<LD>(), at, p0, ROWS, L, hd, fill, tid, 32 * W);
  }
  // q (BM, HDP) of queries q0 ..
  __device__ __forceinline__ void q(float* qs, const float* qg, int q0) const {
    copy<Tile::BM, Tile::ldk>(qs, qg, q0);
  }
  // The key tile of keys key0 ..: k and v (BN, HDP) into stage st of ks and vs.
  __device__ __forceinline__ void tile(float* ks, float* vs, const float* kg, const float* vg, int st, int key0) const {
    copy<Tile::BN, Tile::ldk>(ks + st * Tile::k_floats, kg, key0);
    copy<Tile::BN, Tile::ldv>(vs + st * Tile::v_floats, vg, key0);
  }
};

// The key tiles j0 .. j1 - 1 a block runs: all `tiles`, or under kSplit its
// split's contiguous range of S (at least one: S <= tiles / 2).
struct KeyTiles {
  int j0, j1;
};
template <bool kSplit>
__device__ __forceinline__ KeyTiles split_key_tiles(int tiles, int split, int S) {
  KeyTiles r{0, tiles};
  if constexpr (kSplit) {
    const int2 keys = split_key_range(tiles, split, S);
    r.j0 = keys.x;
    r.j1 = keys.y;
  }
  return r;
}

// The two-stage stream at key tile j of j0 .. j1 - 1, before its products:
// this thread's copies of tile j (and of q) in, then every thread's (the
// barrier, which also says every warp is done with tile j - 1); then tile
// j + 1's copy, copy_tile(stage, first key), into the stage tile j - 1 left.
template <int BN, class CopyTile>
__device__ __forceinline__ void stream_tile(int j, int j0, int j1, CopyTile&& copy_tile) {
  copy_async_wait<0>();
  __syncthreads();
  if (j + 1 < j1) {
    copy_tile((j + 1 - j0) & 1, (j + 1) * BN);
    copy_async_commit();
  }
}

// A warp's products of key tile j (k and v (BN, HDP) at kt, vt): the keep
// bits first (fewer registers live than with the scores), s (16, BN) =
// q k^T, the online softmax on s in base 2 with keys >= L at -inf (only the
// last tile has any), dropped p zeroed after the row sums took them,
// o += p v.
template <class Mainloop, int NF, class Dropout>
__device__ __forceinline__ void tile_products(FlashRows<NF>& rows, const Dropout& dropout, const float* qw,
                                              const float* kt, const float* vt, int j, float scale_log2, int L,
                                              int g, int t) {
  constexpr int NT = Mainloop::NT, BN = 8 * NT;
  uint32_t keep[NT / 2];
  dropout.template keep_bits<NT>(keep, j * BN, L, g, t);
  float s[NT][4];
  Mainloop::scores(s, qw, kt);
  const auto sx = [&](int jn, int e) -> float& { return s[jn][e]; };
  rows.template step<NT>(sx, scale_log2, j * BN, L, t);
  dropout.template apply<NT>(sx, keep, t);
  Mainloop::pv([&](int f) -> float(&)[4] { return rows.group(f); }, s, vt, g, t);
}

// The epilogue of the warp's rows r0 = q0 + 16 warp + g and r0 + 8: o / l
// (with dropout, times the kept probabilities' scale: 0 where p = 1) and the
// lse into the output; under kSplit, the split's unnormalised o, m and l.
// On 16-bit products, o goes to a.o16 rounded to their type where a.o16 is given, and to a.o too
// where that is not null.
template <class Elem>
struct OutputOf {  // Tf32x3: float
  using type = float;
};
template <class T>
struct OutputOf<Mma16<T>> {
  using type = T;
};

template <class Elem, bool kSplit, bool kDropout, int NF>
__device__ __forceinline__ void store_unit(FlashRows<NF>& rows, const AttentionKernelArgs& a, const DropoutPass& dpass,
                                           const FlashPartials& sp, const BlockUnit& u, int64_t seq, int r0, int L,
                                           int hd, int t) {
  using Out16 = typename OutputOf<Elem>::type;
  const float num = kDropout ? dpass.scale : 1.0f;
  if constexpr (kSplit) {
    rows.store_partials(sp, u.split, u.item, r0, L, hd, t);
  } else {
    if constexpr (!std::is_same_v<Out16, float>)
      rows.template store_16bit<Out16>(a, num, seq, u.h * hd, u.item, r0, L, hd, t);
    else
      rows.store(a, num, seq, u.h * hd, u.item, r0, L, hd, t);
  }
}

// The kernels take AttentionKernelArgs (flash_kernel_args), the dropout
// fields as a DropoutPass of their own: FlashArgs with them is past 128
// bytes, where the compiler treats a struct parameter differently, and the
// kernels without dropout took other registers.

// One block: one unit (flash_parts.cuh), blockIdx.x = ((n heads + h) S +
// split) q_tiles + query tile, with S = sp.splits under kSplit, else 1.
// kVec: the 16-byte copies (every head slice 16-byte aligned). kDropout:
// dpass applies (threshold != 0). kSplit: the split's key tiles only, o, m
// and l to sp.partials unnormalised (a.o and a.lse unused).
template <class Elem, int HDP, int W, bool kVec, bool kDropout, bool kSplit>
__global__ void __launch_bounds__(32 * W)
    flash_attention_kernel(const AttentionKernelArgs a, float scale_log2, int q_tiles, const DropoutPass dpass,
                           const FlashPartials sp) {
  static_assert(!(kSplit && kDropout), "splits only without dropout");
  static_assert(!kSplit || W == kWarps, "smem_layout.h's split rule counts blocks of kBM queries");
  using Tile = FlashTile<HDP, W>;
  using Mainloop = MmaMainloop<Elem, HDP, Tile::BN, Tile::ldk, Tile::ldv>;
  constexpr int BM = Tile::BM, BN = Tile::BN;
  const int hd = a.D / a.heads, L = (int)a.pos.len;
  // As the launcher sized shared memory (bytes_for(L)); a split has L >= 1024, hence two stages,
  // written as a constant so that the split kernels need no test of L.
  const int stages = kSplit ? 2 : Tile::stages(L);
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);  // q is (BM, HDP), row stride ldk
  float* ks = qs + Tile::q_floats;              // k stage s at ks + s * k_floats: (BN, HDP), row stride ldk
  float* vs = ks + stages * Tile::k_floats;     // v stage s at vs + s * v_floats: (BN, HDP), row stride ldv
  const int tid = threadIdx.x, warp = tid / 32, g = tid % 32 / 4, t = tid % 4;
  const BlockUnit u = flash_block_unit<kSplit>(q_tiles, sp.splits, a.heads, BM);
  zero_block_padding<HDP, W>(qs, vs, stages, hd, tid);

  grid_dependency_wait();
  allow_dependent_launch();

  UnitDropout<kDropout> dropout(dpass);
  dropout.start(dpass, u.item, u.q0 + 16 * warp, L);

  const int64_t seq = a.pos.offset(u.n, 0);  // row of position 0 (one 64-bit division a block)
  const HeadRows<HDP, W, kVec> copy{seq, a.pos.pos_stride, 3 * (int64_t)a.D, L, hd, a.qkv, tid};
  const float* qg = a.qkv + (int64_t)u.h * hd;  // this head's q columns of row 0; k at + D, v at + 2D
  const float* kg = qg + a.D;
  const float* vg = qg + 2 * a.D;
  const auto copy_tile = [&](int st, int key0) { copy.tile(ks, vs, kg, vg, st, key0); };

  const KeyTiles range = split_key_tiles<kSplit>((L + BN - 1) / BN, u.split, sp.splits);
  copy.q(qs, qg, u.q0);
  copy_tile(0, range.j0 * BN);
  copy_async_commit();

  const bool active = u.q0 + 16 * warp < L;  // a warp whose rows are all >= L only copies
  FlashRows<HDP / 8> rows;
  rows.reset();
  const float* qw = qs + 16 * warp * Tile::ldk;  // the warp's q rows (16, HDP)
  for (int j = range.j0; j < range.j1; ++j) {
    stream_tile<BN>(j, range.j0, range.j1, copy_tile);
    if (!active) continue;
    const int st = (j - range.j0) & 1;
    tile_products<Mainloop>(rows, dropout, qw, ks + st * Tile::k_floats, vs + st * Tile::v_floats, j,
                            scale_log2, L, g, t);
  }
  if (!active) return;
  store_unit<Elem, kSplit, kDropout>(rows, a, dpass, sp, u, seq, u.q0 + 16 * warp + g, L, hd, t);
}

constexpr int kCombineThreads = 256;

// Merges the sp.splits partials of each query row, in split order: a thread
// per (row r = (n heads + h) L + l, column c < hd), thread e = r hd + c, so
// the o partials are read coalesced; the m and l of a row are broadcasts.
__global__ void __launch_bounds__(kCombineThreads)
    flash_combine_kernel(const AttentionKernelArgs a, const FlashPartials sp) {
  grid_dependency_wait();
  allow_dependent_launch();
  const int hd = a.D / a.heads, L = (int)a.pos.len;
  const int64_t e = (int64_t)blockIdx.x * kCombineThreads + threadIdx.x;
  if (e >= sp.rows * hd) return;
  const int64_t r = e / hd;
  const int c = (int)(e % hd);
  const int64_t item = r / L;
  const int l = (int)(r % L);
  const int h = (int)(item % a.heads);
  const int64_t n = item / a.heads;
  const int64_t rows = sp.rows;
  const float* po = sp.partials + r * hd + c;                        // split s at + s rows hd
  const float* pm = sp.partials + (int64_t)sp.splits * rows * hd + r;  // split s at + s rows
  const float* pl = pm + (int64_t)sp.splits * rows;
  float mx = -INFINITY;
  for (int s = 0; s < sp.splits; ++s) mx = fmaxf(mx, pm[s * rows]);  // finite: every split has a key
  float sum = 0.0f, acc = 0.0f;
  for (int s = 0; s < sp.splits; ++s) {
    const float w = exp2f(pm[s * rows] - mx);
    sum += pl[s * rows] * w;
    acc += po[s * rows * hd] * w;
  }
  a.o[a.pos.offset(n, l) * a.D + (int64_t)h * hd + c] = acc * (1.0f / sum);
  if (a.lse && c == 0) store_lse2(a.lse, rows, r, mx, sum);  // as the kernel's
}

// Short sequences (L <= kFlashShortMaxLen = 4: the column pass of a
// (B, 1, W) or (B, 2, W) grid, say). The tiled kernel runs a block of 32 queries for
// each (sequence, head), most of it padding, through all of its products:
// latency-bound. Here a warp per item (n heads + h), lanes
// over its columns, in plain fp32: for each query, the L scores as
// warp-reduced dot products, their softmax (base 2, as the tiled kernel's),
// and o = sum_j p_j v_j / l; the lse as m + log2 l. With L = 1 that is o =
// v (times the mask's scale, or 0). q's columns in registers (hd <= 256:
// 8 a lane); k and v rows read again for each query (L1).
constexpr int kShortThreads = 256;

template <bool kDropout>
__global__ void __launch_bounds__(kShortThreads)
    flash_short_kernel(const AttentionKernelArgs a, float scale_log2, const DropoutPass dpass) {
  constexpr int kCols = (kFlashMaxHeadDim + 31) / 32;  // a lane's columns c = lane + 32 k
  grid_dependency_wait();
  allow_dependent_launch();
  const int hd = a.D / a.heads, L = (int)a.pos.len, lane = threadIdx.x % 32;
  const int64_t items = a.pos.num_seq * a.heads;
  const int64_t item = (int64_t)blockIdx.x * (kShortThreads / 32) + threadIdx.x / 32;
  if (item >= items) return;
  const int h = (int)(item % a.heads);
  const int64_t row0 = a.pos.offset(item / a.heads, 0), step = a.pos.pos_stride * 3 * (int64_t)a.D;
  const float* q0 = a.qkv + row0 * 3 * a.D + (int64_t)h * hd;  // position l's q at + l step; k at + D, v at + 2D
  DropoutParams drop;
  if constexpr (kDropout) drop = dropout_read(dpass);
  for (int i = 0; i < L; ++i) {
    float q[kCols];
#pragma unroll
    for (int k = 0; k < kCols; ++k) q[k] = lane + 32 * k < hd ? q0[i * step + lane + 32 * k] : 0.0f;
    float s[kFlashShortMaxLen];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kFlashShortMaxLen; ++j) {
      if (j >= L) break;
      const float* kj = q0 + j * step + a.D;
      float dot = 0.0f;
#pragma unroll
      for (int k = 0; k < kCols; ++k)
        if (lane + 32 * k < hd) dot = fmaf(q[k], kj[lane + 32 * k], dot);
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
      s[j] = dot * scale_log2;
      mx = fmaxf(mx, s[j]);
    }
    float l = 0.0f;
#pragma unroll
    for (int j = 0; j < kFlashShortMaxLen; ++j) {
      if (j >= L) break;
      s[j] = exp2f(s[j] - mx);
      l += s[j];
      if constexpr (kDropout)
        if (!dropout_keep(drop, dpass.base + ((uint64_t)item * (uint64_t)L + (uint64_t)i) * (uint64_t)L + (uint64_t)j))
          s[j] = 0.0f;
    }
    const float inv = (kDropout ? dpass.scale : 1.0f) / l;
    float* o = a.o + (row0 + (int64_t)i * a.pos.pos_stride) * a.D + (int64_t)h * hd;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int c = lane + 32 * k;
      if (c >= hd) break;
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < kFlashShortMaxLen; ++j) {
        if (j >= L) break;
        acc = fmaf(s[j], q0[j * step + 2 * a.D + c], acc);
      }
      o[c] = acc * inv;
    }
    if (a.lse && lane == 0) store_lse2(a.lse, items * L, item * L + i, mx, l);
  }
}

// A template so that a build without Random123 never instantiates the dropout kernel.
template <typename = void>
cudaError_t launch_short(const FlashArgs& a, float scale_log2, const DeviceCaps& dev, cudaStream_t stream) {
  const AttentionKernelArgs k = flash_kernel_args(a);
  const int64_t items = a.pos.num_seq * a.heads;
  const dim3 grid((unsigned)((items + kShortThreads / 32 - 1) / (kShortThreads / 32)));
  if constexpr (kDropoutAvailable)
    if (a.dropout.threshold != 0)
      return launch_kernel<flash_short_kernel<true>>(grid, dim3(kShortThreads), 0, stream, dev, k, scale_log2,
                                                     dropout_pass(a.dropout, a.pass, a.philox));
  return launch_kernel<flash_short_kernel<false>>(grid, dim3(kShortThreads), 0, stream, dev, k, scale_log2,
                                                  DropoutPass{});
}

// The merge of a split pass's partials into o and lse (flash_combine_kernel).
cudaError_t launch_combine(const FlashArgs& a, const FlashPartials& sp, const DeviceCaps& dev, cudaStream_t stream) {
  const AttentionKernelArgs k = flash_kernel_args(a);
  const int64_t combine_blocks = (sp.rows * (a.D / a.heads) + kCombineThreads - 1) / kCombineThreads;
  return launch_kernel<flash_combine_kernel>(dim3((unsigned)combine_blocks), dim3(kCombineThreads), 0, stream, dev, k,
                                             sp);
}

// One launch of the kernel with W warps a block: a block per (sequence,
// head, query tile of 16 W) [, split].
template <class Elem, int HDP, int W, bool kVec, bool kDropout, bool kSplit>
cudaError_t launch_flash(const FlashArgs& a, float scale_log2, const FlashPartials& sp, const DeviceCaps& dev,
                         cudaStream_t stream) {
  using Tile = FlashTile<HDP, W>;
  constexpr auto kernel = flash_attention_kernel<Elem, HDP, W, kVec, kDropout, kSplit>;
  if (Tile::bytes > (size_t)dev.smem_optin) return cudaErrorInvalidConfiguration;
  if constexpr (Tile::bytes > 48 * 1024)
    if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const int L = (int)a.pos.len;
  const int q_tiles = (L + Tile::BM - 1) / Tile::BM;
  const int64_t blocks = a.pos.num_seq * a.heads * q_tiles;  // <= 2^31 - 1 (flash_attention checks it for kBM)
  const AttentionKernelArgs k = flash_kernel_args(a);
  const DropoutPass dpass = kDropout ? dropout_pass(a.dropout, a.pass, a.philox) : DropoutPass{};
  if (cudaError_t e = launch_kernel<kernel>(dim3((unsigned)(blocks * sp.splits)), dim3(32 * W), Tile::bytes_for(L),
                                            stream, dev, k, scale_log2, q_tiles, dpass, sp);
      e != cudaSuccess || !kSplit)
    return e;
  return launch_combine(a, sp, dev, stream);
}

// The instantiation for a's flags: 16-byte copies (vec), dropout, split (no dropout there), and
// blocks of 1 or 2 warps for short sequences (flash_warps; splits take kWarps); Elem: the products'
// element traits (a 16-bit one never splits).
template <class Elem, int HDP>
cudaError_t launch_flash(const FlashArgs& a, bool vec, float scale_log2, const FlashPartials& sp, const DeviceCaps& dev,
                         cudaStream_t stream) {
  const bool split = sp.splits > 1;
  const bool dropout = kDropoutAvailable && !split && a.dropout.threshold != 0;
  const int warps = split ? kWarps : flash_warps(a.pos.len);
  return with_bools(
      [&](auto v, auto d, auto s, auto one, auto two) {
        constexpr bool kDropout = decltype(d)::value, kSplit = decltype(s)::value;
        constexpr int W = decltype(one)::value ? 1 : decltype(two)::value ? 2 : kWarps;
        if constexpr ((kDropout && (kSplit || !kDropoutAvailable)) || (kSplit && W != kWarps) ||
                      (kSplit && !std::is_same_v<Elem, Tf32x3>) || (decltype(one)::value && decltype(two)::value))
          return cudaErrorInvalidValue;  // never asked for
        else
          return launch_flash<Elem, HDP, W, decltype(v)::value, kDropout, kSplit>(a, scale_log2, sp, dev, stream);
      },
      vec, dropout, split, warps == 1, warps == 2);
}

template <int HDP>
int split_occupancy(const DeviceCaps& dev) {
  using Tile = FlashTile<HDP, kWarps>;
  constexpr auto kernel = flash_attention_kernel<Tf32x3, HDP, kWarps, true, false, true>;
  if (Tile::bytes > (size_t)dev.smem_optin || allow_max_smem<kernel>(dev) != cudaSuccess) return 0;
  int n = 0;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, 32 * kWarps, Tile::bytes) == cudaSuccess ? n : 0;
}

}  // namespace

// The plan (common/plan.cpp) sends a pass here by smem_layout.h's bounds.
static_assert(FlashTile<256>::bytes == kFlashMaxSmemBytes && FlashTile<192>::bytes <= kFlashMaxSmemBytes &&
                  FlashTile<128>::bytes <= kFlashMaxSmemBytes && FlashTile<96>::bytes <= kFlashMaxSmemBytes &&
                  FlashTile<64>::bytes <= kFlashMaxSmemBytes,
              "smem_layout.h's kFlashMaxSmemBytes is the largest tiling");

int flash_split_occupancy(int64_t head_dim, const DeviceCaps& dev) {
  return with_padded_head_dim(
      flash_padded_head_dim(head_dim), [&](auto h) { return split_occupancy<decltype(h)::value>(dev); }, 0);
}

size_t flash_attention_smem_bytes(int64_t head_dim) {
  return with_padded_head_dim(
      flash_padded_head_dim(head_dim), [](auto h) { return (size_t)FlashTile<decltype(h)::value>::bytes; }, size_t{0});
}

namespace {

// What the kernel choice reads of a call: its problem, and the device as this build runs on it.
FlashProblem flash_problem(const FlashArgs& a) {
  FlashProblem f;
  f.num_seq = a.pos.num_seq, f.len = a.pos.len, f.head_dim = a.heads > 0 ? a.D / a.heads : 0, f.heads = a.heads;
  f.dropout = a.dropout.threshold != 0, f.mma_sync = a.mma_sync, f.products = a.products;
  f.partials_bytes = a.partials != nullptr ? a.partials_bytes : 0;
  f.qkv16 = a.qkv16 != nullptr;
  return f;
}
DeviceCaps built_caps(const DeviceCaps& dev) {
  DeviceCaps d = dev;
#if !defined(FASTAXIAL_WGMMA)
  d.sm90a = false;  // no sm_90a code in this build: the wgmma kernels' bodies are traps
#endif
  return d;
}

}  // namespace

FlashVariant flash_attention_variant(const FlashArgs& a, const DeviceCaps& dev) {
  return flash_variant(flash_problem(a), built_caps(dev));
}

bool flash_qkv16_chosen(const FlashArgs& a, const DeviceCaps& dev) {
  return flash_qkv16_can_run(flash_problem(a), built_caps(dev));  // (it reads no f.qkv16)
}

cudaError_t flash_attention(const FlashArgs& a, const DeviceCaps& dev, cudaStream_t stream) {
  if (a.heads <= 0 || a.D <= 0 || a.D % a.heads != 0 || a.pos.num_seq < 0 || a.pos.len < 0 ||
      a.pos.len >= kMaxLen)
    return cudaErrorInvalidValue;
  const int hd = a.D / a.heads;
  const int hdp = flash_padded_head_dim(hd);
  if (hdp == 0 || !dropout_pass_args_ok(a.dropout, a.pass, a.philox, a.pos.len, a.heads)) return cudaErrorInvalidValue;
  if (a.o16 != nullptr && a.products == Products::kFp32) return cudaErrorInvalidValue;  // o16: 16-bit products only
  if (a.qkv16 != nullptr && !flash_qkv16_chosen(a, dev)) return cudaErrorInvalidValue;  // its kernel must serve it
  if (a.pos.num_seq == 0 || a.pos.len == 0) return cudaSuccess;
  if (a.o == nullptr && a.o16 == nullptr) return cudaErrorInvalidValue;  // an output to write
  // Blocks of kBM queries, or fewer where the sequence is short (flash_warps): at most 2^31 - 1,
  // gridDim.x's limit (a short sequence is one query tile whatever the block).
  const int q_tiles = (int)((a.pos.len + kBM - 1) / kBM);
  if (a.pos.num_seq > INT32_MAX / ((int64_t)a.heads * q_tiles)) return cudaErrorInvalidValue;
  // 16-byte copies where every head slice of every row starts 16-byte
  // aligned: row r's slice of head h begins hd h + r 3D (+ D, + 2D) floats
  // after qkv, and hd % 4 == 0 makes D % 4 == 0 too.
  const bool vec = hd % 4 == 0 && aligned16(a.qkv);
  const float scale_log2 = kLog2e / sqrtf((float)hd);
  const FlashVariant v = flash_attention_variant(a, dev);
  // Split-KV (v.splits > 1) only where the rule splits and the caller gave room for the partials.
  const FlashPartials sp = {a.partials, a.pos.num_seq * a.heads * a.pos.len, v.splits};
  switch (v.kernel) {
    case FlashKernel::kShort:
      return launch_short(a, scale_log2, dev, stream);
    case FlashKernel::kWgmma:
      return flash_attention_wgmma(a, vec, scale_log2, dev, stream);
    case FlashKernel::kWgmma16:
      return flash_attention_wgmma16(a, vec, scale_log2, dev, stream);
    case FlashKernel::kQkv16:
      return flash_attention_qkv16(a, scale_log2, dev, stream);
    case FlashKernel::kWgmmaWide:
      if (cudaError_t e = flash_attention_wgmma_wide(a, vec, scale_log2, sp.partials, sp.splits, dev, stream);
          e != cudaSuccess || sp.splits == 1)
        return e;
      return launch_combine(a, sp, dev, stream);
    default:
      return with_padded_head_dim(
          hdp,
          [&](auto h) {
            constexpr int H = decltype(h)::value;
            switch (a.products) {
              case Products::kBf16:
                return launch_flash<Bf16Mma, H>(a, vec, scale_log2, sp, dev, stream);
              case Products::kFp16:
                return launch_flash<Fp16Mma, H>(a, vec, scale_log2, sp, dev, stream);
              default:
                return launch_flash<Tf32x3, H>(a, vec, scale_log2, sp, dev, stream);
            }
          },
          cudaErrorInvalidValue);
  }
}

}  // namespace fastaxial::cuda
