// dropout_mask (fastaxial.h): a pass's mask, written from the definition in common/dropout.h,
// which every kernel draws from.
#include "../common/dropout.h"
#include "../common/validate.h"

#include <limits>

namespace fastaxial {

bool dropout_compiled() {
#if defined(FASTAXIAL_NO_RANDOM123)
  return false;
#else
  return true;
#endif
}

Status dropout_mask(const AxialParams& p, int pass, float* out) {
  if (Status s = validate_sizes(p); !s.ok()) return s;
  if (pass != 0 && pass != 1) return {StatusCode::kInvalidArgument, "pass must be 0 (rows) or 1 (columns)"};
  const AxisView v = pass == 0 ? row_view(p) : col_view(p);
  // N heads L^2 elements; validate_sizes bounds them where dropout > 0 only.
  if (v.num_seq == 0 || v.len == 0) return Status::Ok();
  uint64_t count = 1;
  for (int64_t f : {v.num_seq, p.heads, v.len, v.len}) {
    if (count > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(f))
      return {StatusCode::kInvalidArgument, "the mask's element count overflows uint64"};
    count *= static_cast<uint64_t>(f);
  }
  if (out == nullptr) return {StatusCode::kInvalidArgument, "out is null"};
  if (!(p.dropout > 0.0f)) {
    for (uint64_t e = 0; e < count; ++e) out[e] = 1.0f;
    return Status::Ok();
  }
  const DropoutParams d = make_dropout(p);
  dropout_row(d, dropout_element(d, pass, 0, 0, 0, 0), count, out);  // a pass's elements are consecutive
  return Status::Ok();
}

}  // namespace fastaxial
