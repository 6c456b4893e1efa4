// CUDA training calls: forward_cuda_training's output against the float64 reference forward,
// and backward_cuda from its saved intermediates against the float64 reference backward
// (reference.h, itself checked against finite differences in test_backward_cpu.cpp), on short
// and long axes and head dims 1 to 256; null gradients, grad_x in place of grad_out, bitwise
// determinism, the empty problem, the plan's, saved buffer's and workspace's checks, graph
// replays of repeated calls against direct launches. The LayerNorm kernels alone:
// norm/test_norm.cpp.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "src/cuda/graph_replay.h"
#include "util/backward_util.h"
#include "util/cuda_test_util.h"

namespace fastaxial::test {
namespace {

// x, the ten weights and the gradients on the device.
struct DeviceProblem {
  std::vector<DevicePtr> bufs;

  const float* upload(const std::vector<float>& h) {
    bufs.push_back(device_alloc(h.size()));
    if (!bufs.back()) return nullptr;
    if (cudaMemcpy(bufs.back().get(), h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
      return nullptr;
    return bufs.back().get();
  }
  AxisWeights axis(const AxisData& w) {
    return {upload(w.norm_w), upload(w.norm_b), upload(w.qkv_w), upload(w.out_w), upload(w.out_b)};
  }
  AxialParams params(const Problem& p) {
    AxialParams a = test::params(p, nullptr);
    a.x = upload(p.x);
    a.row = axis(p.row);
    a.col = axis(p.col);
    return a;
  }
};

// Runs forward_cuda_training into a poisoned output (copied to *out where given), then
// backward_cuda with the gradients `wanted` selects, into poisoned buffers, and copies every
// buffer back (unwanted ones keep their poison).
Status run_backward(const AxialParams& dp, const std::vector<float>& gout, Grads* host,
                    const std::vector<bool>& wanted = std::vector<bool>(11, true), bool grad_x_in_place = false,
                    std::vector<float>* out = nullptr) {
  std::vector<DevicePtr> bufs;
  auto list = host->all();
  std::vector<float*> ptr;
  for (size_t i = 0; i < list.size(); ++i) {
    bufs.push_back(device_alloc(list[i].first->size()));
    cudaMemcpy(bufs.back().get(), list[i].first->data(), list[i].first->size() * sizeof(float),
               cudaMemcpyHostToDevice);
    ptr.push_back(wanted[i] ? bufs.back().get() : nullptr);
  }
  DevicePtr d_gout = device_alloc(gout.size());
  cudaMemcpy(d_gout.get(), gout.data(), gout.size() * sizeof(float), cudaMemcpyHostToDevice);
  AxialGrads g = grads_at(ptr);
  g.grad_out = d_gout.get();
  if (grad_x_in_place) g.grad_x = d_gout.get();
  CudaBackwardPlan plan;
  Status s = plan_backward_cuda(dp, &plan);
  if (!s.ok()) return s;
  DevicePtr ws = device_alloc(plan.workspace_bytes / sizeof(float) + 1);
  DevicePtr saved = device_alloc(plan.saved_bytes / sizeof(float) + 1);
  const size_t n = gout.size();
  DevicePtr d_out = device_alloc(n);
  const std::vector<float> poison(n, kNaN);
  cudaMemcpy(d_out.get(), poison.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  AxialParams fp = dp;
  fp.out = d_out.get();
  s = forward_cuda_training(fp, plan, saved.get(), plan.saved_bytes, ws.get(), plan.workspace_bytes, nullptr);
  if (!s.ok()) return s;
  s = backward_cuda(dp, g, plan, saved.get(), plan.saved_bytes, ws.get(), plan.workspace_bytes, nullptr);
  if (!s.ok()) return s;
  if (out != nullptr) {
    out->resize(n);
    cudaMemcpy(out->data(), d_out.get(), n * sizeof(float), cudaMemcpyDeviceToHost);
  }
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return {StatusCode::kCudaError, cudaGetErrorString(e)};
  for (size_t i = 0; i < list.size(); ++i)
    cudaMemcpy(list[i].first->data(), bufs[i].get(), list[i].first->size() * sizeof(float), cudaMemcpyDeviceToHost);
  if (grad_x_in_place)
    cudaMemcpy(host->x.data(), d_gout.get(), gout.size() * sizeof(float), cudaMemcpyDeviceToHost);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return {StatusCode::kCudaError, cudaGetErrorString(e)};
  return Status::Ok();
}

// The bounds: expect_grads_match (backward_util.h), as for the CPU backward.
class CudaBackward : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaBackward, MatchesDoubleReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Shape s = GetParam();
  const Problem p = random_problem(s, 911u + static_cast<uint32_t>(s.D * 7 + s.H * 3 + s.W));
  const std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 37u + static_cast<uint32_t>(s.W));
  const std::vector<float> gout_f(gout.begin(), gout.end());
  DeviceProblem dev;
  const AxialParams dp = dev.params(p);
  Grads got(s);
  std::vector<float> out;
  const Status st = run_backward(dp, gout_f, &got, std::vector<bool>(11, true), false, &out);
  ASSERT_TRUE(st.ok()) << st.message;
  // The training forward's output, as the forward's tests bound it (test_axial_cuda.cpp: within
  // atol = rtol = 1e-4 of float64, every element written).
  EXPECT_LE(worst_ratio(out, reference_forward(p), 1e-4, 1e-4), 1.0) << "forward_cuda_training's output";

  RefGrads<double> ref = reference_backward(p, gout);
  RefGrads<float> ref32 = reference_backward_as<float>(p, gout);
  expect_grads_match(got, ref, ref32);
}

// Shape{B, H, W, D, heads}: head dims 1, 3, 8, 16, 24, 32, 64, 128, 192, 256; L from 1 to 1030
// (H != W, so both passes' views are tested); odd dims (unaligned head slices); the default
// problem. The row passes of (1, 3, 257, 16, 2), (1, 2, 1030, 16, 1), (1, 2, 600, 32, 1) and
// (1, 1, 800, 192, 1) take the plan's dS^T scratch (dq from the stored score gradient; at head dim
// 192 two warps share each key group: test_plan.cpp checks the plan takes it), the others recompute.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackward,
                         ::testing::Values(Shape{1, 1, 1, 8, 1}, Shape{2, 3, 5, 4, 4}, Shape{1, 7, 4, 6, 2},
                                           Shape{2, 5, 9, 16, 2}, Shape{1, 6, 11, 32, 1}, Shape{3, 16, 16, 64, 4},
                                           Shape{1, 9, 40, 128, 4}, Shape{2, 1, 13, 8, 1}, Shape{1, 5, 7, 9, 3},
                                           Shape{1, 3, 257, 16, 2}, Shape{1, 2, 1030, 16, 1},
                                           Shape{1, 3, 65, 128, 1}, Shape{1, 4, 6, 256, 1}, Shape{1, 4, 5, 72, 3},
                                           Shape{4, 32, 32, 64, 4}, Shape{1, 2, 600, 32, 1},
                                           Shape{1, 1, 800, 192, 1}),
                         [](const auto& info) { return shape_name(info.param); });

class CudaBackwardRuns : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  }
  Shape s{2, 6, 9, 16, 2};
  Problem p = random_problem(s, 4242);
  std::vector<double> gout = random_grad(s.B * s.H * s.W * s.D, 11);
  std::vector<float> gout_f = std::vector<float>(gout.begin(), gout.end());
  DeviceProblem dev;
  AxialParams dp = dev.params(p);

  // Another problem: shape, inputs and weights from problem_seed, output gradient from grad_seed.
  void use(const Shape& shape, unsigned problem_seed, unsigned grad_seed) {
    s = shape;
    p = random_problem(s, problem_seed);
    gout = random_grad(s.B * s.H * s.W * s.D, grad_seed);
    gout_f.assign(gout.begin(), gout.end());
    dp = dev.params(p);
  }

  Grads run(const std::vector<bool>& wanted = std::vector<bool>(11, true), bool in_place = false) {
    Grads r(s);
    const Status st = run_backward(dp, gout_f, &r, wanted, in_place);
    EXPECT_TRUE(st.ok()) << st.message;
    return r;
  }
};

TEST_F(CudaBackwardRuns, NullGradientsAreSkippedOthersUnchanged) {
  Grads full = run();
  for (auto& [buf, name] : full.all()) ASSERT_FALSE(std::isnan((*buf)[0])) << name;
  // Order of Grads::all(): x, row (g, b, qkv, out, bout), col (g, b, qkv, out, bout).
  const std::vector<std::vector<bool>> subsets = {
      {1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}, {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
      {0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0}, {0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1},
      {0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
  };
  for (const auto& wanted : subsets) {
    Grads part = run(wanted);
    auto pl = part.all();
    auto fl = full.all();
    for (size_t i = 0; i < pl.size(); ++i) {
      if (wanted[i])
        EXPECT_TRUE(same_bits(*pl[i].first, *fl[i].first)) << pl[i].second << " differs from the full run";
      else
        EXPECT_TRUE(all_nan(*pl[i].first)) << pl[i].second << " was written";
    }
  }
}

TEST_F(CudaBackwardRuns, GradXMayBeGradOut) {
  Grads full = run();
  Grads r = run(std::vector<bool>(11, true), /*in_place=*/true);
  EXPECT_TRUE(same_bits(r.x, full.x));
  EXPECT_TRUE(same_bits(r.col.qkv_w, full.col.qkv_w));
  EXPECT_TRUE(same_bits(r.row.qkv_w, full.row.qkv_w));
}

TEST_F(CudaBackwardRuns, RepeatedCallsAreBitwiseIdentical) {
  use(Shape{2, 48, 40, 64, 4}, 17, 12);  // 3840 positions: the weight gradients sum over many
  Grads a = run(), b = run();
  for (size_t i = 0; i < a.all().size(); ++i)
    EXPECT_TRUE(same_bits(*a.all()[i].first, *b.all()[i].first)) << a.all()[i].second;
}

// The training calls on 16-bit products (AxialParams::products, bf16 and fp16): every gradient
// finite; bits that differ from the fp32 products' (the 16-bit products ran) but for the column
// pass's output bias, the column sums of grad_out, which has fp32's bits; repeated calls bitwise
// identical; a subset of the gradients the full run's bits, the others untouched; the output the
// bits of forward_cuda's on the same products where its plan runs both passes on them (the same
// launches, the attention output rounded by its own launch: FlashAttention16.
// RoundedOutputIsTheOutputRounded; the saved copy 16-byte aligned, as T D % 8 == 0 makes it, so
// that cuBLAS reads it as the inference's). Their accuracy, by issue 37's rule against PyTorch's reference
// in the same dtype: tests/python/test_low_precision.py.
TEST_F(CudaBackwardRuns, SixteenBitProducts) {
  use(Shape{2, 24, 40, 64, 4}, 23, 5);  // a row pass of 40 and a column pass of 24
  Grads fp32(s);
  ASSERT_TRUE(run_backward(dp, gout_f, &fp32).ok());
  const size_t col_out_bias = 10;  // Grads::all()'s order: x, row (g, b, qkv, out, bout), col (...)
  for (Products type : {Products::kBf16, Products::kFp16}) {
    SCOPED_TRACE(type == Products::kBf16 ? "bf16" : "fp16");
    dp.products = type;
    Grads a(s), b(s);
    std::vector<float> out;
    Status st = run_backward(dp, gout_f, &a, std::vector<bool>(11, true), false, &out);
    ASSERT_TRUE(st.ok()) << st.message;
    ASSERT_TRUE(run_backward(dp, gout_f, &b).ok());
    auto al = a.all(), bl = b.all(), fl = fp32.all();
    for (size_t i = 0; i < al.size(); ++i) {
      const std::vector<float>& g = *al[i].first;
      EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float v) { return std::isfinite(v); })) << al[i].second;
      EXPECT_TRUE(same_bits(g, *bl[i].first)) << al[i].second << ": a repeated call differs";
      if (i == col_out_bias)
        EXPECT_TRUE(same_bits(g, *fl[i].first)) << al[i].second << ": the column sums of grad_out";
      else
        EXPECT_FALSE(same_bits(g, *fl[i].first)) << al[i].second << ": the fp32 products' bits";
    }
    // The column pass's out_weight alone (nothing through its attention), x alone, the row
    // pass's qkv_weight alone, the LayerNorm shifts alone.
    for (const std::vector<bool>& wanted :
         {std::vector<bool>{0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0}, std::vector<bool>{1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
          std::vector<bool>{0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}, std::vector<bool>{0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0}}) {
      Grads part(s);
      ASSERT_TRUE(run_backward(dp, gout_f, &part, wanted).ok());
      auto pl = part.all();
      for (size_t i = 0; i < pl.size(); ++i) {
        if (wanted[i])
          EXPECT_TRUE(same_bits(*pl[i].first, *al[i].first)) << pl[i].second << " differs from the full run";
        else
          EXPECT_TRUE(all_nan(*pl[i].first)) << pl[i].second << " was written";
      }
    }
    // forward_cuda on the same products, where its plan runs both passes on them.
    DevicePtr d_out = device_alloc(out.size());
    ASSERT_NE(d_out.get(), nullptr);
    AxialParams fp = dp;
    fp.out = d_out.get();
    CudaPlan plan;
    ASSERT_TRUE(plan_cuda(fp, &plan).ok());
    if (plan.row.products == type && plan.col.products == type) {
      DevicePtr ws = device_alloc(plan.workspace_bytes / sizeof(float) + 1);
      CUDA_OK(cudaMemset(d_out.get(), 0xff, out.size() * sizeof(float)));
      st = forward_cuda(fp, plan, ws.get(), plan.workspace_bytes, nullptr);
      ASSERT_TRUE(st.ok()) << st.message;
      std::vector<float> inference(out.size());
      CUDA_OK(cudaMemcpy(inference.data(), d_out.get(), out.size() * sizeof(float), cudaMemcpyDeviceToHost));
      EXPECT_TRUE(same_bits(out, inference)) << "the training forward's output against forward_cuda's";
    } else {
      std::printf("[   NOTE   ] forward_cuda keeps fp32 products here (%s): its output is not compared\n",
                  plan.describe().c_str());
    }
  }
  // With attention dropout: repeated calls bitwise identical, every gradient finite, and the mask
  // applied (x's gradient differs from the call without).
  Grads plain(s), d1(s), d2(s);
  ASSERT_TRUE(run_backward(dp, gout_f, &plain).ok());
  dp.dropout = 0.25f, dp.seed = 99, dp.offset = 4;
  ASSERT_TRUE(run_backward(dp, gout_f, &d1).ok());
  ASSERT_TRUE(run_backward(dp, gout_f, &d2).ok());
  for (size_t i = 0; i < d1.all().size(); ++i) {
    const std::vector<float>& g = *d1.all()[i].first;
    EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float v) { return std::isfinite(v); })) << d1.all()[i].second;
    EXPECT_TRUE(same_bits(g, *d2.all()[i].first)) << d1.all()[i].second << ": a repeated call with dropout differs";
  }
  EXPECT_FALSE(same_bits(d1.x, plain.x)) << "dropout changed nothing";
  dp.dropout = 0.0f;
  // A plan made for other products is refused.
  CudaBackwardPlan plan;
  ASSERT_TRUE(plan_backward_cuda(dp, &plan).ok());
  DevicePtr d_out = device_alloc(gout_f.size());
  AxialParams other = dp;
  other.out = d_out.get();
  other.products = Products::kFp32;
  const Status st = forward_cuda_training(other, plan, nullptr, 0, nullptr, 0, nullptr);
  EXPECT_EQ(st.code, StatusCode::kInvalidArgument);
  EXPECT_NE(st.message.find("other products"), std::string::npos) << st.message;
}

TEST_F(CudaBackwardRuns, EmptyProblemGivesZeroWeightGradients) {
  s = Shape{0, 4, 5, 8, 2};
  p = random_problem(s, 5);
  gout_f.clear();
  dp = dev.params(p);
  Grads r = run();
  for (auto& [buf, name] : r.all())
    for (float v : *buf) ASSERT_EQ(v, 0.0f) << name;
}

TEST_F(CudaBackwardRuns, ChecksPlanSavedAndWorkspace) {
  CudaBackwardPlan plan;
  ASSERT_TRUE(plan_backward_cuda(dp, &plan).ok());
  EXPECT_NE(plan.describe().find("saved " + std::to_string(plan.saved_bytes) + " B"), std::string::npos);
  size_t saved_bytes = 0;
  ASSERT_TRUE(cuda_saved_bytes(dp, &saved_bytes).ok());
  EXPECT_EQ(saved_bytes, plan.saved_bytes);
  DevicePtr ws = device_alloc(plan.workspace_bytes / sizeof(float) + 64);
  DevicePtr saved = device_alloc(plan.saved_bytes / sizeof(float) + 64);
  DevicePtr gx = device_alloc(gout_f.size()), go = device_alloc(gout_f.size()), out = device_alloc(gout_f.size());
  AxialGrads g;
  g.grad_out = go.get();
  g.grad_x = gx.get();
  auto expect_invalid = [&](const Status& st, const std::string& needle) {
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << st.message;
    EXPECT_NE(st.message.find(needle), std::string::npos) << st.message;
  };
  auto back = [&](const AxialParams& a, const AxialGrads& gr, void* sv, size_t sb, void* w, size_t wb) {
    return backward_cuda(a, gr, plan, sv, sb, w, wb, nullptr);
  };
  const size_t sb = plan.saved_bytes, wb = plan.workspace_bytes;
  expect_invalid(back(dp, g, saved.get(), sb, ws.get(), wb - 1), "workspace holds");
  expect_invalid(back(dp, g, saved.get(), sb - 1, ws.get(), wb), "saved holds");
  expect_invalid(back(dp, g, saved.get(), sb, reinterpret_cast<char*>(ws.get()) + 4, wb), "workspace must be 256-byte");
  expect_invalid(back(dp, g, reinterpret_cast<char*>(saved.get()) + 4, sb, ws.get(), wb), "saved must be 256-byte");
  expect_invalid(back(dp, g, saved.get(), sb, nullptr, wb), "workspace is null");
  expect_invalid(back(dp, g, nullptr, sb, ws.get(), wb), "saved is null");
  AxialParams other = dp;
  other.width += 1;
  expect_invalid(back(other, g, saved.get(), sb, ws.get(), wb), "another problem");
  AxialGrads alias = g;
  alias.grad_x = const_cast<float*>(dp.x);
  expect_invalid(back(dp, alias, saved.get(), sb, ws.get(), wb), "alias");
  AxialGrads no_gout = g;
  no_gout.grad_out = nullptr;
  expect_invalid(back(dp, no_gout, saved.get(), sb, ws.get(), wb), "grad_out is null");
  AxialParams fp = dp;
  fp.out = out.get();
  expect_invalid(forward_cuda_training(fp, plan, saved.get(), sb, ws.get(), wb - 1, nullptr), "workspace holds");
  expect_invalid(forward_cuda_training(dp, plan, saved.get(), sb, ws.get(), wb, nullptr), "out is null");
  // Head dims above the backward's largest: unsupported, said so.
  AxialParams wide = dp;
  wide.dim = 2 * (kCudaBackwardMaxHeadDim + 8), wide.heads = 2;
  CudaBackwardPlan wide_plan;
  const Status st = plan_backward_cuda(wide, &wide_plan);
  EXPECT_EQ(st.code, StatusCode::kUnsupported) << st.message;
  EXPECT_EQ(cuda_saved_bytes(wide, &saved_bytes).code, StatusCode::kUnsupported);
  EXPECT_NE(st.message.find("head dims up to"), std::string::npos) << st.message;
}

// The caller's cuBLAS handle (a framework's, as the torch binding passes PyTorch's): the plan
// reserves no workspace for it; the calls run on it in fp32 whatever its math mode (here TF32,
// which the gradients' bounds would not pass), and give its mode back; a plan without the option
// refuses a handle, a plan with it refuses none, and a handle bound to another stream is refused.
TEST_F(CudaBackwardRuns, CallersBlasHandle) {
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  const std::unique_ptr<cublasContext, cublasStatus_t (*)(cublasHandle_t)> owner(h, cublasDestroy);
  ASSERT_EQ(cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH), CUBLAS_STATUS_SUCCESS);
  CudaBackwardPlan plan, own;
  ASSERT_TRUE(plan_backward_cuda(dp, &plan, /*caller_blas=*/true).ok());
  ASSERT_TRUE(plan_backward_cuda(dp, &own).ok());
  EXPECT_EQ(plan.blas_bytes, 0u);
  EXPECT_LT(plan.workspace_bytes, own.workspace_bytes);
  DevicePtr ws = device_alloc(plan.workspace_bytes / sizeof(float) + 1);
  DevicePtr saved = device_alloc(plan.saved_bytes / sizeof(float) + 1);
  DevicePtr out = device_alloc(gout_f.size()), go = device_alloc(gout_f.size());
  CUDA_OK(cudaMemcpy(go.get(), gout_f.data(), gout_f.size() * sizeof(float), cudaMemcpyHostToDevice));
  Grads got(s);
  auto list = got.all();
  std::vector<DevicePtr> bufs;
  for (auto& [buf, name] : list) {
    bufs.push_back(device_alloc(buf->size()));
    CUDA_OK(cudaMemcpy(bufs.back().get(), buf->data(), buf->size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  AxialGrads g = grads_at(raw(bufs));
  g.grad_out = go.get();
  AxialParams fp = dp;
  fp.out = out.get();
  const size_t sb = plan.saved_bytes, wb = plan.workspace_bytes;
  Status st = forward_cuda_training(fp, plan, saved.get(), sb, ws.get(), wb, nullptr, h);
  ASSERT_TRUE(st.ok()) << st.message;
  st = backward_cuda(dp, g, plan, saved.get(), sb, ws.get(), wb, nullptr, h);
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());
  for (size_t i = 0; i < list.size(); ++i)
    CUDA_OK(cudaMemcpy(list[i].first->data(), bufs[i].get(), list[i].first->size() * sizeof(float),
                       cudaMemcpyDeviceToHost));
  RefGrads<double> ref = reference_backward(p, gout);
  RefGrads<float> ref32 = reference_backward_as<float>(p, gout);
  expect_grads_match(got, ref, ref32);
  cublasMath_t mode = CUBLAS_DEFAULT_MATH;
  ASSERT_EQ(cublasGetMathMode(h, &mode), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(mode, CUBLAS_TF32_TENSOR_OP_MATH) << "the caller's math mode comes back";

  const auto expect_invalid = [](const Status& r, const std::string& needle) {
    EXPECT_EQ(r.code, StatusCode::kInvalidArgument) << r.message;
    EXPECT_NE(r.message.find(needle), std::string::npos) << r.message;
  };
  expect_invalid(backward_cuda(dp, g, plan, saved.get(), sb, ws.get(), wb, nullptr, nullptr), "none was given");
  DevicePtr own_ws = device_alloc(own.workspace_bytes / sizeof(float) + 1);
  expect_invalid(backward_cuda(dp, g, own, saved.get(), sb, own_ws.get(), own.workspace_bytes, nullptr, h),
                 "without caller_blas");
  cudaStream_t other = nullptr;
  CUDA_OK(cudaStreamCreate(&other));
  expect_invalid(backward_cuda(dp, g, plan, saved.get(), sb, ws.get(), wb, other, h), "another stream");
  CUDA_OK(cudaStreamDestroy(other));
}

// The buffers of training steps (forward_cuda_training, then backward_cuda) on one problem, kept
// across steps as a training loop keeps them, so that the calls can replay their graphs.
struct TrainingSteps {
  TrainingSteps(const Shape& s, const AxialParams& dp, const std::vector<float>& gout)
      : s(s), n(gout.size()), out(device_alloc(n)), go(device_alloc(n)) {
    setup = plan_backward_cuda(dp, &plan);
    ws = device_alloc(plan.workspace_bytes / sizeof(float) + 1);
    saved = device_alloc(plan.saved_bytes / sizeof(float) + 1);
    const cudaError_t e = cudaMemcpy(go.get(), gout.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) setup = {StatusCode::kCudaError, std::string("copying the output gradient: ") + cudaGetErrorString(e)};
    Grads shape_of(s);
    for (auto& [buf, name] : shape_of.all()) bufs.push_back(device_alloc(buf->size()));
    g = grads_at(raw(bufs));
    g.grad_out = go.get();
  }

  // One step of fp (its out replaced by this object's) into poisoned buffers: the output and every
  // gradient, copied back.
  void step(AxialParams fp, std::vector<float>* out_host, Grads* grads) {
    fp.out = out.get();
    const std::vector<float> poison(n, kNaN);
    CUDA_OK(cudaMemcpy(out.get(), poison.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    for (size_t i = 0; i < bufs.size(); ++i) CUDA_OK(cudaMemset(bufs[i].get(), 0xff, grads->all()[i].first->size() * 4));
    const size_t sb = plan.saved_bytes, wb = plan.workspace_bytes;
    Status st = forward_cuda_training(fp, plan, saved.get(), sb, ws.get(), wb, nullptr);
    ASSERT_TRUE(st.ok()) << st.message;
    st = backward_cuda(fp, g, plan, saved.get(), sb, ws.get(), wb, nullptr);
    ASSERT_TRUE(st.ok()) << st.message;
    CUDA_OK(cudaDeviceSynchronize());
    out_host->resize(n);
    CUDA_OK(cudaMemcpy(out_host->data(), out.get(), n * sizeof(float), cudaMemcpyDeviceToHost));
    auto list = grads->all();
    for (size_t i = 0; i < list.size(); ++i)
      CUDA_OK(cudaMemcpy(list[i].first->data(), bufs[i].get(), list[i].first->size() * sizeof(float),
                         cudaMemcpyDeviceToHost));
  }

  // Graphs the steps add to the cache: the training forward's and the backward's, where the calls run
  // no cuBLAS product (the tensor-core products: Hopper with an sm_90a build) or run them on the
  // library's own handle (16-bit products: training.cu's capture_blas); elsewhere they cannot be
  // captured and launch directly.
  int graphs_per_problem() const {
    if (plan.products != Products::kFp32) return plan.caller_blas ? 0 : 2;
    return plan.tensor_core_products && plan.tensor_core_weight_grads ? 2 : 0;
  }

  Shape s;
  size_t n;
  CudaBackwardPlan plan;
  Status setup;  // the plan's status, or the output gradient copy's error
  DevicePtr out, go, ws, saved;
  std::vector<DevicePtr> bufs;
  AxialGrads g;
};

void expect_same_step(const std::vector<float>& out_a, Grads& a, const std::vector<float>& out_b, Grads& b,
                      const std::string& what) {
  EXPECT_TRUE(same_bits(out_a, out_b)) << "output, " << what;
  for (size_t i = 0; i < a.all().size(); ++i)
    EXPECT_TRUE(same_bits(*a.all()[i].first, *b.all()[i].first)) << a.all()[i].second << ", " << what;
}

// A call that comes back with the same pointers replays a CUDA graph of its launches
// (src/cuda/graph_replay.h): the second call captures it, the third replays. Outputs and
// gradients are bitwise those of direct launches, and stay so after the inputs' values change in
// place (a graph reads memory when it runs; an optimizer step leaves the pointers alone). On fp32
// and on 16-bit products (whose cuBLAS products the graphs capture on the library's handle).
class CudaGraphReplay : public CudaBackwardRuns, public ::testing::WithParamInterface<Products> {};

TEST_P(CudaGraphReplay, MatchesDirectLaunches) {
  use(Shape{3, 16, 16, 64, 4}, 99, 13);
  dp.products = GetParam();
  TrainingSteps t(s, dp, gout_f);
  ASSERT_TRUE(t.setup.ok()) << t.setup.message;

  cuda::set_graph_replay(false);
  std::vector<float> out_direct;
  Grads direct(s);
  t.step(dp, &out_direct, &direct);
  cuda::set_graph_replay(true);
  const int before = cuda::graphs_cached();
  for (int call = 1; call <= 3; ++call) {  // seen, captured, replayed
    std::vector<float> out_graph;
    Grads graphed(s);
    t.step(dp, &out_graph, &graphed);
    if (HasFatalFailure()) return;
    expect_same_step(out_direct, direct, out_graph, graphed,
                     call == 1 ? "first call" : call == 2 ? "capture" : "replay");
  }
  EXPECT_EQ(cuda::graphs_cached(), before + t.graphs_per_problem()) << "the training forward's graph and the backward's";

  // New values in the same buffers: the replay reads them.
  const Problem q = random_problem(s, 100);
  CUDA_OK(cudaMemcpy(const_cast<float*>(dp.x), q.x.data(), q.x.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(const_cast<float*>(dp.row.qkv_weight), q.row.qkv_w.data(), q.row.qkv_w.size() * sizeof(float),
                     cudaMemcpyHostToDevice));
  std::vector<float> out_replay, out_fresh;
  Grads replayed(s), fresh(s);
  t.step(dp, &out_replay, &replayed);
  cuda::set_graph_replay(false);
  t.step(dp, &out_fresh, &fresh);
  cuda::set_graph_replay(true);
  EXPECT_FALSE(same_bits(out_replay, out_direct)) << "the new inputs changed nothing";
  expect_same_step(out_fresh, fresh, out_replay, replayed, "replay after the inputs changed");
}

INSTANTIATE_TEST_SUITE_P(Products, CudaGraphReplay,
                         ::testing::Values(Products::kFp32, Products::kBf16, Products::kFp16),
                         [](const auto& info) {
                           return std::string(info.param == Products::kFp32   ? "fp32"
                                              : info.param == Products::kBf16 ? "bf16"
                                                                              : "fp16");
                         });

// Dropout with the seed passed by value (as the torch binding passes it outside torch's graph
// capture): the seed is written before the graph, so the training calls replay, and each replay
// draws its own call's mask: output and gradients bitwise those of direct launches with that seed.
TEST_F(CudaBackwardRuns, DropoutGraphReplayDrawsEachCallsMask) {
  use(Shape{2, 12, 20, 32, 2}, 7, 8);
  dp.dropout = 0.25f;
  TrainingSteps t(s, dp, gout_f);
  ASSERT_TRUE(t.setup.ok()) << t.setup.message;
  const auto with_seed = [&](const uint64_t seed_offset[2]) {
    AxialParams fp = dp;
    fp.seed = seed_offset[0], fp.offset = seed_offset[1];
    return fp;
  };
  const uint64_t seeds[4][2] = {{11, 0}, {11, 4}, {12, 0}, {11, 0}};
  std::vector<float> out_direct[4];
  std::vector<Grads> direct(4, Grads(s));
  cuda::set_graph_replay(false);
  for (int c = 0; c < 4; ++c) t.step(with_seed(seeds[c]), &out_direct[c], &direct[c]);
  cuda::set_graph_replay(true);
  if (HasFatalFailure()) return;
  EXPECT_FALSE(same_bits(out_direct[0], out_direct[1])) << "a new offset drew the same mask";
  EXPECT_FALSE(same_bits(out_direct[0], out_direct[2])) << "a new seed drew the same mask";
  EXPECT_TRUE(same_bits(out_direct[0], out_direct[3])) << "the same seed and offset drew another mask";

  const int before = cuda::graphs_cached();
  for (int round = 0; round < 2; ++round)  // seen and captured, then replayed
    for (int c = 0; c < 4; ++c) {
      std::vector<float> out_graph;
      Grads graphed(s);
      t.step(with_seed(seeds[c]), &out_graph, &graphed);
      if (HasFatalFailure()) return;
      expect_same_step(out_direct[c], direct[c], out_graph, graphed, "call " + std::to_string(4 * round + c));
    }
  EXPECT_EQ(cuda::graphs_cached(), before + t.graphs_per_problem()) << "one forward graph whatever the seed";
}

}  // namespace
}  // namespace fastaxial::test
