// Helpers of the backward suites (CPU and CUDA): the eleven gradients in
// poisoned buffers, the reference's in the same order, and the comparisons.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "reference.h"

namespace fastaxial::test {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline std::vector<double> random_grad(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> g(n);
  for (double& e : g) e = static_cast<float>(normal(rng));  // representable in float
  return g;
}

// The eleven gradients of backward_cpu, each in its own (poisoned) buffer.
struct Grads {
  std::vector<float> x;
  struct Axis {
    std::vector<float> norm_w, norm_b, qkv_w, out_w, out_b;
  } row, col;

  explicit Grads(const Shape& s) {
    const int64_t D = s.D;
    x.assign(s.B * s.H * s.W * D, kNaN);
    for (Axis* a : {&row, &col}) {
      a->norm_w.assign(D, kNaN), a->norm_b.assign(D, kNaN), a->qkv_w.assign(3 * D * D, kNaN);
      a->out_w.assign(D * D, kNaN), a->out_b.assign(D, kNaN);
    }
  }
  // The eleven buffers in a fixed order, with names.
  std::vector<std::pair<std::vector<float>*, std::string>> all() {
    return {{&x, "x"},
            {&row.norm_w, "row.norm_weight"}, {&row.norm_b, "row.norm_bias"}, {&row.qkv_w, "row.qkv_weight"},
            {&row.out_w, "row.out_weight"},   {&row.out_b, "row.out_bias"},   {&col.norm_w, "col.norm_weight"},
            {&col.norm_b, "col.norm_bias"},   {&col.qkv_w, "col.qkv_weight"}, {&col.out_w, "col.out_weight"},
            {&col.out_b, "col.out_bias"}};
  }
  // Every pointer set, except where wanted[i] is false (order of all()).
  AxialGrads view(const std::vector<bool>& wanted = std::vector<bool>(11, true)) {
    std::vector<float*> ptr;
    auto list = all();
    for (size_t i = 0; i < list.size(); ++i) ptr.push_back(wanted[i] ? list[i].first->data() : nullptr);
    AxialGrads g;
    g.grad_x = ptr[0];
    g.row = {ptr[1], ptr[2], ptr[3], ptr[4], ptr[5]};
    g.col = {ptr[6], ptr[7], ptr[8], ptr[9], ptr[10]};
    return g;
  }
};

template <typename Real>
std::vector<std::vector<Real>*> ref_list(RefGrads<Real>& r) {
  return {&r.x,         &r.row.norm_w, &r.row.norm_b, &r.row.qkv_w, &r.row.out_w, &r.row.out_b,
          &r.col.norm_w, &r.col.norm_b, &r.col.qkv_w, &r.col.out_w, &r.col.out_b};
}

template <typename A>
double rel_err(const std::vector<A>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline bool all_nan(const std::vector<float>& a) {
  for (float v : a)
    if (!std::isnan(v)) return false;
  return true;
}


}  // namespace fastaxial::test
