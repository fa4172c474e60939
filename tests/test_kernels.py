"""The Metal kernels, run through the emulated ``mx.fast.metal_kernel`` with the very arguments
``kernels.py`` passes, against the pure-MLX references."""

from __future__ import annotations

import dataclasses
import itertools

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import kernels
from tests.metal_emulation import (
    HIGHEST_FIRST,
    LOWEST_FIRST,
    PARALLEL,
    EmulatedMetal,
    GeneratedKernel,
    MetalCompileError,
    mutated_sources,
    to_array,
)

# (Dk, Dv, Hk, Hv): Hv/Hk ratios 1, 2 and 4; Dk one and two elements per lane; the demo's heads.
SHAPES = [(32, 4, 2, 2), (64, 8, 2, 4), (32, 4, 1, 4), (32, 16, 2, 4)]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# y is rounded to the input dtype by both sides; allow one rounding step of it.
Y_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
SCHEDULES_USED = (PARALLEL, LOWEST_FIRST, HIGHEST_FIRST)
# Fixed per shape and dtype (not Python's salted hash()), so every run draws the same inputs.
SEEDS = {(shape, str(dtype)): 100 * i + j for i, shape in enumerate(SHAPES) for j, dtype in enumerate(DTYPES)}


def inputs(rng, B, T, Dk, Dv, Hk, Hv, dtype):
    def normal(shape, scale):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    q, k = normal((B, T, Hk, Dk), Dk**-0.5), normal((B, T, Hk, Dk), Dk**-0.5)
    v = normal((B, T, Hv, Dv), 1.0)
    g = mx.array(rng.uniform(0.3, 1.0, (B, T, Hv)).astype(np.float32))
    beta = mx.array(rng.uniform(0.0, 1.0, (B, T, Hv)).astype(np.float32)).astype(dtype)
    state = mx.array(rng.standard_normal((B, Hv, Dv, Dk)).astype(np.float32))
    return q, k, v, g, beta, state


def as_numpy(x):
    return np.array(x.astype(mx.float32))


def emulated(schedule=PARALLEL, sources=None) -> kernels.MetalKernels:
    """The engine's kernel dispatcher over the emulator, self-check off: the raw kernels."""
    return kernels.MetalKernels(EmulatedMetal(schedule, sources), self_check=False)


def verify(metal, q, k, v, g, beta, state, threadgroup=kernels.THREADGROUP):
    return metal.run(dataclasses.replace(kernels.gated_delta_launch(q, k, v, g, beta, state), threadgroup=threadgroup))


def replay(metal, state, k, g, delta, steps):
    return metal.run(kernels.tape_replay_launch(state, k, g, delta, steps))[0]


# Every shape in float32 (the index math), every dtype on the grouped-heads shape (the loads and
# the rounding of y): the dtypes do not enter the indexing.
CASES = [(shape, mx.float32) for shape in SHAPES] + [(SHAPES[1], dtype) for dtype in DTYPES if dtype != mx.float32]


@pytest.mark.parametrize("shape,dtype", CASES, ids=lambda c: "Dk{}-Dv{}-Hk{}-Hv{}".format(*c) if isinstance(c, tuple)
                         else str(c).split(".")[-1])
def test_verify_kernel_and_replay_equal_the_reference(shape, dtype):
    Dk, Dv, Hk, Hv = shape
    rng = np.random.default_rng(SEEDS[(shape, str(dtype))])
    metals = {schedule: emulated(schedule) for schedule in SCHEDULES_USED}
    for i, (B, T) in enumerate([(1, 1), (2, int(rng.integers(2, 9))), (1, 16)]):
        q, k, v, g, beta, state = inputs(rng, B, T, Dk, Dv, Hk, Hv, dtype)
        want_y, want_state, want_delta = kernels.gated_delta_reference(q, k, v, g, beta, state)
        # Free-running threads always, plus one serial schedule in turn (the sweep covers both).
        for schedule in (PARALLEL, (LOWEST_FIRST, HIGHEST_FIRST)[i % 2]):
            y, final_state, delta = verify(metals[schedule], q, k, v, g, beta, state)
            assert y.dtype == dtype
            np.testing.assert_allclose(as_numpy(y), as_numpy(want_y), atol=Y_TOLERANCE[dtype], rtol=Y_TOLERANCE[dtype])
            np.testing.assert_allclose(np.array(final_state), np.array(want_state), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(np.array(delta), np.array(want_delta), atol=1e-5, rtol=1e-5)
        # Replay: same operations in the same order as the reference, so equal bit for bit.
        for steps in range(T + 1):
            np.testing.assert_array_equal(
                np.array(replay(metals[LOWEST_FIRST], state, k, g, want_delta, steps)),
                np.array(kernels.tape_replay_reference(state, k, g, want_delta, steps)),
            )
        # Replaying the whole tape lands on the verify pass's own final state.
        np.testing.assert_allclose(
            np.array(replay(metals[LOWEST_FIRST], state, k, g, delta, T)), np.array(final_state), atol=1e-5, rtol=1e-5
        )


def test_rows_per_threadgroup_do_not_change_results():
    metal = emulated()
    rng = np.random.default_rng(5)
    q, k, v, g, beta, state = inputs(rng, 1, 6, 32, 8, 2, 4, mx.float32)
    results = [verify(metal, q, k, v, g, beta, state, threadgroup=(32, r, 1)) for r in (1, 2, 4, 8)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(np.array(a), np.array(b))


# The kernels before the address-space fix: typed `device` input pointers. Kept as mutants.
UNFIXED_TAPE = {
    "auto g_ = g + b_idx * T * Hv + hv_idx;": "const device float* g_ = g + b_idx * T * Hv + hv_idx;",
    "auto beta_ = beta + b_idx * T * Hv + hv_idx;": "const device InT* beta_ = beta + b_idx * T * Hv + hv_idx;",
}
UNFIXED_REPLAY = {"auto g_ = g + b_idx * T * Hv + hv_idx;": "const device float* g_ = g + b_idx * T * Hv + hv_idx;"}


def _unfixed(kernel, replacements):
    source = kernels.kernel_source(kernel)
    for fixed, unfixed in replacements.items():
        assert source.count(fixed) == 1, "mutation no longer applies: update the test"
        source = source.replace(fixed, unfixed)
    return {kernel: source}


def test_small_inputs_compile_in_the_constant_address_space():
    """MLX passes inputs of under 8 elements as `constant`: a one-token call on a model with 4
    value heads (the demo) hands g and beta over that way. The unfixed kernels assigned them to
    `device` pointers, which Metal refuses; the fixed ones compile and match at B = 1, T = 1."""
    Dk, Dv, Hk, Hv = 32, 16, 2, 4  # the demo's Gated DeltaNet heads
    q, k, v, g, beta, state = inputs(np.random.default_rng(3), 1, 1, Dk, Dv, Hk, Hv, mx.float32)
    want = kernels.gated_delta_reference(q, k, v, g, beta, state)
    with pytest.raises(MetalCompileError, match="constant"):
        verify(emulated(sources=_unfixed("gated_delta_tape", UNFIXED_TAPE)), q, k, v, g, beta, state)
    with pytest.raises(MetalCompileError, match="constant"):
        replay(emulated(sources=_unfixed("tape_replay", UNFIXED_REPLAY)), state, k, g, want[2], 1)
    metal = emulated()
    for got, expected in zip(verify(metal, q, k, v, g, beta, state), want):
        np.testing.assert_allclose(as_numpy(got), as_numpy(expected), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(
        np.array(replay(metal, state, k, g, want[2], 1)), np.array(kernels.tape_replay_reference(state, k, g, want[2], 1))
    )
    # With 8 or more elements the same unfixed body compiles: why real models (16+ heads) escaped.
    q, k, v, g, beta, state = inputs(np.random.default_rng(3), 1, 2, Dk, Dv, Hk, Hv, mx.float32)
    verify(emulated(sources=_unfixed("gated_delta_tape", UNFIXED_TAPE)), q, k, v, g, beta, state)


def test_inputs_reach_the_kernel_in_the_dtype_it_computes_in():
    """MLX declares each input with its own dtype. A q of another dtype than k is cast by
    kernels.py; a body that assumed the template type for an uncast input would not compile."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(4), 1, 3, 32, 8, 2, 4, mx.float32)
    launch = kernels.gated_delta_launch(q.astype(mx.float16), k, v.astype(mx.bfloat16), g, beta.astype(mx.float16), state)
    assert [a.dtype for a in launch.inputs[:6]] == [mx.float32] * 6
    got = emulated().run(launch)
    want = kernels.gated_delta_reference(q.astype(mx.float16).astype(mx.float32), k, v.astype(mx.bfloat16).astype(mx.float32),
                                         g, beta.astype(mx.float16).astype(mx.float32), state)
    np.testing.assert_allclose(as_numpy(got[0]), as_numpy(want[0]), atol=1e-5, rtol=1e-5)
    typed = {"auto q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;": "const device InT* q_ = q + b_idx * T * Hk * Dk + hk_idx * Dk;"}
    uncast = dataclasses.replace(launch, inputs=(q.astype(mx.float16), *launch.inputs[1:]))
    with pytest.raises(MetalCompileError):
        emulated(sources=_unfixed("gated_delta_tape", typed)).run(uncast)


def test_the_generated_signature_follows_mlx():
    """The emulator's source is MLX's: address space by size, type by dtype, scalars as references."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(0), 1, 1, 32, 16, 2, 4, mx.bfloat16)
    launch = kernels.gated_delta_launch(q, k, v, g, beta, state)
    names, outputs = kernels.KERNEL_IO[launch.name]
    generated = GeneratedKernel(launch.name, names, outputs, kernels.kernel_source(launch.name), "",
                                [to_array(x) for x in launch.inputs], launch.output_dtypes, launch.template)
    text = generated.metal_source
    assert "template <typename InT, typename StT, int Dk, int Dv, int Hk, int Hv>" in text
    assert "  const device bfloat16_t* q [[buffer(0)]]," in text
    assert "  const constant float* g [[buffer(3)]]," in text  # 4 elements
    assert "  const constant bfloat16_t* beta [[buffer(4)]]," in text
    assert "  const constant int32_t& T [[buffer(6)]]," in text
    assert "  device bfloat16_t* y [[buffer(7)]]," in text
    assert "  uint3 thread_position_in_grid [[thread_position_in_grid]]" in text
    assert "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]]" in text
    assert generated.kernel_name == (
        "custom_kernel_gated_delta_tape__bfloat16_t_float_32_16_2_4"  # MLX: "_" + "_bfloat16_t_..."
        "_bfloat16_t_bfloat16_t_bfloat16_t_floatc_bfloat16_tc_float_int32_ts_bfloat16_t_float_float"
    )
    assert f'template [[host_name("{generated.kernel_name}")]] [[kernel]] decltype(' in text


@pytest.mark.parametrize("broken", ["renamed input", "missing template argument", "undeclared name"])
def test_call_glue_mismatches_fail_to_compile(broken):
    q, k, v, g, beta, state = inputs(np.random.default_rng(1), 1, 2, 32, 8, 2, 4, mx.float32)
    launch = kernels.gated_delta_launch(q, k, v, g, beta, state)
    names, outputs = kernels.KERNEL_IO[launch.name]
    source = kernels.kernel_source(launch.name)
    if broken == "renamed input":
        names = ("query", *names[1:])
    elif broken == "missing template argument":
        launch = dataclasses.replace(launch, template=tuple(a for a in launch.template if a[0] != "Hk"))
    else:
        source = source.replace("const float g_t = static_cast<float>(g_[t * Hv]);", "const float g_t = gate[t];")
    kernel = EmulatedMetal()(name=launch.name, input_names=list(names), output_names=list(outputs), source=source)
    with pytest.raises(MetalCompileError):
        kernel(inputs=list(launch.inputs), template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
               output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))


def test_replay_refuses_more_steps_than_the_tape_holds():
    q, k, v, g, beta, state = inputs(np.random.default_rng(2), 1, 3, 32, 8, 2, 4, mx.float32)
    with pytest.raises(ValueError, match="steps=4 outside 0..3"):
        kernels.tape_replay_launch(state, k, g, v.astype(mx.float32), 4)
    with pytest.raises(ValueError, match="steps=4 outside 0..3"):
        kernels.Recurrence().tape_replay(state, k, g, v.astype(mx.float32), 4)


FIRST_BARRIER = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  const float g_t"
MUTATIONS = {
    "wrong GQA head index": ("gated_delta_tape", "hv_idx / (Hv / Hk)", "hv_idx % Hk"),
    "wrong state index": ("gated_delta_tape", "kv += state[i] * k_step[n_per_t * lane + i];", "kv += state[i] * k_step[lane + i];"),
    "dropped barrier before reading k/q": ("gated_delta_tape", FIRST_BARRIER, "\n  const float g_t"),
    "dropped barrier before overwriting k/q": (
        "gated_delta_tape", "  threadgroup_barrier(mem_flags::mem_threadgroup);\n}", "}",
    ),
    "wrong gate (first step's for all)": (
        "gated_delta_tape", "const float g_t = static_cast<float>(g_[t * Hv]);", "const float g_t = static_cast<float>(g_[0]);",
    ),
    "delta missing beta": ("gated_delta_tape", " * static_cast<float>(beta_[t * Hv]);", ";"),
    "replay: gate dropped": ("tape_replay", "state[i] = state[i] * g_t;\n", "\n"),
    "replay: wrong head index": ("tape_replay", "hv_idx / (Hv / Hk)", "hv_idx % Hk"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_the_harness_catches_broken_kernels(mutation):
    kernel, original, broken = MUTATIONS[mutation]
    sources = mutated_sources(kernel, original, broken)
    shape = (64, 4, 2, 4)  # two state elements per lane, so a wrong lane offset shows
    rng = np.random.default_rng(9)
    q, k, v, g, beta, state = inputs(rng, 1, 5, *shape, mx.float32)
    want = kernels.gated_delta_reference(q, k, v, g, beta, state)
    if kernel == "tape_replay":
        got = replay(emulated(sources=sources), state, k, g, want[2], 5)
        assert not np.allclose(np.array(got), np.array(kernels.tape_replay_reference(state, k, g, want[2], 5)), atol=1e-4)
        return
    # Deterministic schedules only: the mutant must fail the same way every run.
    caught = []
    for schedule in (LOWEST_FIRST, HIGHEST_FIRST):
        got = verify(emulated(schedule, sources), q, k, v, g, beta, state)
        caught.append(not all(np.allclose(as_numpy(a), as_numpy(b), atol=1e-4) for a, b in zip(got, want)))
    assert any(caught), f"{mutation} went unnoticed"


def test_model_rollback_goes_through_its_recurrence(hf_target_dir, draft):
    """The target's verify pass and rollback call the Recurrence it was loaded with, and the
    output stays lossless. A freshly loaded target: its compiled layers call the recurrence only
    while they trace, once per shape."""
    from dflash_mlx.loading import load_target
    from dflash_mlx.sampling import Sampler
    from dflash_mlx.speculative import speculative
    from tests.reference import target_only
    from tests.test_lossless import take

    calls = {"gated_delta": 0, "tape_replay": 0}

    class Counted(kernels.Recurrence):
        def gated_delta(self, *args, **kwargs):
            calls["gated_delta"] += 1
            return super().gated_delta(*args, **kwargs)

        def tape_replay(self, *args, **kwargs):
            calls["tape_replay"] += 1
            return super().tape_replay(*args, **kwargs)

    target, _ = load_target(hf_target_dir, recurrence=Counted(chunked=True))
    prompt = mx.array([3, 14, 15, 92, 65, 35], dtype=mx.int32)
    expected, _ = take(target_only(target, prompt, Sampler()), 20)
    got, _ = take(speculative(target, draft, prompt, Sampler(), block_tokens=4), 20)
    assert got == expected and calls["gated_delta"] > 0 and calls["tape_replay"] > 0


def test_reference_switch_and_dispatch_rules(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "reference")
    assert kernels.Recurrence.for_this_process().mode(64, 2, 16, 4) == "reference"
    monkeypatch.delenv(kernels.BACKEND_ENV)
    on_metal = mx.metal.is_available() and mx.default_device() == mx.gpu
    assert kernels.Recurrence.for_this_process().mode(64, 2, 16, 4) == ("metal" if on_metal else "chunked")
    metal = kernels.Recurrence(metal=emulated())
    assert metal.mode(64, 2, 16, 4) == "metal"
    assert metal.mode(48, 2, 16, 4) == "reference"  # Dk not a multiple of 32
    assert metal.mode(64, 2, 6, 4) == "reference"  # Dv not a multiple of 4


def test_every_module_the_kernel_sources_and_the_demo_pair_ship_in_the_wheel(tmp_path):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    import shutil

    root = Path(__file__).resolve().parents[1]
    # Built from a copy of the files git would commit: an in-tree build reads the editable install's
    # egg-info and build/ folder, which can list modules the packaging itself would leave out.
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    source = tmp_path / "source"
    for name in filter(None, files):
        if (root / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, source / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("dflash_mlx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    from dflash_mlx import quantized

    for kernel in kernels.KERNEL_NAMES + tuple(quantized.KERNEL_OF.values()):
        assert f"dflash_mlx/metal/{kernel}.metal" in names
    assert {n for n in names if n.endswith(".metal")} == {f"dflash_mlx/metal/{p.name}" for p in (root / "metal").glob("*.metal")}
    modules = {str(p.relative_to(root)) for p in (root / "dflash_mlx").rglob("*.py")}
    assert modules <= set(names), f"modules missing from the wheel: {sorted(modules - set(names))}"
    demo = root / "dflash_mlx" / "demo"
    shipped = {str(p.relative_to(root)) for p in demo.rglob("*") if p.is_file()}
    assert {"dflash_mlx/demo/target/model.safetensors", "dflash_mlx/demo/draft/model.safetensors"} <= shipped
    assert shipped <= set(names), sorted(shipped - set(names))


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (Metal)")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_metal_kernels_on_an_apple_gpu(dtype):
    """On a Mac: the real kernels, through the engine's own dispatcher and its self-check, against
    the same references (in addition to the emulation); B = 1 and T = 1 included, and the demo's
    4 value heads, whose one-token inputs MLX passes in the constant address space."""
    rng = np.random.default_rng(2)
    metal = kernels.MetalKernels()
    shapes = [(128, 128, 16, 32), (64, 8, 2, 4), (32, 16, 2, 4)]
    for (Dk, Dv, Hk, Hv), B, T in itertools.product(shapes, [1, 2], [1, 8, 16]):
        q, k, v, g, beta, state = inputs(rng, B, T, Dk, Dv, Hk, Hv, dtype)
        with mx.stream(mx.gpu):
            got = metal.gated_delta(q, k, v, g, beta, state)
            assert got is not None, metal.report()
            want = kernels.gated_delta_reference(q, k, v, g, beta, state)
            for a, b in zip(got, want):
                np.testing.assert_allclose(as_numpy(a), as_numpy(b), atol=Y_TOLERANCE[dtype], rtol=Y_TOLERANCE[dtype])
            for steps in range(T + 1):
                replayed = metal.tape_replay(state, k, g, want[2], steps)
                assert replayed is not None, metal.report()
                np.testing.assert_allclose(
                    np.array(replayed), np.array(kernels.tape_replay_reference(state, k, g, want[2], steps)),
                    atol=1e-5, rtol=1e-5,
                )
    assert set(metal.report().values()) == {"ok"}, metal.report()


def test_kernel_sources_are_read_from_this_checkout():
    """In a checkout the ``.metal`` files beside the imported package are the ones run (an editable
    install maps ``dflash_mlx.metal`` to the checkout it was installed from, maybe another one)."""
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "metal"
    assert Path(str(kernels.metal_sources())) == here
    assert kernels.kernel_source("quantized_verify") == (here / "quantized_verify.metal").read_text()


def test_self_checks_cover_each_signature_a_call_makes():
    """A specialization is checked once per (dtype, address space) combination of its inputs: the
    unfixed kernel (typed `device` pointers) passes its check as a block (every input in `device`)
    and fails it as one token on 4 value heads (g and beta `constant`), where the engine then takes
    mlx-lm's kernel instead of compiling an unchecked source."""
    template = dict(InT=mx.float32, StT=mx.float32, Dk=32, Dv=16, Hk=2, Hv=4)
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, _unfixed("gated_delta_tape", UNFIXED_TAPE)))
    block = kernels._check_inputs(template, 8, mx.float32)
    one = kernels._check_inputs(template, 1, mx.float32)
    assert [a.signature for a in (kernels.gated_delta_launch(*block), kernels.gated_delta_launch(*one))] == [
        (("float32", "d"),) * 6 + (("int32", "s"),),
        (("float32", "d"),) * 3 + (("float32", "c"),) * 2 + (("float32", "d"), ("int32", "s"))]
    assert not isinstance(metal.gated_delta(*block)[2], kernels.StepInputs)  # ours, with its tape
    with pytest.warns(RuntimeWarning, match="constant g,beta failed its self-check .* mlx-lm's gated_delta kernel"):
        y, state, tape = metal.gated_delta(*one)
    assert isinstance(tape, kernels.StepInputs)
    want = kernels.gated_delta_reference(*one)
    np.testing.assert_allclose(np.array(y), np.array(want[0]), atol=1e-5, rtol=1e-5)
    assert [v == "ok" for v in metal.report().values()].count(False) == 1


def test_kernel_names_tell_sources_apart_on_mlx_0_30_and_0_31():
    """MLX 0.30/0.31 name a generated source by kernel name and template only, and rebuild a
    library whose name now stands for another source. Ours are built under the name plus the call
    signature: alternating decode steps (g, beta `constant` on 4 heads) and blocks rebuild nothing
    (the bare name would rebuild at every switch)."""
    template = dict(InT=mx.float32, StT=mx.float32, Dk=32, Dv=16, Hk=2, Hv=4)
    calls = [kernels.gated_delta_launch(*kernels._check_inputs(template, T, mx.float32)) for T in (1, 8, 1, 8)]
    emulator = EmulatedMetal(LOWEST_FIRST, mlx_version=(0, 31))
    metal = kernels.MetalKernels(emulator, self_check=False)
    for launch in calls:
        metal.run(launch)
    assert emulator.rebuilds == 0 and len(emulator.libraries) == 2
    bare = EmulatedMetal(LOWEST_FIRST, mlx_version=(0, 31))
    names, outputs = kernels.KERNEL_IO["gated_delta_tape"]
    kernel = bare(name="gated_delta_tape", input_names=list(names), output_names=list(outputs),
                  source=kernels.kernel_source("gated_delta_tape"))
    for launch in calls:
        kernel(inputs=list(launch.inputs), template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
               output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))
    assert bare.rebuilds == 3


def test_fallback_chain_never_loops_per_token_on_a_gpu(monkeypatch):
    """Our kernel and mlx-lm's both failing their self-checks: a block (or a prefill chunk) takes
    the chunked form, a handful of batched operations, not the per-token reference loop."""
    sources = {**mutated_sources("gated_delta_tape", *MUTATIONS["delta missing beta"][1:]),
               **mutated_sources(kernels.MLX_LM_KERNEL, "* beta_[hv_idx];", ";")}
    recurrence = kernels.Recurrence(metal=kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, sources)))
    q, k, v, g, beta, state = inputs(np.random.default_rng(6), 1, 8, 32, 16, 2, 4, mx.float32)
    loops = []
    real_reference = kernels.gated_delta_reference
    monkeypatch.setattr(kernels, "gated_delta_reference", lambda *a: loops.append(a[0] is q) or real_reference(*a))
    with pytest.warns(RuntimeWarning) as warned:
        y, final, delta = recurrence.gated_delta(q, k, v, g, beta, state)
    assert {str(w.message).split()[4] for w in warned} == {"gated_delta_tape", kernels.MLX_LM_KERNEL}
    assert loops and not any(loops)  # the self-checks' references only: the call itself is not looped
    want = real_reference(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.array(y), np.array(want[0]), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.array(final), np.array(want[1]), atol=2e-5, rtol=2e-5)
