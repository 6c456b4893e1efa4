// The flash kernels' mainloop products on Hopper's warpgroup instructions
// (wgmma, sm_90a only), for a warpgroup's 64 rows (queries) and a key tile of
// 64, in the products of element type Elem (traits of detail/tf32x3.cuh's
// shape: Tf32x3 for fp32, whose wgmma_run is a run of 3xTF32 products):
//   rows_times_plane: acc (64, N) = A (64, 32) B^T, A from registers (the
//     fragments of four 8-deep steps), B (N, 32) as a straight plane (Elem's
//     kPlanes planes, plane_bytes apart): q k^T in the forward, q k^T and
//     d_o v^T in the backward's dq;
//   tile_times_planes: acc (64, N) += X (64, 64) Y, X a score-shaped tile in
//     registers (p in the forward, dS in the dq kernel), Y (64, N) as
//     transposed planes: p v, dS k.
// kSmallFirst: each run's products in the backward's order (Tf32x3::wgmma_run).
// A's fragments: rows_frags. The loads and splits that feed them:
// pipeline_wgmma.cuh. Used by flash_attention_wgmma.cu and
// query_grads_wgmma.cu (head dim 32).
#pragma once

#include <cstdint>

#include "../detail/wgmma.cuh"

#if FASTAXIAL_SM90A_DEVICE
namespace fastaxial::cuda {

// The A fragment of 8-deep step kk for a warp's 16 rows of raw fp32 (row 0
// at p, row stride LD): (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4).
template <class Elem, int LD>
__device__ __forceinline__ typename Elem::FragA rows_frag(const float* p, int kk, int g, int t) {
  const float* e = p + g * LD + 8 * kk + t;
  return Elem::a(e[0], e[8 * LD], e[4], e[8 * LD + 4]);
}

// A (64, 32) of rows_times_plane, the warp's 16 rows: the fragments of
// 8-deep steps 0, 1 (a01) and 2, 3 (a23) from raw rows at w (stride LD).
template <class Elem, int LD>
__device__ __forceinline__ void rows_frags(typename Elem::FragA (&a01)[2], typename Elem::FragA (&a23)[2],
                                           const float* w, int g, int t) {
  a01[0] = rows_frag<Elem, LD>(w, 0, g, t), a01[1] = rows_frag<Elem, LD>(w, 1, g, t);
  a23[0] = rows_frag<Elem, LD>(w, 2, g, t), a23[1] = rows_frag<Elem, LD>(w, 3, g, t);
}

// Issues acc (64, N) = A B^T over 32 features: steps 0, 1 (fragments a01)
// into acc, steps 2, 3 (a23) into acc2, one run and commit group each. B's
// rows are 128-byte swizzled rows of the planes at `plane` (Elem::kPlanes
// of them, plane_bytes apart). rows_times_plane_done then waits and adds
// acc2 to acc.
template <class Elem, int N, bool kSmallFirst = false>
__device__ __forceinline__ void rows_times_plane(float (&acc)[N / 2], float (&acc2)[N / 2],
                                                 typename Elem::FragA (&a01)[2], typename Elem::FragA (&a23)[2],
                                                 uint32_t plane, int plane_bytes) {
  const uint64_t d01[2] = {desc_sw128(plane), desc_sw128(plane + 32)};
  const uint64_t d23[2] = {desc_sw128(plane + 64), desc_sw128(plane + 96)};
  Elem::template wgmma_run<N, kSmallFirst>(acc, a01, d01, plane_bytes >> 4);
  Elem::template wgmma_run<N, kSmallFirst>(acc2, a23, d23, plane_bytes >> 4);
}

// rows_times_plane's end: the wait, a01, a23 and acc fenced (the compiler
// keeps them in place until here), acc2 added to acc.
template <class Elem, int N>
__device__ __forceinline__ void rows_times_plane_done(float (&acc)[N / 2], float (&acc2)[N / 2],
                                                      typename Elem::FragA (&a01)[2], typename Elem::FragA (&a23)[2]) {
  wgmma_wait<0>();
  Elem::fence(a01), Elem::fence(a23);
  fence_regs(acc);
  add_to(acc, acc2);
}

// acc (64, N) += X Y for X (64, 64) in the accumulator layout of a score
// tile (x[4 jn + e]: key 8 jn + 2t + (e & 1) of row g + 8 (e >> 1)) and Y
// (64 keys, N) as transposed planes at tb: atoms of 32 keys atom_bytes
// apart, keys permuted inside each group of 8 (slot t for key 2t, t + 4 for
// key 2t + 1), so that X's accumulator registers are its A fragments as they
// are (Elem::a). Four runs of two key groups, two in flight
// (wgmma_add_runs4); Elem's planes plane_bytes apart.
template <class Elem, int N, bool kSmallFirst = false>
__device__ __forceinline__ void tile_times_planes(float (&acc)[N / 2], const float (&x)[32], uint32_t tb,
                                                  int atom_bytes, int plane_bytes) {
  using FragA = typename Elem::FragA;
  const auto run = [&](float(&t)[N / 2], FragA(&f)[2], int r) {
    uint64_t d[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int jg = 2 * r + k;  // key group: keys 8 jg .. 8 jg + 7
      f[k] = Elem::a(x[4 * jg], x[4 * jg + 2], x[4 * jg + 1], x[4 * jg + 3]);
      d[k] = desc_sw128(tb + (jg / 4) * atom_bytes + (jg % 4) * 32);
    }
    Elem::template wgmma_run<N, kSmallFirst>(t, f, d, plane_bytes >> 4);
  };
  float t0[N / 2], t1[N / 2];
  wgmma_add_runs4<Elem>(acc, t0, t1, run);
}

}  // namespace fastaxial::cuda
#endif  // FASTAXIAL_SM90A_DEVICE
