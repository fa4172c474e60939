// Wraps each .metal kernel body, unchanged, in the signature mx.fast.metal_kernel generates for
// it, and exposes a C entry point per input dtype that runs a whole grid through the emulator.
// Shapes that are template parameters on the GPU come in as -D defines (DK, DV, HK, HV).
#include "metal_shim.h"

template <typename InT, typename StT, int Dk, int Dv, int Hk, int Hv>
void gated_delta_tape(
    const device InT* q, const device InT* k, const device InT* v, const device float* g,
    const device InT* beta, const device StT* state_in, const constant int& T,
    device InT* y, device StT* state_out, device float* delta,
    uint3 thread_position_in_grid, uint3 thread_position_in_threadgroup,
    uint3 threads_per_threadgroup, uint thread_index_in_simdgroup) {
#include GATED_DELTA_TAPE_SOURCE
}

template <typename InT, typename StT, int Dk, int Dv, int Hk, int Hv>
void tape_replay(
    const device StT* state_in, const device InT* k, const device float* g,
    const device float* delta, const constant int& T, const constant int& steps,
    device StT* state_out,
    uint3 thread_position_in_grid, uint3 thread_position_in_threadgroup,
    uint3 threads_per_threadgroup, uint thread_index_in_simdgroup) {
#include TAPE_REPLAY_SOURCE
}

template <typename InT>
void run_tape(const void* q, const void* k, const void* v, const float* g, const void* beta,
              const float* state_in, int B, int T, void* y, float* state_out, float* delta,
              int rows_per_group, int schedule) {
  emu::dispatch({32, DV, static_cast<uint>(B * HV)}, {32, static_cast<uint>(rows_per_group), 1},
                static_cast<emu::Schedule>(schedule), [&](uint3 pos, uint3 local, uint3 size) {
                  gated_delta_tape<InT, float, DK, DV, HK, HV>(
                      static_cast<const InT*>(q), static_cast<const InT*>(k), static_cast<const InT*>(v), g,
                      static_cast<const InT*>(beta), state_in, T, static_cast<InT*>(y), state_out, delta,
                      pos, local, size, local.x);
                });
}

template <typename InT>
void run_replay(const float* state_in, const void* k, const float* g, const float* delta, int B, int T,
                int steps, float* state_out, int rows_per_group, int schedule) {
  emu::dispatch({32, DV, static_cast<uint>(B * HV)}, {32, static_cast<uint>(rows_per_group), 1},
                static_cast<emu::Schedule>(schedule), [&](uint3 pos, uint3 local, uint3 size) {
                  tape_replay<InT, float, DK, DV, HK, HV>(state_in, static_cast<const InT*>(k), g, delta, T,
                                                          steps, state_out, pos, local, size, local.x);
                });
}

#define ENTRY_POINTS(suffix, type)                                                                  \
  extern "C" void gated_delta_tape_##suffix(const void* q, const void* k, const void* v,           \
                                            const float* g, const void* beta, const float* s,      \
                                            int B, int T, void* y, float* so, float* d, int r,     \
                                            int sched) {                                           \
    run_tape<type>(q, k, v, g, beta, s, B, T, y, so, d, r, sched);                                  \
  }                                                                                                 \
  extern "C" void tape_replay_##suffix(const float* s, const void* k, const float* g,              \
                                       const float* d, int B, int T, int steps, float* so, int r,  \
                                       int sched) {                                                \
    run_replay<type>(s, k, g, d, B, T, steps, so, r, sched);                                        \
  }

ENTRY_POINTS(float32, float)
ENTRY_POINTS(float16, half)
ENTRY_POINTS(bfloat16, bfloat)
