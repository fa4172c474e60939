"""The verify-matmul kernel (``metal/quantized_verify.metal``) on the emulator, against its
dequantize-then-matmul reference; row independence bit for bit; the harness against mutants; and
the per-shape choice (``QuantizedMatmuls``, the tuner and its cache)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import device, kernels, quantized
from tests.metal_emulation import HIGHEST_FIRST, LOWEST_FIRST, PARALLEL, EmulatedMetal, mutated_sources

M3 = device.DeviceFacts("Apple M3 Pro", "applegpu_g15s", True, 15, None, None)

# (mode, bits, group size): every form the kernel has.
FORMS = [("affine", 4, 32), ("affine", 4, 64), ("affine", 4, 128), ("affine", 8, 32), ("affine", 8, 64),
         ("affine", 8, 128), ("mxfp4", 4, 32)]
DTYPES = [mx.float16, mx.bfloat16]
# Output rounding to the activation dtype dominates: compare relative to the output's scale.
TOLERANCE = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2, mx.float32: 1e-5}


def emulated(sources=None, schedule=LOWEST_FIRST) -> kernels.MetalKernels:
    return kernels.MetalKernels(EmulatedMetal(schedule, sources), self_check=False)


def layer(seed, K, N, mode, bits, group_size, dtype, M=16):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    weight = mx.array((rng.standard_normal((N, K)) * K**-0.5).astype(np.float32)).astype(dtype)
    w, scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
    return x, w, scales, (biases[0] if biases else None)


def run(metal, x, w, scales, biases, mode, bits, group_size, rows=None, impl=quantized.OURS):
    launch = quantized.quantized_verify_launch(x, w, scales, biases, group_size, bits, mode, rows=rows, impl=impl)
    return metal.run(launch)[0]


def assert_matches_reference(got, x, w, scales, biases, mode, bits, group_size):
    want = quantized.quantized_verify_reference(x, w, scales, biases, group_size, bits, mode)
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=TOLERANCE[x.dtype] * scale, rtol=TOLERANCE[x.dtype])


def exact(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))  # widening is exact: equal iff the bits are


# Every accumulator count on one group size per form; the other group sizes (they change only the
# index of a run's scale) at the 1 and 16 accumulator counts.
SWEPT_FORMS = [("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)]


@pytest.mark.parametrize("dtype", DTYPES + [mx.float32], ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f[0]}{f[1]}-gs{f[2]}")
def test_every_row_equals_the_reference_and_the_row_computed_alone(form, dtype):
    """M = 1..16, each in the accumulator count it rounds up to, the two serial thread schedules
    taking turns: every row within rounding of the reference, and bit for bit the same row computed
    alone (one row, one accumulator) and computed beside other companion rows. K is one and a half
    steps of 256 (lanes past the edge idle in the second), N = 21 spans a full threadgroup of four
    simdgroups and a partial one, and is not a multiple of the 4 columns a simdgroup writes."""
    mode, bits, group_size = form
    seed = FORMS.index(form) * 10 + (DTYPES + [mx.float32]).index(dtype)
    K, N = max(group_size, 384), 21
    x, w, scales, biases = layer(seed, K, N, mode, bits, group_size, dtype)
    other, *_ = layer(seed + 100, K, N, mode, bits, group_size, dtype)
    metals = [emulated(schedule=LOWEST_FIRST), emulated(schedule=HIGHEST_FIRST)]
    alone = [exact(run(metals[r % 2], x[r : r + 1], w, scales, biases, mode, bits, group_size)[0]) for r in range(16)]
    counts = range(1, 17) if form in SWEPT_FORMS else (5, 16)
    for M in counts:
        rows = None if form in SWEPT_FORMS else 16
        got = run(metals[M % 2], x[:M], w, scales, biases, mode, bits, group_size, rows=rows)
        assert got.shape == (M, N) and got.dtype == dtype
        assert_matches_reference(got, x[:M], w, scales, biases, mode, bits, group_size)
        for r, row in enumerate(exact(got)):
            np.testing.assert_array_equal(row, alone[r], err_msg=f"row {r} of an {M}-row call")
        mixed = mx.concatenate([other[: M - 1], x[M - 1 : M]])  # row M-1 beside other companions
        np.testing.assert_array_equal(exact(run(metals[(M + 1) % 2], mixed, w, scales, biases, mode, bits, group_size,
                                                rows=rows)[M - 1]), alone[M - 1])


def test_free_running_threads_and_random_shapes():
    """The threads of a threadgroup interleaved by the OS give the serial schedules' bits, on
    random shapes (K a random number of groups, N from one column up)."""
    rng = np.random.default_rng(3)
    serial, free = emulated(schedule=LOWEST_FIRST), emulated(schedule=PARALLEL)
    for mode, bits, group_size in SWEPT_FORMS:
        K = group_size * int(rng.integers(1, 3 * 256 // group_size))
        N = int(rng.integers(1, 40))
        x, w, scales, biases = layer(int(rng.integers(1000)), K, N, mode, bits, group_size, mx.bfloat16)
        for M in (1, 3, 8, 16):
            got = run(free, x[:M], w, scales, biases, mode, bits, group_size)
            assert_matches_reference(got, x[:M], w, scales, biases, mode, bits, group_size)
            np.testing.assert_array_equal(exact(got), exact(run(serial, x[:M], w, scales, biases, mode, bits, group_size)))


def test_shapes_the_kernel_has_no_form_for_are_refused_by_name():
    x, w, scales, biases = layer(0, 64, 8, "affine", 4, 32, mx.float16)
    with pytest.raises(ValueError, match="no affine 3-bit"):
        quantized.quantized_verify_launch(x, w, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="at most 16"):
        quantized.quantized_verify_launch(mx.concatenate([x, x[:1]]), w, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="do not hold K=96"):
        quantized.quantized_verify_launch(mx.zeros((2, 96), mx.float16), w, scales, biases, 32, 4)


# Mutants of the kernel: each must be caught by the reference comparison or the row-independence
# comparison, under one of the two serial schedules, and by the self-check.
MUTATIONS = {
    "wrong scale (next group's)": ("scale = static_cast<float>(scales[n * groups_per_column + group]);",
                                   "scale = static_cast<float>(scales[n * groups_per_column + (group + 1) % groups_per_column]);"),
    "bias dropped": ("metal::fma(scale, static_cast<float>(q), bias)", "scale * static_cast<float>(q)"),
    "dropped reduction": ("const float total = simd_sum(acc[m][c]);", "const float total = acc[m][c];"),
    "row 0's input staged for every row": ("static_cast<float>(x[r * K + k])", "static_cast<float>(x[k])"),
    "wrong output row": ("y[m * N + first + c]", "y[(M - 1 - m) * N + first + c]"),
    "nibbles read in the wrong order": ("(packed >> (j * bits)) & mask", "(packed >> ((per_word - 1 - j) * bits)) & mask"),
    "dropped barrier after staging x": ("  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  const int k0", "\n  const int k0"),
    "dropped barrier before the next step's staging": (
        "  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next step", "  // before the next step"),
    "a summation order that depends on M": ("acc[m][c] = metal::fma(xr[i], wq[c][i], acc[m][c]);",
                                            "acc[m][c] = metal::fma(xr[M > 1 ? run - 1 - i : i], wq[c][M > 1 ? run - 1 - i : i], acc[m][c]);"),
    "e2m1 sign lost": ("e2m1[tid] = (tid & 8u) ? -magnitude : magnitude;", "e2m1[tid] = magnitude;"),
}
MUTANT_FORM = {"e2m1 sign lost": ("mxfp4", 4, 32)}


def caught(sources, form, schedule, impl=quantized.OURS, shape=(4, 1024, 8), seed=5) -> bool:
    """The reference comparison, and the row-independence comparison on cancelling rows (each
    output the rounding error of its own summation order: a 16-bit output shows an order change):
    the last of ``shape``'s M rows (M, K, N) against itself alone."""
    mode, bits, group_size = form
    x, cancelling, w, scales, biases = quantized.cancelling_layer(*shape, bits, group_size, mode, mx.float16, seed=seed)
    metal = emulated(sources, schedule)
    try:
        got = run(metal, x, w, scales, biases, mode, bits, group_size, impl=impl)
        assert_matches_reference(got, x, w, scales, biases, mode, bits, group_size)
        rows = run(metal, cancelling, w, scales, biases, mode, bits, group_size, impl=impl)
        alone = run(metal, cancelling[-1:], w, scales, biases, mode, bits, group_size, impl=impl)[0]
        np.testing.assert_array_equal(exact(rows[-1]), exact(alone))
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_the_harness_catches_broken_kernels(mutation):
    sources = mutated_sources(quantized.KERNEL, *MUTATIONS[mutation])
    form = MUTANT_FORM.get(mutation, ("affine", 4, 32))
    assert caught(sources, form, LOWEST_FIRST) or caught(sources, form, HIGHEST_FIRST), f"{mutation} went unnoticed"
    mode, bits, group_size = form
    x, w, scales, biases = layer(5, 1024, 8, mode, bits, group_size, mx.float16, M=4)
    launch = quantized.quantized_verify_launch(x, w, scales, biases, group_size, bits, mode)
    for schedule in (LOWEST_FIRST, HIGHEST_FIRST):
        checked = kernels.MetalKernels(EmulatedMetal(schedule, sources))
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if not checked.usable(launch, quantized._check_quantized):
                message = str(warned[0].message)
                assert f"quantized_verify float16 Rows=4 bits={bits} group_size={group_size} Mode={quantized.MODES[mode]}" \
                    in message and "failed its self-check" in message
                break
    else:
        raise AssertionError(f"the self-check passed {mutation}")
    assert kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)).usable(launch, quantized._check_quantized)


def quantized_mlp(bits=4, group_size=32, dtype=mx.bfloat16, tie=False):
    """A small module tree with quantized linears and a quantized embedding (a tied head)."""
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(40, 64)
            self.layers = [nn.Linear(64, 24, bias=False), nn.Linear(64, 64, bias=True)]

    model = Tiny()
    model.set_dtype(dtype)
    nn.quantize(model, group_size=group_size, bits=bits)
    return model


def test_routed_layers_use_the_kernel_only_where_chosen_and_keep_their_parameters():
    model = quantized_mlp()
    before = {k: np.array(v.astype(mx.float32)) for k, v in nn.utils.tree_flatten(model.parameters()) if v is not None}
    x = mx.random.normal((1, 3, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    stock = [layer_(x) for layer_ in model.layers] + [model.embed.as_linear(x)]
    metal = emulated()
    calls = []
    real_run = metal.run
    metal.run = lambda launch: calls.append(launch.inputs[4:]) or real_run(launch)  # records (M, K, N)
    matmuls = quantized.QuantizedMatmuls(metal)
    assert quantized.route(model, matmuls) == 3
    assert isinstance(model.layers[0], quantized.QuantizedLinear) and isinstance(model.embed, quantized.QuantizedEmbedding)
    after = {k: np.array(v.astype(mx.float32)) for k, v in nn.utils.tree_flatten(model.parameters()) if v is not None}
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    assert [layer_(x) for layer_ in model.layers][0].shape == (1, 3, 24) and not calls  # no choices: stock
    matmuls.choices = {s: quantized.OURS for s in quantized.shapes_of([model])}
    routed = [layer_(x) for layer_ in model.layers] + [model.embed.as_linear(x)]
    assert sorted(calls) == sorted([(3, 64, 24), (3, 64, 64), (3, 64, 40)])
    for got, want in zip(routed, stock):  # the bias of the second layer included
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=0.05, rtol=0.02)
    calls.clear()
    model.layers[0](mx.concatenate([x] * 6, axis=1))  # M = 18 > 16: stock, always
    assert not calls
    assert quantized.route(model, None) == 3 and not quantized.routes_to_metal(model)


def stand_in_clock(kernel_wins_overall):
    """Timings that prefer stock at M = 1 and the tile kernel at M >= 2 (the per-row kernel in
    between), the sum over the timed row counts going to the tile (or, for the 24-column layer when
    ``kernel_wins_overall`` is False, to stock, the per-row kernel second). The timed calls do run."""
    def measure(which, fn):
        out = fn()
        mx.eval(out)
        M, N = out.shape
        if which == quantized.STOCK:
            return 1.0 if M == 1 else 4.0
        if M == 1:
            return 2.0 if which == quantized.OURS else 3.0
        if N == 24 and not kernel_wins_overall:
            return 4.5
        return 3.0 if which == quantized.OURS else 1.0

    return measure


def recording(metal):
    launches = []
    real_run = metal.run
    metal.run = lambda launch: launches.append(launch) or real_run(launch)
    return launches


def test_one_implementation_per_layer_for_every_row_count(tmp_path):
    """Under ``exact`` (``--exact``) the tuner decides per shape for every row count at once: where stock is faster at M = 1 but
    the tile kernel at M = 8 and over the timed row counts, a decode step (M = 1, the tile padded
    to 8 rows) and a verify block (M = 8) of that layer both go through the tile, and each verify
    row is bit for bit its decode step; where stock wins overall and is one row-independent kernel
    at every M on the GPU (``stock_one``: qmv here), both run stock and the layer stays compiled;
    where stock switches kernels across M (an M3: qmv, then qmv_wide) it is not an option, however
    fast. Timed on the layers' own weights, choices cached per device."""
    model = quantized_mlp()
    layers = quantized.layers_of([model])
    assert {(s.K, s.N) for s in layers} == {(64, 24), (64, 64), (64, 40)}
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    launches = recording(metal)
    one_kernel = lambda shape: "qmv"  # noqa: E731 - e.g. an M1 Ultra at these sizes
    timings = quantized.tune(metal, layers, stand_in_clock(kernel_wins_overall=False), stock_one=one_kernel, exact=True)
    assert all(set(t.stock_s) == set(t.kernel_s) == set(t.tile_s) == set(quantized.TUNED_ROWS) for t in timings)
    assert {t.shape.N: t.choice for t in timings} == {24: quantized.STOCK, 64: quantized.TILE, 40: quantized.TILE}
    m3 = quantized.stock_rule(M3)
    assert {m3(s) for s in layers} == {None}
    switching = quantized.tune(metal, layers, stand_in_clock(kernel_wins_overall=False), stock_one=m3, exact=True)
    assert {t.shape.N: t.choice for t in switching} == {24: quantized.OURS, 64: quantized.TILE, 40: quantized.TILE}
    assert {launch.inputs[1] is layers[t.shape]["weight"] for launch in launches for t in timings
            if launch.inputs[6] == t.shape.N} == {True}  # the layer's own packed weights, not random ones
    cache = quantized.TuningCache(tmp_path / "tuning.json", "test-gpu")
    cache.record(timings)
    again = quantized.TuningCache(tmp_path / "tuning.json", "test-gpu")
    assert again.missing(layers) == [] and again.choices(exact=True) == {t.shape: t.choice for t in timings}
    assert quantized.TuningCache(tmp_path / "tuning.json", "another-gpu").missing(layers) == list(layers)

    matmuls = quantized.QuantizedMatmuls(metal, again.choices(exact=True), exact=True)
    quantized.route(model, matmuls)
    x = mx.random.normal((12, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    for layer_, n, through_kernel in ((model.layers[1], 64, True), (model.layers[0], 24, False)):
        for M in (8, 12):
            launches.clear()
            decode = [exact(layer_(x[r : r + 1])) for r in range(M)]
            verify = exact(layer_(x[:M]))
            ran = sorted({(launch.name, launch.inputs[4], dict(launch.template)["Rows"]) for launch in launches
                          if launch.inputs[6] == n})
            assert ran == ([(quantized.TILE_KERNEL, 1, 8), (quantized.TILE_KERNEL, M, quantized.rows_bucket(M, quantized.TILE))]
                           if through_kernel else [])
            if through_kernel:  # stock's qmv and qmv_wide/qmm may round differently; the kernel may not
                for r in range(M):
                    np.testing.assert_array_equal(verify[r], decode[r][0], err_msg=f"row {r} of {M}")
    assert quantized.routes_to_metal(model.layers[1]) and not quantized.routes_to_metal(model.layers[0])
    lines = quantized.render_timings(timings)
    assert "M=8 stock/kernel/tile" in lines[0] and any(line.endswith("tile (exact)") for line in lines[1:])


def test_a_form_failing_a_self_check_at_one_row_count_runs_stock_at_every_row_count():
    """A kernel broken only in its 16-accumulator form: a layer that chose the kernel runs stock at
    M = 1 too (the decode step may not take the kernel while the verify block takes stock)."""
    broken = mutated_sources(quantized.KERNEL, "acc[m][c] = metal::fma(xr[i], wq[c][i], acc[m][c]);",
                             "acc[m][c] = metal::fma(xr[i], Rows == 16 ? 0.0f : wq[c][i], acc[m][c]);")
    model = quantized_mlp()
    x = mx.random.normal((1, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    stock = exact(model.layers[0](x))
    matmuls = quantized.QuantizedMatmuls(kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, broken)),
                                         {s: quantized.OURS for s in quantized.shapes_of([model])})
    quantized.route(model, matmuls)
    with pytest.warns(RuntimeWarning, match="Rows=16 .* failed its self-check"):
        np.testing.assert_array_equal(exact(model.layers[0](x)), stock)
    assert [v == "ok" for k, v in matmuls.metal.report().items()] == [True, True, True, True, False]


def test_the_tuner_needs_its_margin_and_times_batches_of_calls():
    model = quantized_mlp()
    layers = quantized.layers_of([model])
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    close = lambda which, fn: mx.eval(fn()) or (0.97 if which == quantized.OURS else 1.0)  # noqa: E731
    one_kernel = lambda shape: "qmv"  # noqa: E731 - stock is one row-independent kernel at every M
    assert {t.choice for t in quantized.tune(metal, layers, close, stock_one=one_kernel)} == {quantized.STOCK}  # 3% is noise
    # Where stock switches kernels across M there is no margin to need: the faster of ours runs.
    assert {t.choice for t in quantized.tune(metal, layers, close, stock_one=quantized.stock_rule(M3))} == {quantized.OURS}
    calls = []
    counted = lambda: calls.append(1) or mx.zeros((1,))  # noqa: E731
    assert quantized.batch_time(quantized.STOCK, counted, calls=4, repeats=3, warmup=1) > 0 and len(calls) == 1 + 4 * 3
    # The real clock on one shape: a positive time for each side at each timed row count.
    (real,) = quantized.tune(metal, dict(list(layers.items())[:1]),
                             lambda which, fn: quantized.batch_time(which, fn, calls=2, repeats=1, warmup=1))
    assert min(real.stock_s.values()) > 0 and min(real.kernel_s.values()) > 0


def test_the_traffic_model_follows_mlx_dispatch_rules():
    """The rules as the issue quotes MLX 0.32 (K, N over 4096: qmm from 6 rows on M1/M2, 13 on
    M3/M4 and M5; qmv_wide packs up to 5 rows: M = 8 reads twice, 11-12 three times)."""
    from dflash_mlx import traffic

    big = (4096, 12288)
    assert [traffic.qmv_batch_limit(*big, g) for g in (13, 15, 17)] == [6, 13, 13]
    assert traffic.stock_reads(8, *big, 15) == ("qmv_wide", 2) and traffic.stock_reads(11, *big, 15) == ("qmv_wide", 3)
    assert traffic.stock_reads(16, *big, 15) == ("qmm", 1) and traffic.stock_reads(4, *big, 13) == ("qmv", 4)
    assert traffic.stock_reads(14, 4096, 4096, 15) == ("qmv_wide", 3)  # medium shapes: limit 15 on M3/M4
    dense = traffic.dense_matmuls(traffic.QWEN35_9B)
    assert traffic.pass_bytes(dense, 16, 15, ours=True) == traffic.pass_bytes(dense, 1, 15, ours=False)
    assert traffic.pass_bytes(dense, 8, 15, ours=False) == 2 * traffic.pass_bytes(dense, 8, 15, ours=True)
    assert 4.2e9 < traffic.decode_bytes(traffic.QWEN35_9B) < 4.8e9  # 9B parameters at ~4.5 bits
    moe = traffic.QWEN35_35B_A3B
    assert traffic.expert_bytes(moe, 4) == 32 / 8 * traffic.expert_bytes(moe, 1)  # unsorted: every pair reads
    assert traffic.expert_bytes(moe, 16) < 16 * traffic.expert_bytes(moe, 1)  # sorted: distinct experts once
    assert traffic.cycle_cost(traffic.QWEN35_9B, 8, 15, ours=True) < traffic.cycle_cost(traffic.QWEN35_9B, 8, 15, ours=False)
    assert any(line.startswith("| M3/M4 | 8 | qmv_wide x2") for line in traffic.tables())


def test_the_cost_model_counts_bytes_and_arithmetic():
    """Our kernel's operations per weight are the counts of docs/kernels.md; a 9B pass through it
    is bound by bytes at 1 row and by arithmetic at 16 on every GPU listed (no fma kernel keeps up
    at 16 rows), by bytes at 4 rows on an M3 Pro (21.5 operations per byte) but not on an M1 Max
    (13.3); stock's 16-row qmm costs about 3-4 decode steps on an M3 Pro (public per-op timings:
    3.9-4.5x); and the modelled cycle grows with the block, ours below stock."""
    from dflash_mlx import traffic

    assert [round(traffic.ops_per_weight("ours", M) / M, 2) for M in (1, 2, 4, 8, 16)] == [3.81, 2.62, 2.03, 1.73, 1.59]
    c, m3 = traffic.QWEN35_9B, traffic.gpu_named("M3 Pro")
    for gpu in traffic.GPUS:
        assert traffic.bound_by(c, 1, gpu, ours=True) == 0.0 and traffic.bound_by(c, 16, gpu, ours=True) > 0.9
        assert traffic.bound_by(c, 1, gpu, ours=False) == 0.0
    assert traffic.bound_by(c, 4, m3, ours=True) == 0.0 and traffic.bound_by(c, 4, traffic.gpu_named("M1 Max"), ours=True) > 0.9
    qmm16 = traffic.pass_seconds(c, 16, m3, ours=False) / traffic.pass_seconds(c, 1, m3, ours=False)
    assert 2.5 < qmm16 < 4.5
    draft = traffic.draft_matmuls(*traffic.DRAFTS["9B"])
    for gpu in traffic.GPUS:
        ours = [traffic.cycle_steps(c, b, gpu, True, draft) for b in traffic.BLOCKS]
        stock = [traffic.cycle_steps(c, b, gpu, False, draft) for b in traffic.BLOCKS]
        assert ours == sorted(ours) and all(o <= s + 1e-9 for o, s in zip(ours, stock)) and ours[0] > 1.0
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert all(line in readme for line in traffic.summary())  # the README's numbers are the model's
    lines = traffic.cost_tables()
    assert any(line.startswith("| M3 Pro | ours | 1.00 |") for line in lines)
    assert sum(line.startswith(("| M1 |", "| M3 Pro |", "| M4 Max |")) for line in lines) == 2 * 2 * 3 + 3 + 3 * 2


def test_auto_starts_from_the_cost_model_on_a_mac(tmp_path, monkeypatch):
    """``load`` gives auto the modelled cycle costs of the loaded pair on this GPU (a decode step
    first, costs growing with the block); none off Apple GPUs."""
    from dflash_mlx import api, device, traffic

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    model, _ = api.load("demo", draft_quant="w4", matmuls=None)
    assert model.block_stats.costs.prior is None  # this machine: no Apple GPU
    m3 = device.DeviceFacts("Apple M3 Pro", "applegpu_g15s", True, 15, None, None)
    assert traffic.gpu_of(m3).name == "M3 Pro" and traffic.gpu_of(device.DeviceFacts("Apple M4", "applegpu_g16g", True, 16,
                                                                                       None, None)).generation == 16
    prior = traffic.auto_prior(model, m3)
    assert len(prior) == 16 and prior[0] == pytest.approx(1.0) and prior[1] > 1.0
    monkeypatch.setattr(traffic, "auto_prior", lambda m, facts=None: prior)
    again, _ = api.load("demo", draft_quant="w4", matmuls=None)
    assert again.block_stats.costs.prior == prior and again.block_stats.costs.predict(1, 16) == prior


def test_load_routes_the_pair_through_the_cached_choices(tmp_path, monkeypatch):
    """``load(..., matmuls=...)`` as on a Mac, with this device's cache already holding every shape
    of the demo pair's w4 draft (the kernel measured faster): the draft's passes run the kernel, the
    output is the target's own."""
    from dflash_mlx import api

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    plain, tokenizer = api.load("demo", draft_quant="w4", matmuls=None)
    assert plain.matmuls is None and not quantized.routes_to_metal(plain.draft)
    cache = quantized.TuningCache.for_this_device()
    cache.record([quantized.Timing(s, {1: 2.0}, {1: 1.0}) for s in quantized.shapes_of([plain.target, plain.draft])])
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    routed, _ = api.load("demo", draft_quant="w4", matmuls=quantized.QuantizedMatmuls(metal))
    assert quantized.routes_to_metal(routed.draft) and all(layer.kernel_matmuls is not None for layer in routed.draft.layers)
    assert set(routed.matmuls.choices.values()) == {quantized.OURS}
    where_stock_won = quantized.QuantizedMatmuls(metal, {s: quantized.STOCK for s in routed.matmuls.choices})
    quantized.route_layers(plain.draft, plain.draft.layers, where_stock_won)
    assert not any(layer.kernel_matmuls for layer in plain.draft.layers)  # compiled: nothing of theirs runs the kernel
    quantized.route_layers(plain.draft, plain.draft.layers, None)
    prompt = "def fib(n):"
    texts = [api.generate(m, tokenizer, prompt, max_tokens=12, block_tokens=4) for m in (plain, routed)]
    assert texts[0] == texts[1]
    assert any(k.startswith("quantized_verify") and v == "ok" for k, v in metal.report().items())
