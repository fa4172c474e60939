"""The Metal kernels, compiled unchanged as C++ and run on the CPU, against the pure-MLX references."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import kernels
from tests.metal_emulation import HIGHEST_FIRST, LOWEST_FIRST, PARALLEL, EmulatedKernels

# (Dk, Dv, Hk, Hv): Hv/Hk ratios 1, 2 and 4; Dk one and two elements per lane.
SHAPES = [(32, 4, 2, 2), (64, 8, 2, 4), (32, 4, 1, 4)]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
# y is rounded to the input dtype by both sides; allow one rounding step of it.
Y_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


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


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "Dk{}-Dv{}-Hk{}-Hv{}".format(*s))
def emulated(request):
    return EmulatedKernels(*request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_verify_kernel_and_replay_equal_the_reference(emulated, dtype):
    Dk, Dv, Hk, Hv = emulated.shape
    rng = np.random.default_rng(hash((emulated.shape, str(dtype))) % 2**32)
    for i, (B, T) in enumerate([(1, 1), (2, int(rng.integers(2, 9))), (1, 16)]):
        q, k, v, g, beta, state = inputs(rng, B, T, Dk, Dv, Hk, Hv, dtype)
        want_y, want_state, want_delta = kernels.gated_delta_reference(q, k, v, g, beta, state)
        # Free-running threads always, plus one serial schedule in turn (the sweep covers both).
        for schedule in (PARALLEL, (LOWEST_FIRST, HIGHEST_FIRST)[i % 2]):
            y, final_state, delta = emulated.gated_delta(q, k, v, g, beta, state, schedule=schedule)
            assert y.dtype == dtype
            np.testing.assert_allclose(as_numpy(y), as_numpy(want_y), atol=Y_TOLERANCE[dtype], rtol=Y_TOLERANCE[dtype])
            np.testing.assert_allclose(np.array(final_state), np.array(want_state), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(np.array(delta), np.array(want_delta), atol=1e-5, rtol=1e-5)
        # Replay: same operations in the same order as the reference, so equal bit for bit.
        for steps in range(T + 1):
            replayed = emulated.tape_replay(state, k, g, want_delta, steps)
            np.testing.assert_array_equal(
                np.array(replayed), np.array(kernels.tape_replay_reference(state, k, g, want_delta, steps))
            )
        # Replaying the whole tape lands on the verify pass's own final state.
        np.testing.assert_allclose(
            np.array(emulated.tape_replay(state, k, g, delta, T)), np.array(final_state), atol=1e-5, rtol=1e-5
        )


def test_rows_per_threadgroup_do_not_change_results():
    emulated = EmulatedKernels(32, 8, 2, 4)
    rng = np.random.default_rng(5)
    q, k, v, g, beta, state = inputs(rng, 1, 6, 32, 8, 2, 4, mx.float32)
    results = [emulated.gated_delta(q, k, v, g, beta, state, rows_per_group=r) for r in (1, 2, 4, 8)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(np.array(a), np.array(b))


FIRST_BARRIER = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n\n  const float g_t"
MUTATIONS = {
    "wrong GQA head index": ("gated_delta_tape", "hv_idx / (Hv / Hk)", "hv_idx % Hk"),
    "wrong state index": ("gated_delta_tape", "kv += state[i] * k_step[n_per_t * lane + i];", "kv += state[i] * k_step[lane + i];"),
    "dropped barrier before reading k/q": ("gated_delta_tape", FIRST_BARRIER, "\n  const float g_t"),
    "dropped barrier before overwriting k/q": (
        "gated_delta_tape", "  threadgroup_barrier(mem_flags::mem_threadgroup);\n}", "}",
    ),
    "wrong gate (first step's for all)": ("gated_delta_tape", "const float g_t = g_[t * Hv];", "const float g_t = g_[0];"),
    "delta missing beta": ("gated_delta_tape", " * static_cast<float>(beta_[t * Hv]);", ";"),
    "replay: gate dropped": ("tape_replay", "state[i] = state[i] * g_t;\n", "\n"),
    "replay: wrong head index": ("tape_replay", "hv_idx / (Hv / Hk)", "hv_idx % Hk"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_the_harness_catches_broken_kernels(mutation):
    kernel, original, broken = MUTATIONS[mutation]
    sources = {name: kernels.kernel_source(name) for name in kernels.KERNEL_NAMES}
    assert sources[kernel].count(original) == 1, "mutation no longer applies: update the test"
    sources[kernel] = sources[kernel].replace(original, broken)
    shape = (64, 4, 2, 4)  # two state elements per lane, so a wrong lane offset shows
    mutant = EmulatedKernels(*shape, sources=sources)
    rng = np.random.default_rng(9)
    q, k, v, g, beta, state = inputs(rng, 1, 5, *shape, mx.float32)
    want = kernels.gated_delta_reference(q, k, v, g, beta, state)
    if kernel == "tape_replay":
        got = mutant.tape_replay(state, k, g, want[2], 5)
        assert not np.allclose(np.array(got), np.array(kernels.tape_replay_reference(state, k, g, want[2], 5)), atol=1e-4)
        return
    # Deterministic schedules only: the mutant must fail the same way every run.
    caught = []
    for schedule in (LOWEST_FIRST, HIGHEST_FIRST):
        got = mutant.gated_delta(q, k, v, g, beta, state, schedule=schedule)
        caught.append(not all(np.allclose(as_numpy(a), as_numpy(b), atol=1e-4) for a, b in zip(got, want)))
    assert any(caught), f"{mutation} went unnoticed"


def test_model_rollback_goes_through_kernels(hf_target_dir, draft, monkeypatch):
    """The target's verify pass and rollback call kernels.py, and the output stays lossless.

    A freshly loaded target: its compiled layers call the recurrence only while they trace, once
    per shape, so a model that already ran in this process would not call it again."""
    from dflash_mlx.loading import load_target
    from dflash_mlx.sampling import Sampler
    from dflash_mlx.speculative import speculative, target_only
    from tests.test_lossless import take

    calls = {"gated_delta": 0, "tape_replay": 0}
    for name in calls:
        original = getattr(kernels, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    target, _ = load_target(hf_target_dir)
    prompt = mx.array([3, 14, 15, 92, 65, 35], dtype=mx.int32)
    expected, _ = take(target_only(target, prompt, Sampler()), 20)
    got, _ = take(speculative(target, draft, prompt, Sampler(), block_tokens=4), 20)
    assert got == expected and calls["gated_delta"] > 0 and calls["tape_replay"] > 0


def test_reference_switch_and_dispatch_rules(monkeypatch):
    k = mx.zeros((1, 2, 2, 64))
    v = mx.zeros((1, 2, 4, 16))
    monkeypatch.setenv(kernels.BACKEND_ENV, "reference")
    assert not kernels.use_metal(k, v)
    monkeypatch.delenv(kernels.BACKEND_ENV)
    assert kernels.use_metal(k, v) == (mx.metal.is_available() and mx.default_device() == mx.gpu)
    assert not kernels.use_metal(mx.zeros((1, 2, 2, 48)), v)  # Dk not a multiple of 32


def test_kernel_sources_and_the_demo_pair_ship_in_the_wheel(tmp_path):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(root)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("dflash_mlx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for kernel in kernels.KERNEL_NAMES:
        assert f"dflash_mlx/metal/{kernel}.metal" in names
    demo = root / "dflash_mlx" / "demo"
    shipped = {str(p.relative_to(root)) for p in demo.rglob("*") if p.is_file()}
    assert {"dflash_mlx/demo/target/model.safetensors", "dflash_mlx/demo/draft/model.safetensors"} <= shipped
    assert shipped <= set(names), sorted(shipped - set(names))


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (Metal)")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_metal_kernels_on_an_apple_gpu(dtype):
    """On a Mac: the real kernels against the same references (in addition to the emulation)."""
    rng = np.random.default_rng(2)
    for (Dk, Dv, Hk, Hv), T in itertools.product([(128, 128, 16, 32), (64, 8, 2, 4)], [1, 8, 16]):
        q, k, v, g, beta, state = inputs(rng, 2, T, Dk, Dv, Hk, Hv, dtype)
        with mx.stream(mx.gpu):
            got = kernels.gated_delta_metal(q, k, v, g, beta, state)
            want = kernels.gated_delta_reference(q, k, v, g, beta, state)
            for a, b in zip(got, want):
                np.testing.assert_allclose(as_numpy(a), as_numpy(b), atol=Y_TOLERANCE[dtype], rtol=Y_TOLERANCE[dtype])
            for steps in range(T + 1):
                np.testing.assert_allclose(
                    np.array(kernels.tape_replay_metal(state, k, g, want[2], steps)),
                    np.array(kernels.tape_replay_reference(state, k, g, want[2], steps)), atol=1e-5, rtol=1e-5,
                )
