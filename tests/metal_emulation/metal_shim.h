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
// simdgroup_matrix (8x8, float): every emulated lane holds the whole matrix. simdgroup_load reads
// all of it; simdgroup_store writes only the two elements the lane owns on Apple GPUs (MLX's
// fragment layout, steel/gemm/mma.h), so a lane that reads another lane's stored elements needs a
// simdgroup_barrier here as on a GPU (it is a meeting point of the simdgroup's lanes).
// simdgroup_multiply_accumulate(d, a, b, c) computes each element in ONE documented order:
//   d[i][j] = fma(a[i][7], b[7][j], ... fma(a[i][1], b[1][j], fma(a[i][0], b[0][j], c[i][j])))
// the 8 products of the step added into the accumulator in ascending k, each with one rounding.
// An element depends on row i of a and column j of b only, never on the other rows of a. That is
// the emulator's order, not necessarily the GPU's: a real Apple GPU may sum the 8 products
// otherwise (what the row-independence of a tile kernel needs on hardware, that an element's
// accumulation does not depend on the other rows of the tile, is tested on a Mac:
// tests/test_quantized_verify.py, test_simdgroup_matrix_rows_are_independent_on_an_apple_gpu).
//
// With EMU_CHECK_ADDRESS_SPACES (parsed by Clang's front end through libclang, never run),
// `device`, `constant` and `threadgroup` are Clang address spaces instead, so that a body that
// mixes them (a `constant` input assigned to a `device` pointer, as Metal refuses) does not
// compile here either; g++, which builds the runnable library, has no address spaces.
#pragma once

typedef unsigned int uint;
typedef unsigned short ushort;

typedef unsigned long ulong;
struct ulong2 {
  ulong x, y;
  ulong2(ulong x_ = 0, ulong y_ = 0) : x(x_), y(y_) {}
};

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
void simdgroup_barrier(mem_flags flags);
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  T elements[Rows][Cols];
  simdgroup_matrix() = default;
  simdgroup_matrix(T diagonal);
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
template <typename T, int Cols, int Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value);
template <typename Matrix, typename Pointer>
void simdgroup_load(Matrix& d, Pointer src, ulong elements_per_row = 8, ulong2 matrix_origin = ulong2(0, 0),
                    bool transpose_matrix = false);
template <typename Matrix, typename Pointer>
void simdgroup_store(const Matrix& a, Pointer dst, ulong elements_per_row = 8, ulong2 matrix_origin = ulong2(0, 0),
                     bool transpose_matrix = false);
template <typename D, typename A, typename B, typename C>
void simdgroup_multiply_accumulate(D& d, const A& a, const B& b, const C& c);
template <typename T, typename U>
T as_type(U value);
template <typename Matrix>
void simdgroup_multiply(Matrix& d, const Matrix& a, const Matrix& b);
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
unsigned lane();  // the calling thread's index in its simdgroup
}  // namespace emu

inline void threadgroup_barrier(mem_flags) { emu::barrier(); }
inline float simd_sum(float value) { return emu::simd_reduce_sum(value); }
// The lanes of the simdgroup meet (a simd_sum's rendezvous, its value unused).
inline void simdgroup_barrier(mem_flags) { (void)emu::simd_reduce_sum(0.0f); }

// Metal's simdgroup_matrix<T, Cols, Rows>: see the header comment for what the emulator guarantees.
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  T elements[Rows][Cols];  // elements[row][column], whole in every lane
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {  // Metal: a diagonal matrix, not a filled one
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) elements[r][c] = r == c ? diagonal : T(0);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <typename T, int Cols, int Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) m.elements[r][c] = value;
  return m;
}

// d[r][c] = src[(origin.y + r) * elements_per_row + origin.x + c] (transposed: the source's
// element (origin.y + c, origin.x + r)). Every lane reads the whole matrix.
template <typename T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false) {
  const T* base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      d.elements[r][c] = transpose_matrix ? base[c * elements_per_row + r] : base[r * elements_per_row + c];
}

// The lane's own two elements (row fm, columns fn and fn + 1: MLX's BaseMMAFrag layout for 8x8).
template <typename T>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, T* dst, ulong elements_per_row = 8,
                     ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false) {
  const unsigned lane = emu::lane();
  const unsigned quad = lane / 4;
  const int fm = static_cast<int>((quad & 4) + ((lane / 2) % 4));
  const int fn = static_cast<int>((quad & 2) * 2 + (lane % 2) * 2);
  T* base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (int c = fn; c < fn + 2; ++c) {
    if (transpose_matrix) {
      base[c * elements_per_row + fm] = a.elements[fm][c];
    } else {
      base[fm * elements_per_row + c] = a.elements[fm][c];
    }
  }
}

// d = a * b + c, each element in ascending k with one rounding per product (see the header).
// a and b may hold half or bfloat (Metal's mixed-precision form, float accumulator): each operand
// widens exactly to float, so the product is the exact one, rounded once into the accumulator.
template <int Rows, int Inner, int Cols, typename TA, typename TB>
void simdgroup_multiply_accumulate(simdgroup_matrix<float, Cols, Rows>& d, const simdgroup_matrix<TA, Inner, Rows>& a,
                                   const simdgroup_matrix<TB, Cols, Inner>& b,
                                   const simdgroup_matrix<float, Cols, Rows>& c) {
  simdgroup_matrix<float, Cols, Rows> out;
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < Cols; ++j) {
      float acc = c.elements[i][j];
      for (int k = 0; k < Inner; ++k)
        acc = std::fma(static_cast<float>(a.elements[i][k]), static_cast<float>(b.elements[k][j]), acc);
      out.elements[i][j] = acc;
    }
  d = out;
}

template <int Rows, int Inner, int Cols, typename TA, typename TB>
void simdgroup_multiply(simdgroup_matrix<float, Cols, Rows>& d, const simdgroup_matrix<TA, Inner, Rows>& a,
                        const simdgroup_matrix<TB, Cols, Inner>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<float, Cols, Rows>(0.0f));
}

// Metal's as_type: the same bits as another type of the same size.
template <typename T, typename U>
T as_type(U value) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
  T out;
  std::memcpy(&out, &value, sizeof(T));
  return out;
}

// Address-space qualifiers last: `thread` would otherwise break std::thread in the runtime.
#define device
#define constant
#define thread
#define threadgroup static
#endif  // EMU_CHECK_ADDRESS_SPACES
