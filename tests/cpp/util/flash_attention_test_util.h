// The flash attention kernel's test problems (tests/cpp/cuda/attention/test_flash_attention*.cpp):
// a pass's view and random qkv, the kernel run on them with poisoned outputs, and the device check.
#pragma once

#include "util/attention_dropout_util.h"  // first: whether dropout.h may include Random123

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "src/common/axis.h"
#include "src/common/plan.h"
#include "src/cuda/attention/flash_attention.h"
#include "util/attention_case.h"  // Case, case_name, kPoison, is_poison
#include "util/cuda_test_util.h"
#include "util/round16.h"  // to16: qkv16's values

namespace fastaxial::test {

constexpr int64_t kGuardRows = 3;          // rows of o past the T the views address
constexpr int64_t kGuardLse = 67;          // lse elements past (2, num_seq, heads, L): hi, lo

// max |x - ref| over a row, NaN counting as infinite.
inline double worst_abs(double worst, float x, double ref) {
  const double e = std::isnan(x) ? std::numeric_limits<double>::infinity() : std::fabs((double)x - ref);
  return std::max(worst, e);
}

// A case's sizes, its view in rows (as the staged path's row_indices gives
// it to the kernel) and its random qkv.
struct Problem {
  AxialParams p;
  AxisView view{};
  int64_t D = 0, T = 0, N = 0, L = 0, hd = 0;
  int heads = 0, pass = 0;  // pass: 1 for the column view
  std::vector<float> qkv;   // (T, 3D)
};

inline Problem make_problem(const Case& c) {
  Problem pr;
  pr.D = (int64_t)c.hd * c.heads;
  pr.p.batch = c.B, pr.p.dim = pr.D, pr.p.heads = c.heads;
  pr.p.height = c.col ? c.L : c.other;
  pr.p.width = c.col ? c.other : c.L;
  // The pass's view, in floats (common/axis.h), then in rows of D.
  const AxisView fv = c.col ? col_view(pr.p) : row_view(pr.p);
  pr.view = {c.used ? c.used : fv.num_seq, fv.len, fv.inner, fv.seq_stride / pr.D, fv.pos_stride / pr.D,
             fv.batch_stride / pr.D};
  pr.T = pr.p.batch * pr.p.height * pr.p.width, pr.N = pr.view.num_seq, pr.L = c.L, pr.hd = c.hd;
  pr.heads = c.heads, pr.pass = c.col ? 1 : 0;
  std::mt19937 rng(1234567u + 7919u * (uint32_t)(c.L * 3 + c.hd * 5 + c.heads * 7 + c.B * 11 + c.other * 13));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  pr.qkv.resize((size_t)(pr.T * 3 * pr.D));
  for (float& x : pr.qkv) x = normal(rng);
  return pr;
}

// The kernel's output: o ((T + kGuardRows) D) and lse ((2, N, heads, L) +
// kGuardLse), both poisoned before the call.
struct Result {
  std::vector<float> o, lse;
};

// flash_attention on pr with qkv misaligned by `misalign` floats; with
// drop (threshold != 0: dropout), its seed and offset from the device pair
// {seed, offset} (null: none given).
// With `partials`, a poisoned split-KV buffer of workspace_bytes(FlashProblem)
// for the pass (none where that is 0).
// mma_sync: the mma.sync kernel even where a wgmma one or the short-sequence one applies.
// With o16 (16-bit products): the output rounded (FlashArgs::o16), (T + kGuardRows) D 16-bit
// values poisoned (0xffff: NaN in both types) before the call; r->o is then the poisoned o.
// With qkv16 (16-bit products, misalign 0): qkv rounded to the type on the host and given as
// FlashArgs::qkv16 (qkv null), the kQkv16 kernel's input.
inline void run_gpu(const Problem& pr, int misalign, const DeviceCaps& dev, Result* r,
                    const DropoutParams* drop = nullptr, const uint64_t* philox_seed_offset = nullptr,
                    bool partials = false, bool mma_sync = false, Products products = Products::kFp32,
                    std::vector<uint16_t>* o16 = nullptr, bool o_too = true, bool qkv16 = false) {
  const int64_t D = pr.D, T = pr.T, lse_n = 2 * pr.N * pr.heads * pr.L;  // hi, then lo
  const DevicePtr dqkv = device_alloc(pr.qkv.size() + misalign), dout = device_alloc((size_t)((T + kGuardRows) * D)),
                  dlse = device_alloc((size_t)(lse_n + kGuardLse));
  ASSERT_TRUE(dqkv && dout && dlse);
  DevicePtr philox;
  if (philox_seed_offset) {
    philox = philox_pair(philox_seed_offset[0], philox_seed_offset[1]);
    ASSERT_TRUE(philox);
  }
  float* qkv_at = dqkv.get() + misalign;
  CUDA_OK(cudaMemcpy(qkv_at, pr.qkv.data(), pr.qkv.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dout.get(), 0xff, (size_t)((T + kGuardRows) * D) * sizeof(float)));
  CUDA_OK(cudaMemset(dlse.get(), 0xff, (size_t)(lse_n + kGuardLse) * sizeof(float)));

  cuda::FlashArgs a;
  a.pos = pr.view, a.qkv = qkv_at, a.o = dout.get(), a.lse = dlse.get(), a.D = (int)D, a.heads = pr.heads;
  a.mma_sync = mma_sync, a.products = products;
  DevicePtr d16;
  if (o16) {
    o16->assign((size_t)((T + kGuardRows) * D), 0xffffu);
    d16 = device_alloc(o16->size() / 2 + 1);
    ASSERT_TRUE(d16);
    CUDA_OK(cudaMemset(d16.get(), 0xff, o16->size() * sizeof(uint16_t)));
    a.o16 = d16.get();
    if (!o_too) a.o = nullptr;  // o16 alone: o stays poison
  }
  if (drop) a.dropout = *drop, a.pass = pr.pass, a.philox = as_philox(philox);
  DevicePtr dqkv16;
  if (qkv16) {
    ASSERT_EQ(misalign, 0) << "q, k and v in 16 bits are 16-byte aligned";
    std::vector<uint16_t> h16(pr.qkv.size());
    for (size_t i = 0; i < h16.size(); ++i) h16[i] = to16(pr.qkv[i], products);
    dqkv16 = device_alloc(h16.size() / 2 + 1);
    ASSERT_TRUE(dqkv16);
    CUDA_OK(cudaMemcpy(dqkv16.get(), h16.data(), h16.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
    a.qkv16 = dqkv16.get(), a.qkv = nullptr;
  }
  DevicePtr dpart;
  if (partials) {
    const size_t bytes = workspace_bytes(FlashProblem{pr.N, pr.L, pr.hd, pr.heads}, dev);
    if (bytes > 0) {
      dpart = device_alloc(bytes / sizeof(float));
      ASSERT_TRUE(dpart);
      CUDA_OK(cudaMemset(dpart.get(), 0xff, bytes));
      a.partials = dpart.get(), a.partials_bytes = bytes;
    }
  }
  CUDA_OK(cuda::flash_attention(a, dev, nullptr));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  r->o.resize((size_t)((T + kGuardRows) * D));
  r->lse.resize((size_t)(lse_n + kGuardLse));
  CUDA_OK(cudaMemcpy(r->o.data(), dout.get(), r->o.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(r->lse.data(), dlse.get(), r->lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
  if (o16) CUDA_OK(cudaMemcpy(o16->data(), d16.get(), o16->size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
}

// The device as the kernel sees it; false (with the reason in *why) where
// the case cannot run here.
inline bool device_for(int hd, DeviceCaps* dev, std::string* why) {
  if (!have_gpu())
    *why = "no CUDA device";
  else if (!read_device_caps(dev))
    *why = "device attribute query failed";
  else if (dev->cc_major < 8)
    *why = "needs compute capability 8.0 or later (mma.sync tf32)";
  else if (cuda::flash_attention_smem_bytes(hd) > (size_t)dev->smem_optin)
    *why = "head_dim " + std::to_string(hd) + " needs more shared memory than this device gives a block";
  else
    return true;
  return false;
}

// How many of the rows the view addresses (D floats each) differ, bitwise,
// between two results.
inline int64_t rows_differing(const Problem& pr, const Result& x, const Result& y) {
  int64_t differ = 0;
  for (int64_t n = 0; n < pr.N; ++n)
    for (int64_t l = 0; l < pr.L; ++l) {
      const size_t at = (size_t)(pr.view.offset(n, l) * pr.D);
      differ += std::memcmp(x.o.data() + at, y.o.data() + at, (size_t)pr.D * sizeof(float)) != 0;
    }
  return differ;
}

}  // namespace fastaxial::test
