// Helpers of the dropout cases of the CUDA attention kernels' suites
// (test_flash_attention, test_attention_backward): a case's mask as the
// kernels take it, its {seed, offset} pair in device memory, the host's
// multipliers from dropout_keep (src/common/dropout.h: the reference applies
// the definition itself), and the tensor-core kernels' sharing of draws
// between lanes replayed on the host.
//
// Include it before anything that includes dropout.h: where the suite does
// not see Random123's headers (a build without them), it defines
// FASTAXIAL_NO_RANDOM123, as the library is built then, and the dropout
// cases are left out.
#pragma once

#if !defined(FASTAXIAL_NO_RANDOM123) && defined(__has_include)
#if !__has_include(<Random123/philox.h>)
#define FASTAXIAL_NO_RANDOM123
#endif
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "src/common/axis.h"
#include "src/common/dropout.h"
#include "cuda_test_util.h"

namespace fastaxial::test {

// A case's dropout: rate p, Philox seed and offset, and a shift of the
// pass's base (element indices past 2^32, runs that start off multiples of
// 4; the kernels take any base).
struct DropoutSpec {
  float p = 0.0f;
  uint64_t seed = 0, offset = 0;
  uint64_t base_shift = 0;
};

inline std::string dropout_name(const DropoutSpec& s) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "p%03d_seed%llx_off%llx", (int)(s.p * 100.0f + 0.5f), (unsigned long long)s.seed,
                (unsigned long long)s.offset);
  return std::string(buf) + (s.base_shift ? "_base" + std::to_string(s.base_shift) : "");
}

// The mask of pass `pass` (0 rows, 1 columns) of problem p under s: as
// make_dropout numbers it, base[pass] shifted by s.base_shift.
inline DropoutParams dropout_params(AxialParams p, const DropoutSpec& s, int pass) {
  p.dropout = s.p;
  p.seed = s.seed;
  p.offset = s.offset;
  DropoutParams d = make_dropout(p);
  d.base[pass] += s.base_shift;
  return d;
}

// What the kernels get: d with seed and offset replaced by other values,
// so that a kernel that drew from them rather than from the pair in device
// memory (philox_pair) gets another mask.
inline DropoutParams kernel_dropout(DropoutParams d) {
  d.seed = ~d.seed ^ 0x5555u;
  d.offset = d.offset + 0x10001u;
  return d;
}

// {seed, offset} in device memory, as the kernels read it; null where the
// allocation or the copy fails.
inline DevicePtr philox_pair(uint64_t seed, uint64_t offset) {
  DevicePtr p = device_alloc(4);  // 16 bytes, cudaMalloc-aligned
  const uint64_t pair[2] = {seed, offset};
  if (p && cudaMemcpy(p.get(), pair, sizeof pair, cudaMemcpyHostToDevice) != cudaSuccess) p.reset();
  return p;
}

inline const uint64_t* as_philox(const DevicePtr& p) { return reinterpret_cast<const uint64_t*>(p.get()); }

#if !defined(FASTAXIAL_NO_RANDOM123)

// The multipliers of head h of sequence n, (L, L): m[i L + j] = d.scale
// where dropout_keep(d, pass, n, h, i, j), else 0.
inline std::vector<float> dropout_multipliers(const DropoutParams& d, int pass, int64_t n, int64_t h, int64_t L) {
  std::vector<float> m((size_t)(L * L));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j)
      m[(size_t)(i * L + j)] =
          dropout_keep(d, pass, (uint64_t)n, (uint64_t)h, (uint64_t)i, (uint64_t)j) ? d.scale : 0.0f;
  return m;
}

// A warp's draw of one 16 x 8 tile of the mask as the tensor-core kernels
// make it (dropout.h's fragment helpers), replayed on the host: every
// lane's run (dropout_run_rows or dropout_run_cols), the two shuffles of
// dropout_share16 (lanes 1 and 2 apart for rows, 4 and 8 for columns),
// each lane's bits of c[0..3]. rows: rows of the tile are queries and
// e_tile + r L + c is element (row r, column c); else rows are keys and it
// is e_tile + c L + r. Returns how many of the 128 elements differ from
// dropout_keep.
inline int fragment_mismatches(const DropoutParams& d, uint64_t L, bool rows, uint64_t e_tile) {
  unsigned x[32], y[32];
  const int stride = rows ? 1 : 4;
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const uint64_t e = rows ? dropout_run_rows(e_tile, L, g, t) : dropout_run_cols(e_tile, L, g, t);
    x[lane] = dropout_keep_run4(d, e) << (4 * (rows ? t : g & 3));
  }
  for (int lane = 0; lane < 32; ++lane) y[lane] = x[lane] | x[lane ^ stride];
  for (int lane = 0; lane < 32; ++lane) x[lane] = y[lane] | y[lane ^ (2 * stride)];
  int wrong = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int k = 0; k < 4; ++k) {
      const uint64_t r = (uint64_t)(g + 8 * (k >> 1)), c = (uint64_t)(2 * t + (k & 1));
      const uint64_t e = rows ? e_tile + r * L + c : e_tile + c * L + r;
      const int bit = rows ? dropout_bit_rows(t, k) : dropout_bit_cols(g, k);
      wrong += (int)(((x[lane] >> bit) & 1u) != (dropout_keep(d, e) ? 1u : 0u));
    }
  }
  return wrong;
}

#endif  // FASTAXIAL_NO_RANDOM123

}  // namespace fastaxial::test
