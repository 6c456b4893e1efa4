// CUDA forward vs the double-precision reference, on the GPU present
// (skipped where there is none). Outputs are poisoned with NaN first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>

#include "reference.h"

namespace fastaxial::test {
namespace {

#define CUDA_OK(call)                                                        \
  do {                                                                       \
    const cudaError_t e_ = (call);                                           \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_);   \
  } while (0)

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Device copy of a vector, freed at scope exit.
struct DeviceBuffer {
  float* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(float)) != cudaSuccess) ptr = nullptr;
  }
  explicit DeviceBuffer(const std::vector<float>& v) : DeviceBuffer(v.size()) {
    if (ptr) cudaMemcpy(ptr, v.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
};

class CudaForward : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaForward, MatchesDoubleReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Shape s = GetParam();
  const Problem p = random_problem(s, 99u + static_cast<uint32_t>(s.D + s.H * 5 + s.W * 11));
  DeviceBuffer x(p.x), out(p.x.size());
  DeviceBuffer rw[5] = {DeviceBuffer(p.row.norm_w), DeviceBuffer(p.row.norm_b), DeviceBuffer(p.row.qkv_w),
                        DeviceBuffer(p.row.out_w), DeviceBuffer(p.row.out_b)};
  DeviceBuffer cw[5] = {DeviceBuffer(p.col.norm_w), DeviceBuffer(p.col.norm_b), DeviceBuffer(p.col.qkv_w),
                        DeviceBuffer(p.col.out_w), DeviceBuffer(p.col.out_b)};
  CUDA_OK(cudaMemset(out.ptr, 0xff, out.n * sizeof(float)));  // all-ones bits: NaN
  AxialParams a = params(p, out.ptr);
  a.x = x.ptr;
  a.row = {rw[0].ptr, rw[1].ptr, rw[2].ptr, rw[3].ptr, rw[4].ptr};
  a.col = {cw[0].ptr, cw[1].ptr, cw[2].ptr, cw[3].ptr, cw[4].ptr};
  ASSERT_GE(cuda_workspace_bytes(a), p.x.size() * sizeof(float));
  DeviceBuffer ws(cuda_workspace_bytes(a) / sizeof(float));
  ASSERT_NE(ws.ptr, nullptr);
  const Status st = forward_cuda(a, ws.ptr, nullptr);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> host(p.x.size());
  CUDA_OK(cudaMemcpy(host.data(), out.ptr, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_LE(worst_ratio(host, reference_forward(p), 1e-4, 1e-4), 1.0);
}

// Odd sizes, several key tiles (L > 64), head_dim 1 to 128; each kernel
// family by its own choice (common/dispatch.h): fused (L <= 128; L = 100
// pads 28 keys over four groups, head_dim 64 at L = 64), staged
// (L = 130, 132, 140, 200, 257; dim 256 with L = 100), generic (head_dim
// 12, 1, 128; L = 1024 with head_dim 16). 1 x 132 x 67: the staged attention
// has more (column, head) items than an H200 holds blocks of it, so blocks
// loop, each prefetching its next item during the current one.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaForward,
                         ::testing::Values(Shape{1, 1, 1, 8, 1}, Shape{2, 1, 7, 16, 2}, Shape{1, 7, 1, 32, 4},
                                           Shape{2, 5, 9, 64, 8}, Shape{1, 8, 3, 128, 4}, Shape{1, 4, 6, 256, 4},
                                           Shape{4, 32, 32, 64, 4}, Shape{1, 33, 17, 96, 3},
                                           Shape{1, 130, 3, 32, 2}, Shape{1, 3, 200, 12, 4},
                                           Shape{1, 2, 5, 3, 3}, Shape{1, 3, 4, 128, 1},
                                           Shape{1, 257, 2, 32, 2}, Shape{1, 2, 1024, 64, 4},
                                           Shape{1, 3, 5, 1024, 8}, Shape{1, 100, 3, 256, 8},
                                           Shape{2, 9, 200, 64, 2}, Shape{1, 140, 2, 72, 9},
                                           Shape{1, 100, 2, 64, 2}, Shape{1, 64, 2, 128, 2},
                                           Shape{1, 132, 67, 64, 2}, Shape{3, 40, 20, 64, 2},
                                           Shape{2, 50, 64, 64, 4}),
                         [](const auto& info) { return shape_name(info.param); });

TEST(CudaForward, RejectsMissingWorkspace) {
  const Problem p = random_problem({1, 2, 3, 8, 2}, 7);
  std::vector<float> out(p.x.size());
  const Status s = forward_cuda(params(p, out.data()), nullptr, nullptr);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(s.message.find("workspace"), std::string::npos);
}

TEST(CudaForward, NoDeviceIsAReadableError) {
  // Where no GPU is usable the entry point says so instead of launching blind.
  if (have_gpu()) GTEST_SKIP() << "a CUDA device is present";
  const Problem p = random_problem({1, 2, 3, 8, 2}, 8);
  std::vector<float> out(p.x.size()), ws(p.x.size());
  const Status s = forward_cuda(params(p, out.data()), ws.data(), nullptr);
  EXPECT_EQ(s.code, StatusCode::kCudaError);
  EXPECT_NE(s.message.find("cudaGetDevice"), std::string::npos) << s.message;
}

}  // namespace
}  // namespace fastaxial::test
