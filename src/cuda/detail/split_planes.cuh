// Operands of the wgmma flash kernels (attention/flash_attention_wgmma.cu,
// attention/query_grads_wgmma.cu) in shared memory: raw fp32 rows as cp.async
// brings them, and the TF32 (hi, lo) planes wgmma reads as its B operand,
// K-major in the 128-byte swizzled layout (detail/wgmma.cuh: rows of 32
// values, 16-byte piece c of row r at piece c ^ (r % 8), 8-row groups 1024
// bytes apart).
//   - straight planes: a tile's rows as they are (keys as rows, features
//     along K), for products that sum over features (q k^T, d_o v^T);
//   - transposed planes: features as rows, keys along K in atoms of 32, for
//     products that sum over keys (p v, dS k). Inside each group of 8 keys
//     slot t holds key 2t and slot t + 4 key 2t + 1, so that the A operand of
//     such a product comes straight from a score accumulator (the C fragment
//     of columns 2t, 2t + 1 is then the A fragment of k indices t, t + 4).
// These are Tf32x3's planes (detail/tf32x3.cuh: kPlanes, hi then lo) and
// fp32's splits; another element type brings its own.
#pragma once

#include <cstdint>

#include "tf32x3.cuh"

namespace fastaxial::cuda {

// Word of key kk (0..63), feature n (0..ROWS - 1) in a transposed plane of ROWS rows an atom.
template <int ROWS>
__device__ __forceinline__ int transposed_word(int kk, int n) {
  const int s = (kk & ~7) | ((kk & 7) >> 1) | ((kk & 1) << 2);  // the key's slot
  return (s >> 5) * ROWS * 32 + n * 32 + ((((s >> 2) & 7) ^ (n & 7)) << 2) + (s & 3);
}

// The 16-byte piece c (features 4c..4c + 3) of row r of raw rows (stride
// LD) split into a straight plane pair: hi at plane, lo plane_bytes after.
template <int LD>
__device__ __forceinline__ void split_piece(const float* raw, char* plane, int plane_bytes, int r, int c) {
  const float4 x = *reinterpret_cast<const float4*>(raw + r * LD + 4 * c);
  uint32_t h0, h1, h2, h3, w0, w1, w2, w3;
  split(x.x, h0, w0), split(x.y, h1, w1), split(x.z, h2, w2), split(x.w, h3, w3);
  char* at = plane + r * 128 + (((c ^ r) & 7) << 4);
  *reinterpret_cast<uint4*>(at) = make_uint4(h0, h1, h2, h3);
  *reinterpret_cast<uint4*>(at + plane_bytes) = make_uint4(w0, w1, w2, w3);
}

// A thread's share of a transposing split of a (64 keys, 32 features) tile,
// the same every tile: element e = tid + i threads is key 8 (e / 64 % 8) +
// 2 (e / 8 % 4) + e / 32 % 2, feature 8 (e / 512) + e % 8, so that a warp's
// 32 reads (keys 2j + b, 8 features; raw rows at a stride of 4 mod 16
// words) and writes (slots j, 8 swizzled pieces) hit 32 banks. Packed: the
// raw word (low 16 bits) and the plane word (high 16).
template <int LD, int ELEMS, int THREADS>
struct TransposeMap {
  uint32_t at[ELEMS];
  __device__ __forceinline__ explicit TransposeMap(int tid) {
    static_assert(ELEMS * THREADS == 64 * 32, "a (64, 32) tile in whole rounds");
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) {
      const int e = tid + i * THREADS;
      const int n = 8 * (e / 512) + (e & 7), key = 8 * ((e >> 6) % 8) + 2 * ((e >> 3) & 3) + ((e >> 5) & 1);
      at[i] = (uint32_t)(key * LD + n) | (uint32_t)transposed_word<32>(key, n) << 16;
    }
  }
  // raw (64, 32) at stride LD into the transposed planes at plane (hi), plane + plane_words (lo).
  __device__ __forceinline__ void split(const float* raw, float* plane, int plane_words) const {
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) {
      uint32_t hv, lv;
      ::fastaxial::cuda::split(raw[at[i] & 0xffffu], hv, lv);
      plane[at[i] >> 16] = __uint_as_float(hv);
      plane[plane_words + (at[i] >> 16)] = __uint_as_float(lv);
    }
  }
};

}  // namespace fastaxial::cuda
