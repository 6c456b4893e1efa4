// Runs fastaxial's CPU forward on the default problem (B=4, H=W=32, D=64,
// 4 heads) with random weights initialised as PyTorch's modules would be,
// and prints a checksum. Shows the whole C++ API a client needs.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "fastaxial/fastaxial.h"

int main() {
  const int64_t B = 4, H = 32, W = 32, D = 64, heads = 4;
  std::mt19937 rng(0);
  auto uniform = [&](std::vector<float>& v, float bound) {
    std::uniform_real_distribution<float> u(-bound, bound);
    for (float& e : v) e = u(rng);
  };
  std::vector<float> x(B * H * W * D), out(x.size());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& e : x) e = normal(rng);

  // Per axis: LayerNorm (ones, zeros), qkv (3D, D) and out (D, D) Linear layers.
  struct Axis {
    std::vector<float> norm_w, norm_b, qkv_w, out_w, out_b;
  } axes[2];
  const float bound = 1.0f / std::sqrt(static_cast<float>(D));
  for (Axis& a : axes) {
    a.norm_w.assign(D, 1.0f);
    a.norm_b.assign(D, 0.0f);
    a.qkv_w.resize(3 * D * D);
    a.out_w.resize(D * D);
    a.out_b.resize(D);
    uniform(a.qkv_w, bound);
    uniform(a.out_w, bound);
    uniform(a.out_b, bound);
  }
  auto weights = [](const Axis& a) {
    return fastaxial::AxisWeights{a.norm_w.data(), a.norm_b.data(), a.qkv_w.data(), a.out_w.data(),
                                  a.out_b.data()};
  };

  fastaxial::AxialParams p;
  p.batch = B, p.height = H, p.width = W, p.dim = D, p.heads = heads;
  p.x = x.data();
  p.out = out.data();
  p.row = weights(axes[0]);
  p.col = weights(axes[1]);

  const fastaxial::Status s = fastaxial::forward_cpu(p);
  if (!s.ok()) {
    std::fprintf(stderr, "fastaxial: %s\n", s.message.c_str());
    return 1;
  }
  double sum = 0.0, sum_abs = 0.0;
  for (float e : out) sum += e, sum_abs += std::fabs(e);
  std::printf("fastaxial consumer: CPU forward, out (%lld, %lld, %lld, %lld), sum %.6f, mean |out| %.6f\n",
              (long long)B, (long long)H, (long long)W, (long long)D, sum, sum_abs / out.size());
  // The CUDA plan of the same problem: which kernels would run on this machine's GPU, and the
  // workspace to allocate. It needs a build with the CUDA kernels and a GPU with its driver.
  fastaxial::CudaPlan plan;
  const fastaxial::Status planned = fastaxial::plan_cuda(p, &plan);
  if (planned.ok()) {
    std::printf("CUDA plan: %s\n", plan.describe().c_str());
  } else if (!fastaxial::cuda_compiled()) {
    std::printf("CUDA: this build of fastaxial has no CUDA kernels (no GPU where it was built, or "
                "FASTAXIAL_CUDA=OFF); only the CPU path ran\n");
  } else if (planned.code == fastaxial::StatusCode::kUnsupported) {
    // No device the CUDA runtime can use: no GPU, or no NVIDIA driver (the runtime then reports
    // "driver version is insufficient", which reads as an old driver rather than none).
    std::printf("CUDA: no usable CUDA GPU here (no GPU, or no NVIDIA driver; the CUDA runtime says: %s); "
                "only the CPU path ran\n", planned.message.c_str());
  } else {
    std::fprintf(stderr, "CUDA plan failed: %s\n", planned.message.c_str());
    return 1;
  }
  return std::isfinite(sum) ? 0 : 1;
}
