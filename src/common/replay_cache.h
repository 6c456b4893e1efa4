// The bookkeeping of CUDA graph replays (src/cuda/graph_replay.cu), kept apart from CUDA so
// that the CPU tests check it: the keys seen once, and the keys that have a value (there an
// instantiated graph, or none where the call could not be captured). Each set drops its least
// recently used key when full. Lookups are by hash, each key checked whole; a different key
// with the same hash takes the older one's place.
//
// Sizes: a training step of a model with n fastaxial layers cycles through 2n keys (a forward
// and a backward per layer), and an LRU set smaller than the cycle would evict every key before
// it comes back, so the sets hold hundreds of keys (graph_replay.cu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fastaxial {

template <typename Value>
class ReplayCache {
 public:
  enum class Lookup {
    kHit,     // the key has a value: *value
    kSecond,  // the key was seen once before: the caller makes its value and put()s it
    kFirst,   // a key not seen before (or forgotten): now remembered as seen once
  };

  ReplayCache(size_t max_values, size_t max_seen) : max_values_(max_values), max_seen_(max_seen) {}

  Lookup find(const std::vector<uint64_t>& key, Value* value) {
    const uint64_t h = hash(key);
    if (auto it = values_index_.find(h); it != values_index_.end() && it->second->key == key) {
      values_.splice(values_.begin(), values_, it->second);  // most recently used first
      *value = it->second->value;
      return Lookup::kHit;
    }
    if (auto it = seen_index_.find(h); it != seen_index_.end() && it->second->key == key) {
      seen_.erase(it->second);
      seen_index_.erase(it);
      return Lookup::kSecond;
    }
    insert(&seen_, &seen_index_, max_seen_, Entry{key, h, Value{}});
    return Lookup::kFirst;
  }

  void put(const std::vector<uint64_t>& key, Value value) {
    insert(&values_, &values_index_, max_values_, Entry{key, hash(key), std::move(value)});
  }

  size_t values() const { return values_.size(); }
  size_t seen() const { return seen_.size(); }

  template <typename F>
  void for_each_value(F f) const {
    for (const Entry& e : values_) f(e.value);
  }

  static uint64_t hash(const std::vector<uint64_t>& words) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (uint64_t w : words) h = (h ^ w) * 1099511628211ull;
    return h;
  }

 private:
  struct Entry {
    std::vector<uint64_t> key;
    uint64_t hash;
    Value value;
  };
  using List = std::list<Entry>;
  using Index = std::unordered_map<uint64_t, typename List::iterator>;

  static void insert(List* list, Index* index, size_t max, Entry entry) {
    if (max == 0) return;
    if (auto it = index->find(entry.hash); it != index->end()) {  // the same hash: this key takes its place
      list->erase(it->second);
      index->erase(it);
    }
    list->push_front(std::move(entry));
    (*index)[list->front().hash] = list->begin();
    if (list->size() > max) {
      index->erase(list->back().hash);
      list->pop_back();
    }
  }

  size_t max_values_, max_seen_;
  List values_, seen_;
  Index values_index_, seen_index_;
};

}  // namespace fastaxial
