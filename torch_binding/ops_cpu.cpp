// CPU kernels of fastaxial::axial_attention, its training forward and its backward, for float32,
// and for bfloat16 and float16 as fp32 math on float32 copies (check_call). Dropout's
// seed comes from PyTorch's default CPU generator (so torch.manual_seed fixes the mask), its
// offset is 0, unless the call passes its own (`rng_state`). The training forward's `saved` keeps
// what the backward reads: the row pass's output x1 (AxialParams::row_out, B H W D floats), each
// pass's q, k, v (AxialParams::saved_qkv, 6 B H W D floats) and the attention output of each pass
// of 128 positions or more (AxialParams::saved_o, saved_o_floats), the softmax probabilities of each
// shorter pass (AxialParams::saved_p, saved_p_floats), x's sizes (B, H, W, D as int64: the backward
// refuses a `saved` of another shape), then that pair (4 floats).
//
// The products run on the BLAS PyTorch runs on where it is MKL: libtorch_cpu's sgemm_ (PyTorch's
// x86 wheels), looked up when the library loads, not linked, so another torch leaves Eigen's GEMM
// (docs/cpu-blas.md). FASTAXIAL_CPU_BLAS=eigen keeps Eigen's.
#include <dlfcn.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace fastaxial::torch_binding {
namespace {

// torch's sgemm_, and MKL's thread count for the calling thread where torch's BLAS is MKL.
CpuSgemm torch_sgemm = nullptr;
int (*mkl_local_threads)(int) = nullptr;  // MKL_Set_Num_Threads_Local: the previous count back

// torch's sgemm on one thread. fastaxial runs its products from its own OpenMP threads (one
// product per thread at a time); MKL, left to thread a call made outside those regions, starts a
// team of its own beside them, and small steps stall (docs/cpu-blas.md, "One thread a call").
void sgemm_one_thread(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                      const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                      const float* beta, float* c, const int* ldc) {
  const int before = mkl_local_threads(1);
  torch_sgemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  mkl_local_threads(before);
}

// Sets torch's sgemm_ as the CPU products' BLAS, on one thread a call, where it is MKL's (the
// thread-local setting found); unless FASTAXIAL_CPU_BLAS=eigen. A torch with another BLAS
// (OpenBLAS in its aarch64 wheels) keeps Eigen's GEMM: nothing here could hold that BLAS to one
// thread a call. What it set.
CpuSgemm use_torch_blas() {
  const char* choice = std::getenv("FASTAXIAL_CPU_BLAS");
  if (choice != nullptr && std::strcmp(choice, "eigen") == 0) return nullptr;
  void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);  // loaded already: this library links it
  if (torch_cpu == nullptr) return nullptr;
  torch_sgemm = reinterpret_cast<CpuSgemm>(dlsym(torch_cpu, "sgemm_"));
  mkl_local_threads = reinterpret_cast<int (*)(int)>(dlsym(torch_cpu, "MKL_Set_Num_Threads_Local"));
  dlclose(torch_cpu);  // (drops the reference NOLOAD took; torch stays loaded)
  const CpuSgemm sgemm = torch_sgemm != nullptr && mkl_local_threads != nullptr ? &sgemm_one_thread : nullptr;
  set_cpu_sgemm(sgemm);
  return sgemm;
}
[[maybe_unused]] const CpuSgemm torch_blas = use_torch_blas();  // at load

// params with the call's dropout state, where dropout is active: rng_state's (seed, offset) where
// given, else a fresh seed from the default CPU generator and offset 0.
void draw_dropout_seed(AxialParams* p, const std::optional<at::Tensor>& rng_state) {
  if (!(p->dropout > 0.0f)) return;
  if (rng_state.has_value()) {
    const int64_t* r = rng_state->data_ptr<int64_t>();
    p->seed = static_cast<uint64_t>(r[0]), p->offset = static_cast<uint64_t>(r[1]);
    return;
  }
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  const std::lock_guard<std::mutex> lock(gen->mutex_);
  p->seed = gen->random64();
  p->offset = 0;
}

// The CPU training forward's `saved` for p's sizes, in floats: x1 (n, x's elements), q k v of both
// passes (6 n), o of the passes that keep it (saved_o_floats), P of the passes that keep it
// (saved_p_floats), x's four sizes (int64), the dropout state.
constexpr int64_t kShapeFloats = 8;
struct CpuSaved {
  int64_t n, o, probs;
  int64_t shape_at() const { return 7 * n + o + probs; }
  int64_t state_at() const { return shape_at() + kShapeFloats; }
  int64_t floats() const { return state_at() + kDropoutStateFloats; }
  // Where p reads and writes the kept tensors in `saved`.
  void point(AxialParams* p, float* saved) const {
    p->row_out = saved, p->saved_qkv = saved + n, p->saved_o = o > 0 ? saved + 7 * n : nullptr;
    p->saved_p = probs > 0 ? saved + 7 * n + o : nullptr;
  }
};
CpuSaved cpu_saved(const AxialParams& p) {
  return {p.batch * p.height * p.width * p.dim, saved_o_floats(p), saved_p_floats(p)};
}

// The training forward's `saved` buffers, kept when freed for the next training forward of the same
// size. A training step frees its `saved` when its backward is done, and the next step's forward
// asks for as many floats again. Buffers that large (tens of MB and up: glibc's malloc maps them
// itself above 32 MB) go back to the system at each free, and the next step's first touch faults
// in and zeroes every page again, as costly as the forward's own work at short sequences (perf
// notes v69). The cache holds at most kMaxCachedBytes, the most recently freed
// buffers first; fastaxial.ops.empty_cpu_cache() hands them back (torch.cuda.empty_cache's
// counterpart). What a buffer held before is never read: the forward writes all of `saved`.
class SavedCache {
 public:
  static constexpr size_t kMinBytes = size_t{1} << 20;          // smaller ones: malloc's own reuse
  static constexpr size_t kMaxCachedBytes = size_t{2} << 30;     // 2 GiB
  static constexpr size_t kAlign = 64;

  // A float32 CPU tensor of `floats` elements, on a cached buffer of its size where there is one.
  at::Tensor empty(int64_t floats, const at::TensorOptions& options) {
    const size_t bytes = static_cast<size_t>(floats) * sizeof(float);
    if (bytes < kMinBytes) return at::empty({floats}, options);
    void* ptr = take(bytes);
    const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    if (ptr == nullptr) ptr = std::aligned_alloc(kAlign, rounded);
    if (ptr == nullptr && clear() > 0) ptr = std::aligned_alloc(kAlign, rounded);  // the cache's room first
    TORCH_CHECK(ptr != nullptr, "fastaxial.axial_attention_training (CPU): out of memory allocating ", bytes,
                " bytes for the backward's saved activations");
    return at::from_blob(ptr, {floats}, [this, bytes](void* p) { give_back(p, bytes); }, options);
  }
  // Frees every cached buffer; the bytes freed.
  size_t clear() {
    std::list<Entry> drop;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      drop.swap(free_);
      cached_ = 0;
    }
    size_t bytes = 0;
    for (const Entry& e : drop) bytes += e.bytes, std::free(e.ptr);
    return bytes;
  }
  size_t cached_bytes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }

 private:
  struct Entry {
    void* ptr;
    size_t bytes;
  };
  void* take(size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it)  // the most recently freed first
      if (it->bytes == bytes) {
        void* ptr = it->ptr;
        cached_ -= bytes;
        free_.erase(std::next(it).base());
        return ptr;
      }
    return nullptr;
  }
  // A tensor's deleter, which must not throw: a buffer the list cannot take is freed.
  void give_back(void* ptr, size_t bytes) noexcept {
    std::list<Entry> evicted;
    bool kept = false;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (bytes <= kMaxCachedBytes) {
        try {
          free_.push_back({ptr, bytes});
          kept = true;
        } catch (...) {  // (no memory for the list's node)
        }
      }
      if (kept) {
        cached_ += bytes;
        while (cached_ > kMaxCachedBytes) {  // the least recently freed go
          cached_ -= free_.front().bytes;
          evicted.splice(evicted.end(), free_, free_.begin());
        }
      }
    }
    if (!kept) std::free(ptr);
    for (const Entry& e : evicted) std::free(e.ptr);
  }
  std::mutex mutex_;
  std::list<Entry> free_;  // oldest first
  size_t cached_ = 0;
};
// Never destroyed: a tensor freed during the process's exit may still give its buffer back.
SavedCache& saved_cache() {
  static SavedCache* cache = new SavedCache;
  return *cache;
}

// out = the forward of the call, in the caller's dtype; the dropout state drawn into *p; where
// `saved` is given (CpuSaved), x1 and the passes' q, k, v and o kept there.
at::Tensor forward(const Call& c, const std::optional<at::Tensor>& rng_state, AxialParams* p, const char* op,
                   float* saved = nullptr) {
  at::Tensor out = at::empty_like(c.x, at::MemoryFormat::Contiguous);  // float32, as c.x
  *p = c.params(out);
  if (saved != nullptr) cpu_saved(*p).point(p, saved);
  if (out.numel() == 0) return out.to(c.dtype);  // nothing drawn, as on CUDA
  draw_dropout_seed(p, rng_state);
  const Status s = forward_cpu(*p);
  TORCH_CHECK(s.ok(), op, " (CPU): ", s.message);
  return out.to(c.dtype);  // (out itself where the call is float32)
}

at::Tensor axial_attention_cpu(const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
                               const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob,
                               const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
                               const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads, double eps,
                               double dropout, const std::optional<at::Tensor>& rng_state,
                               std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.axial_attention");  // (the CPU kernels' products are fp32 whatever it asks)
  Call c = check_call("fastaxial.axial_attention", x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob, num_heads,
                      eps, dropout, rng_state);
  AxialParams p;
  return forward(c, rng_state, &p, "fastaxial.axial_attention");
}

// The output, and `saved`: x1 (B H W D floats), the passes' q, k, v (6 B H W D), the kept o
// (saved_o_floats) and P (saved_p_floats), x's sizes (four int64), then the dropout state (seed,
// offset as two uint64) in 4 floats.
std::tuple<at::Tensor, at::Tensor> axial_attention_training_cpu(
    const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb, const at::Tensor& rqkv, const at::Tensor& rout,
    const at::Tensor& rob, const at::Tensor& cnw, const at::Tensor& cnb, const at::Tensor& cqkv,
    const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads, double eps, double dropout,
    const std::optional<at::Tensor>& rng_state, std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.axial_attention_training");  // (fp32 math whatever it asks)
  Call c = check_call("fastaxial.axial_attention_training", x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob,
                      num_heads, eps, dropout, rng_state);
  const CpuSaved layout = cpu_saved(c.params());
  at::Tensor saved = saved_cache().empty(layout.floats(), c.x.options());  // float32, as c.x
  AxialParams p;
  at::Tensor out = forward(c, rng_state, &p, "fastaxial.axial_attention_training", saved.data_ptr<float>());
  const int64_t sizes[4] = {c.x.size(0), c.x.size(1), c.x.size(2), c.x.size(3)};
  std::memcpy(saved.data_ptr<float>() + layout.shape_at(), sizes, sizeof sizes);
  const uint64_t state[2] = {p.seed, p.offset};
  std::memcpy(saved.data_ptr<float>() + layout.state_at(), state, sizeof state);
  return {out, saved};
}

// The gradients output_mask asks for, each a fresh tensor shaped like its input.
std::vector<at::Tensor> axial_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& rnw, const at::Tensor& rnb,
    const at::Tensor& rqkv, const at::Tensor& rout, const at::Tensor& rob, const at::Tensor& cnw,
    const at::Tensor& cnb, const at::Tensor& cqkv, const at::Tensor& cout, const at::Tensor& cob, int64_t num_heads,
    double eps, std::array<bool, 11> output_mask, const std::optional<at::Tensor>& saved, double dropout,
    std::optional<at::ScalarType> products) {
  check_products(products, "fastaxial.axial_attention_backward");  // (fp32 math whatever it asks)
  Call c = check_call("fastaxial.axial_attention_backward", x, rnw, rnb, rqkv, rout, rob, cnw, cnb, cqkv, cout, cob,
                      num_heads, eps, dropout);
  AxialParams p = c.params();
  const CpuSaved layout = cpu_saved(p);
  if (saved.has_value()) {
    TORCH_CHECK_VALUE(saved->is_cpu() && saved->scalar_type() == at::kFloat && saved->is_contiguous() &&
                          saved->numel() == layout.floats(),
                      "fastaxial.axial_attention_backward (CPU): `saved` must be axial_attention_training's for these "
                      "inputs (", layout.floats(), " float32 on the CPU: the row pass's output, both passes' q, k, v, "
                      "the attention output of the passes of 128 positions or more, the probabilities of the "
                      "shorter ones, x's sizes, then the dropout "
                      "state), got ", saved->numel(), " ", saved->scalar_type(), " on ", saved->device());
    int64_t sizes[4];
    std::memcpy(sizes, saved->data_ptr<float>() + layout.shape_at(), sizeof sizes);
    TORCH_CHECK_VALUE(sizes[0] == c.x.size(0) && sizes[1] == c.x.size(1) && sizes[2] == c.x.size(2) &&
                          sizes[3] == c.x.size(3),
                      "fastaxial.axial_attention_backward (CPU): `saved` was made by axial_attention_training for x "
                      "of shape [", sizes[0], ", ", sizes[1], ", ", sizes[2], ", ", sizes[3], "], not this call's ",
                      c.x.sizes());
    // Read, never written: backward_cpu only reads row_out, saved_qkv, saved_o and saved_p.
    layout.point(&p, const_cast<float*>(saved->data_ptr<float>()));
  }
  if (dropout > 0) {  // the forward's mask: its seed and offset, which only `saved` knows
    TORCH_CHECK_VALUE(saved.has_value(), "fastaxial.axial_attention_backward: with dropout > 0, `saved` (from "
                      "axial_attention_training) is required: it holds the forward's dropout seed and offset");
    uint64_t state[2];
    std::memcpy(state, saved->data_ptr<float>() + layout.state_at(), sizeof state);
    p.seed = state[0], p.offset = state[1];
  }
  BackwardCall b = prepare_backward(c, grad_out, output_mask);
  const Status s = backward_cpu(p, b.grads);
  TORCH_CHECK(s.ok(), "fastaxial.axial_attention_backward (CPU): ", s.message);
  b.outputs = converted(std::move(b.outputs), c.dtype);  // the gradients in the inputs' dtype
  return b.outputs;
}

}  // namespace

int64_t empty_cpu_cache() { return static_cast<int64_t>(saved_cache().clear()); }
int64_t cpu_cache_bytes() { return static_cast<int64_t>(saved_cache().cached_bytes()); }

}  // namespace fastaxial::torch_binding

TORCH_LIBRARY_IMPL(fastaxial, CPU, m) {
  m.impl("axial_attention", &fastaxial::torch_binding::axial_attention_cpu);
  m.impl("axial_attention_backward", &fastaxial::torch_binding::axial_attention_backward_cpu);
  m.impl("axial_attention_training", &fastaxial::torch_binding::axial_attention_training_cpu);
}
