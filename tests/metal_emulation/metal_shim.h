// The subset of Metal Shading Language our kernels use, for compiling them as C++ on a CPU.
//
// Each emulated GPU thread is a real std::thread. A threadgroup's threads run concurrently and
// meet at the same synchronisation points a GPU has: simd_sum waits for the 32 lanes of its
// simdgroup, threadgroup_barrier for the whole threadgroup. Two schedules:
//   PARALLEL   all threads run freely (the OS interleaves them);
//   LOWEST_FIRST / HIGHEST_FIRST
//               one thread runs at a time, switching only at those synchronisation points, to
//               the runnable thread of lowest (highest) index. A thread thus runs as far ahead
//               of the others as the kernel allows; between the two orders, a missing barrier
//               lets some reader see memory before (or after) its writer, every time, rather
//               than now and then.
// `threadgroup` variables become function statics: shared by the threads of the one
// threadgroup that runs at a time.
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

typedef unsigned int uint;

struct uint3 {
  uint x, y, z;
};

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
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace metal
using namespace metal;

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

namespace emu {

enum Schedule { PARALLEL = 0, LOWEST_FIRST = 1, HIGHEST_FIRST = 2 };

// One threadgroup's worth of shared synchronisation state. Every thread sleeps on its own
// condition variable, so a hand-over wakes exactly the threads that may proceed.
struct Group {
  std::mutex m;
  std::vector<std::condition_variable> wake;
  Schedule schedule;
  int n_threads;
  int turn;                      // serial schedules: the thread allowed to run
  std::vector<char> blocked;     // waiting at an unfinished synchronisation point
  std::vector<char> finished;
  // threadgroup_barrier
  int barrier_arrived = 0;
  long barrier_generation = 0;
  // simd_sum, one slot per simdgroup
  std::vector<std::vector<float>> simd_values;
  std::vector<int> simd_arrived;
  std::vector<long> simd_generation;
  std::vector<float> simd_result;

  Group(int n, Schedule s)
      : wake(n), schedule(s), n_threads(n), turn(s == HIGHEST_FIRST ? n - 1 : 0), blocked(n, 0), finished(n, 0),
        simd_values((n + 31) / 32, std::vector<float>(32)), simd_arrived((n + 31) / 32, 0),
        simd_generation((n + 31) / 32, 0), simd_result((n + 31) / 32, 0.0f) {}

  // After threads [first, last) were released, wake whoever may run now.
  void hand_over(int first, int last) {
    if (schedule != PARALLEL) {
      turn = -1;
      for (int j = 0; j < n_threads; ++j) {
        const int i = schedule == LOWEST_FIRST ? j : n_threads - 1 - j;
        if (!blocked[i] && !finished[i]) {
          turn = i;
          break;
        }
      }
      if (turn >= 0) wake[turn].notify_one();
    } else {
      for (int i = first; i < last; ++i) wake[i].notify_one();
    }
  }
  template <typename Ready>
  void sleep(std::unique_lock<std::mutex>& lock, int me, Ready ready) {
    wake[me].wait(lock, [&] { return ready() && (schedule == PARALLEL || turn == me); });
  }
};

struct ThreadContext {
  Group* group;
  int index;  // linear index in the threadgroup
};
inline thread_local ThreadContext current;

inline void barrier() {
  Group& g = *current.group;
  const int me = current.index;
  std::unique_lock<std::mutex> lock(g.m);
  const long generation = g.barrier_generation;
  g.blocked[me] = 1;
  if (++g.barrier_arrived == g.n_threads) {
    g.barrier_arrived = 0;
    ++g.barrier_generation;
    std::fill(g.blocked.begin(), g.blocked.end(), 0);
    g.hand_over(0, g.n_threads);
  } else if (g.schedule != PARALLEL) {
    g.hand_over(0, 0);
  }
  g.sleep(lock, me, [&] { return g.barrier_generation != generation; });
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
    g.hand_over(first, first + lanes);
  } else if (g.schedule != PARALLEL) {
    g.hand_over(0, 0);
  }
  g.sleep(lock, me, [&] { return g.simd_generation[sg] != generation; });
  return g.simd_result[sg];
}

// Runs `body(thread_position_in_grid, thread_position_in_threadgroup, threads_per_threadgroup)`
// for every thread of `grid`, one threadgroup at a time, its threads concurrent.
inline void dispatch(uint3 grid, uint3 tg, Schedule schedule,
                     const std::function<void(uint3, uint3, uint3)>& body) {
  for (uint gz = 0; gz < grid.z; gz += tg.z)
    for (uint gy = 0; gy < grid.y; gy += tg.y)
      for (uint gx = 0; gx < grid.x; gx += tg.x) {
        const uint3 size{std::min(tg.x, grid.x - gx), std::min(tg.y, grid.y - gy), std::min(tg.z, grid.z - gz)};
        const int n = static_cast<int>(size.x * size.y * size.z);
        Group group(n, schedule);
        std::vector<std::thread> threads;
        threads.reserve(n);
        for (int i = 0; i < n; ++i) {
          const uint3 local{i % size.x, (i / size.x) % size.y, i / (size.x * size.y)};
          const uint3 global{gx + local.x, gy + local.y, gz + local.z};
          threads.emplace_back([&group, &body, i, local, global, size] {
            current = ThreadContext{&group, i};
            {
              std::unique_lock<std::mutex> lock(group.m);
              group.sleep(lock, i, [] { return true; });
            }
            body(global, local, size);
            std::unique_lock<std::mutex> lock(group.m);
            group.finished[i] = 1;
            if (group.schedule != PARALLEL) group.hand_over(0, 0);
          });
        }
        for (auto& t : threads) t.join();
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
