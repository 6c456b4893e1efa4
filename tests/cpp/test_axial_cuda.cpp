// CUDA forward vs the double-precision reference, on the GPU present
// (skipped where there is none). Outputs are poisoned with NaN first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

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

// A problem's input and weights on the device, and its parameters pointing
// there (output: `out`).
struct DeviceProblem {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  AxialParams a;
  DeviceProblem(const Problem& p, float* out) : a(params(p, out)) {
    const auto upload = [&](const std::vector<float>& v) {
      buffers.push_back(std::make_unique<DeviceBuffer>(v));
      return buffers.back()->ptr;
    };
    a.x = upload(p.x);
    for (auto [data, view] : {std::pair{&p.row, &a.row}, std::pair{&p.col, &a.col}})
      *view = {upload(data->norm_w), upload(data->norm_b), upload(data->qkv_w), upload(data->out_w),
               upload(data->out_b)};
  }
  bool ok() const {
    return std::all_of(buffers.begin(), buffers.end(), [](const auto& b) { return b->ptr != nullptr; });
  }
};

class CudaForward : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaForward, MatchesDoubleReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Shape s = GetParam();
  const Problem p = random_problem(s, 99u + static_cast<uint32_t>(s.D + s.H * 5 + s.W * 11));
  DeviceBuffer out(p.x.size());
  const DeviceProblem dp(p, out.ptr);
  ASSERT_TRUE(dp.ok() && out.ptr != nullptr);
  CUDA_OK(cudaMemset(out.ptr, 0xff, out.n * sizeof(float)));  // all-ones bits: NaN
  const AxialParams& a = dp.a;
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

// Weights that the kernel just before a forward writes must be the ones it
// uses, although that kernel may still run when the forward's first blocks
// start: every kernel reads its inputs only after its dependency wait
// (src/cuda/launch.cuh). A first forward writes its output into a second
// one's Wqkv (both passes'), NaN until then, and the second runs right after
// it on the same stream; ten times.
TEST(CudaForward, UsesWeightsTheKernelBeforeWrote) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Problem writer = random_problem({1, 12, 16, 64, 4}, 5);  // its output: 3 * 64 * 64 floats
  for (std::vector<float>* v : {&writer.x, &writer.row.out_w, &writer.row.out_b, &writer.col.out_w, &writer.col.out_b})
    for (float& e : *v) e *= 0.125f;  // an output of the size of Wqkv's entries
  Problem reader = random_problem({4, 32, 32, 64, 4}, 6);
  ASSERT_EQ(writer.x.size(), reader.col.qkv_w.size());
  DeviceBuffer qkv(writer.x.size()), out(reader.x.size());
  DeviceProblem w(writer, qkv.ptr), r(reader, out.ptr);
  r.a.row.qkv_weight = r.a.col.qkv_weight = qkv.ptr;
  DeviceBuffer ws_w(cuda_workspace_bytes(w.a) / sizeof(float)), ws_r(cuda_workspace_bytes(r.a) / sizeof(float));
  ASSERT_TRUE(w.ok() && r.ok() && qkv.ptr && out.ptr && ws_w.ptr && ws_r.ptr);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::unique_ptr<CUstream_st, cudaError_t (*)(cudaStream_t)> own(stream, cudaStreamDestroy);
  std::vector<double> ref;
  std::vector<float> host(out.n);
  for (int it = 0; it < 10; ++it) {
    CUDA_OK(cudaMemsetAsync(qkv.ptr, 0xff, qkv.n * sizeof(float), stream));
    CUDA_OK(cudaMemsetAsync(out.ptr, 0xff, out.n * sizeof(float), stream));
    const Status first = forward_cuda(w.a, ws_w.ptr, stream), second = forward_cuda(r.a, ws_r.ptr, stream);
    ASSERT_TRUE(first.ok() && second.ok()) << first.message << second.message;
    CUDA_OK(cudaStreamSynchronize(stream));
    if (ref.empty()) {  // the writer is deterministic: its output is the reader's Wqkv every time
      CUDA_OK(cudaMemcpy(reader.col.qkv_w.data(), qkv.ptr, qkv.n * sizeof(float), cudaMemcpyDeviceToHost));
      ASSERT_TRUE(std::all_of(reader.col.qkv_w.begin(), reader.col.qkv_w.end(), [](float e) { return std::isfinite(e); }));
      reader.row.qkv_w = reader.col.qkv_w;
      ref = reference_forward(reader);
    }
    CUDA_OK(cudaMemcpy(host.data(), out.ptr, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    EXPECT_LE(worst_ratio(host, ref, 1e-4, 1e-4), 1.0) << "forward pair " << it;
  }
}

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
