// CUDA training with attention dropout: forward_cuda_training's output and backward_cuda's
// gradients against the float64 reference applying the mask of src/common/dropout.h (the CPU's),
// so the kernels are checked to draw exactly the defined mask; the seed and offset read from
// device memory (CUDA graphs) against the same values given on the host; the state `saved`
// keeps; bitwise repeatability, fresh masks for another offset or seed, and p = 0 as no dropout.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "util/backward_util.h"
#include "util/cuda_test_util.h"
#include "util/dropout_util.h"

namespace fastaxial::test {
namespace {

// One training step of a problem on the device: x and the weights uploaded once, then
// forward_cuda_training and backward_cuda into poisoned buffers, everything copied back.
class DeviceStep {
 public:
  explicit DeviceStep(const Problem& p) : s_(p.shape), params_(test::params(p, nullptr)) {
    params_.x = upload(p.x);
    params_.row = axis(p.row);
    params_.col = axis(p.col);
  }

  struct Result {
    Status status;
    std::vector<float> out;
    Grads grads;
    uint64_t state[2] = {0, 0};  // the last 16 bytes of saved: seed and offset
  };

  // With dropout rate, seed and offset; where `device_state`, the seed and the offset are read
  // from device memory: *seed_device = seed, *offset_device = offset - 5, params.offset = 5.
  Result run(const std::vector<float>& gout, float rate, uint64_t seed, uint64_t offset, bool device_state = false) {
    Result r{Status::Ok(), std::vector<float>(gout.size(), kNaN), Grads(s_)};
    AxialParams p = params_;
    p.dropout = rate, p.seed = seed, p.offset = offset;
    DevicePtr state_buf = device_alloc(4);
    if (device_state) {
      const uint64_t host[2] = {seed, offset - 5};
      cudaMemcpy(state_buf.get(), host, sizeof host, cudaMemcpyHostToDevice);
      p.seed = 0xdeadbeef, p.offset = 5;  // the seed must come from device memory
      p.seed_device = reinterpret_cast<const uint64_t*>(state_buf.get());
      p.offset_device = p.seed_device + 1;
    }
    CudaBackwardPlan plan;
    if (r.status = plan_backward_cuda(p, &plan); !r.status.ok()) return r;
    DevicePtr ws = device_alloc(plan.workspace_bytes / sizeof(float) + 1);
    DevicePtr saved = device_alloc(plan.saved_bytes / sizeof(float) + 1);
    DevicePtr out = upload_buffer(r.out), d_gout = upload_buffer(gout);
    auto list = r.grads.all();
    std::vector<DevicePtr> bufs;
    for (auto& [buf, name] : list) bufs.push_back(upload_buffer(*buf));
    AxialGrads g = grads_at(raw(bufs));
    g.grad_out = d_gout.get();
    p.out = out.get();
    if (r.status = forward_cuda_training(p, plan, saved.get(), plan.saved_bytes, ws.get(), plan.workspace_bytes,
                                         nullptr);
        !r.status.ok())
      return r;
    if (r.status = backward_cuda(p, g, plan, saved.get(), plan.saved_bytes, ws.get(), plan.workspace_bytes, nullptr);
        !r.status.ok())
      return r;
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      r.status = {StatusCode::kCudaError, cudaGetErrorString(e)};
      return r;
    }
    cudaMemcpy(r.out.data(), out.get(), r.out.size() * sizeof(float), cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < list.size(); ++i)
      cudaMemcpy(list[i].first->data(), bufs[i].get(), list[i].first->size() * sizeof(float), cudaMemcpyDeviceToHost);
    cudaMemcpy(r.state, reinterpret_cast<char*>(saved.get()) + plan.dropout_state, sizeof r.state,
               cudaMemcpyDeviceToHost);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) r.status = {StatusCode::kCudaError, cudaGetErrorString(e)};
    return r;
  }

 private:
  DevicePtr upload_buffer(const std::vector<float>& h) {
    DevicePtr d = device_alloc(h.size());
    if (d) cudaMemcpy(d.get(), h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice);
    return d;
  }
  const float* upload(const std::vector<float>& h) {
    bufs_.push_back(upload_buffer(h));
    return bufs_.back().get();
  }
  AxisWeights axis(const AxisData& w) {
    return {upload(w.norm_w), upload(w.norm_b), upload(w.qkv_w), upload(w.out_w), upload(w.out_b)};
  }

  Shape s_;
  std::vector<DevicePtr> bufs_;
  AxialParams params_;
};

bool same_grads(Grads& a, Grads& b) {
  for (size_t i = 0; i < a.all().size(); ++i)
    if (!same_bits(*a.all()[i].first, *b.all()[i].first)) return false;
  return true;
}

struct Case {
  Shape shape;
  float rate;
  uint64_t seed, offset;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string r = std::to_string((int)(info.param.rate * 100 + 0.5f));
  return shape_name(info.param.shape) + "_p" + r;
}

// The output within the forward's bound (1e-4 of float64, as test_backward_cuda), the gradients
// within expect_grads_match's, the reference applying the defined mask.
class CudaDropout : public ::testing::TestWithParam<Case> {};

TEST_P(CudaDropout, MatchesDoubleReferenceWithTheDefinedMask) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case c = GetParam();
  const Shape s = c.shape;
  const Problem p = with_dropout(random_problem(s, 515u + static_cast<uint32_t>(s.D + 3 * s.W)), c.rate, c.seed,
                                 c.offset);
  const std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 77u + static_cast<uint32_t>(s.H));
  DeviceStep step(p);
  DeviceStep::Result r = step.run(std::vector<float>(gout.begin(), gout.end()), c.rate, c.seed, c.offset);
  ASSERT_TRUE(r.status.ok()) << r.status.message;
  EXPECT_LE(worst_ratio(r.out, reference_forward(p), 1e-4, 1e-4), 1.0) << "forward_cuda_training's output";
  RefGrads<double> ref = reference_backward(p, gout);
  RefGrads<float> ref32 = reference_backward_as<float>(p, gout);
  expect_grads_match(r.grads, ref, ref32);
  EXPECT_EQ(r.state[0], c.seed);
  EXPECT_EQ(r.state[1], c.offset);
}

// Shapes: H != W (both passes, the column pass's elements after the row pass's), L not a multiple
// of 4 (a row's elements straddle Philox blocks), L above a tile (257), odd dims (hd 3, the
// cuBLAS products), head dims 8 to 128, the default problem; rates 0.1, 0.5 and 1; 64-bit seeds
// and offsets; row passes through the dS^T scratch at head dims 8 and 32 (1, 3, 257, 16, 2 and
// 1, 2, 300, 64, 2).
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaDropout,
    ::testing::Values(Case{{2, 5, 9, 16, 2}, 0.5f, 7, 0}, Case{{1, 7, 4, 6, 2}, 0.5f, 123456789, 12},
                      Case{{4, 32, 32, 64, 4}, 0.1f, 0x9e3779b97f4a7c15ull, 0xfedcba9876543210ull},
                      Case{{1, 3, 257, 16, 2}, 0.1f, 99, 4}, Case{{1, 9, 40, 128, 4}, 0.1f, 5, 1ull << 40},
                      Case{{2, 6, 11, 24, 3}, 1.0f, 3, 8}, Case{{1, 13, 3, 8, 1}, 0.5f, 1ull << 63, 1},
                      Case{{1, 2, 300, 64, 2}, 0.1f, 77, 3}),
    case_name);

class CudaDropoutRuns : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
  Shape s{2, 6, 9, 16, 2};
  Problem p = random_problem(s, 4242);
  std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 11);
  std::vector<float> gout_f = std::vector<float>(gout.begin(), gout.end());
  DeviceStep step{p};

  DeviceStep::Result run(float rate, uint64_t seed, uint64_t offset, bool device_state = false) {
    DeviceStep::Result r = step.run(gout_f, rate, seed, offset, device_state);
    EXPECT_TRUE(r.status.ok()) << r.status.message;
    return r;
  }
};

TEST_F(CudaDropoutRuns, SameSeedAndOffsetAreBitwiseIdentical) {
  DeviceStep::Result a = run(0.3f, 42, 1000), b = run(0.3f, 42, 1000);
  EXPECT_TRUE(same_bits(a.out, b.out));
  EXPECT_TRUE(same_grads(a.grads, b.grads));
}

// What a CUDA graph does: seed and offset read from device memory when the kernels run.
TEST_F(CudaDropoutRuns, DeviceSeedAndOffsetAreTheHostOnes) {
  DeviceStep::Result host = run(0.3f, 42, 1000), device = run(0.3f, 42, 1000, /*device_state=*/true);
  EXPECT_TRUE(same_bits(host.out, device.out));
  EXPECT_TRUE(same_grads(host.grads, device.grads));
  EXPECT_EQ(device.state[0], 42u);
  EXPECT_EQ(device.state[1], 1000u);
}

TEST_F(CudaDropoutRuns, OtherSeedOrOffsetGivesAnotherMask) {
  DeviceStep::Result a = run(0.3f, 42, 1000), b = run(0.3f, 42, 1004), c = run(0.3f, 43, 1000);
  EXPECT_FALSE(same_bits(a.out, b.out));
  EXPECT_FALSE(same_bits(a.out, c.out));
  EXPECT_FALSE(same_bits(b.out, c.out));
}

// p = 0 is no dropout whatever the seed and offset, and its state is zeros.
TEST_F(CudaDropoutRuns, ZeroRateIsNoDropout) {
  DeviceStep::Result a = run(0.0f, 0, 0), b = run(0.0f, 42, 1000);
  EXPECT_TRUE(same_bits(a.out, b.out));
  EXPECT_TRUE(same_grads(a.grads, b.grads));
  EXPECT_EQ(b.state[0], 0u);
  EXPECT_EQ(b.state[1], 0u);
  EXPECT_LE(worst_ratio(a.out, reference_forward(p), 1e-4, 1e-4), 1.0);
}

TEST_F(CudaDropoutRuns, SeedDeviceWithoutOffsetDeviceIsRejected) {
  AxialParams a = test::params(p, nullptr);
  a.dropout = 0.1f;
  uint64_t* state = nullptr;
  ASSERT_EQ(cudaMalloc(&state, 16), cudaSuccess);
  a.seed_device = state;
  CudaBackwardPlan plan;
  ASSERT_TRUE(plan_backward_cuda(a, &plan).ok());
  DevicePtr ws = device_alloc(plan.workspace_bytes / sizeof(float) + 1);
  DevicePtr saved = device_alloc(plan.saved_bytes / sizeof(float) + 1);
  DevicePtr out = device_alloc(p.x.size()), x = device_alloc(p.x.size());
  a.x = x.get(), a.out = out.get();
  const Status st = forward_cuda_training(a, plan, saved.get(), plan.saved_bytes, ws.get(), plan.workspace_bytes,
                                          nullptr);
  cudaFree(state);
  EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << st.message;
  EXPECT_NE(st.message.find("together"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace fastaxial::test
