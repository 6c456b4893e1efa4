// Replays of a call's kernel launches as one CUDA graph.
//
// A training call is tens of kernel launches. On small problems their GPU
// work takes less time than the host takes to issue them, so the host sets
// the pace. In a training loop the same call comes back
// step after step with the same sizes and, since PyTorch's caching allocator
// hands out the same blocks each step, the same pointers. run_graphed()
// therefore captures a call's launches into a graph the second time it sees
// the call's key (every size, pointer and value its launches take), then
// replays that graph with one cudaGraphLaunch whenever the key comes again.
// A call seen once runs its launches directly, so calls that never repeat
// (changing shapes) cost a key lookup and nothing else. (A dropout seed that
// changes every call stays out of the graph: the training forward writes it
// to device memory by a launch of its own, training.cu.)
//
// Replays are exact: a graph's kernels take the arguments the key lists, by
// value, as the direct launches would. A call whose enqueue cannot be captured
// (a cuBLAS product, see Enqueue) keeps running directly. The cache holds
// hundreds of keys (common/replay_cache.h), as a training step of a model of
// n layers cycles through 2n of them. Calls made while the caller's stream
// is itself being captured (a CUDA graph of the caller's own) launch
// directly, into that capture. FASTAXIAL_CUDA_GRAPHS=0 in the environment
// turns replays off.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "fastaxial/fastaxial.h"

namespace fastaxial::cuda {

// Everything a call's launches depend on, as 64-bit words.
class CallKey {
 public:
  void add(uint64_t v) { words_.push_back(v); }
  void add(int64_t v) { words_.push_back(static_cast<uint64_t>(v)); }
  void add(int v) { words_.push_back(static_cast<uint64_t>(static_cast<int64_t>(v))); }
  void add(bool v) { words_.push_back(v ? 1 : 0); }
  void add(float v);
  void add(const void* ptr) { words_.push_back(reinterpret_cast<uintptr_t>(ptr)); }
  const std::vector<uint64_t>& words() const { return words_; }

 private:
  std::vector<uint64_t> words_;
};

// Issues a call's launches onto `stream`. `capturing`: the launches are being recorded into a
// graph, so the call must not use anything a graph cannot hold (cuBLAS on a caller's handle bound
// to another stream, a host read of device memory): it returns Status kUnsupported instead, and
// the call then runs directly, now and whenever its key comes again.
using Enqueue = std::function<Status(cudaStream_t stream, bool capturing)>;

// Runs `enqueue` onto `stream` of the current device `device`: directly, or as a replay of the
// graph of an earlier call with the same key (above).
Status run_graphed(const CallKey& key, cudaStream_t stream, int device, const Enqueue& enqueue);

// Turns replays on or off for the calls that follow (tests compare the two); the default is on,
// unless FASTAXIAL_CUDA_GRAPHS=0.
void set_graph_replay(bool on);

// Graphs held now (all devices): for tests.
int graphs_cached();

}  // namespace fastaxial::cuda
