// One attention pass with a thread block per whole sequence, every product on
// the tensor cores (mma.sync, 3xTF32 split for fp32 accuracy: tf32x3.cuh).
//
// For sequence n of the axis, x is its (L, D) positions (strided in the grid):
//   xs  = LayerNorm(x)                  (LP, D) in shared memory, LP = 16*MT >= L
//                                       (x arrives by cp.async, all of it in flight at once)
//   q, k, v = xs @ Wqkv^T               (LP, D) each, in shared memory
//   o_h = softmax(q_h k_h^T * scale) v_h  per head, into xs's space
//   dst = x + o @ Wout^T + bout
// Why this shape: axial sequences are short (tens to a hundred positions), so
// a whole sequence's q, k and v fit one block's shared memory. Keys are then
// projected once per sequence, and each attention row is complete in one
// warp's registers: an exact softmax, no online rescaling, no block barrier
// inside the attention. Five barriers per sequence in all.
//
// Work split (8 warps): the projections go by (16-row, 8-column) tiles of the
// output, register-blocked MI x NI per warp; the attention goes by (head,
// 16-query tile): scores (16, LP) live in registers, P is fed to the P @ V
// product straight from the score registers (the key order inside each group
// of 8 keys is permuted to match the A-fragment layout, and V is read in the
// same order), and o_h goes to shared memory.
//
// Padded rows (L <= i < LP) are zero in xs, so their q, k, v are zero;
// padded keys are masked out of the softmax; padded queries are never stored.
// Weights are read from global memory (L2) as B fragments.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common/dispatch.h"
#include "axis_kernels.h"
#include "tf32x3.cuh"
#include "warp_ops.cuh"

namespace fastaxial::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

struct TcArgs {
  AxisView view;
  int D, heads;
  float eps, scale;
  AxisWeights w;
  const float* src;
  float* dst;
};

// Shared-memory rows are D + 4 floats: the fragment loads of A (rows g, columns
// t), of keys (rows g, columns t) and of values (rows 2t, columns g) then hit
// 32 different banks.
__host__ __device__ constexpr int row_stride(int D) { return D + 4; }

// c (16 MI x 8 NI) = A[0:16 MI, 0:K] @ W[0:8 NI, 0:K]^T for one warp. A is in
// shared memory (row stride lda), W in global memory (row stride K). K is a
// multiple of 8; steps go in groups of 4 so that a group's weight loads are
// all in flight before the first product waits for them.
template <int MI, int NI>
__device__ void warp_gemm(float (&c)[MI][NI][4], const float* A, int lda, const float* __restrict__ W, int K) {
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.0f;
  auto step = [&](int kk) {
    FragA a[MI];
    FragB b[NI];
#pragma unroll
    for (int j = 0; j < NI; ++j) b[j] = load_bt(W + (int64_t)(8 * j) * K + kk, K);
#pragma unroll
    for (int i = 0; i < MI; ++i) a[i] = load_a(A + 16 * i * lda + kk, lda);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j) mma_3xtf32(c[i][j], a[i], b[j]);
  };
  int k0 = 0;
  for (; k0 + 32 <= K; k0 += 32) {
#pragma unroll
    for (int s = 0; s < 4; ++s) step(k0 + 8 * s);
  }
  for (; k0 < K; k0 += 8) step(k0);
}

// xs (LP, ld) = sequence n's positions, rows L..LP zero. Every 16-byte piece
// is its own asynchronous copy, so the whole tile is in flight at once.
template <int MT>
__device__ void load_tile(float* xs, int ld, const TcArgs& a, int64_t n, int L) {
  constexpr int LP = 16 * MT;
  const int D = a.D, per_row = D / 4;
  for (int e = threadIdx.x; e < LP * per_row; e += kThreads) {
    const int r = e / per_row, c = 4 * (e % per_row);
    float* dst = xs + r * ld + c;
    if (r < L) {
      const float* src = a.src + a.view.offset(n, r) + c;
      const unsigned dst_s = (unsigned)__cvta_generic_to_shared(dst);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst_s), "l"(src));
    } else {
      *reinterpret_cast<float4*>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// LayerNorm of rows 0..L of xs, in place; a warp per row.
__device__ void layer_norm(float* xs, int ld, const TcArgs& a, int L) {
  for (int r = threadIdx.x / 32; r < L; r += kWarps) {
    float* y = xs + r * ld;
    layer_norm_row(y, a.D, a.w.norm_weight, a.w.norm_bias, a.eps, [&](int c, float v) { y[c] = v; });
  }
}

// o_h for (head h, query tile mt) = softmax(q_h k_h^T * scale) v_h, written to
// o (LP, ld) at columns h*HD.. . One warp; L valid keys of LP.
template <int MT, int HD>
__device__ void attend_tile(float* o, const float* q, const float* k, const float* v, int ld, int h, int mt, int L,
                            float scale) {
  constexpr int NT = 2 * MT;  // 8-key groups
  constexpr int KS = HD / 8;  // 8-feature steps of a head
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int hc = h * HD, r0 = 16 * mt;

  // s (16, LP) = q_h[r0 : r0+16] k_h^T; this thread holds rows g and g+8,
  // keys 8j + 2t and 8j + 2t + 1 of each group j.
  FragA qa[KS];
#pragma unroll
  for (int s = 0; s < KS; ++s) qa[s] = load_a(q + r0 * ld + hc + 8 * s, ld);
  float s[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) mma_3xtf32(s[j], qa[ks], load_bt(k + 8 * j * ld + hc + 8 * ks, ld));
  }

  // Exact softmax per row: a row's LP scores are spread over the 4 lanes of a
  // quad (same g), so max and sum reduce over lanes xor 1 and 2.
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool valid = 8 * j + 2 * t + e < L;
      s[j][e] = valid ? s[j][e] * scale : -INFINITY;
      s[j][2 + e] = valid ? s[j][2 + e] * scale : -INFINITY;
      mx0 = fmaxf(mx0, s[j][e]);
      mx1 = fmaxf(mx1, s[j][2 + e]);
    }
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, m));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, m));
  }
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[j][e] = expf(s[j][e] - mx0);  // exp(-inf) = 0 for masked keys
      s[j][2 + e] = expf(s[j][2 + e] - mx1);
      sum0 += s[j][e];
      sum1 += s[j][2 + e];
    }
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, m);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, m);
  }

  // o_h (16, HD) = p v_h. The k index of the product is the key; inside group
  // j, A-column t stands for key 8j + 2t and column t + 4 for key 8j + 2t + 1,
  // so this thread's score registers are its A fragment as they are, and the
  // B fragment reads v rows 8j + 2t and 8j + 2t + 1.
  float acc[KS][4];
#pragma unroll
  for (int n = 0; n < KS; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const FragA pa = make_a(s[j][0], s[j][2], s[j][1], s[j][3]);
    const float* vj = v + (8 * j + 2 * t) * ld + hc + g;
#pragma unroll
    for (int n = 0; n < KS; ++n) mma_3xtf32(acc[n], pa, make_b(vj[8 * n], vj[ld + 8 * n]));
  }
  const float inv0 = 1.0f / sum0, inv1 = 1.0f / sum1;
#pragma unroll
  for (int n = 0; n < KS; ++n) {
    float* o0 = o + (r0 + g) * ld + hc + 8 * n + 2 * t;
    *reinterpret_cast<float2*>(o0) = make_float2(acc[n][0] * inv0, acc[n][1] * inv0);
    *reinterpret_cast<float2*>(o0 + 8 * ld) = make_float2(acc[n][2] * inv1, acc[n][3] * inv1);
  }
}

template <int MT, int HD>
__global__ void __launch_bounds__(kThreads, 1) axis_tensor_core_kernel(const TcArgs a) {
  constexpr int LP = 16 * MT;
  constexpr int MI = MT % 2 == 0 ? 2 : 1;  // 16-row tiles per warp in the projections
  const int D = a.D, ld = row_stride(D), L = (int)a.view.len;
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);  // (LP, ld) LayerNorm(x), then o
  float* q = xs + LP * ld;                      // (LP, ld) queries, all heads
  float* k = q + LP * ld;                       // (LP, ld) keys
  float* v = k + LP * ld;                       // (LP, ld) values
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  for (int64_t n = blockIdx.x; n < a.view.num_seq; n += gridDim.x) {
    load_tile<MT>(xs, ld, a, n, L);
    __syncthreads();
    layer_norm(xs, ld, a, L);
    __syncthreads();

    // [q | k | v] = xs @ Wqkv^T: tiles of 16 MI rows x 24 columns (3D / 8 is a
    // multiple of 3); each 8-column part lies in one of q, k, v since 8 | D.
    {
      constexpr int NI = 3;
      const int col_tiles = 3 * D / (8 * NI);
      for (int item = warp; item < (MT / MI) * col_tiles; item += kWarps) {
        const int m0 = 16 * MI * (item % (MT / MI)), c0 = 8 * NI * (item / (MT / MI));
        float c[MI][NI][4];
        warp_gemm<MI, NI>(c, xs + m0 * ld, ld, a.w.qkv_weight + (int64_t)c0 * D, D);
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const int col = c0 + 8 * j;  // 8 columns in one of q, k, v
          float* out = col < D ? q + col : col < 2 * D ? k + col - D : v + col - 2 * D;
#pragma unroll
          for (int i = 0; i < MI; ++i) {
            float* p = out + (m0 + 16 * i + g) * ld + 2 * t;
            *reinterpret_cast<float2*>(p) = make_float2(c[i][j][0], c[i][j][1]);
            *reinterpret_cast<float2*>(p + 8 * ld) = make_float2(c[i][j][2], c[i][j][3]);
          }
        }
      }
    }
    __syncthreads();

    for (int item = warp; item < a.heads * MT; item += kWarps)
      attend_tile<MT, HD>(xs, q, k, v, ld, item / MT, item % MT, L, a.scale);
    __syncthreads();

    // dst = src + o @ Wout^T + bout, rows < L only.
    {
      constexpr int NI = 1;
      const int col_tiles = D / (8 * NI);
      for (int item = warp; item < (MT / MI) * col_tiles; item += kWarps) {
        const int m0 = 16 * MI * (item % (MT / MI)), c0 = 8 * NI * (item / (MT / MI));
        const int col = c0 + 2 * t;
        // The residual rows, loaded before the product so the loads overlap it.
        float2 x[MI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = m0 + 16 * i + g + 8 * half;
            x[i][half] = r < L ? *reinterpret_cast<const float2*>(a.src + a.view.offset(n, r) + col)
                               : make_float2(0.0f, 0.0f);
          }
        float c[MI][NI][4];
        warp_gemm<MI, NI>(c, xs + m0 * ld, ld, a.w.out_weight + (int64_t)c0 * D, D);
        const float2 bias = *reinterpret_cast<const float2*>(a.w.out_bias + col);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = m0 + 16 * i + g + 8 * half;
            if (r >= L) continue;
            *reinterpret_cast<float2*>(a.dst + a.view.offset(n, r) + col) =
                make_float2(x[i][half].x + c[i][0][2 * half] + bias.x, x[i][half].y + c[i][0][2 * half + 1] + bias.y);
          }
      }
    }
    __syncthreads();  // xs is rewritten by the next sequence
  }
}

template <int MT, int HD>
cudaError_t launch(const TcArgs& a, const DeviceInfo& dev, cudaStream_t stream) {
  constexpr auto kernel = axis_tensor_core_kernel<MT, HD>;
  if (cudaError_t e = allow_max_smem<kernel>(dev); e != cudaSuccess) return e;
  const size_t smem = fused_smem_bytes(a.view.len, a.D);  // 16 MT rows
  // A block per sequence; past a few waves, blocks loop over sequences.
  const int64_t grid = std::min<int64_t>(a.view.num_seq, (int64_t)dev.sms * 64);
  kernel<<<(unsigned)grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <int HD>
cudaError_t launch_tiles(const TcArgs& a, int mt, const DeviceInfo& dev, cudaStream_t stream) {
  switch (mt) {
    case 1: return launch<1, HD>(a, dev, stream);
    case 2: return launch<2, HD>(a, dev, stream);
    case 3: return launch<3, HD>(a, dev, stream);
    case 4: return launch<4, HD>(a, dev, stream);
    case 5: return launch<5, HD>(a, dev, stream);
    case 6: return launch<6, HD>(a, dev, stream);
    case 8: return launch<8, HD>(a, dev, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool tensor_core_fits(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                      const float* dst, const DeviceInfo& dev) {
  return fused_tile_count(view.len) > 0 && fused_smem_bytes(view.len, p.dim) <= (size_t)dev.smem_optin &&
         pass_aligned(w, src, dst);
}

Status launch_axis_tensor_core(const AxisView& view, const AxialParams& p, const AxisWeights& w, const float* src,
                               float* dst, const DeviceInfo& dev, cudaStream_t stream) {
  TcArgs a;
  a.view = view;
  a.D = (int)p.dim;
  a.heads = (int)p.heads;
  a.eps = p.eps;
  const int hd = (int)(p.dim / p.heads);
  a.scale = 1.0f / sqrtf((float)hd);
  a.w = w;
  a.src = src;
  a.dst = dst;
  const int mt = fused_tile_count(view.len);
  cudaError_t e = cudaErrorInvalidValue;
  switch (hd) {
    case 8: e = launch_tiles<8>(a, mt, dev, stream); break;
    case 16: e = launch_tiles<16>(a, mt, dev, stream); break;
    case 32: e = launch_tiles<32>(a, mt, dev, stream); break;
    case 64: e = launch_tiles<64>(a, mt, dev, stream); break;
  }
  if (e != cudaSuccess) return cuda_error(e, "axis_tensor_core_kernel launch");
  return Status::Ok();
}

}  // namespace fastaxial::cuda
