// Gated DeltaNet verify pass that also writes the rollback tape.
//
// Body for mx.fast.metal_kernel (MLX writes the signature from the arrays passed: each input
// is declared with its own dtype, in the `constant` address space when it has fewer than 8
// elements and `device` otherwise; scalars are `constant` references). Input pointers are
// therefore `auto`, and values are read through static_cast<float>, so that the body compiles
// whatever address space and dtype MLX declares.
// Inputs:  q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv]; beta [B, T, Hv] (kernels.py
//          passes them in InT, g in float); state_in [B, Hv, Dv, Dk] (float); T (int).
// Outputs: y [B, T, Hv, Dv] (InT); state_out [B, Hv, Dv, Dk] (StT); delta [B, T, Hv, Dv] (float).
// Template: InT, StT, Dk (multiple of 32), Dv, Hk, Hv (multiple of Hk).
// Grid (32, Dv, B*Hv), threadgroup (32, R, 1): one simdgroup per value row dv, lane l keeps
// state[dv, l*Dk/32 .. (l+1)*Dk/32) in registers. The R rows of a threadgroup belong to the
// same head, so each step's k and q are staged once in threadgroup memory and shared.

constexpr int n_per_t = Dk / 32;
const uint n = thread_position_in_grid.z;
const uint b_idx = n / Hv;
const uint hv_idx = n % Hv;
const uint hk_idx = hv_idx / (Hv / Hk);
const uint lane = thread_index_in_simdgroup;
const uint dv_idx = thread_position_in_grid.y;
const uint tid = thread_position_in_threadgroup.y * 32 + thread_position_in_threadgroup.x;
const uint n_threads = threads_per_threadgroup.y * 32;

auto q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;
auto k_ = k + b_idx * T * Hk * Dk + hk_idx * Dk;
auto v_ = v + b_idx * T * Hv * Dv + hv_idx * Dv + dv_idx;
auto beta_ = beta + b_idx * T * Hv + hv_idx;
auto g_ = g + b_idx * T * Hv + hv_idx;
device InT* y_ = y + b_idx * T * Hv * Dv + hv_idx * Dv + dv_idx;
device float* delta_ = delta + b_idx * T * Hv * Dv + hv_idx * Dv + dv_idx;

threadgroup float k_step[Dk];
threadgroup float q_step[Dk];

auto i_state = state_in + (n * Dv + dv_idx) * Dk + n_per_t * lane;
float state[n_per_t];
for (int i = 0; i < n_per_t; ++i) {
  state[i] = static_cast<float>(i_state[i]);
}

for (int t = 0; t < T; ++t) {
  for (uint i = tid; i < Dk; i += n_threads) {
    k_step[i] = static_cast<float>(k_[t * Hk * Dk + i]);
    q_step[i] = static_cast<float>(q_[t * Hk * Dk + i]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const float g_t = static_cast<float>(g_[t * Hv]);
  float kv = 0.0f;
  for (int i = 0; i < n_per_t; ++i) {
    state[i] = state[i] * g_t;
    kv += state[i] * k_step[n_per_t * lane + i];
  }
  kv = simd_sum(kv);

  const float d = (static_cast<float>(v_[t * Hv * Dv]) - kv) * static_cast<float>(beta_[t * Hv]);
  float out = 0.0f;
  for (int i = 0; i < n_per_t; ++i) {
    state[i] = state[i] + k_step[n_per_t * lane + i] * d;
    out += state[i] * q_step[n_per_t * lane + i];
  }
  out = simd_sum(out);
  if (lane == 0) {
    y_[t * Hv * Dv] = static_cast<InT>(out);
    delta_[t * Hv * Dv] = d;
  }
  // The next step overwrites k_step/q_step: every row must be done reading them.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

device StT* o_state = state_out + (n * Dv + dv_idx) * Dk + n_per_t * lane;
for (int i = 0; i < n_per_t; ++i) {
  o_state[i] = static_cast<StT>(state[i]);
}
