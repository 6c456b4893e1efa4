// run_graphed (graph_replay.h): a small cache of keys seen once and of instantiated graphs, each
// list most recently used first, under one mutex. Keys are a few dozen words, so a linear scan
// with a hash compared first costs well under a microsecond, against the several microseconds
// of each launch a replay saves.
#include "graph_replay.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>

#include "detail/host.h"

namespace fastaxial::cuda {
namespace {

constexpr size_t kMaxGraphs = 16;  // graphs kept (and keys that could not be captured)
constexpr size_t kMaxSeen = 64;    // keys seen once, waiting for a second call
constexpr int kMaxDevices = 64;

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  explicit GraphExec(cudaGraphExec_t e) : exec(e) {}
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() { cudaGraphExecDestroy(exec); }
};

struct Entry {
  std::vector<uint64_t> key;  // the call's words, then the device
  uint64_t hash = 0;
  std::shared_ptr<GraphExec> graph;  // null in `seen`, and for a key that could not be captured
};

struct Cache {
  std::mutex mutex;
  std::list<Entry> graphs, seen;
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

uint64_t hash_words(const std::vector<uint64_t>& words) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over words
  for (uint64_t w : words) h = (h ^ w) * 1099511628211ull;
  return h;
}

std::list<Entry>::iterator find(std::list<Entry>& list, const std::vector<uint64_t>& key, uint64_t hash) {
  for (auto it = list.begin(); it != list.end(); ++it)
    if (it->hash == hash && it->key == key) return it;
  return list.end();
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

  std::vector<uint64_t> key = call_key.words();
  key.push_back(static_cast<uint64_t>(device));
  const uint64_t hash = hash_words(key);
  Cache& c = cache();
  std::shared_ptr<GraphExec> graph;
  {
    std::unique_lock<std::mutex> lock(c.mutex);
    if (auto it = find(c.graphs, key, hash); it != c.graphs.end()) {
      c.graphs.splice(c.graphs.begin(), c.graphs, it);
      graph = it->graph;
    } else if (auto seen = find(c.seen, key, hash); seen != c.seen.end()) {
      c.seen.erase(seen);  // the second call: capture it
      graph = capture(c, device, enqueue);
      c.graphs.push_front(Entry{std::move(key), hash, graph});
      if (c.graphs.size() > kMaxGraphs) c.graphs.pop_back();  // a launch in flight keeps its graph alive
    } else {
      c.seen.push_front(Entry{std::move(key), hash, nullptr});
      if (c.seen.size() > kMaxSeen) c.seen.pop_back();
    }
  }
  if (graph == nullptr) return enqueue(stream, false);
  if (cudaError_t e = cudaGraphLaunch(graph->exec, stream); e != cudaSuccess) return cuda_error(e, "cudaGraphLaunch");
  return Status::Ok();
}

void set_graph_replay(bool on) { enabled().store(on, std::memory_order_relaxed); }

int graphs_cached() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  int n = 0;
  for (const Entry& e : c.graphs) n += e.graph != nullptr;
  return n;
}

}  // namespace fastaxial::cuda
