// The CPU kernels' parallel regions: every one on the process's whole OpenMP team.
//
// A pass asks for fewer threads than it may where its work is small (team_for in cpu_common.h).
// Asked of OpenMP as a smaller team (num_threads(2) after PyTorch's 16, say), that costs threads:
// libgomp ends the threads a region leaves out of the team before it, and starts new ones for the
// next larger region. A training step whose regions went 16, 2, 16 started 14 to 28 threads a call
// (perf notes v105). So each region here has the whole team (max_threads(): PyTorch's setting),
// and one that wants fewer workers leaves the rest idle: they pass its barriers, which costs far
// less than starting a thread.
//
// Which thread runs a task never changes a result: the kernels' sums are fixed by the shape alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef FASTAXIAL_CPU_COPY
#define FASTAXIAL_CPU_COPY single
#endif
namespace fastaxial::cpu {
inline namespace FASTAXIAL_CPU_COPY {}  // (cpu_common.h)
}  // namespace fastaxial::cpu

namespace fastaxial::cpu::FASTAXIAL_CPU_COPY {

// The threads an OpenMP parallel region gets by default; 1 in a build without OpenMP.
inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Runs f(worker, workers) on every thread of one parallel region of the whole team, where
// workers = min(team, the threads the region got) and worker is the thread's index: the threads
// from `workers` up have no work (a region nested in another gets one thread while nesting is off,
// OpenMP's default, and that thread does all); a team of one runs f(0, 1) on the calling thread,
// in no region. Every thread must reach each barrier() f passes, idle ones too.
template <class F>
void on_team(int team, const F& f) {
  if (team <= 1) return f(0, 1);  // on the calling thread: no region
#ifdef _OPENMP
#pragma omp parallel num_threads(max_threads())
  f(omp_get_thread_num(), std::max(1, std::min(team, omp_get_num_threads())));
#else
  (void)team;
  f(0, 1);
#endif
}

// A barrier of the region on_team opened: every thread of it must reach it. Only where workers > 1:
// with one worker f may run in no region of its own, and the barrier would bind to the caller's.
inline void barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

// Tasks 0..n-1, each handed to the first worker that asks (schedule(dynamic) over the workers).
class TaskQueue {
 public:
  explicit TaskQueue(int64_t n) : n_(n) {}
  TaskQueue(const TaskQueue&) = delete;
  // The next task into *task; false once none is left.
  bool next(int64_t* task) {
    *task = next_.fetch_add(1, std::memory_order_relaxed);
    return *task < n_;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t n_;
};

// f(i, state) for tasks i = 0..n-1 on up to `team` workers, each task to the first worker that asks
// (schedule(dynamic)), each worker with a State of its own (its scratch).
template <class State, class F>
void dynamic_tasks(int64_t n, int team, const F& f) {
  TaskQueue queue(n);
  on_team(team, [&](int worker, int workers) {
    if (worker >= workers) return;
    State state;
    for (int64_t i; queue.next(&i);) f(i, state);
  });
}

// The most floats a kept State may hold after a call (32 MB): larger ones are freed, as before the
// states were kept (a thread keeps at most one backward Scratch, its HeadScratch at half this; the
// caller few_sequences_pass's rows and the backward's dx1 and partials: about 112 MB at most).
constexpr int64_t kKeptStateFloats = int64_t{8} << 20;

// The calling thread's State of this type, kept from one call to the next: one a type and thread,
// whichever call site asks.
template <class State>
State& thread_state() {
  thread_local State state;
  return state;
}

// dynamic_tasks with each worker's State kept by its thread from one call to the next
// (thread_state): scratch of megabytes a thread (a long sequence's (queries, L) score tiles) that
// glibc returns to the system when it is freed, so that every call faulted it in and zeroed it
// again page by page (perf notes v106). After the tasks, a State that keep(state) refuses (too
// large to hold on to) is emptied. No two calls may use one State type on a thread at once.
template <class State, class F, class Keep>
void dynamic_tasks_kept(int64_t n, int team, const F& f, const Keep& keep) {
  TaskQueue queue(n);
  on_team(team, [&](int worker, int workers) {
    if (worker >= workers) return;
    State& state = thread_state<State>();
    for (int64_t i; queue.next(&i);) f(i, state);
    if (!keep(state)) state = State();
  });
}

// Worker `worker` of `workers`' share of tasks 0..n-1, contiguous (schedule(static)): [begin, end).
struct StaticShare {
  int64_t begin, end;
  StaticShare(int64_t n, int worker, int workers)
      : begin(worker < workers ? n * worker / workers : n), end(worker < workers ? n * (worker + 1) / workers : n) {}
};

}  // namespace fastaxial::cpu::FASTAXIAL_CPU_COPY
