// Timing of the staged path's flash attention (src/cuda/attention/flash_attention.cu): one pass of
// N sequences of length L, `heads` heads of head_dim hd, qkv and o contiguous rows (as a row pass
// of a (1, N, L, heads hd) grid), on the kernel flash_attention picks (wgmma where it applies)
// and on the mma.sync kernel (FlashArgs::mma_sync), then on bf16 and fp16 products (FlashArgs::products,
// on the kernel picked for them: the 16-bit wgmma one where it applies; their difference from the first
// relative to max |o|), and bf16 on the mma.sync kernel, with the log-sum-exp written (as the
// training forward does) and without a split-KV buffer (so no pass splits its keys here); then,
// where the kQkv16 kernel serves the pass, bf16 on q, k, v given in 16 bits (FlashArgs::qkv16: the
// inference pass's input; its difference from the bf16 run on fp32 rows).
// Each time is the mean of `reps` calls,
// each after the L2 is flushed (a 256 MB memset), between CUDA events around the call alone.
// Also prints the two outputs' largest difference relative to max |o| (a sanity check;
// test_flash_attention holds the accuracy bounds against float64).
// Rate: 4 N heads L^2 hd floating-point operations a pass (two products), in each run's products.
// Then the pass's attention backward (src/cuda/attention/: delta, dk and
// dv, dq) from that forward's o and lse and a random d_o: with dq recomputing the scores, as
// picked (wgmma where it applies) and with AttentionBackwardArgs::mma_sync, then with dq from
// the dS^T the dk, dv kernel stores (AttentionBackwardArgs::ds, as the training path's plan gives
// it where it fits); rate: 14 N heads L^2 hd (the seven products of the recomputing kernels) for
// all three, and each one's largest difference of dqkv from the first relative to max |dqkv|;
// then on bf16 and fp16 products (AttentionBackwardArgs::products, from the same products'
// forward: its o and lse), dq from dS^T and dq recomputing the scores, each one's difference
// from the first likewise.
// Not a test: built on request (ninja bench_flash_attention), run on a GPU.
//   build/benchmarks/cpp/bench_flash_attention [reps] [N L hd heads]...
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "src/common/axis.h"
#include "src/common/plan.h"
#include "src/cuda/attention/attention_backward.h"
#include "src/cuda/attention/flash_attention.h"
#include "bench_util.h"
#include "util/cuda_test_util.h"
#include "util/round16.h"  // to16: the 16-bit qkv

namespace {

using fastaxial::DeviceCaps;
namespace cuda = fastaxial::cuda;

struct Shape {
  int64_t N, L;
  int hd, heads;
};

// max |x - y| / max |y| over n floats of device memory.
double relative_difference(const float* x, const float* y, size_t n) {
  std::vector<float> hx(n), hy(n);
  BENCH_CHECK(cudaMemcpy(hx.data(), x, n * 4, cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(hy.data(), y, n * 4, cudaMemcpyDeviceToHost));
  double ymax = 0.0, diff = 0.0;
  for (size_t e = 0; e < n; ++e) {
    ymax = std::max(ymax, (double)std::fabs(hy[e]));
    diff = std::max(diff, (double)std::fabs(hx[e] - hy[e]));
  }
  return diff / ymax;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  std::vector<Shape> shapes;
  if (argc > 1) reps = std::max(1, std::atoi(argv[1]));
  for (int i = 2; i + 3 < argc; i += 4)
    shapes.push_back({std::atoll(argv[i]), std::atoll(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3])});
  if (shapes.empty())  // passes of the training benchmark's shapes and of long axes
    shapes = {{256, 256, 32, 4}, {256, 128, 32, 8}, {96, 80, 32, 3},  {160, 48, 32, 3},
              {512, 64, 16, 8},  {32, 1024, 32, 8}, {16, 2048, 32, 2}, {512, 512, 16, 4}};
  const DeviceCaps dev = fastaxial::test::bench_device(reps);
  fastaxial::test::ColdTimer timer;

  std::printf("%6s %5s %4s %5s | %-22s | %-18s | %s | %-33s | %-33s | %-18s | %s\n", "N", "L", "hd", "heads",
              "flash_attention (kernel)", "mma.sync forced", "max diff / max |o|", "bf16 products (kernel, diff)",
              "fp16 products (kernel, diff)", "bf16 on mma.sync", "bf16 on 16-bit qkv (diff)");
  for (const Shape& s : shapes) {
    const int64_t D = (int64_t)s.hd * s.heads, T = s.N * s.L;
    fastaxial::AxialParams p;
    p.batch = 1, p.height = s.N, p.width = s.L, p.dim = D, p.heads = s.heads;
    const fastaxial::AxisView fv = fastaxial::row_view(p);
    const fastaxial::AxisView view = {fv.num_seq, fv.len, fv.inner, fv.seq_stride / D, fv.pos_stride / D,
                                      fv.batch_stride / D};
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> hqkv((size_t)(T * 3 * D));
    for (float& x : hqkv) x = normal(rng);
    float *qkv, *o[6], *lse, *lse16[3];
    BENCH_CHECK(cudaMalloc(&qkv, hqkv.size() * 4));
    for (float*& oi : o) BENCH_CHECK(cudaMalloc(&oi, (size_t)(T * D) * 4));
    BENCH_CHECK(cudaMalloc(&lse, (size_t)(2 * s.N * s.heads * s.L) * 4));  // hi, lo
    for (float*& l : lse16)  // the 16-bit runs' own, bf16, fp16, bf16 on mma.sync (the backward reads the first two)
      BENCH_CHECK(cudaMalloc(&l, (size_t)(2 * s.N * s.heads * s.L) * 4));
    BENCH_CHECK(cudaMemcpy(qkv, hqkv.data(), hqkv.size() * 4, cudaMemcpyHostToDevice));
    std::vector<uint16_t> h16(hqkv.size());
    for (size_t e = 0; e < h16.size(); ++e) h16[e] = fastaxial::test::to16(hqkv[e], fastaxial::Products::kBf16);
    void* qkv16;
    BENCH_CHECK(cudaMalloc(&qkv16, h16.size() * 2));
    BENCH_CHECK(cudaMemcpy(qkv16, h16.data(), h16.size() * 2, cudaMemcpyHostToDevice));

    cuda::FlashArgs a;
    a.pos = view, a.qkv = qkv, a.lse = lse, a.D = (int)D, a.heads = s.heads;
    // variant 0: as picked; 1: mma.sync; 2 and 3: bf16 and fp16 products as picked; 4: bf16 on
    // mma.sync; 5: bf16 on the 16-bit qkv. Returns the mean time in ms.
    const auto args = [&](int variant) {
      cuda::FlashArgs av = a;
      av.o = o[variant], av.mma_sync = variant == 1 || variant == 4;
      if (variant >= 2)
        av.products = variant == 3 ? fastaxial::Products::kFp16 : fastaxial::Products::kBf16,
        av.lse = lse16[std::min(variant - 2, 2)];
      if (variant == 5) av.qkv16 = qkv16, av.qkv = nullptr;
      return av;
    };
    const auto time = [&](int variant) {
      const cuda::FlashArgs av = args(variant);
      return timer.mean_ms(reps, [&] { BENCH_CHECK(cuda::flash_attention(av, dev, nullptr)); });
    };
    double ms[6];
    const bool qkv16_served = cuda::flash_qkv16_chosen(args(2), dev);
    for (int v = 0; v < 6; ++v) ms[v] = v < 5 || qkv16_served ? time(v) : 0.0;
    const auto kernel16 = [&](int variant) { return fastaxial::to_string(cuda::flash_attention_variant(args(variant), dev).kernel); };
    const double flop = 4.0 * (double)s.N * s.heads * (double)s.L * (double)s.L * s.hd;
    const bool wgmma = cuda::flash_wgmma_chosen(a, dev);
    std::printf("%6lld %5lld %4d %5d | %8.1f us %5.1f TF %-5s | %8.1f us %5.1f TF | %.1e | %8.1f us %5.1f TF %-11s %.1e | "
                "%8.1f us %5.1f TF %-11s %.1e | %8.1f us %5.1f TF | ",
                (long long)s.N, (long long)s.L, s.hd, s.heads, 1e3 * ms[0], flop / ms[0] * 1e-9, wgmma ? "wgmma" : "mma",
                1e3 * ms[1], flop / ms[1] * 1e-9, relative_difference(o[0], o[1], (size_t)(T * D)), 1e3 * ms[2],
                flop / ms[2] * 1e-9, kernel16(2), relative_difference(o[0], o[2], (size_t)(T * D)), 1e3 * ms[3],
                flop / ms[3] * 1e-9, kernel16(3), relative_difference(o[0], o[3], (size_t)(T * D)), 1e3 * ms[4],
                flop / ms[4] * 1e-9);
    if (qkv16_served)
      std::printf("%8.1f us %5.1f TF %.1e\n", 1e3 * ms[5], flop / ms[5] * 1e-9,
                  relative_difference(o[5], o[2], (size_t)(T * D)));
    else
      std::printf("-\n");
    // The backward from variant 0's o and lse.
    std::vector<float> hdo((size_t)(T * D));
    for (float& x : hdo) x = normal(rng);
    float *d_o, *delta, *dqkv[7], *ds;
    BENCH_CHECK(cudaMalloc(&ds, (size_t)(s.N * s.heads * s.L * fastaxial::attention_scores_stride(s.L)) * 4));
    BENCH_CHECK(cudaMalloc(&d_o, hdo.size() * 4));
    BENCH_CHECK(cudaMalloc(&delta, (size_t)(s.N * s.heads * s.L) * 4));
    for (float*& di : dqkv) BENCH_CHECK(cudaMalloc(&di, (size_t)(T * 3 * D) * 4));
    BENCH_CHECK(cudaMemcpy(d_o, hdo.data(), hdo.size() * 4, cudaMemcpyHostToDevice));
    cuda::AttentionBackwardArgs b;
    b.pos = view, b.qkv = qkv, b.o = o[0], b.d_o = d_o, b.lse = lse, b.delta = delta, b.D = (int)D;
    b.heads = s.heads;
    // variant 0: as picked; 1: mma.sync; 2: dq from dS^T; 3 and 4: bf16 and fp16 products from their
    // forward's o and lse, dq from dS^T; 5 and 6: the same, dq recomputing the scores.
    const auto time_backward = [&](int variant) {
      cuda::AttentionBackwardArgs bv = b;
      bv.dqkv = dqkv[variant], bv.mma_sync = variant == 1, bv.ds = variant >= 2 && variant <= 4 ? ds : nullptr;
      if (variant >= 3) {
        const bool bf16 = variant == 3 || variant == 5;
        bv.products = bf16 ? fastaxial::Products::kBf16 : fastaxial::Products::kFp16;
        bv.o = o[bf16 ? 2 : 3], bv.lse = lse16[bf16 ? 0 : 1];
      }
      return timer.mean_ms(reps, [&] { BENCH_CHECK(cuda::attention_backward(bv, dev, nullptr)); });
    };
    double bms[7];
    for (int v = 0; v < 7; ++v) bms[v] = time_backward(v);
    const double bflop = 3.5 * flop;
    std::printf("%6s %5s %4s %5s | backward %8.1f us %5.1f TF %-5s | %8.1f us %5.1f TF | %.1e | from dS^T %8.1f us "
                "%5.1f TF | %.1e\n",
                "", "", "", "", 1e3 * bms[0], bflop / bms[0] * 1e-9,
                cuda::query_grads_wgmma_can_run(b, dev) ? "wgmma" : "mma", 1e3 * bms[1], bflop / bms[1] * 1e-9,
                relative_difference(dqkv[0], dqkv[1], (size_t)(T * 3 * D)), 1e3 * bms[2], bflop / bms[2] * 1e-9,
                relative_difference(dqkv[0], dqkv[2], (size_t)(T * 3 * D)));
    for (int v = 3; v <= 5; v += 2)
      std::printf("%6s %5s %4s %5s | backward on bf16 products, dq %-10s %8.1f us %5.1f TF %.1e | on fp16 products "
                  "%8.1f us %5.1f TF %.1e\n",
                  "", "", "", "", v == 3 ? "from dS^T" : "recomputed", 1e3 * bms[v], bflop / bms[v] * 1e-9,
                  relative_difference(dqkv[0], dqkv[v], (size_t)(T * 3 * D)), 1e3 * bms[v + 1],
                  bflop / bms[v + 1] * 1e-9, relative_difference(dqkv[0], dqkv[v + 1], (size_t)(T * 3 * D)));
    BENCH_CHECK(cudaFree(ds));
    BENCH_CHECK(cudaFree(d_o));
    BENCH_CHECK(cudaFree(delta));
    for (float* di : dqkv) BENCH_CHECK(cudaFree(di));
    BENCH_CHECK(cudaFree(qkv));
    BENCH_CHECK(cudaFree(qkv16));
    for (float* oi : o) BENCH_CHECK(cudaFree(oi));
    BENCH_CHECK(cudaFree(lse));
    for (float* l : lse16) BENCH_CHECK(cudaFree(l));
  }
  return 0;
}
