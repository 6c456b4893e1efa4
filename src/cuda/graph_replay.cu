// run_graphed (graph_replay.h): the keys seen once and the instantiated graphs in a
// ReplayCache (common/replay_cache.h) under one mutex. Captures and launches both run under it:
// a graph exec is not to be launched from two threads at once, and one capture at a time uses
// the device's capture stream.
#include "graph_replay.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "../common/replay_cache.h"
#include "detail/host.h"

namespace fastaxial::cuda {
namespace {

// Training calls of models with up to a few hundred fastaxial layers per step (two keys a layer).
constexpr size_t kMaxGraphs = 512;  // graphs kept (and keys that could not be captured)
constexpr size_t kMaxSeen = 1024;   // keys seen once, waiting for a second call
constexpr int kMaxDevices = 64;

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  explicit GraphExec(cudaGraphExec_t e) : exec(e) {}
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() { cudaGraphExecDestroy(exec); }  // one still running is freed when it completes
};

struct Cache {
  std::mutex mutex;
  ReplayCache<std::shared_ptr<GraphExec>> graphs{kMaxGraphs, kMaxSeen};
  cudaStream_t capture_stream[kMaxDevices] = {};  // per device, created on the first capture
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: graphs may be launched from threads that outlive statics
  return *c;
}

std::atomic<bool>& enabled() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("FASTAXIAL_CUDA_GRAPHS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }()};
  return on;
}

// The graph of enqueue's launches, captured on the device's own stream; null where the call
// cannot be captured. Called under the cache's mutex, so one capture runs at a time.
std::shared_ptr<GraphExec> capture(Cache& c, int device, const Enqueue& enqueue) {
  cudaStream_t& side = c.capture_stream[device];
  if (side == nullptr && cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess) {
    side = nullptr;
    (void)cudaGetLastError();
    return nullptr;
  }
  // Thread-local mode: other threads' CUDA calls (PyTorch's allocator, say) go on unhindered.
  if (cudaStreamBeginCapture(side, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  const Status s = enqueue(side, /*capturing=*/true);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(side, &graph);
  std::shared_ptr<GraphExec> result;
  if (s.ok() && ended == cudaSuccess && graph != nullptr) {
    cudaGraphExec_t exec = nullptr;
    if (cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) result = std::make_shared<GraphExec>(exec);
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  // A capture that failed leaves its error as the thread's last error; the call runs directly.
  (void)cudaGetLastError();
  return result;
}

}  // namespace

void CallKey::add(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  words_.push_back(bits);
}

Status run_graphed(const CallKey& call_key, cudaStream_t stream, int device, const Enqueue& enqueue) {
  if (!enabled().load(std::memory_order_relaxed) || device < 0 || device >= kMaxDevices) return enqueue(stream, false);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaError_t e = cudaStreamIsCapturing(stream, &capturing); e != cudaSuccess)
    return cuda_error(e, "cudaStreamIsCapturing");
  if (capturing != cudaStreamCaptureStatusNone) return enqueue(stream, false);  // into the caller's graph
  // An error already pending is the caller's to see: a capture would clear it.
  if (cudaPeekAtLastError() != cudaSuccess) return enqueue(stream, false);

  std::vector<uint64_t> key = call_key.words();
  key.push_back(static_cast<uint64_t>(device));
  using Cached = ReplayCache<std::shared_ptr<GraphExec>>;
  Cache& c = cache();
  {
    const std::lock_guard<std::mutex> lock(c.mutex);
    std::shared_ptr<GraphExec> graph;
    if (c.graphs.find(key, &graph) == Cached::Lookup::kSecond) {  // the second call: capture it
      graph = capture(c, device, enqueue);
      c.graphs.put(key, graph);  // null: this key runs directly from now on
    }
    if (graph != nullptr) {
      if (cudaError_t e = cudaGraphLaunch(graph->exec, stream); e != cudaSuccess)
        return cuda_error(e, "cudaGraphLaunch");
      return Status::Ok();
    }
  }
  return enqueue(stream, false);  // outside the lock: other threads' calls go on meanwhile
}

void set_graph_replay(bool on) { enabled().store(on, std::memory_order_relaxed); }

int graphs_cached() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  int n = 0;
  c.graphs.for_each_value([&](const std::shared_ptr<GraphExec>& g) { n += g != nullptr; });
  return n;
}

}  // namespace fastaxial::cuda
