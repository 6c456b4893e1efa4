// The bookkeeping of CUDA graph replays (src/common/replay_cache.h), on the CPU: a key's first
// call is remembered, its second asks for a value, later ones hit; both sets drop their least
// recently used keys when full; a training step's cycle of keys (a forward and a backward per
// layer) replays from its third step on, for models of hundreds of layers.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "src/common/replay_cache.h"

namespace fastaxial::test {
namespace {

using Cache = ReplayCache<int>;
using Lookup = Cache::Lookup;

std::vector<uint64_t> key(uint64_t i) { return {7, i, 0x1234567890abcdefull ^ i}; }

TEST(ReplayCache, FirstSecondThenHits) {
  Cache c(4, 4);
  int v = -1;
  EXPECT_EQ(c.find(key(1), &v), Lookup::kFirst);
  EXPECT_EQ(c.seen(), 1u);
  EXPECT_EQ(c.find(key(1), &v), Lookup::kSecond);
  EXPECT_EQ(c.seen(), 0u);
  c.put(key(1), 42);
  EXPECT_EQ(c.find(key(1), &v), Lookup::kHit);
  EXPECT_EQ(v, 42);
  EXPECT_EQ(c.find(key(2), &v), Lookup::kFirst) << "another key is not the first's";
  EXPECT_EQ(c.values(), 1u);
}

TEST(ReplayCache, KeysDifferingInOneWordAreDifferentKeys) {
  Cache c(4, 4);
  int v = 0;
  std::vector<uint64_t> a = {1, 2, 3}, b = {1, 2, 4}, longer = {1, 2, 3, 0};
  EXPECT_EQ(c.find(a, &v), Lookup::kFirst);
  EXPECT_EQ(c.find(b, &v), Lookup::kFirst);
  EXPECT_EQ(c.find(longer, &v), Lookup::kFirst);
  EXPECT_EQ(c.find(a, &v), Lookup::kSecond);
}

TEST(ReplayCache, ValuesDropTheLeastRecentlyUsed) {
  Cache c(3, 8);
  for (uint64_t i = 1; i <= 3; ++i) c.put(key(i), (int)i);
  int v = 0;
  EXPECT_EQ(c.find(key(1), &v), Lookup::kHit);  // 1 is now the most recently used
  c.put(key(4), 4);                               // drops 2
  EXPECT_EQ(c.values(), 3u);
  EXPECT_EQ(c.find(key(2), &v), Lookup::kFirst);
  for (uint64_t i : {1, 3, 4}) {
    EXPECT_EQ(c.find(key(i), &v), Lookup::kHit) << i;
    EXPECT_EQ(v, (int)i);
  }
  c.put(key(3), 30);  // a key put again takes the new value, once
  EXPECT_EQ(c.values(), 3u);
  EXPECT_EQ(c.find(key(3), &v), Lookup::kHit);
  EXPECT_EQ(v, 30);
}

TEST(ReplayCache, SeenKeysDropTheLeastRecentlyUsed) {
  Cache c(8, 2);
  int v = 0;
  EXPECT_EQ(c.find(key(1), &v), Lookup::kFirst);
  EXPECT_EQ(c.find(key(2), &v), Lookup::kFirst);
  EXPECT_EQ(c.find(key(3), &v), Lookup::kFirst);  // forgets 1
  EXPECT_EQ(c.seen(), 2u);
  EXPECT_EQ(c.find(key(1), &v), Lookup::kFirst);
  EXPECT_EQ(c.find(key(3), &v), Lookup::kSecond);
}

TEST(ReplayCache, ZeroSizesHoldNothing) {
  Cache c(0, 0);
  int v = 0;
  EXPECT_EQ(c.find(key(1), &v), Lookup::kFirst);
  EXPECT_EQ(c.find(key(1), &v), Lookup::kFirst);
  c.put(key(1), 1);
  EXPECT_EQ(c.values(), 0u);
}

// The sizes graph_replay.cu gives the cache (512 graphs, 1024 seen): a model of 200 layers
// cycles through 400 keys a step; the first step sees them, the second captures them, every later
// step hits on each.
TEST(ReplayCache, LongTrainingCyclesReplay) {
  Cache c(512, 1024);
  const uint64_t keys = 400;
  int v = 0;
  for (uint64_t k = 0; k < keys; ++k) ASSERT_EQ(c.find(key(k), &v), Lookup::kFirst);
  for (uint64_t k = 0; k < keys; ++k) {
    ASSERT_EQ(c.find(key(k), &v), Lookup::kSecond);
    c.put(key(k), (int)k);
  }
  for (int step = 0; step < 3; ++step)
    for (uint64_t k = 0; k < keys; ++k) {
      ASSERT_EQ(c.find(key(k), &v), Lookup::kHit) << "step " << step << ", key " << k;
      ASSERT_EQ(v, (int)k);
    }
}

}  // namespace
}  // namespace fastaxial::test
