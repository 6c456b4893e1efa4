// The attention kernels' test cases (test_flash_attention*.cpp through flash_attention_test_util.h,
// test_attention_backward.cpp): a pass's sizes and view, its gtest name, and the poison the tests
// fill outputs with before a run.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>

namespace fastaxial::test {

constexpr uint32_t kPoison = 0xffffffffu;  // a NaN: cudaMemset(0xff)

inline bool is_poison(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u == kPoison;
}

struct Case {
  int L, hd, heads;
  bool col;      // the column pass's view of a (B, L, other) grid, else the row pass's of (B, other, L)
  int B, other;  // batch, and the grid's extent along the other axis
  int used;      // sequences the view covers (0: all of B * other); the other rows must stay untouched
  int misalign;  // the kernel's tensors (qkv; the backward's d_o and dqkv too) passed this many floats
                 // past a 16-byte boundary (the kernels' 4-byte copies)
};

inline std::string case_name(const Case& c) {
  return "L" + std::to_string(c.L) + "_hd" + std::to_string(c.hd) + "_heads" + std::to_string(c.heads) +
         (c.col ? "_col" : "_row") + "_B" + std::to_string(c.B) + "x" + std::to_string(c.other) +
         (c.used ? "_used" + std::to_string(c.used) : "") + (c.misalign ? "_misalign" + std::to_string(c.misalign) : "");
}

inline void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

}  // namespace fastaxial::test
