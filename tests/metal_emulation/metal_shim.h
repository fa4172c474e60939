// The subset of Metal Shading Language our kernels use, for compiling them as C++ on a CPU.
//
// A threadgroup's threads run concurrently and meet at the same synchronisation points a GPU
// has: simd_sum waits for the 32 lanes of its simdgroup, threadgroup_barrier for the whole
// threadgroup. Three schedules:
//   PARALLEL   every emulated GPU thread is an OS thread and they run freely (the OS
//               interleaves them);
//   LOWEST_FIRST / HIGHEST_FIRST
//               the threads are fibers of one OS thread: one runs at a time, switching only at
//               those synchronisation points, to the runnable thread of lowest (highest) index. A thread thus runs as far ahead
//               of the others as the kernel allows; between the two orders, a missing barrier
//               lets some reader see memory before (or after) its writer, every time, rather
//               than now and then.
// `threadgroup` variables become function statics: shared by the threads of the one
// threadgroup that runs at a time.
//
// With EMU_CHECK_ADDRESS_SPACES (parsed by Clang's front end through libclang, never run),
// `device`, `constant` and `threadgroup` are Clang address spaces instead, so that a body that
// mixes them (a `constant` input assigned to a `device` pointer, as Metal refuses) does not
// compile here either; g++, which builds the runnable library, has no address spaces.
#pragma once

typedef unsigned int uint;

struct uint3 {
  uint x, y, z;
};

namespace emu {
// The values of Metal's thread attributes for one thread (MLX passes those a body names).
struct Thread {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threads_per_threadgroup, threads_per_grid, grid_size, grid_origin, threadgroups_per_grid,
      dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width, thread_index_in_quadgroup,
      quadgroup_index_in_threadgroup, quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup,
      dispatch_quadgroups_per_threadgroup;
};
}  // namespace emu

#ifdef EMU_CHECK_ADDRESS_SPACES
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef _Float16 half;
typedef _Float16 float16_t;
typedef __bf16 bfloat;
typedef __bf16 bfloat16_t;
namespace metal {
inline float exp(float x) { return __builtin_expf(x); }
inline float log(float x) { return __builtin_logf(x); }
inline float sqrt(float x) { return __builtin_sqrtf(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
inline float fmax(float x, float y) { return __builtin_fmaxf(x, y); }
inline float fmin(float x, float y) { return __builtin_fminf(x, y); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float exp2(float x) { return __builtin_exp2f(x); }
}  // namespace metal
using namespace metal;
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
float simd_sum(float value);
void threadgroup_barrier(mem_flags flags);
namespace emu {
template <typename Body>
void dispatch(uint3, uint3, int, Body body) {
  body(Thread{});
}
}  // namespace emu
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#define thread
#else

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <setjmp.h>
#include <ucontext.h>

typedef _Float16 half;
typedef _Float16 float16_t;

// bfloat16 with round-to-nearest-even on conversion from float, as MLX does.
struct bfloat {
  uint16_t bits;
  bfloat() : bits(0) {}
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) {
      bits = 0x7fc0;
    } else {
      bits = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef bfloat bfloat16_t;

namespace metal {
using std::exp;
using std::log;
using std::sqrt;
using std::fabs;
using std::fmax;
using std::fmin;
using std::fma;  // fused, as Metal's: one rounding
using std::exp2;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace metal
using namespace metal;

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

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
inline thread_local ThreadContext current;

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

inline void barrier() {
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

inline float simd_reduce_sum(float value) {
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
inline void dispatch(uint3 grid, uint3 tg, int schedule, const std::function<void(const Thread&)>& body) {
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

}  // namespace emu

inline void threadgroup_barrier(mem_flags) { emu::barrier(); }
inline float simd_sum(float value) { return emu::simd_reduce_sum(value); }

// Address-space qualifiers last: `thread` would otherwise break std::thread above.
#define device
#define constant
#define thread
#define threadgroup static
#endif  // EMU_CHECK_ADDRESS_SPACES
