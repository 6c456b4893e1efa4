// The CPU kernels' parallel regions (src/cpu/team.h): every task runs once whatever the team, the
// workers are the asked number, a team of one runs on the calling thread, and regions that want
// teams of different sizes keep the same threads (no thread ended and started again: perf notes v105).
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <vector>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "src/cpu/team.h"

namespace fastaxial::cpu {
namespace {

TEST(Team, QueueHandsEachTaskToOneWorker) {
  for (int64_t n : {0, 1, 7, 64, 1000}) {
    for (int team : {1, 2, 3, 16}) {
      std::vector<std::atomic<int>> runs(n);
      TaskQueue queue(n);
      on_team(team, [&](int worker, int workers) {
        if (worker >= workers) return;
        for (int64_t i; queue.next(&i);) runs[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(runs[i].load(), 1) << "task " << i << " of " << n << ", team " << team;
    }
  }
}

TEST(Team, DynamicTasksRunEachTaskOnceWithTheWorkersState) {
  struct State {
    int tasks = 0;  // this worker's count so far
  };
  for (int64_t n : {0, 1, 7, 1000}) {
    for (int team : {1, 2, 16}) {
      std::vector<std::atomic<int>> runs(n);
      std::atomic<int64_t> counted{0};
      dynamic_tasks<State>(n, team, [&](int64_t i, State& s) {
        runs[i].fetch_add(1);
        counted.fetch_add(++s.tasks == 1 ? 1 : 0);  // each worker's first task, once per worker
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(runs[i].load(), 1) << "task " << i << " of " << n << ", team " << team;
      EXPECT_LE(counted.load(), std::max<int64_t>(1, team)) << "more workers with a state of their own than asked";
    }
  }
}

// dynamic_tasks_kept: each thread finds its State as its last call left it (the buffer, not a copy),
// whichever call site asks; a State that keep() refuses is emptied after the call.
TEST(Team, KeptStateOutlivesTheCallUnlessRefused) {
  struct Kept {
    std::vector<float> buffer;
  };
  std::mutex mutex;
  std::set<const float*> first, second;  // each worker's buffer after each call
  const auto fill = [&](std::set<const float*>* seen) {
    return [&, seen](int64_t, Kept& k) {
      k.buffer.resize(1 << 16);  // the same size each call: no reallocation where it was kept
      const std::lock_guard<std::mutex> lock(mutex);
      seen->insert(k.buffer.data());
    };
  };
  const auto keep = [](const Kept&) { return true; };
  // One task a worker at most: a team of one, on the calling thread (other teams could hand the one
  // task to another thread each call).
  dynamic_tasks_kept<Kept>(1, 1, fill(&first), keep);
  dynamic_tasks_kept<Kept>(1, 1, fill(&second), keep);
  EXPECT_EQ(first, second);
  EXPECT_EQ(thread_state<Kept>().buffer.size(), size_t{1} << 16);
  dynamic_tasks_kept<Kept>(1, 1, fill(&second), [](const Kept&) { return false; });
  EXPECT_TRUE(thread_state<Kept>().buffer.empty());
  EXPECT_EQ(thread_state<Kept>().buffer.capacity(), size_t{0});
}

TEST(Team, StaticSharesCoverEveryTaskOnce) {
  for (int64_t n : {0, 1, 5, 16, 17, 1000}) {
    for (int workers : {1, 2, 3, 16}) {
      std::vector<int> runs(n, 0);
      int64_t next = 0;
      for (int w = 0; w < workers; ++w) {
        const StaticShare s(n, w, workers);
        EXPECT_EQ(s.begin, next) << "worker " << w << " of " << workers << ", n " << n;  // contiguous, in order
        for (int64_t i = s.begin; i < s.end; ++i) ++runs[i];
        next = s.end;
      }
      EXPECT_EQ(next, n);
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(runs[i], 1);
      const StaticShare idle(n, workers, workers);  // a thread past the workers has none
      EXPECT_EQ(idle.begin, idle.end);
    }
  }
}

TEST(Team, TeamOfOneRunsOnTheCallingThread) {
  int calls = 0;
  on_team(1, [&](int worker, int workers) {
    ++calls;
    EXPECT_EQ(worker, 0);
    EXPECT_EQ(workers, 1);
#ifdef _OPENMP
    EXPECT_FALSE(omp_in_parallel());
#endif
  });
  EXPECT_EQ(calls, 1);
}

#if defined(_OPENMP) && defined(__linux__)
// Linux ids of the threads of one region of on_team(team), and the indices that had work.
struct Region {
  std::set<long> threads;
  std::set<int> workers;
};
Region run_region(int team) {
  Region r;
  std::mutex m;
  on_team(team, [&](int worker, int workers) {
    {
      std::lock_guard<std::mutex> lock(m);
      r.threads.insert(syscall(SYS_gettid));
      if (worker < workers) r.workers.insert(worker);
    }
    barrier();  // every thread of the region reaches it, idle ones too
  });
  return r;
}

TEST(Team, RegionsOfAnyTeamKeepTheirThreads) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(4);
  const std::set<long> first = run_region(4).threads;
  EXPECT_EQ(first.size(), 4u) << "a region has the whole team";
  for (int round = 0; round < 5; ++round) {
    for (int team : {2, 4, 3, 16}) {
      const Region r = run_region(team);
      EXPECT_EQ(r.threads, first) << "team " << team << ": a thread ended and another started";
      std::set<int> want;
      for (int w = 0; w < std::min(team, 4); ++w) want.insert(w);
      EXPECT_EQ(r.workers, want) << "team " << team;
    }
  }
  omp_set_num_threads(saved);
}
#endif

}  // namespace
}  // namespace fastaxial::cpu
