// Devices as the library's plans see them (DeviceCaps), for the tests of the host-side rules, which
// run without a GPU.
#pragma once

#include "src/common/plan.h"

namespace fastaxial::test {

// An H200: 132 SMs, 227 KB of shared memory a block, sm_90a code.
inline DeviceCaps h200() {
  DeviceCaps d;
  d.sms = 132, d.smem_optin = 227 * 1024, d.cc_major = 9, d.cc_minor = 0, d.sm90a = true;
  return d;
}

// A newer GPU with as much shared memory, running the PTX build: no sm_90a code, so no staged
// path and no wgmma.
inline DeviceCaps ptx_only() {
  DeviceCaps d = h200();
  d.cc_major = 10, d.sm90a = false;
  return d;
}

// An Ampere-class GPU: less shared memory, and the PTX build.
inline DeviceCaps a100() {
  DeviceCaps d;
  d.sms = 108, d.smem_optin = 163 * 1024, d.cc_major = 8, d.cc_minor = 0, d.sm90a = false;
  return d;
}

}  // namespace fastaxial::test
