// Argument checks shared by the CPU and CUDA entry points.
#include "fastaxial/fastaxial.h"
#include "validate.h"

#include <array>
#include <cstdint>
#include <limits>
#include <sstream>

namespace fastaxial {
namespace {

Status invalid(const std::string& what) { return {StatusCode::kInvalidArgument, what}; }

Status check_axis(const AxisWeights& w, const char* axis) {
  const std::pair<const void*, const char*> ptrs[] = {
      {w.norm_weight, "norm_weight"}, {w.norm_bias, "norm_bias"}, {w.qkv_weight, "qkv_weight"},
      {w.out_weight, "out_weight"},   {w.out_bias, "out_bias"}};
  for (const auto& [ptr, name] : ptrs)
    if (ptr == nullptr) return invalid(std::string(axis) + "." + name + " is null");
  return Status::Ok();
}

}  // namespace

Status validate_sizes(const AxialParams& p) {
  const std::pair<int64_t, const char*> sizes[] = {
      {p.batch, "batch"}, {p.height, "height"}, {p.width, "width"}};
  for (const auto& [v, name] : sizes)
    if (v < 0) return invalid(std::string(name) + " must be >= 0, got " + std::to_string(v));
  if (p.dim < 1) return invalid("dim must be >= 1, got " + std::to_string(p.dim));
  if (p.heads < 1) return invalid("heads must be >= 1, got " + std::to_string(p.heads));
  if (p.products != Products::kFp32 && p.products != Products::kBf16 && p.products != Products::kFp16)
    return invalid("products must be Products::kFp32, kBf16 or kFp16, got " + std::to_string((int)p.products));
  if (p.dim % p.heads != 0) {
    std::ostringstream s;
    s << "dim (" << p.dim << ") must be divisible by heads (" << p.heads << ")";
    return invalid(s.str());
  }
  if (!(p.eps >= 0.0f)) return invalid("eps must be >= 0");
  if (!(p.dropout >= 0.0f && p.dropout <= 1.0f)) {  // NaN fails both
    std::ostringstream s;
    s << "dropout must be in [0, 1], got " << p.dropout;
    return invalid(s.str());
  }
#if defined(FASTAXIAL_NO_RANDOM123)
  if (p.dropout > 0.0f)
    return {StatusCode::kUnsupported,
            "this build has no attention dropout: it was built without Random123 (Debian: librandom123-dev); "
            "install it and rebuild"};
#endif
  // B*H*W*D must fit in int64 (every index below is 64-bit), and so must the products of the
  // non-zero sizes (B*H sequences of a row pass where W = 0), and the qkv weight's 3 D^2 elements.
  const int64_t max = std::numeric_limits<int64_t>::max();
  int64_t n = p.dim;
  for (int64_t v : {p.width, p.height, p.batch}) {
    if (v != 0 && n > max / v) return invalid("B*H*W*D overflows int64");
    if (v != 0) n *= v;
  }
  if (p.dim > max / 3 / p.dim) return invalid("dim is too large: the qkv weight's 3 dim^2 elements overflow int64");
  // The dropout mask numbers its elements in uint64 (common/dropout.h): B H heads W^2 of the
  // row pass, then B W heads H^2 of the column pass, which must fit (only absurd grids fail).
  if (p.dropout > 0.0f) {
    const uint64_t umax = std::numeric_limits<uint64_t>::max();
    uint64_t total = 0;
    for (const auto& f : {std::array<int64_t, 4>{p.batch, p.height, p.width, p.width},
                          std::array<int64_t, 4>{p.batch, p.width, p.height, p.height}}) {
      uint64_t c = static_cast<uint64_t>(p.heads);
      for (int64_t v : f) {
        if (v != 0 && c > umax / static_cast<uint64_t>(v)) return invalid("the dropout mask's element count overflows uint64");
        c *= static_cast<uint64_t>(v);
      }
      if (c > umax - total) return invalid("the dropout mask's element count overflows uint64");
      total += c;
    }
  }
  return Status::Ok();
}

Status validate_inputs(const AxialParams& p) {
  if (Status s = validate_sizes(p); !s.ok()) return s;
  // (B H W D fits in int64: validate_sizes.)
  if (p.saved_qkv != nullptr && p.batch * p.height * p.width * p.dim > std::numeric_limits<int64_t>::max() / 6)
    return invalid("saved_qkv: its 6 B H W D floats do not fit in int64");
  if (p.saved_o != nullptr && p.batch * p.height * p.width * p.dim > std::numeric_limits<int64_t>::max() / 2)
    return invalid("saved_o: its 2 B H W D floats do not fit in int64");
  if (p.saved_p != nullptr && p.heads > 0 &&
      p.batch * p.height * p.width > std::numeric_limits<int64_t>::max() / (2 * 128 * p.heads))
    return invalid("saved_p: its floats do not fit in int64");
  if (p.batch * p.height * p.width == 0) return Status::Ok();  // nothing to read
  if (p.x == nullptr) return invalid("x is null");
  if (Status s = check_axis(p.row, "row"); !s.ok()) return s;
  return check_axis(p.col, "col");
}

Status validate(const AxialParams& p) {
  if (Status s = validate_inputs(p); !s.ok()) return s;
  if (p.batch * p.height * p.width == 0) return Status::Ok();  // nothing to write
  if (p.out == nullptr) return invalid("out is null");
  if (p.out == p.x) return invalid("out must not alias x");
  if (p.row_out != nullptr && (p.row_out == p.x || p.row_out == p.out))
    return invalid("row_out must not alias x or out");
  if (p.saved_qkv != nullptr && (p.saved_qkv == p.x || p.saved_qkv == p.out || p.saved_qkv == p.row_out))
    return invalid("saved_qkv must not alias x, out or row_out");
  if (p.saved_o != nullptr &&
      (p.saved_o == p.x || p.saved_o == p.out || p.saved_o == p.row_out || p.saved_o == p.saved_qkv))
    return invalid("saved_o must not alias x, out, row_out or saved_qkv");
  if (p.saved_p != nullptr && (p.saved_p == p.x || p.saved_p == p.out || p.saved_p == p.row_out ||
                               p.saved_p == p.saved_qkv || p.saved_p == p.saved_o))
    return invalid("saved_p must not alias x, out, row_out, saved_qkv or saved_o");
  return Status::Ok();
}

}  // namespace fastaxial
