// The subset of Metal Shading Language our kernels use, for compiling them as C++ on a CPU.
//
// A threadgroup's threads run concurrently and meet at the same synchronisation points a GPU
// has: simd_sum waits for the 32 lanes of its simdgroup, threadgroup_barrier for the whole
// threadgroup. Three schedules (run by metal_runtime.cpp, which every kernel's library links to):
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
inline void dispatch(uint3, uint3, int, void (*body)(const Thread&, void*), void* context) {
  body(Thread{}, context);
}
}  // namespace emu
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#define thread
#else

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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
// The scheduler lives in metal_runtime.cpp, built once: each kernel's library only holds its body
// (the scheduler's templates in every kernel were half of each kernel's compile time).
using Body = void (*)(const Thread& thread, void* context);
void dispatch(uint3 grid, uint3 threadgroup_size, int schedule, Body body, void* context);
void barrier();
float simd_reduce_sum(float value);
}  // namespace emu

inline void threadgroup_barrier(mem_flags) { emu::barrier(); }
inline float simd_sum(float value) { return emu::simd_reduce_sum(value); }

// Address-space qualifiers last: `thread` would otherwise break std::thread in the runtime.
#define device
#define constant
#define thread
#define threadgroup static
#endif  // EMU_CHECK_ADDRESS_SPACES
