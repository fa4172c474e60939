// y[M, N] = x[M, K] @ dequant(w)[N, K]^T for the M <= 16 rows of a verify block, a draft pass or a
// decode step, reading every weight once per call (MLX's qmv re-reads them per row, qmv_wide per 5
// rows) and decoding every weight once per call.
//
// One simdgroup per 4 output columns, as MLX's quantized matrix-vector kernels; each lane owns a
// run of 8 consecutive K elements per step of 256 (a run never straddles a group). Per step:
//   1. the threadgroup stages the step's slice of x, rows < M, in threadgroup memory as float
//      (each x element loaded and converted once per threadgroup, not once per simdgroup);
//   2. each lane decodes its run of weights for its 4 columns once into float registers
//      (affine: scale * q + bias; mxfp4: a lookup of the e2m1 code times the e8m0 scale);
//   3. each row r < M multiplies the same decoded weights: acc[r][c] = fma(x[r][k], w[c][k],
//      acc[r][c]) for k in the lane's run, in ascending k.
// After the last step, acc[r][c] is summed over the 32 lanes (simd_sum).
//
// Row independence: row r's accumulators see the same fma's, with the same operands, in the same
// order whatever M and Rows are and whatever the other rows hold (the decoded weights depend on
// the weights only), so row r of an M-row call is bit for bit that row computed alone. fma is
// explicit: no contraction is left to the compiler. The rows loop has a constant trip count
// (Rows, a template argument) and is unrolled; rows >= M are skipped by a uniform branch.
//
// Body for mx.fast.metal_kernel; input pointers are `auto` (MLX declares each input with its own
// dtype and address space, see gated_delta_tape.metal).
// Inputs:  x [M, K] (float16/bfloat16/float32); w [N, K*bits/32] (uint32, MLX's packing: element
//          i of a word at bits i*bits); scales [N, K/group_size] (affine: x's float type; mxfp4:
//          uint8 powers of two, e8m0); biases [N, K/group_size] (affine; mxfp4 has none and passes
//          a one-element placeholder); M, K, N (int). K is a multiple of group_size (MLX's own
//          rule); N need not be a multiple of 4.
// Outputs: y [M, N] (OutT).
// Template: OutT, Rows (M <= Rows <= 16: accumulators per lane), bits (4 or 8; mxfp4: 4),
//          group_size (32, 64, 128; mxfp4: 32), Mode (0 affine, 1 mxfp4).
// Grid (32, ceil(N / 4), 1), threadgroup (32, S, 1): one simdgroup per 4 output columns, S of them
// sharing the staged x (any S; the edge threadgroup may hold fewer).

constexpr int columns = 4;                       // output columns per simdgroup
constexpr int run = 8;                           // K elements per lane per step
constexpr int per_word = 32 / bits;
constexpr int words = run / per_word;            // 1 at 4 bits, 2 at 8 bits
constexpr int step = run * 32;                   // K elements per simdgroup step
constexpr uint mask = (1u << bits) - 1u;

threadgroup float x_tile[Rows * step];           // the step's x, rows < M, as float
threadgroup float e2m1[16];                      // mxfp4: the value of each e2m1 code

const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const uint threads = threads_per_threadgroup.x * threads_per_threadgroup.y;
const int first = static_cast<int>(thread_position_in_grid.y) * columns;
const int words_per_column = K / per_word;
const int groups_per_column = K / group_size;

if (Mode == 1 && tid < 16) {
  // sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
  const uint e = (tid >> 1) & 3u;
  const float half_steps = static_cast<float>(tid & 1u) * 0.5f;
  const float magnitude = e == 0 ? half_steps : (1.0f + half_steps) * static_cast<float>(1u << (e - 1u));
  e2m1[tid] = (tid & 8u) ? -magnitude : magnitude;
}

float acc[Rows][columns];
#pragma unroll
for (int m = 0; m < Rows; ++m) {
#pragma unroll
  for (int c = 0; c < columns; ++c) {
    acc[m][c] = 0.0f;
  }
}

for (int kb = 0; kb < K; kb += step) {  // the same trip count in every thread: barriers inside
  for (int i = static_cast<int>(tid); i < M * step; i += static_cast<int>(threads)) {
    const int r = i / step;
    const int k = kb + i % step;
    x_tile[i] = k < K ? static_cast<float>(x[r * K + k]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int k0 = kb + static_cast<int>(lane) * run;
  if (k0 < K) {  // lanes past K idle for this step
    const int group = k0 / group_size;
    float wq[columns][run];
#pragma unroll
    for (int c = 0; c < columns; ++c) {
      const int n = first + c < N ? first + c : N - 1;  // past the edge: read a real column, write nothing
      float scale;
      float bias = 0.0f;
      if (Mode == 0) {
        scale = static_cast<float>(scales[n * groups_per_column + group]);
        bias = static_cast<float>(biases[n * groups_per_column + group]);
      } else {
        // e8m0: 2^(e - 127)
        scale = metal::exp2(static_cast<float>(static_cast<int>(scales[n * groups_per_column + group]) - 127));
      }
#pragma unroll
      for (int i = 0; i < words; ++i) {
        const uint packed = static_cast<uint>(w[n * words_per_column + k0 / per_word + i]);
#pragma unroll
        for (int j = 0; j < per_word; ++j) {
          const uint q = (packed >> (j * bits)) & mask;
          wq[c][i * per_word + j] = Mode == 0 ? metal::fma(scale, static_cast<float>(q), bias) : e2m1[q] * scale;
        }
      }
    }
    const int offset = static_cast<int>(lane) * run;
#pragma unroll
    for (int m = 0; m < Rows; ++m) {
      if (m < M) {
        float xr[run];
#pragma unroll
        for (int i = 0; i < run; ++i) {
          xr[i] = x_tile[m * step + offset + i];
        }
#pragma unroll
        for (int c = 0; c < columns; ++c) {
#pragma unroll
          for (int i = 0; i < run; ++i) {
            acc[m][c] = metal::fma(xr[i], wq[c][i], acc[m][c]);
          }
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next step overwrites x_tile
}

#pragma unroll
for (int m = 0; m < Rows; ++m) {
  if (m < M) {
#pragma unroll
    for (int c = 0; c < columns; ++c) {
      const float total = simd_sum(acc[m][c]);
      if (lane == 0 && first + c < N) {
        y[m * N + first + c] = static_cast<OutT>(total);
      }
    }
  }
}
