// y[M, N] = x[M, K] @ dequant(w)[N, K]^T for the M <= 16 rows of a verify block, a draft pass or a
// decode step, through simdgroup matrices: each weight is dequantized once per call into a tile in
// threadgroup memory, and every row is multiplied with it by 8x8 simdgroup_multiply_accumulate.
// The rows are padded with zeros to Rows (8 or 16: one or two 8-row tiles); a decode step runs the
// same kernel with 7 zero rows.
//
// Threadgroup of 4 simdgroups, 32 output columns (8 per simdgroup). Per step of 32 K elements
// (MLX's qmm BK; every group size is a multiple, so a step never straddles a group edge within a
// thread's run):
//   1. the threadgroup stages x[0..Rows)[kb, kb + 32) as float in threadgroup memory, rows >= M
//      as zeros;
//   2. each of the 128 threads dequantizes one run of 8 weights (column n0 + tid / 4, K elements
//      kb + (tid % 4) * 8 ..) into the weight tile, K-major (the tile is B of B[k][n]); affine:
//      fma(scale, q, bias); mxfp4: a lookup of the e2m1 code times the e8m0 scale; columns >= N
//      as zeros;
//   3. each simdgroup, for kk = 0, 8, 16, 24 in that order, loads B (8 K x its 8 columns) and,
//      for each 8-row tile t, A (8 rows x 8 K) and accumulates C[t] += A * B.
// At the end each simdgroup stores C to threadgroup memory and writes rows < M, columns < N.
//
// Row independence: the K order (steps ascending, kk ascending within a step) is fixed and does
// not depend on M or Rows; row r sits in tile r / 8 at row r % 8 whatever M is; and the zero
// padding depends on nothing. What remains is how the GPU sums the 8 products of one 8x8x8 step
// into an element of C: if that does not depend on the other rows of A (assumption H,
// docs/kernels.md), row r of an M-row call is bit for bit that row computed alone. The emulator
// sums them in ascending k (metal_shim.h); H itself is tested on an Apple GPU.
//
// Body for mx.fast.metal_kernel; input pointers are `auto` (MLX declares each input with its own
// dtype and address space, see gated_delta_tape.metal).
// Inputs:  x [M, K] (float16/bfloat16/float32); w [N, K*bits/32] (uint32, MLX's packing); scales
//          [N, K/group_size] (affine: x's float type; mxfp4: uint8 e8m0); biases [N, K/group_size]
//          (affine; mxfp4 passes a one-element placeholder); M, K, N (int). K is a multiple of
//          group_size (MLX's rule), hence of 32; N need not be a multiple of anything.
// Outputs: y [M, N] (OutT).
// Template: OutT, Rows (8 or 16, M <= Rows), bits (4 or 8; mxfp4: 4), group_size (32, 64, 128;
//          mxfp4: 32), Mode (0 affine, 1 mxfp4).
// Grid (32, 4 * ceil(N / 32), 1), threadgroup (32, 4, 1): exactly 128 threads per threadgroup.

constexpr int tile_n = 32;                       // output columns per threadgroup
constexpr int tile_k = 32;                       // K elements per step
constexpr int run = 8;                           // K elements one thread dequantizes per step
constexpr int runs = tile_k / run;               // threads per column
constexpr int per_word = 32 / bits;
constexpr int words = run / per_word;            // 1 at 4 bits, 2 at 8 bits
constexpr uint mask = (1u << bits) - 1u;
constexpr int row_tiles = Rows / 8;

threadgroup float x_tile[Rows * tile_k];         // x[r][kb + k] at r * tile_k + k; 0 for r >= M
threadgroup float w_tile[tile_k * tile_n];       // dequant(w)[n0 + n][kb + k] at k * tile_n + n
threadgroup float y_tile[4 * Rows * 8];          // simdgroup s: its Rows x 8 results at s * Rows * 8
threadgroup float e2m1[16];                      // mxfp4: the value of each e2m1 code

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint simdgroup = tid / 32;
const int n0 = static_cast<int>(threadgroup_position_in_grid.y) * tile_n;
const int column = static_cast<int>(tid) / runs;  // the column this thread dequantizes
const int offset = (static_cast<int>(tid) % runs) * run;
const int words_per_column = K / per_word;
const int groups_per_column = K / group_size;

if (Mode == 1) {
  if (tid < 16) {
    // sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    const uint e = (tid >> 1) & 3u;
    const float half_steps = static_cast<float>(tid & 1u) * 0.5f;
    const float magnitude = e == 0 ? half_steps : (1.0f + half_steps) * static_cast<float>(1u << (e - 1u));
    e2m1[tid] = (tid & 8u) ? -magnitude : magnitude;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the table before any thread decodes
}

simdgroup_float8x8 acc[row_tiles];
#pragma unroll
for (int t = 0; t < row_tiles; ++t) {
  acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

for (int kb = 0; kb < K; kb += tile_k) {  // the same trip count in every thread: barriers inside
  for (int i = static_cast<int>(tid); i < Rows * tile_k; i += 128) {
    const int r = i / tile_k;
    x_tile[i] = r < M ? static_cast<float>(x[r * K + kb + i % tile_k]) : 0.0f;
  }

  const int n = n0 + column;
  if (n < N) {
    const int k0 = kb + offset;
    const int group = k0 / group_size;
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
        w_tile[(offset + i * per_word + j) * tile_n + column] =
            Mode == 0 ? metal::fma(scale, static_cast<float>(q), bias) : e2m1[q] * scale;
      }
    }
  } else {  // past the last column: zeros, written nowhere
#pragma unroll
    for (int i = 0; i < run; ++i) {
      w_tile[(offset + i) * tile_n + column] = 0.0f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

#pragma unroll
  for (int kk = 0; kk < tile_k; kk += 8) {
    simdgroup_float8x8 b;
    simdgroup_load(b, &w_tile[kk * tile_n + simdgroup * 8], tile_n);
#pragma unroll
    for (int t = 0; t < row_tiles; ++t) {
      simdgroup_float8x8 a;
      simdgroup_load(a, &x_tile[t * 8 * tile_k + kk], tile_k);
      simdgroup_multiply_accumulate(acc[t], a, b, acc[t]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next step overwrites the tiles
}

#pragma unroll
for (int t = 0; t < row_tiles; ++t) {
  simdgroup_store(acc[t], &y_tile[(simdgroup * Rows + t * 8) * 8], 8);
}
simdgroup_barrier(mem_flags::mem_threadgroup);  // a lane writes elements other lanes stored
for (int i = static_cast<int>(lane); i < Rows * 8; i += 32) {
  const int r = i / 8;
  const int n = n0 + static_cast<int>(simdgroup) * 8 + i % 8;
  if (r < M && n < N) {
    y[r * N + n] = static_cast<OutT>(y_tile[simdgroup * Rows * 8 + i]);
  }
}
