// What the timing tools (bench_weight_gradient, bench_flash_attention) share: a check that
// stops the tool on a failed call, the device they time (and its header line), and the timing of
// a call on a cold L2.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>

#include "util/cuda_test_util.h"  // read_device_caps

// Stops the tool where `call` (a CUDA, cuBLAS or library call: 0 on success) fails.
#define BENCH_CHECK(call)                                                                    \
  do {                                                                                       \
    const auto e_ = (call);                                                                  \
    if (e_ != 0) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #call, (int)e_); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace fastaxial::test {

// The current device as the kernels see it, after printing its header line (name, SMs, `reps`);
// stops the tool where its attributes cannot be read.
inline DeviceCaps bench_device(int reps) {
  DeviceCaps dev;
  if (!read_device_caps(&dev)) {
    std::fprintf(stderr, "reading the device's attributes failed\n");
    std::exit(1);
  }
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, dev.device));
  std::printf("%s, %d SMs; mean of %d calls, L2 flushed before each\n", prop.name, dev.sms, reps);
  return dev;
}

// Mean ms of a call over `reps` calls, each after the L2 is flushed (a 256 MB memset), between
// CUDA events around the call alone, on the default stream; one call before them warms up
// (shared-memory opt-in, cuBLAS heuristics).
class ColdTimer {
 public:
  ColdTimer() {
    BENCH_CHECK(cudaMalloc(&flush_, kFlushBytes));
    BENCH_CHECK(cudaEventCreate(&start_));
    BENCH_CHECK(cudaEventCreate(&stop_));
  }
  ~ColdTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaFree(flush_);
  }
  ColdTimer(const ColdTimer&) = delete;
  ColdTimer& operator=(const ColdTimer&) = delete;

  template <class Call>
  double mean_ms(int reps, Call call) {
    float total = 0.0f;
    for (int r = 0; r <= reps; ++r) {
      BENCH_CHECK(cudaMemsetAsync(flush_, r & 0xff, kFlushBytes));
      BENCH_CHECK(cudaEventRecord(start_));
      call();
      BENCH_CHECK(cudaEventRecord(stop_));
      BENCH_CHECK(cudaEventSynchronize(stop_));
      float ms = 0.0f;
      BENCH_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      if (r > 0) total += ms;
    }
    return total / reps;
  }

 private:
  static constexpr size_t kFlushBytes = size_t{256} << 20;
  void* flush_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

}  // namespace fastaxial::test
