// The emulator's scheduler: runs a kernel's body for every thread of a grid, one threadgroup at a
// time, and implements the synchronisation points the body calls (threadgroup_barrier, simd_sum).
// Built once per shim version into the library every kernel's library links to.
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <setjmp.h>
#include <ucontext.h>

#include "metal_shim.h"
// The shim's Metal spellings are for kernels; `thread` would break std::thread here.
#undef device
#undef constant
#undef thread
#undef threadgroup

namespace emu {

enum Schedule { PARALLEL = 0, LOWEST_FIRST = 1, HIGHEST_FIRST = 2 };

// One threadgroup's synchronisation state: the barrier and one simd_sum slot per simdgroup.
// PARALLEL: the group's threads are OS threads and wait on condition variables. Serial
// schedules: they are fibers (ucontext) of one OS thread, and a thread that reaches a
// synchronisation point hands over to the runnable thread of lowest (highest) index, which
// is the same order the GPU may pick, made deterministic and fast.
struct Group {
  Schedule schedule;
  int n_threads;
  std::mutex m;
  std::condition_variable cv;
  std::vector<char> blocked, finished;
  int barrier_arrived = 0;
  long barrier_generation = 0;
  std::vector<std::vector<float>> simd_values;
  std::vector<int> simd_arrived;
  std::vector<long> simd_generation;
  std::vector<float> simd_result;
  // Serial schedules. A fiber is entered the first time through its ucontext, and after that
  // every switch is _setjmp/_longjmp: swapcontext also saves and restores the signal mask, a
  // system call per switch, which made the switches most of the emulator's time (578 against
  // 19 ns a round trip, measured here).
  ucontext_t scheduler;
  std::vector<ucontext_t> fibers;
  jmp_buf scheduler_jump;
  struct Jump { jmp_buf at; };
  std::vector<Jump> fiber_jumps;
  std::vector<char> started;
  int running = -1;

  Group(int n, Schedule s)
      : schedule(s), n_threads(n), blocked(n, 0), finished(n, 0), simd_values((n + 31) / 32, std::vector<float>(32)),
        simd_arrived((n + 31) / 32, 0), simd_generation((n + 31) / 32, 0), simd_result((n + 31) / 32, 0.0f),
        fibers(s == PARALLEL ? 0 : n), fiber_jumps(s == PARALLEL ? 0 : n), started(n, 0) {}

  // Serial schedules: give the processor back to the scheduler, which picks who runs next.
  void yield() {
    if (_setjmp(fiber_jumps[running].at) == 0) _longjmp(scheduler_jump, 1);
  }
};

struct ThreadContext {
  Group* group;
  int index;  // linear index in the threadgroup
};
thread_local ThreadContext current;

// Waits at a synchronisation point until `done` (the last thread to arrive releases the others).
template <typename Done>
inline void wait_for(Group& g, std::unique_lock<std::mutex>& lock, Done done) {
  if (g.schedule == PARALLEL) {
    g.cv.wait(lock, done);
  } else {
    do {  // hand over even when this thread released the others: the schedule picks who runs
      lock.unlock();
      g.yield();
      lock.lock();
    } while (!done());
  }
}

void barrier() {
  Group& g = *current.group;
  std::unique_lock<std::mutex> lock(g.m);
  const long generation = g.barrier_generation;
  g.blocked[current.index] = 1;
  if (++g.barrier_arrived == g.n_threads) {
    g.barrier_arrived = 0;
    ++g.barrier_generation;
    std::fill(g.blocked.begin(), g.blocked.end(), 0);
    g.cv.notify_all();
  }
  wait_for(g, lock, [&] { return g.barrier_generation != generation; });
}

float simd_reduce_sum(float value) {
  Group& g = *current.group;
  const int me = current.index;
  const int sg = me / 32;
  const int first = sg * 32;
  const int lanes = std::min(32, g.n_threads - first);
  std::unique_lock<std::mutex> lock(g.m);
  const long generation = g.simd_generation[sg];
  g.simd_values[sg][me - first] = value;
  g.blocked[me] = 1;
  if (++g.simd_arrived[sg] == lanes) {
    float total = 0.0f;
    for (int i = 0; i < lanes; ++i) total += g.simd_values[sg][i];
    g.simd_result[sg] = total;
    g.simd_arrived[sg] = 0;
    ++g.simd_generation[sg];
    for (int i = first; i < first + lanes; ++i) g.blocked[i] = 0;
    g.cv.notify_all();
  }
  wait_for(g, lock, [&] { return g.simd_generation[sg] != generation; });
  return g.simd_result[sg];
}

unsigned lane() { return static_cast<unsigned>(current.index % 32); }

inline uint ceil_div(uint a, uint b) { return (a + b - 1) / b; }

constexpr size_t kFiberStack = 64 * 1024;

struct FiberStart {
  Group* group;
  int index;
  const Thread* thread;
  const std::function<void(const Thread&)>* body;
};

inline void fiber_main(unsigned lo, unsigned hi) {
  FiberStart* start = reinterpret_cast<FiberStart*>((static_cast<uintptr_t>(hi) << 32) | lo);
  (*start->body)(*start->thread);
  start->group->finished[start->index] = 1;
  _longjmp(start->group->scheduler_jump, 1);  // never returns: the scheduler picks the next fiber
}

// One threadgroup under a serial schedule: run the lowest (highest) runnable fiber until it
// reaches a synchronisation point or ends, then pick again.
inline void run_serial(Group& group, const std::vector<Thread>& threads, const std::function<void(const Thread&)>& body,
                       std::vector<std::unique_ptr<char[]>>& stacks) {
  const int n = group.n_threads;
  std::vector<FiberStart> starts(n);
  for (int i = 0; i < n; ++i) {
    starts[i] = FiberStart{&group, i, &threads[i], &body};
    getcontext(&group.fibers[i]);
    group.fibers[i].uc_stack.ss_sp = stacks[i].get();
    group.fibers[i].uc_stack.ss_size = kFiberStack;
    group.fibers[i].uc_link = nullptr;  // fiber_main never returns
    const uintptr_t address = reinterpret_cast<uintptr_t>(&starts[i]);
    makecontext(&group.fibers[i], reinterpret_cast<void (*)()>(fiber_main), 2, static_cast<unsigned>(address),
                static_cast<unsigned>(address >> 32));
  }
  for (;;) {
    int next = -1;
    for (int j = 0; j < n && next < 0; ++j) {
      const int i = group.schedule == LOWEST_FIRST ? j : n - 1 - j;
      if (!group.blocked[i] && !group.finished[i]) next = i;
    }
    if (next < 0) {
      for (int i = 0; i < n; ++i)
        if (!group.finished[i]) {
          std::fprintf(stderr, "emulated threadgroup deadlocked: a barrier or simd_sum not reached by every thread\n");
          std::abort();
        }
      return;
    }
    group.running = next;
    current = ThreadContext{&group, next};
    if (_setjmp(group.scheduler_jump) == 0) {  // a fiber's yield or end jumps back here
      if (group.started[next]) _longjmp(group.fiber_jumps[next].at, 1);
      group.started[next] = 1;
      swapcontext(&group.scheduler, &group.fibers[next]);
    }
  }
}

// Runs `body(thread)` for every thread of `grid` (in threads, as MLX's dispatch_threads), one
// threadgroup at a time; edge threadgroups are partial, as on Metal.
static void run_grid(uint3 grid, uint3 tg, int schedule, const std::function<void(const Thread&)>& body) {
  tg = {std::min(tg.x, grid.x), std::min(tg.y, grid.y), std::min(tg.z, grid.z)};
  const uint3 groups{ceil_div(grid.x, tg.x), ceil_div(grid.y, tg.y), ceil_div(grid.z, tg.z)};
  const uint tg_threads = tg.x * tg.y * tg.z;
  std::vector<std::unique_ptr<char[]>> stacks;  // uninitialised: no 8 MB memset per call
  if (schedule != PARALLEL)
    for (uint i = 0; i < tg_threads; ++i) stacks.emplace_back(new char[kFiberStack]);
  for (uint gz = 0; gz < grid.z; gz += tg.z)
    for (uint gy = 0; gy < grid.y; gy += tg.y)
      for (uint gx = 0; gx < grid.x; gx += tg.x) {
        const uint3 size{std::min(tg.x, grid.x - gx), std::min(tg.y, grid.y - gy), std::min(tg.z, grid.z - gz)};
        const int n = static_cast<int>(size.x * size.y * size.z);
        std::vector<Thread> threads(n);
        for (int i = 0; i < n; ++i) {
          Thread& t = threads[i];
          t.thread_position_in_threadgroup = {i % size.x, (i / size.x) % size.y, i / (size.x * size.y)};
          t.thread_position_in_grid = {gx + t.thread_position_in_threadgroup.x, gy + t.thread_position_in_threadgroup.y,
                                       gz + t.thread_position_in_threadgroup.z};
          t.threadgroup_position_in_grid = {gx / tg.x, gy / tg.y, gz / tg.z};
          t.threads_per_threadgroup = size;
          t.threads_per_grid = t.grid_size = grid;
          t.grid_origin = {0, 0, 0};
          t.threadgroups_per_grid = groups;
          t.dispatch_threads_per_threadgroup = tg;
          t.thread_index_in_threadgroup = i;
          t.thread_index_in_simdgroup = i % 32;
          t.simdgroup_index_in_threadgroup = i / 32;
          t.simdgroups_per_threadgroup = ceil_div(n, 32);
          t.threads_per_simdgroup = t.thread_execution_width = 32;
          t.thread_index_in_quadgroup = i % 4;
          t.quadgroup_index_in_threadgroup = i / 4;
          t.quadgroups_per_threadgroup = ceil_div(n, 4);
          t.dispatch_simdgroups_per_threadgroup = ceil_div(tg_threads, 32);
          t.dispatch_quadgroups_per_threadgroup = ceil_div(tg_threads, 4);
        }
        Group group(n, static_cast<Schedule>(schedule));
        if (schedule != PARALLEL) {
          run_serial(group, threads, body, stacks);
          continue;
        }
        std::vector<std::thread> workers;
        workers.reserve(n);
        for (int i = 0; i < n; ++i) {
          workers.emplace_back([&group, &body, &threads, i] {
            current = ThreadContext{&group, i};
            body(threads[i]);
          });
        }
        for (auto& w : workers) w.join();
      }
}

void dispatch(uint3 grid, uint3 threadgroup_size, int schedule, Body body, void* context) {
  run_grid(grid, threadgroup_size, schedule, [body, context](const Thread& t) { body(t, context); });
}

}  // namespace emu
