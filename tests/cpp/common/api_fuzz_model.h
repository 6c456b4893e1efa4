// The model behind test_api_fuzz.cpp: the rules fastaxial.h documents for each entry point,
// in exact arithmetic, random cases and their tensors (buffers with guard zones), and the check
// of one call against the rules. Included by that one test file (an anonymous namespace).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fastaxial/fastaxial.h"
#include "src/common/plan.h"
#include "util/devices.h"

// A crash, a failed assertion or (under a sanitizer) a finding ends the process at once: the
// test says which case it was in.
#if defined(__SANITIZE_ADDRESS__)
#define FASTAXIAL_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define FASTAXIAL_SANITIZED 1
#endif
#endif
#ifdef FASTAXIAL_SANITIZED
#include <dlfcn.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace fastaxial::test {
namespace {

using u128 = unsigned __int128;
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr u128 kSat = u128{1} << 126;  // saturation of exact products: far above any size

// ---- exact arithmetic ------------------------------------------------------------------------

u128 mul(u128 a, u128 b) {
  if (a == 0 || b == 0) return 0;
  return a > kSat / b ? kSat : std::min(a * b, kSat);
}
u128 mul(std::initializer_list<u128> v) {
  u128 r = 1;
  for (u128 x : v) r = mul(r, x);
  return r;
}
u128 u(int64_t v) { return v < 0 ? 0 : static_cast<u128>(v); }
std::string str(u128 v) {
  if (v >= kSat) return ">=2^126";
  std::string s;
  do s.insert(s.begin(), char('0' + int(v % 10))), v /= 10;
  while (v != 0);
  return s;
}

// ---- what the rules allow: a set of status codes ----------------------------------------------

enum Accept : unsigned { kOk = 1, kInvalid = 2, kUnsupported = 4, kCuda = 8 };
unsigned bit(StatusCode c) {
  switch (c) {
    case StatusCode::kOk: return kOk;
    case StatusCode::kInvalidArgument: return kInvalid;
    case StatusCode::kUnsupported: return kUnsupported;
    case StatusCode::kCudaError: return kCuda;
  }
  return 0;
}
std::string names(unsigned a) {
  std::string s;
  for (auto [b, n] : {std::pair{kOk, "ok"}, {kInvalid, "invalid"}, {kUnsupported, "unsupported"}, {kCuda, "cuda"}})
    if (a & b) s += (s.empty() ? "" : "|") + std::string(n);
  return s.empty() ? "nothing" : s;
}
// `a` with "ok" turned into `code` (a check after the previous ones failed).
unsigned instead_of_ok(unsigned a, unsigned code) { return (a & kOk) ? ((a & ~kOk) | code) : a; }

// The positions (B H W) and the elements (B H W D), exact.
u128 positions(const AxialParams& p) { return mul({u(p.batch), u(p.height), u(p.width)}); }
u128 elements(const AxialParams& p) { return mul(positions(p), u(p.dim)); }

// validate_sizes' rules (validate.h), written from fastaxial.h's contract, not from its code.
unsigned sizes_rule(const AxialParams& p) {
  if (p.batch < 0 || p.height < 0 || p.width < 0 || p.dim < 1 || p.heads < 1) return kInvalid;
  if (p.dim % p.heads != 0) return kInvalid;
  if (!(p.eps >= 0.0f)) return kInvalid;  // NaN too; +inf is accepted (LayerNorm's output is then its shift)
  if (!(p.dropout >= 0.0f && p.dropout <= 1.0f)) return kInvalid;
  if (p.dropout > 0.0f && !dropout_compiled()) return kUnsupported;
  if (elements(p) > u(kI64Max)) return kInvalid;  // B*H*W*D must fit in int64
  unsigned a = kOk;
  // Where a size is zero there is nothing to compute, but the library forms the other sizes'
  // products too (B*H sequences of a row pass with W = 0): the header's rule refuses those whose
  // product overflows, and a qkv weight of 3 D^2 elements beyond int64.
  const u128 nonzero = mul({std::max<u128>(u(p.batch), 1), std::max<u128>(u(p.height), 1),
                            std::max<u128>(u(p.width), 1), u(p.dim)});
  if (nonzero > u(kI64Max) || mul({3, u(p.dim), u(p.dim)}) > u(kI64Max)) return kInvalid;
  if (p.dropout > 0.0f) {  // the mask's elements, heads (B H W^2 + B W H^2), are numbered in uint64
    const u128 B = u(p.batch), H = u(p.height), W = u(p.width), h = u(p.heads);
    const u128 count = mul({h, B, H, W, W}) + mul({h, B, W, H, H});
    if (count > std::numeric_limits<uint64_t>::max()) return kInvalid;
  }
  return a;
}

bool any_weight_null(const AxisWeights& w) {
  return !w.norm_weight || !w.norm_bias || !w.qkv_weight || !w.out_weight || !w.out_bias;
}

// validate_inputs: the sizes, then where there is a position x and the ten weights.
unsigned inputs_rule(const AxialParams& p) {
  const unsigned a = sizes_rule(p);
  if (!(a & kOk) || positions(p) == 0) return a;
  if (!p.x || any_weight_null(p.row) || any_weight_null(p.col)) return kInvalid;
  return a;
}

// validate(): the inputs, then where there is a position an output that is not x.
unsigned validate_rule(const AxialParams& p) {
  const unsigned a = inputs_rule(p);
  if (!(a & kOk) || positions(p) == 0) return a;
  if (!p.out || p.out == p.x) return kInvalid;
  return a;
}

unsigned backward_rule(const AxialParams& p, const AxialGrads& g) {
  const unsigned a = inputs_rule(p);
  if (!(a & kOk) || positions(p) == 0) return a;
  if (!g.grad_out || (g.grad_x && g.grad_x == p.x)) return kInvalid;
  return a;
}

// Elements of dropout_mask's output for pass 0 (rows: B H sequences of W) or 1 (columns).
u128 mask_elements(const AxialParams& p, int pass) {
  const u128 n = mul(u(p.batch), u(pass == 0 ? p.height : p.width)), L = u(pass == 0 ? p.width : p.height);
  return mul({n, u(p.heads), L, L});
}

unsigned mask_rule(const AxialParams& p, int pass, const float* out) {
  unsigned a = sizes_rule(p);
  if (!(a & kOk)) return a;
  if (pass != 0 && pass != 1) return kInvalid;
  if (mask_elements(p, pass) == 0) return a;
  // As validate_sizes' with dropout: the count must fit in uint64.
  if (mask_elements(p, pass) > std::numeric_limits<uint64_t>::max()) return kInvalid;
  return out ? a : kInvalid;
}

// A problem whose workspace is beyond any memory (2^55 bytes and more): the planning functions
// may refuse it as overflowing size_t. Smaller ones they must plan.
bool huge_problem(const AxialParams& p) {
  const u128 T = positions(p), D = u(p.dim), big = u128{1} << 55;
  return mul({T, D, 16}) >= big || mul({T, u(p.heads), 16}) >= big || mul({D, D, 128}) >= big;
}

// ---- buffers with guard zones ----------------------------------------------------------------

constexpr size_t kGuard = 64;  // floats of sentinel on each side
constexpr uint32_t kSentinel = 0x7fa5a5a5u;  // a NaN no computation produces

// `n` floats between two guard zones, starting `shift` floats (0 to 3) past a 16-byte boundary.
class Guarded {
 public:
  Guarded(size_t n, size_t shift, std::mt19937_64* rng) : n_(n), mem_(n + 2 * kGuard + 8) {
    // The first 16-byte boundary in the allocation, then `shift` floats on.
    off_ = (4 - reinterpret_cast<uintptr_t>(mem_.data()) / 4 % 4) % 4 + shift;
    uint32_t s = kSentinel;
    for (float& f : mem_) std::memcpy(&f, &s, 4);
    if (rng) {
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (size_t i = 0; i < n; ++i) data()[i] = normal(*rng);
    }
    snapshot_ = mem_;
  }
  float* data() { return mem_.data() + off_ + kGuard; }
  size_t size() const { return n_; }
  // The guard zones hold the sentinel still.
  bool guards_intact() const {
    const size_t after = off_ + kGuard + n_;
    return std::memcmp(mem_.data() + off_, snapshot_.data() + off_, kGuard * 4) == 0 &&
           std::memcmp(mem_.data() + after, snapshot_.data() + after, kGuard * 4) == 0;
  }
  // Not one byte changed since the buffer was made (or since remember()).
  bool untouched() const { return std::memcmp(mem_.data(), snapshot_.data(), mem_.size() * 4) == 0; }
  void remember() { snapshot_ = mem_; }
  bool all_finite() const {
    const float* d = mem_.data() + off_ + kGuard;
    return std::all_of(d, d + n_, [](float f) { return std::isfinite(f); });
  }

 private:
  size_t n_, off_;
  std::vector<float> mem_, snapshot_;
};

// ---- a random case ---------------------------------------------------------------------------

int64_t nasty_size(std::mt19937_64& rng) {
  static const int64_t pool[] = {kI64Min,
                                 kI64Min + 1,
                                 -(int64_t{1} << 40),
                                 -2,
                                 -1,
                                 0,
                                 0,
                                 1,
                                 1,
                                 2,
                                 3,
                                 (int64_t{1} << 31) - 1,
                                 int64_t{1} << 31,
                                 int64_t{1} << 32,
                                 (int64_t{1} << 32) + 1,
                                 3037000499,  // floor(sqrt(2^63))
                                 3037000500,
                                 379625062,   // about sqrt(2^64 / 128): a backward plan's weight planes, 128 D^2 bytes
                                 759250125,   // about sqrt(2^64 / 32): a forward plan's, 32 D^2 bytes
                                 1753413056,  // floor(sqrt(2^63 / 3)): the qkv weight's 3 D^2 elements
                                 1753413057,
                                 int64_t{1} << 40,
                                 int64_t{1} << 62,
                                 kI64Max - 1,
                                 kI64Max};
  if (rng() % 8 == 0) return static_cast<int64_t>(rng() >> (rng() % 64));  // any magnitude, any sign
  return pool[rng() % (sizeof(pool) / sizeof(pool[0]))];
}

float pick(std::mt19937_64& rng, std::initializer_list<float> values) { return values.begin()[rng() % values.size()]; }

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Case {
  AxialParams p;
  // Which of the 12 tensor pointers (x, out, row's five, col's five) are null, and whether out is x.
  bool null_ptr[12] = {};
  bool out_is_x = false;
  // The backward's: grad_out null, grad_x null / = x / = grad_out, each weight gradient wanted.
  bool null_grad_out = false, grad_x_null = false, grad_x_is_x = false, grad_x_is_grad_out = false;
  bool want[10] = {};
  int mask_pass = 0;
  size_t shift = 0;  // the buffers' offset from 16-byte alignment, in floats

  std::string describe() const {
    std::ostringstream s;
    s.precision(9);
    s << "B " << p.batch << ", H " << p.height << ", W " << p.width << ", D " << p.dim << ", heads " << p.heads
      << ", eps " << p.eps << ", dropout " << p.dropout << ", null {";
    static const char* ptr_names[12] = {"x", "out", "row.norm_weight", "row.norm_bias", "row.qkv_weight",
                                        "row.out_weight", "row.out_bias", "col.norm_weight", "col.norm_bias",
                                        "col.qkv_weight", "col.out_weight", "col.out_bias"};
    for (int i = 0; i < 12; ++i)
      if (null_ptr[i]) s << " " << ptr_names[i];
    s << " }" << (out_is_x ? ", out = x" : "") << (null_grad_out ? ", grad_out null" : "")
      << (grad_x_null          ? ", grad_x null"
          : grad_x_is_x        ? ", grad_x = x"
          : grad_x_is_grad_out ? ", grad_x = grad_out"
                               : "")
      << ", wanted weight grads " << std::count(want, want + 10, true) << ", mask pass " << mask_pass
      << ", buffers " << 4 * shift << " B past 16-byte alignment";
    return s.str();
  }
};

Case random_case(std::mt19937_64& rng) {
  Case c;
  AxialParams& p = c.p;
  // A small problem, which the CPU can run...
  p.batch = rng() % 3, p.height = rng() % 6, p.width = rng() % 6;
  if (rng() % 4 != 0) p.batch = std::max<int64_t>(p.batch, 1), p.height = std::max<int64_t>(p.height, 1),
                      p.width = std::max<int64_t>(p.width, 1);
  p.heads = 1 + rng() % 3;
  p.dim = p.heads * (1 + rng() % 6);
  // ... with one to three of its sizes made nasty, in half the cases.
  if (rng() % 2 == 0) {
    for (int k = 1 + rng() % 3; k > 0; --k) {
      switch (rng() % 7) {
        case 0: p.batch = nasty_size(rng); break;
        case 1: p.height = nasty_size(rng); break;
        case 2: p.width = nasty_size(rng); break;
        case 3: p.dim = nasty_size(rng); break;
        case 4: p.heads = nasty_size(rng); break;
        case 5: p.heads = p.dim; break;  // a valid head count for a nasty dim
        case 6:                          // a head dim of 1 to 256 (the staged and training plans) where one divides
          for (int64_t hd : {int64_t{256}, int64_t{64}, int64_t{32}, int64_t{8}, int64_t{1}})
            if (p.dim > 0 && p.dim % hd == 0) {
              p.heads = p.dim / hd;
              break;
            }
          break;
      }
    }
  }
  if (rng() % 6 == 0)
    p.eps = pick(rng, {0.0f, -0.0f, 1e-30f, std::numeric_limits<float>::denorm_min(), 0.5f, 1e30f,
                       std::numeric_limits<float>::max(), kInf, -1e-5f, -kInf, kNaN, -kNaN});
  if (rng() % 5 == 0)
    p.dropout = pick(rng, {0.1f, 0.5f, 0.999999f, 1.0f, -0.0f, -1e-7f, 1.0000001f, 2.0f, kInf, -kInf, kNaN,
                           std::numeric_limits<float>::denorm_min()});
  p.seed = rng(), p.offset = rng();
  for (bool& n : c.null_ptr) n = rng() % 40 == 0;
  c.out_is_x = rng() % 40 == 0;
  c.null_grad_out = rng() % 30 == 0;
  const int gx = rng() % 30;
  c.grad_x_null = gx < 6, c.grad_x_is_x = gx == 6, c.grad_x_is_grad_out = gx >= 7 && gx < 10;
  for (bool& w : c.want) w = rng() % 3 != 0;
  c.mask_pass = rng() % 20 == 0 ? static_cast<int>(rng() % 5) - 2 : static_cast<int>(rng() % 2);
  c.shift = rng() % 4;
  return c;
}

// ---- the tensors of a case -------------------------------------------------------------------

// Real buffers of the problem's sizes where they are small enough to allocate; else small
// dummies (where the library should read none of them: ASan would see a read past them).
struct Tensors {
  static constexpr u128 kMaxFloats = 1 << 16;
  std::vector<std::unique_ptr<Guarded>> all;
  Guarded *x, *out, *w[10], *grad_out, *grad_x, *gw[10], *mask;
  bool real_activations, real_weights, real_mask;

  Tensors(const Case& c, std::mt19937_64& rng) {
    const AxialParams& p = c.p;
    const u128 td = elements(p), D = u(p.dim);
    // (Sequences of up to 128 positions: the attention's cost grows as their square.)
    real_activations = sizes_rule(p) != kInvalid && td <= kMaxFloats && p.height <= 128 && p.width <= 128;
    real_weights = p.dim >= 1 && mul({3, D, D}) <= kMaxFloats;
    const u128 m = p.heads >= 1 ? mask_elements(p, c.mask_pass == 1) : 0;
    real_mask = sizes_rule(p) != kInvalid && m <= kMaxFloats;
    const auto make = [&](u128 n, bool real, bool input) {
      all.push_back(std::make_unique<Guarded>(real ? static_cast<size_t>(n) : 16, c.shift, input ? &rng : nullptr));
      return all.back().get();
    };
    x = make(td, real_activations, true);
    out = make(td, real_activations, false);
    grad_out = make(td, real_activations, true);
    grad_x = make(td, real_activations, false);
    for (int a = 0; a < 2; ++a) {
      const u128 sizes[5] = {D, D, 3 * D * D, D * D, D};
      for (int i = 0; i < 5; ++i) {
        w[5 * a + i] = make(sizes[i], real_weights, true);
        gw[5 * a + i] = make(sizes[i], real_weights, false);
      }
    }
    mask = make(m, real_mask, false);
  }

  static void set(AxisWeights& a, Guarded* const* w, const bool* null) {
    const float** f[5] = {&a.norm_weight, &a.norm_bias, &a.qkv_weight, &a.out_weight, &a.out_bias};
    for (int i = 0; i < 5; ++i) *f[i] = null[i] ? nullptr : w[i]->data();
  }
  static void set(AxisGrads& a, Guarded* const* w, const bool* want) {
    float** f[5] = {&a.norm_weight, &a.norm_bias, &a.qkv_weight, &a.out_weight, &a.out_bias};
    for (int i = 0; i < 5; ++i) *f[i] = want[i] ? w[i]->data() : nullptr;
  }

  AxialParams params(const Case& c) const {
    AxialParams p = c.p;
    p.x = c.null_ptr[0] ? nullptr : x->data();
    p.out = c.out_is_x ? const_cast<float*>(p.x) : c.null_ptr[1] ? nullptr : out->data();
    set(p.row, w, c.null_ptr + 2);
    set(p.col, w + 5, c.null_ptr + 7);
    return p;
  }
  AxialGrads grads(const Case& c, const AxialParams& p) const {
    AxialGrads g;
    g.grad_out = c.null_grad_out ? nullptr : grad_out->data();
    g.grad_x = c.grad_x_null          ? nullptr
               : c.grad_x_is_x        ? const_cast<float*>(p.x)
               : c.grad_x_is_grad_out ? const_cast<float*>(g.grad_out)
                                      : grad_x->data();
    set(g.row, gw, c.want);
    set(g.col, gw + 5, c.want + 5);
    return g;
  }

  void remember() {
    for (auto& b : all) b->remember();
  }
  // Every buffer unchanged (a call that failed), or every guard zone intact (one that ran).
  ::testing::AssertionResult untouched() const {
    for (size_t i = 0; i < all.size(); ++i)
      if (!all[i]->untouched()) return ::testing::AssertionFailure() << "buffer " << i << " was written";
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult guards_intact() const {
    for (size_t i = 0; i < all.size(); ++i)
      if (!all[i]->guards_intact()) return ::testing::AssertionFailure() << "buffer " << i << ": guard zone written";
    return ::testing::AssertionSuccess();
  }
};

// ---- the plans' layouts, in exact arithmetic ------------------------------------------------

struct Region {
  const char* name;
  size_t offset;
  u128 bytes;
};

// Each region 256-byte aligned, inside `total`, and no two overlapping (regions at the same
// offset are one region, shared: the larger counts).
::testing::AssertionResult sound_layout(std::vector<Region> regions, size_t total, const char* what) {
  for (const Region& r : regions) {
    if (r.offset % 256 != 0)
      return ::testing::AssertionFailure() << what << ": " << r.name << " at " << r.offset << ", not 256-byte aligned";
    if (u128{r.offset} + r.bytes > total)
      return ::testing::AssertionFailure() << what << ": " << r.name << " (" << str(r.bytes) << " B at " << r.offset
                                           << ") runs past its end, " << total << " B";
  }
  std::sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
  });
  const auto shared = [](const Region& a, const Region& b) {  // the one region two uses share (fastaxial.h)
    const std::string n = std::string(a.name) + " " + b.name;
    return a.offset == b.offset &&
           (n == "flash_partials attention_partials" || n == "attention_partials flash_partials");
  };
  for (size_t i = 0; i + 1 < regions.size(); ++i) {
    const Region &a = regions[i], &b = regions[i + 1];
    if (a.bytes > 0 && u128{a.offset} + a.bytes > b.offset && !shared(a, b))
      return ::testing::AssertionFailure() << what << ": " << a.name << " (" << str(a.bytes) << " B at " << a.offset
                                           << ") overlaps " << b.name << " at " << b.offset;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult sound_plan(const CudaPlan& c, const AxialParams& p) {
  if (c.batch != p.batch || c.height != p.height || c.width != p.width || c.dim != p.dim || c.heads != p.heads)
    return ::testing::AssertionFailure() << "the plan records other sizes: " << c.describe();
  const u128 td4 = mul(elements(p), 4), planes = mul({32, u(p.dim), u(p.dim)});
  const bool row_staged = c.row.family == KernelFamily::kStaged, col_staged = c.col.family == KernelFamily::kStaged;
  std::vector<Region> r = {{"row_output", c.row_output, td4}};
  if ((c.staged_scratch != CudaPlan::kNone) != (row_staged || col_staged))
    return ::testing::AssertionFailure() << "staged scratch without a staged pass, or the reverse: " << c.describe();
  if (c.staged_scratch != CudaPlan::kNone) r.push_back({"staged_scratch", c.staged_scratch, mul(td4, 4)});
  if ((c.row_weight_planes != CudaPlan::kNone) != row_staged || (c.col_weight_planes != CudaPlan::kNone) != col_staged)
    return ::testing::AssertionFailure() << "weight planes and staged passes disagree: " << c.describe();
  if (row_staged) r.push_back({"row_weight_planes", c.row_weight_planes, planes});
  if (col_staged) r.push_back({"col_weight_planes", c.col_weight_planes, planes});
  if (c.flash_partials != CudaPlan::kNone) r.push_back({"flash_partials", c.flash_partials, c.flash_partials_bytes});
  return sound_layout(r, c.workspace_bytes, "workspace");
}

::testing::AssertionResult sound_plan(const CudaBackwardPlan& c, const AxialParams& p) {
  if (c.batch != p.batch || c.height != p.height || c.width != p.width || c.dim != p.dim || c.heads != p.heads)
    return ::testing::AssertionFailure() << "the backward plan records other sizes: " << c.describe();
  const u128 T = positions(p), td4 = mul(elements(p), 4), th4 = mul({T, u(p.heads), 4});
  std::vector<Region> saved;
  for (const CudaBackwardPlan::Pass* s : {&c.row, &c.col}) {
    saved.push_back({"norm", s->norm, td4});
    saved.push_back({"stats", s->stats, mul(T, 8)});
    saved.push_back({"qkv", s->qkv, mul(td4, 3)});
    saved.push_back({"attn", s->attn, td4});
    saved.push_back({"lse", s->lse, mul(th4, 2)});
  }
  saved.push_back({"row_output", c.row_output, td4});
  saved.push_back({"dropout_state", c.dropout_state, 16});
  if (u128{c.dropout_state} + 16 != c.saved_bytes)
    return ::testing::AssertionFailure() << "the dropout state is not saved's last 16 bytes: " << c.describe();
  if (auto r = sound_layout(saved, c.saved_bytes, "saved"); !r) return r;

  std::vector<Region> ws = {{"grad_row_output", c.grad_row_output, td4}, {"grad_attn", c.grad_attn, td4},
                            {"grad_qkv", c.grad_qkv, mul(td4, 3)},       {"grad_norm", c.grad_norm, td4},
                            {"delta", c.delta, th4},
                            {"column_partials", c.column_partials, mul({5 * kMaxColumnSumChunks + 3, u(p.dim), 8})}};
  if (c.caller_blas != (c.blas == CudaBackwardPlan::kNone))
    return ::testing::AssertionFailure() << "cuBLAS scratch and caller_blas disagree: " << c.describe();
  if (!c.caller_blas) ws.push_back({"blas", c.blas, c.blas_bytes});
  if (c.tensor_core_products != (c.weight_planes != CudaBackwardPlan::kNone))
    return ::testing::AssertionFailure() << "weight planes and tensor-core products disagree: " << c.describe();
  if (c.tensor_core_products) ws.push_back({"weight_planes", c.weight_planes, mul({128, u(p.dim), u(p.dim)})});
  if (c.weight_grad_partials != CudaBackwardPlan::kNone)
    ws.push_back({"weight_grad_partials", c.weight_grad_partials, c.weight_grad_partials_bytes});
  if (c.attention_scores != CudaBackwardPlan::kNone)
    ws.push_back({"attention_scores", c.attention_scores, c.attention_scores_bytes});
  if (c.flash_partials != CudaBackwardPlan::kNone)
    ws.push_back({"flash_partials", c.flash_partials, c.flash_partials_bytes});
  if (c.attention_partials != CudaBackwardPlan::kNone)
    ws.push_back({"attention_partials", c.attention_partials, c.attention_partials_bytes});
  return sound_layout(ws, c.workspace_bytes, "workspace");
}

// Devices for the host-side planners (as tests/cpp/common/test_plan.cpp): an H200, an A100, a
// newer GPU running the PTX build, a compute-capability 8.0 one with 48 KB of shared memory a
// block, and one that reports nothing.
std::vector<DeviceCaps> devices() {
  DeviceCaps small, none;
  small.sms = 2, small.smem_optin = 48 * 1024, small.cc_major = 8;  // too little for the tensor-core kernels
  return {h200(), a100(), ptx_only(), small, none};
}

// ---- checking one call -----------------------------------------------------------------------

::testing::AssertionResult allowed(const Status& s, unsigned accept, const char* call) {
  if (!(bit(s.code) & accept))
    return ::testing::AssertionFailure() << call << " returned " << names(bit(s.code)) << " (\"" << s.message
                                         << "\"), the rules allow " << names(accept);
  if (s.ok() != s.message.empty())
    return ::testing::AssertionFailure() << call << ": status " << names(bit(s.code)) << " with message \""
                                         << s.message << "\"";
  return ::testing::AssertionSuccess();
}

// A planning call's out-parameter stays as it was when the call fails.
constexpr int64_t kUnwritten = -7777;
constexpr size_t kUnwrittenBytes = 0xdeadbeef;

// What one case did, for the counts.
struct Outcome {
  bool ran = false;      // the CPU forward or backward computed something
  bool refused = false;  // validate() refused it
};

// Every entry point on one case.
Outcome check_case(const Case& case_, std::mt19937_64& rng) {
  Case c = case_;
  Tensors t(c, rng);
  // No position and weights too large to allocate: the backward zeroes the weight gradients it is
  // given, so it gets none (it must still not compute their sizes in overflowing arithmetic).
  if (positions(c.p) == 0 && !t.real_weights) std::fill(c.want, c.want + 10, false);
  const AxialParams p = t.params(c);
  const AxialGrads g = t.grads(c, p);
  const u128 T = positions(p);
  const bool cuda = cuda_compiled();
  const unsigned sizes = sizes_rule(p), inputs = inputs_rule(p), valid = validate_rule(p);
  Outcome outcome;
  bool& ran = outcome.ran;
  const Status v = validate(p);
  EXPECT_TRUE(allowed(v, valid, "validate"));
  outcome.refused = !v.ok();
  // The inputs: never written by the forward, nor by the backward (but grad_out where grad_x is it).
  const auto inputs_untouched = [&](bool grad_out_too) {
    bool ok = t.x->untouched() && (!grad_out_too || t.grad_out->untouched());
    for (const Guarded* w : t.w) ok = ok && w->untouched();
    return ok;
  };

  // The CPU forward: where the rules refuse it it must write nothing; where they accept it, it runs
  // only where its tensors are real (or there is no position: it reads and writes nothing).
  if (valid == kInvalid || valid == kUnsupported || T == 0 || (t.real_activations && t.real_weights)) {
    t.remember();
    const Status s = forward_cpu(p);
    EXPECT_TRUE(allowed(s, valid, "forward_cpu"));
    if (!s.ok() || T == 0) {
      EXPECT_TRUE(t.untouched()) << "forward_cpu returned " << s.message;
    } else {
      ran = true;
      EXPECT_TRUE(t.guards_intact()) << "forward_cpu";
      EXPECT_TRUE(inputs_untouched(true)) << "forward_cpu wrote into an input";
      if (p.eps > 0.0f) {
        EXPECT_TRUE(t.out->all_finite()) << "forward_cpu: a non-finite output";
      }
    }
  }

  // The CPU backward: as the forward; with no position it zeroes the wanted weight gradients.
  const unsigned bw = backward_rule(p, g);
  const bool grads_real = t.real_weights || std::none_of(c.want, c.want + 10, [](bool w) { return w; });
  if (bw == kInvalid || bw == kUnsupported || (T == 0 && grads_real) ||
      (t.real_activations && t.real_weights)) {
    t.remember();
    const Status s = backward_cpu(p, g);
    EXPECT_TRUE(allowed(s, bw, "backward_cpu"));
    if (!s.ok()) {
      EXPECT_TRUE(t.untouched()) << "backward_cpu returned " << s.message;
    } else {
      ran = ran || T > 0;
      EXPECT_TRUE(t.guards_intact()) << "backward_cpu";
      EXPECT_TRUE(inputs_untouched(g.grad_x != g.grad_out)) << "backward_cpu wrote into an input";
      for (int i = 0; i < 10; ++i) {
        if (!c.want[i]) {
          EXPECT_TRUE(t.gw[i]->untouched()) << "backward_cpu wrote an unwanted gradient " << i;
        } else if (p.eps > 0.0f) {
          EXPECT_TRUE(t.gw[i]->all_finite()) << "backward_cpu: weight gradient " << i;
        }
        if (c.want[i] && T == 0) {
          const float* d = t.gw[i]->data();
          EXPECT_TRUE(std::all_of(d, d + t.gw[i]->size(), [](float f) { return f == 0.0f; }))
              << "backward_cpu with no position: weight gradient " << i << " not zeroed";
        }
      }
    }
  }

  // dropout_mask: the same rules for the sizes, its pass, and its output.
  float* mask_out = c.null_ptr[1] ? nullptr : t.mask->data();
  const unsigned mr = mask_rule(p, c.mask_pass, mask_out);
  if (mr == kInvalid || mr == kUnsupported || t.real_mask) {
    t.remember();
    const Status s = dropout_mask(p, c.mask_pass, mask_out);
    EXPECT_TRUE(allowed(s, mr, "dropout_mask"));
    if (!s.ok())
      EXPECT_TRUE(t.untouched()) << "dropout_mask returned " << s.message;
    else
      EXPECT_TRUE(t.guards_intact()) << "dropout_mask";
  }

  // The CUDA planning functions. Without CUDA (cuda_stub.cpp) they check the sizes, then say
  // kUnsupported; with it, a valid problem gets a plan or the device's error, and a huge one
  // may be refused as overflowing.
  const unsigned huge = huge_problem(p) ? unsigned{kInvalid} : 0u;
  const unsigned planned = cuda ? instead_of_ok(sizes, kOk | kUnsupported | kCuda | huge) | (sizes & kOk ? huge : 0)
                                : instead_of_ok(sizes, kUnsupported);
  {
    CudaPlan plan;
    plan.batch = kUnwritten;
    const Status s = plan_cuda(p, &plan);
    EXPECT_TRUE(allowed(s, planned, "plan_cuda"));
    if (s.ok()) {
      EXPECT_TRUE(sound_plan(plan, p));
    } else {
      EXPECT_EQ(plan.batch, kUnwritten) << "plan_cuda failed but wrote its plan";
    }
    size_t bytes = kUnwrittenBytes;
    const Status w = cuda_workspace_bytes(p, &bytes);
    EXPECT_TRUE(allowed(w, planned, "cuda_workspace_bytes"));
    if (w.ok() && s.ok()) {
      EXPECT_EQ(bytes, plan.workspace_bytes);
    }
    if (!w.ok()) {
      EXPECT_EQ(bytes, kUnwrittenBytes) << "cuda_workspace_bytes failed but wrote its result";
    }
  }
  {
    CudaBackwardPlan plan;
    plan.batch = kUnwritten;
    const Status s = plan_backward_cuda(p, &plan, rng() % 2 == 0);
    EXPECT_TRUE(allowed(s, planned, "plan_backward_cuda"));
    if (s.ok()) {
      EXPECT_TRUE(sound_plan(plan, p));
    } else {
      EXPECT_EQ(plan.batch, kUnwritten) << "plan_backward_cuda failed but wrote its plan";
    }
  }
  // cuda_saved_bytes is host code in every build: the backward plan's saved size, any device.
  const bool wide_heads = p.heads >= 1 && p.dim / p.heads > kCudaBackwardMaxHeadDim;
  {
    size_t bytes = kUnwrittenBytes;
    const unsigned rule = instead_of_ok(sizes, wide_heads ? kUnsupported : kOk | huge) | (sizes & kOk ? huge : 0);
    const Status s = cuda_saved_bytes(p, &bytes);
    EXPECT_TRUE(allowed(s, rule, "cuda_saved_bytes"));
    if (!s.ok()) {
      EXPECT_EQ(bytes, kUnwrittenBytes) << "cuda_saved_bytes failed but wrote its result";
    } else {
      EXPECT_GE(u128{bytes}, mul({positions(p), u(p.dim), 4, 11}) + 16) << "saved holds less than its tensors";
    }
  }

  // The host planners behind plan_cuda and plan_backward_cuda, on several devices, with the
  // pointers' alignment (the fused and staged paths need 16 bytes): a sound layout, whatever
  // the sizes. They need sizes that validate_sizes accepted (plan.h).
  if (validate_sizes(p).ok()) {
    PlanOptions options;
    options.forced = static_cast<ForcedFamily>(rng() % 4);
    for (const DeviceCaps& dev : devices()) {
      CudaPlan plan;
      plan.batch = kUnwritten;
      const Status s = make_plan(p, dev, options, &plan);
      const unsigned forced_staged = options.forced == ForcedFamily::kStaged ? unsigned{kUnsupported} : 0u;
      const unsigned forward_rule = huge | kOk | forced_staged;
      EXPECT_TRUE(allowed(s, forward_rule, "make_plan")) << " on sms " << dev.sms << ", cc " << dev.cc_major;
      if (s.ok()) {
        EXPECT_TRUE(sound_plan(plan, p)) << " on sms " << dev.sms << ", cc " << dev.cc_major;
      } else {
        EXPECT_EQ(plan.batch, kUnwritten);
      }
      CudaBackwardPlan bplan;
      bplan.batch = kUnwritten;
      const bool caller_blas = rng() % 2 == 0;
      const Status b = make_backward_plan(p, dev, &bplan, caller_blas);
      const unsigned backward_plan_rule = wide_heads || dev.cc_major < 8 ? kUnsupported : (kOk | huge);
      EXPECT_TRUE(allowed(b, backward_plan_rule, "make_backward_plan"))
          << " on sms " << dev.sms << ", cc " << dev.cc_major;
      if (b.ok()) {
        EXPECT_TRUE(sound_plan(bplan, p)) << " on sms " << dev.sms << ", cc " << dev.cc_major;
      } else {
        EXPECT_EQ(bplan.batch, kUnwritten);
      }
    }
  }

  // The CUDA calls: without CUDA, each checks what it reads, then says kUnsupported. With CUDA,
  // only arguments the rules refuse are passed (they must fail before touching the GPU).
  {
    CudaPlan plan;
    CudaBackwardPlan bplan;
    alignas(256) static char ws[512];
    const unsigned fwd = instead_of_ok(valid, kUnsupported), bwd = instead_of_ok(inputs, kUnsupported);
    t.remember();
    if (!cuda || !(valid & kOk)) {
      EXPECT_TRUE(allowed(forward_cuda(p, plan, ws, sizeof ws, nullptr), cuda ? valid : fwd, "forward_cuda(plan)"));
      // (Its plan first: on a GPU build the device may answer before the pointers are checked.)
      const unsigned planless = cuda ? valid | (sizes & kOk ? planned : 0) : fwd;
      EXPECT_TRUE(allowed(forward_cuda(p, ws, sizeof ws, nullptr), planless, "forward_cuda"));
      EXPECT_TRUE(allowed(forward_cuda_training(p, bplan, ws, sizeof ws, ws, sizeof ws, nullptr),
                          cuda ? valid : fwd, "forward_cuda_training"));
    }
    if (!cuda || !(inputs & kOk)) {
      EXPECT_TRUE(allowed(backward_cuda(p, g, bplan, ws, sizeof ws, ws, sizeof ws, nullptr), cuda ? inputs : bwd,
                          "backward_cuda"));
    }
    EXPECT_TRUE(t.untouched()) << "a CUDA entry point wrote into a host buffer";
  }
  return outcome;
}

// The case being checked, printed if the process dies in it.
std::string g_current;
void print_current() { std::fprintf(stderr, "\nthe process died in %s\n", g_current.c_str()); }
extern "C" void on_fatal_signal(int sig) {
  print_current();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 0) : fallback;
}

}  // namespace
}  // namespace fastaxial::test
