// The flash forward's mainloop on mma.sync (any sm_80+ GPU): the two products
// of one key tile for a warp's 16 queries, element type Elem (traits of
// detail/tf32x3.cuh's shape: Tf32x3 for fp32).
//   scores: s (16, BN) = q (16, HDP) k^T (HDP, BN)
//   pv:     o (16, HDP) += p (16, BN) v (BN, HDP)
// P needs no trip through shared memory: with k permuted (k index t for key
// 2t, t + 4 for key 2t + 1 inside each group of 8), a thread's C fragment of
// s, (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1), is its A fragment of
// p for the product with v, whose B fragment is then v's rows 2t and 2t + 1
// (keys) at column g (feature): two 4-byte loads from v stored key-major.
#pragma once

#include "../detail/tf32x3.cuh"

namespace fastaxial::cuda {

// HDP: padded head dim (q k^T's depth, o's columns); BN: keys a tile; LDK and
// LDV: the row strides of q and k, and of v, in shared memory.
template <class Elem, int HDP, int BN, int LDK, int LDV>
struct MmaMainloop {
  static constexpr int KS = HDP / 8, NT = BN / 8;  // 8-deep steps of q k^T; key groups (n-tiles) of a tile
  using FragA = typename Elem::FragA;
  using FragB = typename Elem::FragB;

  // s[jn] = n-tile jn (keys 8 jn .. 8 jn + 7 of the tile) of q k^T: this
  // thread holds keys 8 jn + 2t, + 1 of rows g and g + 8. qw: the warp's q
  // rows, kt: the tile's k rows. Runs of two 8-deep steps per fresh
  // accumulator (the first run is s itself).
  __device__ static __forceinline__ void scores(float (&s)[NT][4], const float* qw, const float* kt) {
    if constexpr (KS == 1) {
      const FragA qa = Elem::load_a_perm(qw, LDK);
#pragma unroll
      for (int jn = 0; jn < NT; ++jn) Elem::template step<true>(s[jn], qa, Elem::load_bt_perm(kt + 8 * jn * LDK, LDK));
    } else {
      static_assert(KS % 2 == 0, "runs of two steps");
      // Features 0..15 straight into s, then the other runs each into a
      // fresh accumulator added to s. At HDP 192 and 256 (o alone is 96 and
      // 128 registers) the loop over runs stays rolled: unrolled, the loads
      // hoisted ahead of their products spill.
      {
        const FragA qa0 = Elem::load_a_perm(qw, LDK), qa1 = Elem::load_a_perm(qw + 8, LDK);
#pragma unroll
        for (int jn = 0; jn < NT; ++jn) {
          const float* kr = kt + 8 * jn * LDK;  // keys 8 jn .., features 0 ..
          Elem::template step<true>(s[jn], qa0, Elem::load_bt_perm(kr, LDK));
          Elem::template step<false>(s[jn], qa1, Elem::load_bt_perm(kr + 8, LDK));
        }
      }
      constexpr int kUnroll = HDP > 128 ? 1 : KS;
#pragma unroll kUnroll
      for (int kk = 2; kk < KS; kk += 2) {
        const FragA qa0 = Elem::load_a_perm(qw + 8 * kk, LDK), qa1 = Elem::load_a_perm(qw + 8 * kk + 8, LDK);
#pragma unroll
        for (int jn = 0; jn < NT; ++jn) {
          const float* kr = kt + 8 * jn * LDK + 8 * kk;  // keys 8 jn .., features 8 kk ..
          Elem::run(s[jn], qa0, Elem::load_bt_perm(kr, LDK), qa1, Elem::load_bt_perm(kr + 8, LDK));
        }
      }
    }
  }

  // o += p v: key groups jn, jn + 1 into one fresh accumulator per output
  // n-tile f (features 8f .. 8f + 7), o's group f at group(f). A fragment of p
  // for group jn, k index t standing for key 2t and t + 4 for key 2t + 1:
  // (g, t) = p(g, 2t) = s[jn][0], (g + 8, t) = s[jn][2], (g, t + 4) = p(g, 2t +
  // 1) = s[jn][1], (g + 8, t + 4) = s[jn][3]. B fragment: (t, g) = v[key 8 jn +
  // 2t][8f + g], (t + 4, g) = v[key 8 jn + 2t + 1][8f + g].
  template <class Group>
  __device__ static __forceinline__ void pv(Group&& group, float (&s)[NT][4], const float* vt, int g, int t) {
    static_assert(NT % 2 == 0, "P @ V takes the key groups in pairs");
#pragma unroll
    for (int jn = 0; jn < NT; jn += 2) {
      const FragA pa = Elem::a(s[jn][0], s[jn][2], s[jn][1], s[jn][3]);
      const FragA pb = Elem::a(s[jn + 1][0], s[jn + 1][2], s[jn + 1][1], s[jn + 1][3]);
      const float* v0 = vt + (8 * jn + 2 * t) * LDV + g;  // key 8 jn + 2t, feature g
#pragma unroll
      for (int f = 0; f < KS; ++f) {
        const FragB b0 = Elem::b(v0[8 * f], v0[LDV + 8 * f]);
        const FragB b1 = Elem::b(v0[8 * LDV + 8 * f], v0[9 * LDV + 8 * f]);
        Elem::run(group(f), pa, b0, pb, b1);
      }
    }
  }
};

}  // namespace fastaxial::cuda
