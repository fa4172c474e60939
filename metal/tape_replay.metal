// Replays the first `steps` steps of a Gated DeltaNet tape onto the saved state:
//   S = g_t * S + delta_t ⊗ k_t
// No dot products and no reductions: every state element evolves on its own.
//
// Body for mx.fast.metal_kernel; input pointers are `auto` for the reasons given in
// gated_delta_tape.metal (MLX picks each input's address space and dtype).
// Inputs:  state_in [B, Hv, Dv, Dk] (float); k [B, T, Hk, Dk] (InT); g [B, T, Hv] (float);
//          delta [B, T, Hv, Dv] (float); T (int, tape length); steps (int, 0..T; kernels.py
//          refuses others, and the body never reads past the tape).
// Outputs: state_out [B, Hv, Dv, Dk] (StT).
// Template: InT, StT, Dk (multiple of 32), Dv, Hk, Hv.
// Grid (32, Dv, B*Hv), threadgroup (32, R, 1), as the verify kernel.

constexpr int n_per_t = Dk / 32;
const uint n = thread_position_in_grid.z;
const uint b_idx = n / Hv;
const uint hv_idx = n % Hv;
const uint hk_idx = hv_idx / (Hv / Hk);
const uint lane = thread_index_in_simdgroup;
const uint dv_idx = thread_position_in_grid.y;

auto k_ = k + b_idx * T * Hk * Dk + hk_idx * Dk + n_per_t * lane;
auto g_ = g + b_idx * T * Hv + hv_idx;
auto delta_ = delta + b_idx * T * Hv * Dv + hv_idx * Dv + dv_idx;
const int n_steps = steps < T ? steps : T;

auto i_state = state_in + (n * Dv + dv_idx) * Dk + n_per_t * lane;
float state[n_per_t];
for (int i = 0; i < n_per_t; ++i) {
  state[i] = static_cast<float>(i_state[i]);
}

for (int t = 0; t < n_steps; ++t) {
  const float g_t = static_cast<float>(g_[t * Hv]);
  const float d = static_cast<float>(delta_[t * Hv * Dv]);
  for (int i = 0; i < n_per_t; ++i) {
    state[i] = state[i] * g_t;
    state[i] = state[i] + static_cast<float>(k_[t * Hk * Dk + i]) * d;
  }
}

device StT* o_state = state_out + (n * Dv + dv_idx) * Dk + n_per_t * lane;
for (int i = 0; i < n_per_t; ++i) {
  o_state[i] = static_cast<StT>(state[i]);
}
