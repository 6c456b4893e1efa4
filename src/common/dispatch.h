// Run-time values as template arguments: the one way a launcher (or a host rule sizing a
// kernel's tiles) turns a size or a flag into a kernel's template argument. Plain C++, so that
// host code without CUDA uses it too.
#pragma once

#include <type_traits>

#include "smem_layout.h"  // flash_padded_head_dim

namespace fastaxial {

// f(std::integral_constant<int, v>()) where v is one of Values, `otherwise` for any other v: the
// one way a launcher turns a run-time size into a template argument.
template <int V0, int... Values, class F>
constexpr auto with_int(int v, F&& f, decltype(f(std::integral_constant<int, V0>())) otherwise) {
  if (v == V0) return f(std::integral_constant<int, V0>());
  if constexpr (sizeof...(Values) > 0)
    return with_int<Values...>(v, f, otherwise);
  else
    return otherwise;
}

// with_int over the padded head dims the attention kernels are built for (common/smem_layout.h:
// flash_padded_head_dim).
template <class F>
constexpr auto with_padded_head_dim(int hdp, F&& f, decltype(f(std::integral_constant<int, 8>())) otherwise) {
  return with_int<8, 16, 32, 48, 64, 96, 128, 192, 256>(hdp, f, otherwise);
}

// f(std::bool_constant<b>()...) for run-time flags b...: the one place a launcher turns bools into
// template arguments (read each in f as decltype(flag)::value).
template <class F>
constexpr decltype(auto) with_bools(F&& f) {
  return f();
}
template <class F, class... Rest>
constexpr decltype(auto) with_bools(F&& f, bool b, Rest... rest) {
  if (b) return with_bools([&](auto... c) { return f(std::true_type(), c...); }, rest...);
  return with_bools([&](auto... c) { return f(std::false_type(), c...); }, rest...);
}

// Every head dim the attention kernels take pads to one of the cases above.
constexpr bool padded_head_dims_have_cases() {
  for (int h = 1; h <= kFlashMaxHeadDim; ++h) {
    const int p = flash_padded_head_dim(h);
    if (with_padded_head_dim(p, [](auto c) { return int{decltype(c)::value}; }, 0) != p) return false;
  }
  return true;
}
static_assert(padded_head_dims_have_cases(), "with_padded_head_dim's cases are smem_layout.h's padded head dims");

}  // namespace fastaxial
