"""The simdgroup-matrix tile kernel (``metal/quantized_verify_tile.metal``) on the emulator, against
the dequantize-then-matmul reference, row independence bit for bit, mutants; the assumption its
row independence rests on on real hardware (H), tested where an Apple GPU is; MLX's stock dispatch
rule (``traffic.stock_kernel``) against MLX 0.32's source; the cost model's count of the tile."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import device, kernels, quantized, traffic
from tests.metal_emulation import HIGHEST_FIRST, LOWEST_FIRST, PARALLEL, EmulatedMetal, mutated_sources
from tests.test_quantized_verify import DTYPES, FORMS, assert_matches_reference, caught, emulated, exact, layer
from tests.test_quantized_verify import run as verify_run

TILE = quantized.TILE
ALL_DTYPES = DTYPES + [mx.float32]


def run(metal, x, w, scales, biases, mode, bits, group_size, rows=None):
    return verify_run(metal, x, w, scales, biases, mode, bits, group_size, rows, impl=TILE)


@pytest.mark.slow  # the tile kernel in the C++ emulator, 42 specializations
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f[0]}{f[1]}-gs{f[2]}")
def test_tile_rows_equal_the_reference_and_the_row_computed_alone(form, dtype):
    """Every form, dtype and M = 1..16, the two serial thread schedules taking turns: every row
    of random x within rounding of the reference; and on cancelling rows (each output the rounding
    error of its own summation order, so any change of order shows even in 16 bits), every row bit
    for bit the same row computed alone (a decode step: one row padded to a tile of 8) and beside
    random companion rows, also when it sits in the second 8-row tile. K is 16 steps of 32 (every
    group size divides its halves); N = 41 spans a full threadgroup of 32 columns and a partial
    one, a partial simdgroup of 8 columns included."""
    mode, bits, group_size = form
    seed = 500 + FORMS.index(form) * 10 + ALL_DTYPES.index(dtype)
    K, N = 512, 41
    x, cancelling, w, scales, biases = quantized.cancelling_layer(16, K, N, bits, group_size, mode, dtype, seed=seed)
    metals = [emulated(schedule=LOWEST_FIRST), emulated(schedule=HIGHEST_FIRST)]
    alone = [exact(run(metals[r % 2], cancelling[r : r + 1], w, scales, biases, mode, bits, group_size)[0])
             for r in range(16)]
    for M in range(1, 17):
        got = run(metals[M % 2], x[:M], w, scales, biases, mode, bits, group_size)
        assert got.shape == (M, N) and got.dtype == dtype
        assert_matches_reference(got, x[:M], w, scales, biases, mode, bits, group_size)
        rows = exact(run(metals[(M + 1) % 2], cancelling[:M], w, scales, biases, mode, bits, group_size))
        for r, row in enumerate(rows):
            np.testing.assert_array_equal(row, alone[r], err_msg=f"row {r} of an {M}-row call")
        mixed = mx.concatenate([x[: M - 1], cancelling[M - 1 : M]])  # row M-1 beside other companions
        np.testing.assert_array_equal(exact(run(metals[M % 2], mixed, w, scales, biases, mode, bits, group_size)[M - 1]),
                                      alone[M - 1])


@pytest.mark.slow  # the tile kernel in the C++ emulator
def test_tile_free_running_threads_and_random_shapes():
    """Threads interleaved by the OS give the serial schedules' bits, on random shapes (K a random
    number of groups, N from one column up); the 8-row form holds rows 1..8 alone as well."""
    rng = np.random.default_rng(13)
    serial, free = emulated(schedule=LOWEST_FIRST), emulated(schedule=PARALLEL)
    for mode, bits, group_size in (("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)):
        K = group_size * int(rng.integers(1, 3 * 256 // group_size))
        N = int(rng.integers(1, 70))
        x, w, scales, biases = layer(int(rng.integers(1000)), K, N, mode, bits, group_size, mx.bfloat16)
        for M in (1, 3, 8, 16):
            got = run(free, x[:M], w, scales, biases, mode, bits, group_size)
            assert_matches_reference(got, x[:M], w, scales, biases, mode, bits, group_size)
            np.testing.assert_array_equal(exact(got), exact(run(serial, x[:M], w, scales, biases, mode, bits, group_size)))
        np.testing.assert_array_equal(exact(run(serial, x[:3], w, scales, biases, mode, bits, group_size, rows=16)),
                                      exact(run(serial, x[:3], w, scales, biases, mode, bits, group_size, rows=8)))


def test_tile_launch_refuses_what_it_has_no_form_for():
    x, w, scales, biases = layer(0, 64, 8, "affine", 4, 32, mx.float16)
    with pytest.raises(ValueError, match="in the tile"):
        quantized.quantized_verify_launch(x[:3], w, scales, biases, 32, 4, rows=4, impl=TILE)
    launch = quantized.quantized_verify_launch(x[:3], w, scales, biases, 32, 4, impl=TILE)
    assert launch.name == quantized.TILE_KERNEL and dict(launch.template)["Rows"] == 8
    assert launch.grid == (32, 4, 1) and launch.threadgroup == (32, 4, 1)  # whole threadgroups of 128 threads


# Mutants of the tile kernel: each must be caught by the reference comparison or the
# row-independence comparison under one of the serial schedules, and by the self-check.
TILE_MUTATIONS = {
    "a K order that depends on M": (
        "for (int kk = 0; kk < tile_k; kk += 8) {\n    simdgroup_float8x8 b;",
        "for (int kk_ = 0; kk_ < tile_k; kk_ += 8) {\n    const int kk = M > 1 ? tile_k - 8 - kk_ : kk_;\n"
        "    simdgroup_float8x8 b;"),
    "wrong scale (next group's)": ("scale = static_cast<float>(scales[n * groups_per_column + group]);",
                                   "scale = static_cast<float>(scales[n * groups_per_column + (group + 1) % groups_per_column]);"),
    "bias dropped": ("metal::fma(scale, static_cast<float>(q), bias)", "scale * static_cast<float>(q)"),
    "nibbles read in the wrong order": ("(packed >> (j * bits)) & mask", "(packed >> ((per_word - 1 - j) * bits)) & mask"),
    "e2m1 sign lost": ("e2m1[tid] = (tid & 8u) ? -magnitude : magnitude;", "e2m1[tid] = magnitude;"),
    "e2m1 table value wrong (6 read as 4)": ("(1.0f + half_steps) * static_cast<float>(1u << (e - 1u))",
                                             "(1.0f + half_steps * (e == 3u ? 0.0f : 1.0f)) * static_cast<float>(1u << (e - 1u))"),
    "output written past the last column (into the next row)": ("if (r < M && n < N) {", "if (r < M && (n < N || (r + 1 < M && n < 2 * N))) {"),
    "a partial threadgroup's real columns not dequantized": ("  if (n < N) {\n    const int k0", "  if (n < N && n0 + tile_n <= N) {\n    const int k0"),
    "the second row tile reads the first's rows": ("&x_tile[t * 8 * tile_k + kk]", "&x_tile[kk]"),
    "a row of x staged from the row before": ("static_cast<float>(x[r * K + kb + i % tile_k])",
                                              "static_cast<float>(x[(r > 0 ? r - 1 : 0) * K + kb + i % tile_k])"),
    "dropped barrier after staging the tiles": (
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n#pragma unroll\n  for (int kk", "\n#pragma unroll\n  for (int kk"),
    "dropped barrier before the next step's staging": (
        "  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next step", "  // before the next step"),
    "dropped simdgroup_barrier before the write-out": (
        "simdgroup_barrier(mem_flags::mem_threadgroup);  // a lane writes", "// a lane writes"),
}
TILE_MUTANT_FORM = {name: ("mxfp4", 4, 32) for name in TILE_MUTATIONS if name.startswith("e2m1")}


def tile_caught(sources, form, schedule) -> bool:
    """``test_quantized_verify.caught`` through the tile kernel, on 12 rows (two row tiles) over 41
    columns (a partial threadgroup)."""
    return caught(sources, form, schedule, impl=TILE, shape=(12, 512, 41), seed=7)


@pytest.mark.slow  # builds mutated kernels in the emulator
@pytest.mark.parametrize("mutation", list(TILE_MUTATIONS), ids=list(TILE_MUTATIONS))
def test_the_harness_catches_broken_tile_kernels(mutation):
    sources = mutated_sources(quantized.TILE_KERNEL, *TILE_MUTATIONS[mutation])
    form = TILE_MUTANT_FORM.get(mutation, ("affine", 4, 32))
    assert tile_caught(sources, form, LOWEST_FIRST) or tile_caught(sources, form, HIGHEST_FIRST), f"{mutation} went unnoticed"
    mode, bits, group_size = form
    x, w, scales, biases = layer(5, 512, 41, mode, bits, group_size, mx.float16, M=12)
    launch = quantized.quantized_verify_launch(x, w, scales, biases, group_size, bits, mode, impl=TILE)
    for schedule in (LOWEST_FIRST, HIGHEST_FIRST):
        checked = kernels.MetalKernels(EmulatedMetal(schedule, sources))
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if not checked.usable(launch, quantized._check_quantized):
                message = str(warned[0].message)
                assert f"quantized_verify_tile float16 Rows=16 bits={bits} group_size={group_size}" in message
                assert "failed its self-check" in message
                break
    else:
        raise AssertionError(f"the self-check passed {mutation}")
    assert kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)).usable(launch, quantized._check_quantized)


@pytest.mark.slow  # builds a mutated kernel in the emulator
def test_a_tile_failing_its_self_check_falls_back_to_stock_at_every_row_count():
    """A tile kernel broken only in its 16-row form, chosen for a layer: the layer's decode step
    (8-row form, which passes) runs stock too, with one warning."""
    from tests.test_quantized_verify import quantized_mlp

    broken = mutated_sources(quantized.TILE_KERNEL, "simdgroup_multiply_accumulate(acc[t], a, b, acc[t]);",
                             "simdgroup_multiply_accumulate(acc[t], a, Rows == 16 ? a : b, acc[t]);")
    model = quantized_mlp()
    x = mx.random.normal((1, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    stock = exact(model.layers[0](x))
    matmuls = quantized.QuantizedMatmuls(kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, broken)),
                                         {s: TILE for s in quantized.shapes_of([model])})
    quantized.route(model, matmuls)
    with pytest.warns(RuntimeWarning, match="quantized_verify_tile .*Rows=16 .* failed its self-check"):
        np.testing.assert_array_equal(exact(model.layers[0](x)), stock)
    assert [v == "ok" for k, v in matmuls.metal.report().items()] == [True, False]


# ---- MLX's stock dispatch ---------------------------------------------------------------------

# MLX 0.32's QuantizedMatmul::eval_gpu and dispatch_qmv (mlx/backend/metal/quantized.cpp), read by
# hand for these cases: (M, K, N, bits, mode, generation, ultra) -> kernel.
MLX_STOCK_CASES = [
    (1, 4096, 12288, 4, "affine", 15, False, "qmv"),
    (2, 4096, 12288, 4, "affine", 15, False, "qmv_wide"),      # qmv_wide: affine on gen 15+
    (12, 4096, 12288, 4, "affine", 15, False, "qmv_wide"),
    (13, 4096, 12288, 4, "affine", 15, False, "qmm"),          # get_qmv_batch_limit: 13 for large shapes
    (14, 4096, 4096, 4, "affine", 15, False, "qmv_wide"),      # medium: 15
    (5, 4096, 12288, 4, "affine", 13, False, "qmv"),           # M1/M2: one qmv per row
    (6, 4096, 12288, 4, "affine", 13, False, "qmm"),           # limit 6
    (2, 2048, 2048, 4, "mxfp4", 13, False, "qmv_wide"),        # fp modes take qmv_wide on every generation
    (16, 2048, 2048, 4, "affine", 13, True, "qmv"),            # Ultra ('d'): limit 32
    (16, 4096, 4096, 8, "affine", 13, True, "qmv"),            # limit 18
    (12, 4096, 12288, 4, "affine", 13, True, "qmm"),           # limit 12
    (2, 4096, 4096, 4, "affine", 15, True, "qmv_wide"),        # an M3 Ultra: gen-13 'd' limits, gen-15 qmv_wide
    (16, 4096, 4096, 4, "affine", 15, True, "qmv_wide"),       # limit 18
    (12, 64, 512, 4, "affine", 15, False, "qmv_quad"),         # K 64 or 128: qmv_quad below the limit
    (13, 128, 512, 4, "affine", 15, False, "qmm"),
    (16, 128, 2048, 8, "affine", 17, False, "qmv_quad"),       # M5, small: limit 33
    (16, 2048, 2048, 4, "affine", 17, False, "qmv_wide"),
    (14, 4096, 12288, 4, "affine", 17, False, "qmm"),          # M5, large: 13
    (13, 256, 512, 3, "affine", 13, False, "qmv"),             # 3 bits: no qmv_quad, whatever K
]


@pytest.mark.parametrize("case", MLX_STOCK_CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-{c[4]}{c[3]}-g{c[5]}{'d' if c[6] else ''}")
def test_stock_kernel_follows_mlx_dispatch(case):
    *arguments, kernel = case
    assert traffic.stock_kernel(*arguments) == kernel


def test_stock_is_one_implementation_only_where_one_row_independent_kernel_runs_every_row_count():
    """Where stock switches kernels across M = 1..16 (every non-Ultra M1-M4 for affine weights:
    qmv, then qmv_wide or qmm) it is not one implementation: a layer runs it only as the fastest at
    each row count (not exact), never as its exact choice; an Ultra's qmv for every M on small shapes, and qmv_quad for K = 64 or 128 below a limit of
    33 (M5), are. Off Apple GPUs (no generation) nothing is."""
    one = traffic.stock_one_kernel
    assert one(4096, 12288, 4, "affine", 15) is None and one(4096, 12288, 4, "affine", 13) is None
    assert one(2048, 2048, 4, "affine", 13) is None  # M1/M2 small: limit 14, qmm at 14-16
    assert one(2048, 2048, 4, "affine", 13, ultra=True) == "qmv"
    assert one(2048, 2048, 4, "mxfp4", 13, ultra=True) is None  # qmv, then qmv_wide
    assert one(128, 2048, 4, "affine", 17) == "qmv_quad" and one(128, 2048, 4, "affine", 15) is None
    assert one(2048, 2048, 4, "affine", None) is None
    ultra = device.DeviceFacts("Apple M1 Ultra", "applegpu_g13d", True, 13, None, None)
    shape = quantized.MatmulShape(2048, 2048, 4, 64, "affine", "bfloat16")
    assert quantized.stock_rule(ultra)(shape) == "qmv"
    assert quantized.stock_rule(device.DeviceFacts("Apple M1", "applegpu_g13g", True, 13, None, None))(shape) is None
    t = quantized.Timing(shape, {1: 1.0, 8: 1.0}, {1: 2.0, 8: 2.0}, {1: 3.0, 8: 1.5}, stock_one="qmv")
    assert t.choice == quantized.STOCK and t.is_exact
    switching = quantized.Timing(shape, t.stock_s, t.kernel_s, t.tile_s)  # stock not one kernel: not exact
    assert switching.exact_choice == quantized.OURS and switching.exactness_cost == pytest.approx(1.0)
    assert switching.choice == quantized.STOCK and not switching.is_exact
    assert quantized.Timing(shape, t.stock_s, t.kernel_s, t.tile_s, exact=True).choice == quantized.OURS
    assert quantized.Timing(shape, t.stock_s, None, None).choice == quantized.STOCK  # no kernel of ours usable


# ---- The cost model ------------------------------------------------------------------------------

def test_the_cost_model_counts_the_tile_kernel():
    """The tile's operations per weight per row as docs/kernels.md counts them from the source, in
    fma slots (15.1 at one row: the 8-row tile computed for a decode step; shifts, masks and
    conversions at a quarter, a simdgroup-matrix multiply-accumulate at 1.18), against the per-row
    kernel's; the model never has the tile faster on the GPU families listed (a matrix
    multiply-accumulate costs more than an fma), and a decode step through it is bound by
    arithmetic."""
    per_row = [round(traffic.ops_per_weight("tile", M) / M, 2) for M in (1, 2, 4, 8, 16)]
    assert per_row == [15.13, 7.59, 3.83, 1.95, 1.67]
    assert [round(traffic.ops_per_weight("tile", M, bits=8) / M, 2) for M in (1, 16)] == [15.25, 1.68]
    for gpu in traffic.GPUS:
        assert traffic.tile_faster_rows(gpu) == []
        assert traffic.tile_over_per_row(gpu, 1) > 1.2  # a decode step through the tile is bound by arithmetic
    lines = traffic.tile_table()
    assert sum(line.startswith(("| M1 |", "| M3 Pro |", "| M4 Max |")) for line in lines) == 6
    assert all("| never |" in line for line in lines[4:])
    c, draft = traffic.QWEN35_9B, traffic.draft_matmuls(*traffic.DRAFTS["9B"])
    m3 = traffic.gpu_named("M3 Pro")
    assert traffic.cycle_steps(c, 8, m3, "tile", draft) > traffic.cycle_steps(c, 8, m3, True, draft)


def test_the_cost_model_meets_the_published_m3_max_measurements():
    """mlx#3863 (katlun-lgtm, 2026-07-22): ``mx.quantized_matmul`` of 4-bit weights, K = 5120,
    N = 17408, on an M3 Max (MLX main before 0.32.1: batch limit 10 for this shape, so qmv at
    M = 1, qmv_wide at 2-9, qmm from 10), milliseconds per call. The recalibrated model meets every
    point within 7%; counting shifts, masks and conversions as one operation each and a matrix
    multiply-accumulate as one fma, it over-charged qmv_wide by 21-23% at M = 4-8 and
    under-charged qmm by 8-10%."""
    published = {1: 0.129, 2: 0.129, 4: 0.165, 6: 0.263, 8: 0.323, 9: 0.405, 10: 0.508, 12: 0.508, 14: 0.507,
                 16: 0.509, 32: 0.513, 33: 1.002}
    gpu, layer = traffic.gpu_named("M3 Max"), traffic.Matmul("mlp", 5120, 17408, 1)

    def modelled_ms(M, qmv, wide_tile, wide_row, qmm_tile):
        if M == 1:
            kind, reads, ops = "qmv", 1, qmv
        elif M < 10:
            kind, reads = "qmv_wide", -(-M // 5)
            ops = wide_tile * reads + wide_row * M
        else:
            kind, reads = "qmm", -(-M // 32)
            ops = qmm_tile * reads
        return 1e3 * traffic.seconds(layer.bytes * reads, layer.K * layer.N * ops, gpu)

    now = (traffic.QMV_PER_ROW, traffic.QMV_WIDE_PER_TILE, traffic.QMV_WIDE_PER_ROW, traffic.QMM_PER_TILE)
    assert traffic.ops_per_weight("qmv_wide", 4, tiles=1) == now[1] + 4 * now[2]
    for M, ms in published.items():
        assert abs(modelled_ms(M, *now) / ms - 1) < 0.07, (M, modelled_ms(M, *now), ms)
    before = (4.6, 4.0, 3.0, 5.0 + 32.0)  # one operation each, as counted before the recalibration
    assert [round(modelled_ms(M, *before) / published[M] - 1, 2) for M in (4, 6, 8)] == [0.21, 0.23, 0.23]
    assert all(-0.11 <= modelled_ms(M, *before) / published[M] - 1 <= -0.08 for M in (10, 16, 32, 33))


# ---- Assumption H on an Apple GPU ------------------------------------------------------------------

# One 8x8 output tile per threadgroup: C[t] = A[t] (8 x K) @ B[t] (K x 8), K/8 steps of
# simdgroup_multiply_accumulate from device memory, float32.
MMA_SOURCE = """
const uint t = threadgroup_position_in_grid.x;
simdgroup_float8x8 c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
for (int kk = 0; kk < K; kk += 8) {
  simdgroup_float8x8 a;
  simdgroup_float8x8 b;
  simdgroup_load(a, &A[t * 8 * K + kk], K);
  simdgroup_load(b, &B[t * K * 8 + kk * 8], 8);
  simdgroup_multiply_accumulate(c, a, b, c);
}
simdgroup_store(c, &C[t * 64], 8);
"""


def mma_tiles(metal_kernel, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a`` [T, 8, K] @ ``b`` [T, K, 8] by one simdgroup per tile."""
    T, _, K = a.shape
    kernel = metal_kernel(name="h_mma", input_names=["A", "B", "K"], output_names=["C"], source=MMA_SOURCE)
    (c,) = kernel(inputs=[mx.array(a), mx.array(b), K], grid=(32 * T, 1, 1), threadgroup=(32, 1, 1),
                  output_shapes=[(T, 8, 8)], output_dtypes=[mx.float32])
    return np.array(c)


def companions_do_not_change_a_row(metal_kernel, tiles: int = 256, K: int = 256, seed: int = 0) -> None:
    """Assumption H: an element of an 8x8 simdgroup product accumulates the same whatever the other
    rows of A hold and whichever of the 8 rows it sits in. A cancelling row (its second half of K
    negates its first against a B whose halves repeat: each result is the rounding error of its own
    summation order) is placed at every row position beside random companion rows (large, small,
    zero), over many random tiles; every placement must give the same bits."""
    rng = np.random.default_rng(seed)
    half = rng.standard_normal((tiles, K // 2, 8)).astype(np.float32)
    b = np.concatenate([half, half], axis=1)
    u = (rng.uniform(-1, 1, (tiles, K // 2)) * 2048).astype(np.float32)
    row = np.concatenate([u, -u], axis=1)
    results = []
    for position in range(8):
        kind = position % 3
        scale = (1e4, 1e-3, 0.0)[kind]
        a = (rng.standard_normal((tiles, 8, K)) * scale).astype(np.float32)
        a[:, position] = row
        results.append(mma_tiles(metal_kernel, a, b)[:, position])
    for position in range(1, 8):
        np.testing.assert_array_equal(results[position].view(np.uint32), results[0].view(np.uint32),
                                      err_msg=f"a row at position {position} beside other rows")


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (Metal): assumption H is about the hardware")
def test_simdgroup_matrix_rows_are_independent_on_an_apple_gpu():
    """H on this GPU (the emulator sums in ascending k by construction and proves only that), and
    the tile kernel itself: row r of every M-row call bit for bit the row alone, on cancelling
    rows, for a form of each kind."""
    with mx.stream(mx.gpu):
        companions_do_not_change_a_row(mx.fast.metal_kernel)
        metal = kernels.MetalKernels()
        for mode, bits, group_size in (("affine", 4, 64), ("affine", 8, 32), ("mxfp4", 4, 32)):
            for dtype in ALL_DTYPES:
                _, cancelling, w, scales, biases = quantized.cancelling_layer(16, 1024, 72, bits, group_size, mode, dtype, seed=3)
                launch = quantized.quantized_verify_launch(cancelling, w, scales, biases, group_size, bits, mode, impl=TILE)
                assert metal.usable(launch, quantized._check_quantized), metal.report()
                alone = [exact(metal.run(quantized.quantized_verify_launch(cancelling[r : r + 1], w, scales, biases, group_size,
                                                                            bits, mode, impl=TILE))[0]) for r in range(16)]
                for M in range(1, 17):
                    got = exact(metal.run(quantized.quantized_verify_launch(cancelling[:M], w, scales, biases, group_size, bits,
                                                                             mode, impl=TILE))[0])
                    for r in range(M):
                        np.testing.assert_array_equal(got[r], alone[r][0], err_msg=f"{mode}{bits} {dtype} row {r} of {M}")


@pytest.mark.slow  # compiles the H kernel in the emulator
def test_the_h_check_runs_and_fails_on_a_row_dependent_order():
    """The H check itself, on the emulator (which holds H by construction): it passes there, and
    fails on a product whose order depends on the other rows (a tile whose row 7 is all zeros sums
    its steps in reverse), so that on a Mac a pass means something."""
    companions_do_not_change_a_row(EmulatedMetal(LOWEST_FIRST), tiles=16, K=64)
    row_dependent = MMA_SOURCE.replace(
        "for (int kk = 0; kk < K; kk += 8) {\n  simdgroup_float8x8 a;",
        "const bool reverse = A[t * 8 * K + 7 * K] == 0.0f;\n"
        "for (int kk_ = 0; kk_ < K; kk_ += 8) {\n  const int kk = reverse ? K - 8 - kk_ : kk_;\n  simdgroup_float8x8 a;")
    assert row_dependent != MMA_SOURCE
    with pytest.raises(AssertionError, match="beside other rows"):
        companions_do_not_change_a_row(EmulatedMetal(LOWEST_FIRST, {"h_mma": row_dependent}), tiles=16, K=64)
