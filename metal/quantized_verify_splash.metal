// y[M, N] = x[M, K] @ dequant(w)[N, K]^T for M <= 16 rows, Splash-style: the weights are decoded
// to their integer codes straight into the activations' 16-bit type by bit construction (no
// int->float conversion), multiplied with x through simdgroup matrices of that type accumulating
// in float32, and each group's scale and bias are applied afterwards, once per group and output:
//   y[r][n] = sum over groups g of  scale[n][g] * (sum_{k in g} x[r][k] q[n][k])
//                                 + bias[n][g]  * (sum_{k in g} x[r][k])          (the row sums)
// (mxfp4: q is the e2m1 value, from a table, and there is no bias.) Off by default: it is an
// option behind the routing (docs/kernels.md, "The Splash-style kernel").
//
// Bit construction: a half whose exponent field is 25 (0x6400) is 1024 + its mantissa field, so
// as_type<half>(0x6400 | q) is 1024 + q exactly, with no operation but the OR; a bfloat from
// 0x4300 | q is 128 + q (4-bit q only: 7 mantissa bits). The offset is not subtracted per weight:
// sum_k x (offset + q) = offset * rowsum + sum_k x q, so the group's bias becomes
// bias - offset * scale (once per group and column). Float codes (float32 activations, where the
// offset's cancellation would cost precision, and 8-bit codes into a bfloat tile) are built from
// 0x4B000000 | q (2^23 + q) minus 2^23: q exactly. x * code is exact in float32 (at most 11 + 11
// significant bits), so the roundings are the simdgroup accumulation, the row sums and the apply.
//
// Threadgroup of 4 simdgroups, 32 output columns (8 per simdgroup), as the float tile kernel
// (quantized_verify_tile.metal). Per step of 32 K elements (every group size is a multiple):
//   1. stage x[0..Rows)[kb, kb + 32) in MatT, rows >= M as zeros; 128 threads decode one run of 8
//      codes each into the weight tile (K-major); at a group's first step the group's scale and
//      bias per column; columns >= N as zeros;
//   2. thread r < Rows adds its row's 32 staged elements to its running row sum (ascending k);
//   3. each simdgroup, for kk = 0, 8, 16, 24, loads B (8 K x its 8 columns) and for each 8-row
//      tile t, A, and accumulates G[t] += A * B (float32): the group's partial dot products;
//   4. at a group's last step, each simdgroup stores G, and each lane, for its own elements
//      (row r, column c), adds  fma(scale[c], G[r][c], fma(bias[c], rowsum[r], total))  to a
//      register; G restarts at zero.
// The tiles' rows are padded by 16 bytes (pad) so that the 8 rows a simdgroup_load reads start in
// different banks (MLX's steel tiles pad the same way).
//
// Row independence: an element's operations depend only on its row of x and its column of w, in
// an order fixed by K alone (steps, kk and groups ascending; the row sum ascending), never on M,
// Rows or the other rows: row r sits in tile r / 8 at row r % 8 whatever M is. As for the float
// tile, the one thing the kernel cannot fix is how the GPU sums the 8 products of one 8x8x8 step
// (assumption H, docs/kernels.md; the emulator sums in ascending k).
//
// Body for mx.fast.metal_kernel; input pointers are `auto`.
// Inputs:  x [M, K] (float16/bfloat16/float32); w [N, K*bits/32] (uint32); scales [N, K/group_size]
//          (affine: float type; mxfp4: uint8 e8m0); biases (affine; mxfp4: a one-element
//          placeholder); M, K, N (int).
// Outputs: y [M, N] (OutT).
// Template: OutT, MatT (the simdgroup matrices' element type: x's own), Mat (0 float, 1 half,
//          2 bfloat), Rows (8 or 16), bits (4 or 8; mxfp4: 4), group_size (32, 64, 128; mxfp4: 32),
//          Mode (0 affine, 1 mxfp4).
// Grid (32, 4 * ceil(N / 32), 1), threadgroup (32, 4, 1).

constexpr int tile_n = 32;
constexpr int tile_k = 32;
constexpr int pad = 16 / static_cast<int>(sizeof(MatT));  // 16 bytes per tile row against bank conflicts
constexpr int ldx = tile_k + pad;
constexpr int ldw = tile_n + pad;
constexpr int run = 8;
constexpr int runs = tile_k / run;
constexpr int per_word = 32 / bits;
constexpr int words = run / per_word;
constexpr uint mask = (1u << bits) - 1u;
constexpr int row_tiles = Rows / 8;
constexpr int per_lane = Rows * 8 / 32;  // each lane's elements of its simdgroup's Rows x 8 outputs
// What a 16-bit code holds beyond q: a half built from 0x6400 | q is 1024 + q, a bfloat from
// 0x4300 | q is 128 + q; float codes (float32 activations, 8-bit codes for a bfloat tile) are q.
constexpr float code_offset = Mode == 0 && Mat == 1 ? 1024.0f : Mode == 0 && Mat == 2 && bits == 4 ? 128.0f : 0.0f;

threadgroup MatT x_tile[Rows * ldx];      // x[r][kb + k] at r * ldx + k
threadgroup MatT w_tile[tile_k * ldw];    // q[n0 + n][kb + k] at k * ldw + n
threadgroup float group_scale[tile_n];    // the current group's scale and bias per column
threadgroup float group_bias[tile_n];
threadgroup float row_sum[Rows];          // the current group's sum of x per row
threadgroup float g_tile[4 * Rows * 8];   // simdgroup s: its Rows x 8 group dot products at s * Rows * 8
threadgroup MatT e2m1[16];

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint simdgroup = tid / 32;
const int n0 = static_cast<int>(threadgroup_position_in_grid.y) * tile_n;
const int column = static_cast<int>(tid) / runs;
const int offset = (static_cast<int>(tid) % runs) * run;
const int words_per_column = K / per_word;
const int groups_per_column = K / group_size;

if (Mode == 1) {
  if (tid < 16) {
    const uint e = (tid >> 1) & 3u;
    const float half_steps = static_cast<float>(tid & 1u) * 0.5f;
    const float magnitude = e == 0 ? half_steps : (1.0f + half_steps) * static_cast<float>(1u << (e - 1u));
    e2m1[tid] = static_cast<MatT>((tid & 8u) ? -magnitude : magnitude);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

simdgroup_matrix<float, 8, 8> acc[row_tiles];
#pragma unroll
for (int t = 0; t < row_tiles; ++t) {
  acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
float total[per_lane];
#pragma unroll
for (int j = 0; j < per_lane; ++j) {
  total[j] = 0.0f;
}
float my_row_sum = 0.0f;  // thread tid < Rows: row tid's sum over the current group so far

for (int kb = 0; kb < K; kb += tile_k) {  // the same trip count in every thread: barriers inside
  const bool group_start = kb % group_size == 0;
  const bool group_end = (kb + tile_k) % group_size == 0;
  for (int i = static_cast<int>(tid); i < Rows * tile_k; i += 128) {
    const int r = i / tile_k;
    x_tile[r * ldx + i % tile_k] = r < M ? static_cast<MatT>(x[r * K + kb + i % tile_k]) : static_cast<MatT>(0.0f);
  }

  const int n = n0 + column;
  if (n < N) {
    const int k0 = kb + offset;
    if (group_start && offset == 0) {
      const int g = n * groups_per_column + k0 / group_size;
      if (Mode == 0) {
        group_scale[column] = static_cast<float>(scales[g]);
        // the offset the bit construction leaves in each code, taken out with the bias
        group_bias[column] = metal::fma(-code_offset, group_scale[column], static_cast<float>(biases[g]));
      } else {
        group_scale[column] = metal::exp2(static_cast<float>(static_cast<int>(scales[g]) - 127));
        group_bias[column] = 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < words; ++i) {
      const uint packed = static_cast<uint>(w[n * words_per_column + k0 / per_word + i]);
#pragma unroll
      for (int j = 0; j < per_word; ++j) {
        const uint q = (packed >> (j * bits)) & mask;
        MatT code;
        if (Mode == 1) {
          code = e2m1[q];
        } else if (Mat == 1) {  // 1024 + q: the 1024 is taken out through the row sums
          code = static_cast<MatT>(static_cast<float>(as_type<half>(static_cast<ushort>(0x6400u | q))));
        } else if (Mat == 2 && bits == 4) {  // 128 + q
          code = static_cast<MatT>(static_cast<float>(as_type<bfloat16_t>(static_cast<ushort>(0x4300u | q))));
        } else {  // q, exact, then MatT (float, or a bfloat tile of 8-bit codes)
          code = static_cast<MatT>(as_type<float>(0x4B000000u | q) - 8388608.0f);
        }
        w_tile[(offset + i * per_word + j) * ldw + column] = code;
      }
    }
  } else {  // past the last column: zeros, written nowhere
    if (group_start && offset == 0) {
      group_scale[column] = 0.0f;
      group_bias[column] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < run; ++i) {
      w_tile[(offset + i) * ldw + column] = static_cast<MatT>(0.0f);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  if (static_cast<int>(tid) < Rows) {  // the row sums, each row by its own thread, ascending k
    float s = group_start ? 0.0f : my_row_sum;
    for (int k = 0; k < tile_k; ++k) {
      s += static_cast<float>(x_tile[static_cast<int>(tid) * ldx + k]);
    }
    my_row_sum = s;
    if (group_end) {
      row_sum[tid] = s;
    }
  }

#pragma unroll
  for (int kk = 0; kk < tile_k; kk += 8) {
    simdgroup_matrix<MatT, 8, 8> b;
    simdgroup_load(b, &w_tile[kk * ldw + simdgroup * 8], ldw);
#pragma unroll
    for (int t = 0; t < row_tiles; ++t) {
      simdgroup_matrix<MatT, 8, 8> a;
      simdgroup_load(a, &x_tile[t * 8 * ldx + kk], ldx);
      simdgroup_multiply_accumulate(acc[t], a, b, acc[t]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the tiles read, the row sums written

  if (group_end) {  // uniform: depends on kb alone
#pragma unroll
    for (int t = 0; t < row_tiles; ++t) {
      simdgroup_store(acc[t], &g_tile[(simdgroup * Rows + t * 8) * 8], 8);
      acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // a lane reads elements other lanes stored
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      const int i = static_cast<int>(lane) + 32 * j;
      const int c = static_cast<int>(simdgroup) * 8 + i % 8;
      const float dot = g_tile[simdgroup * Rows * 8 + i];
      total[j] = Mode == 0 ? metal::fma(group_scale[c], dot, metal::fma(group_bias[c], row_sum[i / 8], total[j]))
                           : metal::fma(group_scale[c], dot, total[j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next group's scales and sums
  }
}

#pragma unroll
for (int j = 0; j < per_lane; ++j) {
  const int i = static_cast<int>(lane) + 32 * j;
  const int r = i / 8;
  const int n = n0 + static_cast<int>(simdgroup) * 8 + i % 8;
  if (r < M && n < N) {
    y[r * N + n] = static_cast<OutT>(total[j]);
  }
}
