"""The Splash-style verify kernel (``metal/quantized_verify_splash.metal``, ``dflash_mlx/splash.py``)
on the emulator: every form and dtype against the dequantize-then-matmul reference, every row bit
for bit the row computed alone and beside other rows (M = 1..16), free-running threads, mutants;
a quantized pair routed to it, lossless; and its modelled cost (``splash.cycle_steps``) against
``traffic``'s own cycle model."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import kernels, quantized, splash, traffic
from tests.metal_emulation import HIGHEST_FIRST, LOWEST_FIRST, PARALLEL, EmulatedMetal, mutated_sources
from tests.test_mac_path import apple_gpu
from tests.test_emulated_metal import bf16_target_dir, small_prompts  # noqa: F401 - fixtures of the pair test
from tests.test_quantized_verify import FORMS, assert_matches_reference, exact, layer

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
SWEPT = [("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)]  # every M; the other group sizes at 5 and 16


def emulated(sources=None, schedule=LOWEST_FIRST) -> kernels.MetalKernels:
    return kernels.MetalKernels(EmulatedMetal(schedule, sources), self_check=False)


def run(metal, x, w, scales, biases, form, rows=None):
    mode, bits, group_size = form
    return metal.run(splash.splash_launch(x, w, scales, biases, group_size, bits, mode, rows=rows))[0]


def rows_equal_the_reference_and_the_row_computed_alone(form, dtype, K, counts, metals=None):
    """The two serial schedules taking turns: every row of random x within rounding of the
    reference; on cancelling rows (each output the rounding error of its own summation order)
    every row bit for bit the same row computed alone (a decode step: one row padded to 8) and
    beside random companion rows, in the first and the second 8-row tile. N = 41: a full
    threadgroup of 32 columns and a partial one."""
    mode, bits, group_size = form
    N = 41
    seed = 900 + FORMS.index(form) * 10 + DTYPES.index(dtype)
    x, cancelling, w, scales, biases = quantized.cancelling_layer(16, K, N, bits, group_size, mode, dtype, seed=seed)
    metals = metals or [emulated(schedule=LOWEST_FIRST), emulated(schedule=HIGHEST_FIRST)]
    alone = {r: exact(run(metals[r % 2], cancelling[r : r + 1], w, scales, biases, form)[0]) for r in range(max(counts))}
    for M in counts:
        got = run(metals[M % 2], x[:M], w, scales, biases, form)
        assert got.shape == (M, N) and got.dtype == dtype
        assert_matches_reference(got, x[:M], w, scales, biases, mode, bits, group_size)
        rows = exact(run(metals[(M + 1) % 2], cancelling[:M], w, scales, biases, form))
        for r, row in enumerate(rows):
            np.testing.assert_array_equal(row, alone[r], err_msg=f"row {r} of an {M}-row call")
        mixed = mx.concatenate([x[: M - 1], cancelling[M - 1 : M]])
        np.testing.assert_array_equal(exact(run(metals[M % 2], mixed, w, scales, biases, form)[M - 1]), alone[M - 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("form", SWEPT, ids=lambda f: f"{f[0]}{f[1]}-gs{f[2]}")
def test_splash_rows_equal_the_reference_and_the_row_computed_alone(form, dtype):
    """One group size per form, every dtype: a decode step, the 8-row form full, the 16-row form
    from its first row count to full (K = 256: 8 steps, two groups of 128)."""
    rows_equal_the_reference_and_the_row_computed_alone(form, dtype, 256, (1, 2, 8, 9, 16))


@pytest.mark.slow  # 21 specializations in the C++ emulator (about half a minute)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f[0]}{f[1]}-gs{f[2]}")
def test_splash_every_form_dtype_and_row_count(form, dtype):
    """Every form and dtype, M = 1..16 on one group size per form (the other group sizes at 5 and
    16 rows), K = 256 (8 steps, every group size's halves whole)."""
    rows_equal_the_reference_and_the_row_computed_alone(form, dtype, 256, range(1, 17) if form in SWEPT else (5, 16))


@apple_gpu
def test_splash_kernel_on_an_apple_gpu():
    """Apple's compiler and GPU: every form and dtype, M = 1..16, within rounding of the reference
    and every row bit for bit the row alone (its decode step; assumption H for 16-bit operands)."""
    metal = kernels.MetalKernels()
    for form in FORMS:
        for dtype in DTYPES:
            rows_equal_the_reference_and_the_row_computed_alone(form, dtype, 768, range(1, 17), [metal, metal])


def test_splash_free_running_threads_and_random_shapes():
    """Threads interleaved by the OS give the serial schedules' bits on random shapes (K a random
    number of groups, N from one column up); 16 padded rows give the 8-row form's bits."""
    rng = np.random.default_rng(17)
    serial, free = emulated(schedule=LOWEST_FIRST), emulated(schedule=PARALLEL)
    for form in SWEPT:
        mode, bits, group_size = form
        K = group_size * int(rng.integers(1, 3 * 256 // group_size))
        N = int(rng.integers(1, 70))
        x, w, scales, biases = layer(int(rng.integers(1000)), K, N, mode, bits, group_size, mx.bfloat16)
        for M in (1, 8, 13):
            got = run(free, x[:M], w, scales, biases, form)
            assert_matches_reference(got, x[:M], w, scales, biases, mode, bits, group_size)
            np.testing.assert_array_equal(exact(got), exact(run(serial, x[:M], w, scales, biases, form)))
        np.testing.assert_array_equal(exact(run(serial, x[:3], w, scales, biases, form, rows=16)),
                                      exact(run(serial, x[:3], w, scales, biases, form, rows=8)))


def test_splash_launch_refuses_what_it_has_no_form_for():
    x, w, scales, biases = layer(0, 64, 8, "affine", 4, 32, mx.float16)
    with pytest.raises(ValueError, match="no affine 3-bit"):
        splash.splash_launch(x, w, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="rows=4 cannot hold M=3"):
        splash.splash_launch(x[:3], w, scales, biases, 32, 4, rows=4)
    with pytest.raises(ValueError, match="at most 16"):
        splash.splash_launch(mx.concatenate([x, x[:1]]), w, scales, biases, 32, 4)
    launch = splash.splash_launch(x[:3], w, scales, biases, 32, 4)
    assert dict(launch.template)["Rows"] == 8 and launch.grid == (32, 4, 1) and launch.threadgroup == (32, 4, 1)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32 activations"):
        splash.splash_launch(x.astype(mx.int32), w, scales, biases, 32, 4)
    assert quantized.KERNEL_OF[quantized.SPLASH] == splash.SPLASH_KERNEL  # routed: the tuner times it


# Mutants: each must be caught by the reference or the cancelling-rows comparison (12 rows: two
# row tiles; N = 41: a partial threadgroup) under one of the serial schedules.
MUTATIONS = {
    "a K order that depends on M": (
        "for (int kk = 0; kk < tile_k; kk += 8) {\n    simdgroup_matrix<MatT, 8, 8> b;",
        "for (int kk_ = 0; kk_ < tile_k; kk_ += 8) {\n    const int kk = M > 1 ? tile_k - 8 - kk_ : kk_;\n"
        "    simdgroup_matrix<MatT, 8, 8> b;"),
    "wrong scale (next group's)": ("group_scale[column] = static_cast<float>(scales[g]);",
                                   "group_scale[column] = static_cast<float>(scales[(g + 1) % (N * groups_per_column)]);"),
    "bias dropped": ("metal::fma(group_bias[c], row_sum[i / 8], total[j])", "total[j]"),
    "row sum of the wrong row": ("row_sum[i / 8]", "row_sum[0]"),
    "row sums of the second row tile not taken": ("if (static_cast<int>(tid) < Rows) {  // the row sums",
                                                   "if (static_cast<int>(tid) < 8) {  // the row sums"),
    "row sum not restarted per group": ("float s = group_start ? 0.0f : my_row_sum;", "float s = my_row_sum;"),
    "group dot products not restarted": (
        "      acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);\n    }\n    simdgroup_barrier",
        "    }\n    simdgroup_barrier"),
    "nibbles read in the wrong order": ("(packed >> (j * bits)) & mask", "(packed >> ((per_word - 1 - j) * bits)) & mask"),
    "half offset taken out wrong": ("code_offset = Mode == 0 && Mat == 1 ? 1024.0f", "code_offset = Mode == 0 && Mat == 1 ? 1023.0f"),
    "bfloat bit construction with the half's exponent": ("0x4300u | q", "0x4380u | q"),
    "e2m1 sign lost": ("e2m1[tid] = static_cast<MatT>((tid & 8u) ? -magnitude : magnitude);",
                       "e2m1[tid] = static_cast<MatT>(magnitude);"),
    "the second row tile reads the first's rows": ("&x_tile[t * 8 * ldx + kk]", "&x_tile[kk]"),
    "x tile read with the unpadded stride": ("simdgroup_load(a, &x_tile[t * 8 * ldx + kk], ldx);",
                                             "simdgroup_load(a, &x_tile[t * 8 * ldx + kk], tile_k);"),
    "a partial threadgroup's real columns not decoded": ("  if (n < N) {\n    const int k0", "  if (n < N && n0 + tile_n <= N) {\n    const int k0"),
    "dropped barrier after staging the tiles": (
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  if (static_cast<int>(tid) < Rows)",
        "\n  if (static_cast<int>(tid) < Rows)"),
    "dropped barrier after the step's products": (
        "  threadgroup_barrier(mem_flags::mem_threadgroup);  // the tiles read", "  // the tiles read"),
    "dropped barrier after a group's apply": (
        "    threadgroup_barrier(mem_flags::mem_threadgroup);  // before the next group's", "    // before the next group's"),
    "dropped simdgroup_barrier before the apply": (
        "simdgroup_barrier(mem_flags::mem_threadgroup);  // a lane reads", "// a lane reads"),
}
MUTANT_FORM = {"e2m1 sign lost": (("mxfp4", 4, 32), mx.float16),
               "bfloat bit construction with the half's exponent": (("affine", 4, 32), mx.bfloat16),
               "row sum not restarted per group": (("affine", 4, 32), mx.float16)}


def caught(sources, form, dtype, schedule) -> bool:
    mode, bits, group_size = form
    x, cancelling, w, scales, biases = quantized.cancelling_layer(12, 256, 41, bits, group_size, mode, dtype, seed=7)
    metal = emulated(sources, schedule)
    try:
        got = run(metal, x, w, scales, biases, form)
        assert_matches_reference(got, x, w, scales, biases, mode, bits, group_size)
        rows = run(metal, cancelling, w, scales, biases, form)
        np.testing.assert_array_equal(exact(rows[-1]), exact(run(metal, cancelling[-1:], w, scales, biases, form)[0]))
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_the_harness_catches_broken_splash_kernels(mutation):
    sources = mutated_sources(splash.SPLASH_KERNEL, *MUTATIONS[mutation])
    form, dtype = MUTANT_FORM.get(mutation, (("affine", 4, 32), mx.float16))
    assert caught(sources, form, dtype, LOWEST_FIRST) or caught(sources, form, dtype, HIGHEST_FIRST), \
        f"{mutation} went unnoticed"


@pytest.mark.parametrize("mutation", ["a K order that depends on M", "bias dropped", "dropped barrier after staging the tiles"])
def test_the_self_check_refuses_broken_splash_kernels(mutation):
    """``splash.check_splash`` through ``MetalKernels.usable`` (what a routing would run): the
    shipped kernel passes at 8 and 16 rows; a mutant fails under one of the serial schedules, with
    the warning naming the specialization."""
    x, w, scales, biases = layer(5, 256, 41, "affine", 4, 32, mx.float16, M=12)
    launch = splash.splash_launch(x, w, scales, biases, 32, 4)
    assert kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)).usable(launch, splash.check_splash)
    assert kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)).usable(splash.splash_launch(x[:3], w, scales, biases, 32, 4),
                                                                     splash.check_splash)
    sources = mutated_sources(splash.SPLASH_KERNEL, *MUTATIONS[mutation])
    for schedule in (LOWEST_FIRST, HIGHEST_FIRST):
        checked = kernels.MetalKernels(EmulatedMetal(schedule, sources))
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if not checked.usable(launch, splash.check_splash):
                message = str(warned[0].message)
                assert "quantized_verify_splash float16 float16 Mat=1 Rows=16 bits=4 group_size=32" in message
                assert "failed its self-check" in message
                return
    raise AssertionError(f"the self-check passed {mutation}")


def test_the_cost_model_of_splash_is_traffics_own():
    """``splash.cycle_steps`` recomputes a cycle from ``traffic``'s parts with one kernel's count for
    every quantized matmul of at most 16 rows: with the per-row kernel's count it must give
    ``traffic.cycle_steps`` exactly, so the Splash figures in docs/kernels.md come from the same
    model as the README's table."""
    gpu = traffic.gpu_named("M3 Pro")
    per_row = lambda M, bits: traffic.ops_per_weight("ours", M, bits)  # noqa: E731
    draft = traffic.draft_matmuls(*traffic.DRAFTS["9B"])
    for block in (1, 2, 8, 16):
        assert splash.cycle_steps(block, gpu, per_row) == pytest.approx(
            traffic.cycle_steps(traffic.QWEN35_9B, block, gpu, True, draft), rel=1e-12)
    # the Splash count: dearer than the float tile per padded row (the group apply), cheaper once
    assert splash.ops_per_weight(8, 4) > traffic.ops_per_weight("tile", 8, 4) - 0.5
    assert splash.SPLASH_ONCE[4] < traffic.TILE_ONCE[4]


@pytest.mark.slow  # every quantized matmul of the pair runs in the C++ emulator (about 20 s)
def test_a_quantized_pair_routed_to_splash_is_lossless(bf16_target_dir, tmp_path, small_prompts):
    """A w4 target and w4 draft with every quantized layer routed to the Splash kernel
    (``quantized.SPLASH``, one kernel at every row count): the target's verify pass of 8 tokens
    gives bit for bit the logits of its 8 decode steps (each padded to the 8-row tile), greedy
    speculative output equals the target alone at blocks 2 and 8, and every quantized matmul ran the
    Splash kernel (both row forms self-checked, none fell back; no other verify kernel)."""
    from dflash_mlx.cache import restore, snapshot
    from dflash_mlx.prefill import prefill
    from tests.reference import target_only
    from tests.test_emulated_metal import GREEDY, check_greedy_lossless, quantized_mac_pair
    from tests.test_lossless import take

    target, draft, metal = quantized_mac_pair(bf16_target_dir, tmp_path, 4, impl=quantized.SPLASH)
    ran = set()
    real_run = metal.run
    metal.run = lambda launch: ran.add(launch.name) or real_run(launch)
    prompt = small_prompts[0]
    tokens, _ = take(target_only(target, prompt, GREEDY), 8)
    cache = target.make_cache()
    prefill(target, prompt, cache, 64)
    before = snapshot(cache)
    verify = exact(target.forward(mx.array(tokens)[None], cache)[0][0])
    restore(cache, before)
    for r, token in enumerate(tokens):
        np.testing.assert_array_equal(verify[r], exact(target.forward(mx.array([[token]]), cache)[0][0, -1]),
                                      err_msg=f"verify row {r} against its decode step")
    check_greedy_lossless(target, draft, small_prompts[:1], [2, 8], n=16)
    report = {k: v for k, v in metal.report().items() if k.startswith("quantized_verify")}
    rows = {int(k.split("Rows=")[1].split()[0]) for k in report}
    assert rows == {8, 16} and set(report.values()) == {"ok"}, report
    assert all(k.startswith(splash.SPLASH_KERNEL + " ") for k in report), report
    assert {name for name in ran if name.startswith("quantized_verify")} == {splash.SPLASH_KERNEL}, ran


def test_the_docs_table_is_the_models():
    """docs/kernels.md's Splash cycle table is what ``python -m dflash_mlx.splash`` prints now."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text()
    for line in splash.cycle_table():
        assert line in text, f"docs/kernels.md lacks: {line}"
