// One attention pass for any shape: the generic kernel, FFMA products. The
// plan (common/plan.cpp) gives it the passes the tensor-core families cannot
// serve: head_dim other than 8/16/32/64 or dim not a multiple of 8, tensors
// not 16-byte aligned, sequences longer than 128 where the staged path is
// missing (no sm_90a build or not a compute-capability 9.0 GPU), shared
// memory the device does not have for the others; or FASTAXIAL_CUDA_PATH=generic.
//
// What a launch computes, for every sequence of the axis (rows: x is viewed
// as B*H sequences of W positions; columns: B*W sequences of H positions,
// read and written in place in the (B, H, W, D) layout through strides):
//   dst = src + Attention(LayerNorm(src)) @ Wout^T + bout
// with LayerNorm, the QKV projection, softmax attention over all heads and
// the output projection fused: q, k, v, scores and probabilities live only in
// shared memory and registers.
//
// Shape of the work. A thread block owns one tile of T query positions of
// one sequence. It normalises its positions and projects them to q, k and v
// for all heads in one product ((T, D) each), then visits the sequence's key
// tiles starting with its own: for every other tile it normalises and
// projects k and v again, and per head it updates an online softmax (running
// max m, running sum l, rescaled accumulator o). Keys are projected again by
// every query tile of a sequence; for sequences that fit one tile (most
// axial-attention grids) that costs nothing extra, and for long ones it keeps
// the launch independent of L. T is a template parameter, picked at launch as
// the largest power of two up to 64 that covers L and fits shared memory.
//
// Matrix products with the weights go through gemm_smem_w(): the activation
// tile is in shared memory, weight tiles of 64 outputs x 32 inputs are staged
// through shared memory with coalesced loads, and each thread accumulates an
// R x 4 block of outputs in registers from float4 shared loads. fp32
// throughout (no TF32), expf for the softmax.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>

#include "../detail/launch.cuh"
#include "../detail/warp_ops.cuh"
#include "../kernels.h"

namespace fastaxial::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTile = 64;   // query / key positions per tile
constexpr int kNTile = 64;     // weight rows (outputs) per staged tile
constexpr int kKChunk = 32;    // weight columns (inputs) per staged tile
constexpr int kStageLd = kNTile + 4;                    // keeps float4 rows 16-byte aligned
constexpr int kStageFloats = kKChunk * kStageLd;
constexpr int kColGroups = kNTile / 4;                  // 16 threads x 4 columns
constexpr int kRowGroups = kThreads / kColGroups;       // 32

struct AxisArgs {
  AxisView view;
  int D, heads, hd;
  int64_t tiles_per_seq, num_blocks;
  float eps, scale;
  AxisWeights w;
  const float* src;
  float* dst;
};

__host__ __device__ constexpr int round4(int n) { return (n + 3) & ~3; }

// Shared-memory floats for tile size T: o and xn (rows padded to a multiple of
// 4 floats for float4 reads), the weight stage, q, k (rows padded by one), v,
// scores, and per-row softmax state.
size_t smem_floats(int64_t T, int64_t D, int64_t heads) {
  return 2 * T * round4((int)D) + kStageFloats + T * D + T * (D + 1) + T * D + T * T + 2 * T * heads + 3 * T;
}


// xn (T, ld) = LayerNorm of positions l0 .. l0+rows-1 of sequence n. Rows past
// `rows` and the pad columns D..ld are zero: they project to zero and keep the
// float4 reads of gemm_smem_w finite. A warp per position, two reductions
// (detail/warp_ops.cuh: the mean, then the variance).
template <int T>
__device__ void layer_norm_tile(float* xn, int ld, const AxisArgs& a, int64_t n, int64_t l0, int rows) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = a.D;
  for (int r = warp; r < T; r += kWarps) {
    float* y = xn + r * ld;
    if (r >= rows) {
      for (int c = lane; c < ld; c += 32) y[c] = 0.0f;
      continue;
    }
    layer_norm_row(a.src + a.view.offset(n, l0 + r), D, a.w.norm_weight, a.w.norm_bias, a.eps,
                   [&](int c, float v) { y[c] = v; });
    for (int c = D + lane; c < ld; c += 32) y[c] = 0.0f;
  }
  __syncthreads();
}

// For r < M, c < N: epi(r, c, sum_k A[r, k] * W[c, k]).
// A is (M, K) in shared memory, 16-byte aligned, row stride lda (a multiple of
// 4) with columns K..round4(K) zero; M <= kRowGroups * R. W is (N, K) in global
// memory, row-major. Each thread owns an R x 4 block of C in registers: rows
// R*(tid/16) .., columns 4*(tid%16) .. of each 64-column tile, so a step over
// 4 inputs costs R + 4 float4 shared loads for 16 R fused multiply-adds.
// Weight tiles (64 outputs x 32 inputs) are staged through shared memory with
// coalesced loads, the next one held in registers while this one is used.
template <int R, class Epilogue>
__device__ void gemm_smem_w(const float* A, int lda, int M, const float* W, int N, int K, float* stage,
                            Epilogue epi) {
  const int cg = threadIdx.x % kColGroups, rg = threadIdx.x / kColGroups;
  constexpr int kPerThread = kNTile * kKChunk / kThreads;
  for (int n0 = 0; n0 < N; n0 += kNTile) {
    float acc[R][4];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    float next[kPerThread];
    auto load_chunk = [&](int k0) {
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        const int e = threadIdx.x + u * kThreads, kk = e % kKChunk, cc = e / kKChunk;
        const bool in = n0 + cc < N && k0 + kk < K;
        next[u] = in ? W[(int64_t)(n0 + cc) * K + k0 + kk] : 0.0f;
      }
    };
    load_chunk(0);
    for (int k0 = 0; k0 < K; k0 += kKChunk) {
      __syncthreads();  // the previous chunk is consumed
      // stage[kk][cc] = W[n0 + cc, k0 + kk]; consecutive threads read consecutive kk
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        const int e = threadIdx.x + u * kThreads;
        stage[(e % kKChunk) * kStageLd + e / kKChunk] = next[u];
      }
      __syncthreads();
      if (k0 + kKChunk < K) load_chunk(k0 + kKChunk);
      // Blocked summation: each 32-input chunk is summed on its own and then
      // added, so the rounding error grows with K / 32 + 32 rather than with K.
      float part[R][4];
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] = 0.0f;
      const int steps = (min(kKChunk, K - k0) + 3) / 4;
      for (int q = 0; q < steps; ++q) {
        float4 av[R], bv[4];
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const int r = rg * R + i;
          av[i] = r < M ? *reinterpret_cast<const float4*>(A + r * lda + k0 + 4 * q) : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) bv[t] = *reinterpret_cast<const float4*>(stage + (4 * q + t) * kStageLd + 4 * cg);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const float a4[4] = {av[i].x, av[i].y, av[i].z, av[i].w};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            part[i][0] = fmaf(a4[t], bv[t].x, part[i][0]);
            part[i][1] = fmaf(a4[t], bv[t].y, part[i][1]);
            part[i][2] = fmaf(a4[t], bv[t].z, part[i][2]);
            part[i][3] = fmaf(a4[t], bv[t].w, part[i][3]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += part[i][j];
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int r = rg * R + i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = n0 + 4 * cg + j;
        if (r < M && c < N) epi(r, c, acc[i][j]);
      }
    }
  }
  __syncthreads();
}

// The block's shared memory for tiles of T positions.
template <int T>
struct GenericSmem {
  int ldx;       // rows of o and xn
  // Key rows are padded to D + 1 floats: the score loop reads one key row per
  // lane, and an unpadded stride (a multiple of 32 banks) would serialise the warp.
  int ldk;
  float* o;      // (T, ldx) attention output accumulator
  float* xn;     // (T, ldx) normalised positions
  float* stage;  // weight staging for gemm_smem_w
  float* q;      // (T, D) queries, all heads
  float* k;      // (T, ldk) keys, all heads
  float* v;      // (T, D) values, all heads
  float* s;      // (T, T) scores, then probabilities
  float* m;      // (T, heads) running max
  float* l;      // (T, heads) running sum
  float* corr;   // (T) rescale of the accumulator

  __device__ __forceinline__ GenericSmem(int D, int heads) : ldx(round4(D)), ldk(D + 1) {
    extern __shared__ float4 smem4[];
    o = reinterpret_cast<float*>(smem4);
    xn = o + T * ldx;
    stage = xn + T * ldx;
    q = stage + kStageFloats;
    k = q + T * D;
    v = k + T * ldk;
    s = v + T * D;
    m = s + T * T;
    l = m + T * heads;
    corr = l + T * heads;
  }
};

// Head h of the query tile (qrows rows) against the key tile in k and v
// (krows rows): s = q_h k_h^T / sqrt(hd), the online softmax's running max
// and sum updated, o_h = o_h * corr + p v_h.
template <int T>
__device__ __forceinline__ void attend_head(const GenericSmem<T>& sm, const AxisArgs& a, int h, int qrows,
                                            int krows) {
  const int D = a.D, hd = a.hd, heads = a.heads, hc = h * hd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s = sm.s;
  // s = q_h k_h^T / sqrt(hd)
  for (int e = threadIdx.x; e < qrows * krows; e += kThreads) {
    const int i = e / krows, j = e % krows;
    const float* qi = sm.q + i * D + hc;
    const float* kj = sm.k + j * sm.ldk + hc;
    float acc = 0.0f;
    for (int c = 0; c < hd; ++c) acc = fmaf(qi[c], kj[c], acc);
    s[i * T + j] = acc * a.scale;
  }
  __syncthreads();
  // online softmax, a warp per query
  for (int i = warp; i < qrows; i += kWarps) {
    float mx = -INFINITY;
    for (int j = lane; j < krows; j += 32) mx = fmaxf(mx, s[i * T + j]);
    mx = warp_max(mx);
    const float m_old = sm.m[i * heads + h], m_new = fmaxf(m_old, mx);
    float sum = 0.0f;
    for (int j = lane; j < krows; j += 32) {
      const float p = expf(s[i * T + j] - m_new);
      s[i * T + j] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    __syncwarp();  // every lane has read m_old before lane 0 replaces it
    if (lane == 0) {
      const float c = expf(m_old - m_new);  // 0 on the first tile
      sm.corr[i] = c;
      sm.l[i * heads + h] = sm.l[i * heads + h] * c + sum;
      sm.m[i * heads + h] = m_new;
    }
  }
  __syncthreads();
  // o_h = o_h * corr + p v_h
  for (int e = threadIdx.x; e < qrows * hd; e += kThreads) {
    const int i = e / hd, c = e % hd;
    float acc = 0.0f;
    for (int j = 0; j < krows; ++j) acc = fmaf(s[i * T + j], sm.v[j * D + hc + c], acc);
    sm.o[i * sm.ldx + hc + c] = fmaf(sm.o[i * sm.ldx + hc + c], sm.corr[i], acc);
  }
  __syncthreads();
}

template <int T>
__global__ void __launch_bounds__(kThreads, 1) axis_attention_kernel(const AxisArgs a) {
  constexpr int R = T >= kRowGroups ? T / kRowGroups : 1;  // gemm rows per thread
  const int D = a.D, hd = a.hd, heads = a.heads;
  const GenericSmem<T> sm(D, heads);
  const int ldx = sm.ldx, ldk = sm.ldk;
  float *o = sm.o, *xn = sm.xn, *q = sm.q, *k = sm.k, *v = sm.v;
  const int64_t L = a.view.len;
  grid_dependency_wait();
  allow_dependent_launch();

  for (int64_t blk = blockIdx.x; blk < a.num_blocks; blk += gridDim.x) {
    const int64_t n = blk / a.tiles_per_seq;
    const int64_t q0 = (blk % a.tiles_per_seq) * T;
    const int qrows = (int)(L - q0 < T ? L - q0 : T);

    // [q | k | v] of the block's own positions in one product: its query tile
    // is also the first key tile it visits.
    layer_norm_tile<T>(xn, ldx, a, n, q0, qrows);
    gemm_smem_w<R>(xn, ldx, qrows, a.w.qkv_weight, 3 * D, D, sm.stage, [&](int r, int c, float val) {
      if (c < D) q[r * D + c] = val;
      else if (c < 2 * D) k[r * ldk + c - D] = val;
      else v[r * D + c - 2 * D] = val;
    });
    for (int e = threadIdx.x; e < T * ldx; e += kThreads) o[e] = 0.0f;
    for (int e = threadIdx.x; e < T * heads; e += kThreads) {
      sm.m[e] = -INFINITY;
      sm.l[e] = 0.0f;
    }

    // Key tiles in the order q0, q0 + T, ... wrapping around; the softmax is online.
    for (int64_t t = 0; t < a.tiles_per_seq; ++t) {
      const int64_t k0 = ((q0 / T + t) % a.tiles_per_seq) * T;
      const int krows = (int)(L - k0 < T ? L - k0 : T);
      if (t > 0) {
        // [k | v] = LayerNorm(x_k) [Wk | Wv]^T: rows D..3D of Wqkv, contiguous.
        layer_norm_tile<T>(xn, ldx, a, n, k0, krows);
        gemm_smem_w<R>(xn, ldx, krows, a.w.qkv_weight + (int64_t)D * D, 2 * D, D, sm.stage,
                       [&](int r, int c, float val) {
                         if (c < D) k[r * ldk + c] = val;
                         else v[r * D + c - D] = val;
                       });
      }
      for (int h = 0; h < heads; ++h) attend_head<T>(sm, a, h, qrows, krows);
    }
    for (int e = threadIdx.x; e < qrows * D; e += kThreads) {
      const int i = e / D, c = e % D;
      o[i * ldx + c] /= sm.l[i * heads + c / hd];
    }
    __syncthreads();

    // dst = src + o Wout^T + bout
    gemm_smem_w<R>(o, ldx, qrows, a.w.out_weight, D, D, sm.stage, [&](int r, int c, float val) {
      const int64_t off = a.view.offset(n, q0 + r) + c;
      a.dst[off] = a.src[off] + val + a.w.out_bias[c];
    });
  }
}

template <int T>
cudaError_t launch_tile(const AxisArgs& a, int64_t grid, size_t smem, const DeviceCaps& dev, cudaStream_t stream) {
  if (cudaError_t e = allow_max_smem<axis_attention_kernel<T>>(dev); e != cudaSuccess) return e;
  return launch_kernel<axis_attention_kernel<T>>((unsigned)grid, kThreads, smem, stream, dev, a);
}

}  // namespace

Status launch_generic(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src, float* dst,
                      const DeviceCaps& dev, cudaStream_t stream) {
  if (p.dim > INT_MAX / kMaxTile) return {StatusCode::kUnsupported, "dim too large for the CUDA kernels"};
  // Largest power-of-two tile, at most kMaxTile and at most L rounded up, that fits.
  int64_t T = 1;
  while (T < kMaxTile && T < view.len) T *= 2;
  while (T > 1 && smem_floats(T, p.dim, p.heads) * sizeof(float) > (size_t)dev.smem_optin) T /= 2;
  const size_t smem = smem_floats(T, p.dim, p.heads) * sizeof(float);
  if (smem > (size_t)dev.smem_optin)
    return {StatusCode::kUnsupported, "dim " + std::to_string(p.dim) + " needs " + std::to_string(smem) +
                                          " bytes of shared memory per block; this device has " +
                                          std::to_string(dev.smem_optin)};

  AxisArgs a;
  a.view = view;
  a.D = (int)p.dim;
  a.heads = (int)p.heads;
  a.hd = (int)(p.dim / p.heads);
  a.tiles_per_seq = (view.len + T - 1) / T;
  a.num_blocks = view.num_seq * a.tiles_per_seq;
  a.eps = p.eps;
  a.scale = 1.0f / sqrtf((float)a.hd);
  a.w = w;
  a.src = src;
  a.dst = dst;

  const int64_t grid = std::min<int64_t>(a.num_blocks, (int64_t)dev.sms * 1024);
  const cudaError_t e = with_int<64, 32, 16, 8, 4, 2, 1>(
      T, [&](auto t) { return launch_tile<decltype(t)::value>(a, grid, smem, dev, stream); }, cudaErrorInvalidValue);
  if (e != cudaSuccess) return cuda_error(e, "axis_attention_kernel launch");
  return Status::Ok();
}

}  // namespace fastaxial::cuda
