// y[M, N] = x[M, K] @ dequant(w)[N, K]^T for the M <= 16 rows of a verify block or a draft pass,
// reading every weight once per call (MLX's qmv re-reads them per row, qmv_wide per 5 rows).
//
// Structure of MLX's quantized matrix-vector kernel (one simdgroup per 4 output columns, each lane
// a contiguous run of K, simd_sum at the end), with one accumulator per row of x: a lane loads its
// run of weights for its 4 columns once and applies it to every row. Each row's accumulator sees
// the same operations in the same order whatever M is and whatever the other rows hold, so row r
// of an M-row call is bit for bit that row computed alone (explicit fma: no contraction choice is
// left to the compiler).
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
// Grid (32, ceil(N / 4), 1), threadgroup (32, S, 1): one simdgroup per 4 output columns.

constexpr int columns = 4;                       // output columns per simdgroup
constexpr int run = bits == 4 ? 16 : 8;          // K elements per lane per step (two words)
constexpr int per_word = 32 / bits;
constexpr int words = run / per_word;
constexpr int step = run * 32;                   // K elements per simdgroup step
constexpr uint mask = (1u << bits) - 1u;

const uint lane = thread_index_in_simdgroup;
const int first = static_cast<int>(thread_position_in_grid.y) * columns;
const int words_per_column = K / per_word;
const int groups_per_column = K / group_size;

float acc[Rows][columns];
for (int m = 0; m < Rows; ++m) {
  for (int c = 0; c < columns; ++c) {
    acc[m][c] = 0.0f;
  }
}

for (int k0 = static_cast<int>(lane) * run; k0 < K; k0 += step) {
  const int group = k0 / group_size;  // a lane's run never straddles a group (run divides group_size)
  uint packed[columns][words];
  float scale[columns];
  float bias[columns];
  for (int c = 0; c < columns; ++c) {
    const int n = first + c < N ? first + c : N - 1;  // past the edge: read a real column, write nothing
    for (int i = 0; i < words; ++i) {
      packed[c][i] = static_cast<uint>(w[n * words_per_column + k0 / per_word + i]);
    }
    if (Mode == 0) {
      scale[c] = static_cast<float>(scales[n * groups_per_column + group]);
      bias[c] = static_cast<float>(biases[n * groups_per_column + group]);
    } else {
      // e8m0: 2^(e - 127)
      scale[c] = metal::exp2(static_cast<float>(static_cast<int>(scales[n * groups_per_column + group]) - 127));
      bias[c] = 0.0f;
    }
  }
  for (int m = 0; m < Rows; ++m) {
    if (m < M) {
      float xs[run];
      float x_sum = 0.0f;
      for (int i = 0; i < run; ++i) {
        xs[i] = static_cast<float>(x[m * K + k0 + i]);
        x_sum += xs[i];
      }
      for (int c = 0; c < columns; ++c) {
        float dot = 0.0f;
        for (int i = 0; i < words; ++i) {
          for (int j = 0; j < per_word; ++j) {
            const uint q = (packed[c][i] >> (j * bits)) & mask;
            float value = static_cast<float>(q);
            if (Mode == 1) {  // e2m1: sign, two exponent bits, one mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6)
              const uint e = (q >> 1) & 3u;
              const float half_steps = static_cast<float>(q & 1u) * 0.5f;
              const float magnitude = e == 0 ? half_steps : (1.0f + half_steps) * static_cast<float>(1u << (e - 1u));
              value = (q & 8u) ? -magnitude : magnitude;
            }
            dot = metal::fma(xs[i * per_word + j], value, dot);
          }
        }
        // affine: sum_i x_i (s q_i + b) = s * sum_i x_i q_i + b * sum_i x_i
        acc[m][c] = metal::fma(scale[c], dot, metal::fma(bias[c], x_sum, acc[m][c]));
      }
    }
  }
}

for (int m = 0; m < Rows; ++m) {
  if (m < M) {
    for (int c = 0; c < columns; ++c) {
      const float total = simd_sum(acc[m][c]);
      if (lane == 0 && first + c < N) {
        y[m * N + first + c] = static_cast<OutT>(total);
      }
    }
  }
}
