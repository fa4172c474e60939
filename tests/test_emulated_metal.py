"""The engine on the emulated Mac path.

The target is loaded the way it runs on an Apple GPU: its Gated DeltaNet layers in the ``metal``
recurrence mode (run plain here: the emulator runs a kernel on the host, which ``mx.compile`` cannot
trace; tests/test_compiled_kernels.py covers the compiled form), every recurrence and replay
dispatched by ``kernels.MetalKernels`` through ``mx.fast.metal_kernel``'s signature, here the
emulator's stand-in (the shipped ``.metal`` sources compiled as C++). The lossless tests run on that path for float32 and bfloat16
checkpoints (each test on one: the kernels' dtypes are compared with the reference one by one in
``test_kernels``; bfloat16 where outputs are checked, float32 where caches are compared to a tight
tolerance); mutated kernels make them fail; a kernel that fails its self-check falls back.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash_mlx import kernels
from dflash_mlx.loading import load_target
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from tests import test_sampling
from tests.conftest import VOCAB, make_draft, make_hf_target, random_prompts
from tests.metal_emulation import HIGHEST_FIRST, LOWEST_FIRST, EmulatedMetal, mutated_sources
from tests.test_kernels import MUTATIONS
from tests.test_lossless import (
    OracleDraft,
    ScriptedBlock,
    assert_caches_hold_the_committed_tokens,
    assert_lossless,
    stop_after,
    changing_blocks,
    take,
)

GREEDY = Sampler()


def emulated_recurrence(sources=None, self_check=True, schedule=LOWEST_FIRST) -> kernels.Recurrence:
    """The recurrence a Mac runs, over the emulator: kernels dispatched and self-checked."""
    return kernels.Recurrence(metal=kernels.MetalKernels(EmulatedMetal(schedule, sources), self_check=self_check))


BFLOAT16 = pytest.mark.parametrize("checkpoint", ["bfloat16"], indirect=True)
FLOAT32 = pytest.mark.parametrize("checkpoint", ["float32"], indirect=True)


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    return make_hf_target(tmp_path_factory.mktemp(f"mac_target_{request.param}"), dtype=request.param)


@pytest.fixture(scope="module")
def mac_pair(checkpoint, tmp_path_factory):
    target, config = load_target(checkpoint, recurrence=emulated_recurrence())
    assert all(l.linear_attn.recurrence_mode() == "metal" for l in target.layers if l.is_linear)
    draft = make_draft(tmp_path_factory.mktemp("mac_draft"), target, config, block_size=8)
    return target, draft, config


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, VOCAB, seed=7)


def kernels_used(target) -> dict:
    return next(l.linear_attn.recurrence for l in target.layers if l.is_linear).metal.report()


def check_greedy_lossless(target, draft, prompts, blocks, n=20):
    for prompt in prompts:
        expected, _ = take(target_only(target, prompt, GREEDY), n)
        for block in blocks:
            got, _ = take(speculative(target, draft, prompt, GREEDY, block_tokens=block), n)
            assert_lossless(target, prompt, expected, got)


@BFLOAT16
def test_greedy_is_lossless_on_the_emulated_metal_path(mac_pair, prompts):
    target, draft, _ = mac_pair
    check_greedy_lossless(target, draft, prompts, [2, 4, 8])
    report = kernels_used(target)
    assert report and set(report.values()) == {"ok"}, report  # the kernels ran; none fell back


@pytest.mark.slow  # every kernel call runs in the C++ emulator
@FLOAT32
def test_changing_blocks_are_lossless_on_the_emulated_metal_path(mac_pair, prompts):
    """Sizes chosen per cycle (scripted through 1 with shadows, and the auto controller): greedy
    output, and the caches after every cycle, as the target alone gives them."""
    from dflash_mlx.block_policy import AutoBlock, BlockStats

    target, draft, config = mac_pair
    stats = BlockStats.seeded(0)
    for prompt in prompts:
        expected, _ = take(target_only(target, prompt, GREEDY), 24)
        for blocks in (ScriptedBlock(changing_blocks(8)), AutoBlock(stats, 8)):
            got, _ = take(speculative(target, draft, prompt, GREEDY, block_tokens=blocks), 24)
            assert_lossless(target, prompt, expected, got)
    tolerance = 2e-5 if config.get("dtype", "float32") == "float32" else 2e-2
    prompt = prompts[0]
    expected, _ = take(target_only(target, prompt, GREEDY), 40)
    oracle = OracleDraft(prompt.tolist() + expected, 8, [0, 3, 7, 1, 5, 2, 6, 4])
    for cycles in (0, 3, 7, 14):  # streams stopped there (plain steps, shadows, blocks of 2..5 behind)
        cache = target.make_cache()
        stream = speculative(target, oracle, prompt, GREEDY, block_tokens=ScriptedBlock(changing_blocks(8)), cache=cache)
        committed = stop_after(stream, cycles)
        assert_caches_hold_the_committed_tokens(target, cache, prompt, committed[:-1], tolerance, f"cycle {cycles}")
    assert set(kernels_used(target).values()) == {"ok"}


def check_every_acceptance_length(target, prompts, block=4):
    """An oracle draft wrong at a scheduled slot per cycle: every acceptance length 0..block-1."""
    seen = set()
    for k, prompt in enumerate(prompts):
        expected, _ = take(target_only(target, prompt, GREEDY), 16)
        schedule = list(range(block))[k % block :] + list(range(block))[: k % block]
        oracle = OracleDraft(prompt.tolist() + expected, block, schedule)
        got, commits = take(speculative(target, oracle, prompt, GREEDY, block_tokens=block), 11)
        assert_lossless(target, prompt, expected[:11], got)
        accepted = [c.accepted for c in commits[1:]]
        assert accepted[: len(schedule)] == schedule[: len(accepted)]
        seen.update(accepted)
    return seen


@pytest.mark.slow  # every kernel call runs in the C++ emulator
@BFLOAT16
def test_every_acceptance_length_is_lossless_on_the_emulated_metal_path(mac_pair, prompts):
    target, _, _ = mac_pair
    assert check_every_acceptance_length(target, prompts) == set(range(4))


@pytest.mark.slow  # every kernel call runs in the C++ emulator
@FLOAT32
def test_rollback_state_on_the_emulated_metal_path(mac_pair, prompts):
    """Wherever a stream stops, the caches equal those of feeding the committed tokens directly."""
    target, _, config = mac_pair
    tolerance = 2e-5 if config.get("dtype", "float32") == "float32" else 2e-2
    prompt = prompts[0]
    expected, _ = take(target_only(target, prompt, GREEDY), 16)
    oracle = OracleDraft(prompt.tolist() + expected, 4, [0, 1, 2, 3, 3, 2, 1, 0])
    for cycles in range(0, 9, 2):  # every acceptance length of the schedule is behind one of them
        cache = target.make_cache()
        committed = stop_after(speculative(target, oracle, prompt, GREEDY, block_tokens=4, cache=cache), cycles)
        assert_caches_hold_the_committed_tokens(target, cache, prompt, committed[:-1], tolerance, f"cycle {cycles}")


@pytest.mark.slow  # chi-square through the emulator
def test_sampling_follows_the_target_on_the_emulated_metal_path(tmp_path_factory):
    """The chi-square test of test_sampling, on a small-vocabulary pair with small heads (the
    emulator runs every GPU thread: 256 of them per call here). A quarter of the rule's samples:
    this path differs from the CPU one only in the target's recurrence, whose outputs and states
    the greedy and rollback tests above check exactly (p = 0.02, 0.65, 0.02 for seeds 0, 1, 2)."""
    heads = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_value_head_dim=4)
    path = make_hf_target(tmp_path_factory.mktemp("mac_small"), vocab_size=test_sampling.V, seed=11, **heads)
    target, config = load_target(path, recurrence=emulated_recurrence())
    draft = make_draft(tmp_path_factory.mktemp("mac_small_draft"), target, config, block_size=4, seed=12)
    sampler = test_sampling.SAMPLERS[1]
    counts = test_sampling.sampled_joint(target, draft, sampler, seed=0, samples=test_sampling.SAMPLES // 4)
    pvalue = test_sampling.goodness_of_fit(counts, test_sampling.exact_joint(target, sampler))
    assert pvalue > 1e-3, f"speculative samples on the Metal path do not follow the target (p={pvalue:.2g})"
    assert set(kernels_used(target).values()) == {"ok"}


@pytest.mark.slow  # builds mutated kernels in the emulator
@pytest.mark.parametrize("mutation", ["wrong gate (first step's for all)", "dropped barrier before overwriting k/q"])
def test_a_mutated_kernel_fails_the_lossless_test(hf_target_dir, mutation, prompts):
    """Without its self-check, a broken .metal file breaks losslessness end to end (the oracle
    draft's accepted slots are where a verify block's later steps show)."""
    kernel, original, broken = MUTATIONS[mutation]
    caught = False
    for schedule in (LOWEST_FIRST, HIGHEST_FIRST):
        recurrence = emulated_recurrence(mutated_sources(kernel, original, broken), self_check=False, schedule=schedule)
        target, _ = load_target(hf_target_dir, recurrence=recurrence)
        try:
            check_every_acceptance_length(target, prompts)
        except AssertionError:
            caught = True
            break
    assert caught, f"{mutation} did not break the lossless test"


def _self_check_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "failed its self-check" in str(w.message)]


@pytest.mark.slow  # builds kernels in the emulator
@pytest.mark.parametrize("failure", ["compile error", "wrong output"])
def test_a_recurrence_kernel_that_fails_its_self_check_falls_back_to_mlx_lms_kernel(hf_target_dir, tmp_path, failure,
                                                                                      prompts, monkeypatch):
    """One warning naming the kernel, the error and the fallback; then mlx-lm's own gated_delta
    kernel (its source, run by the emulator) takes prefill, decode steps and verify blocks, one
    dispatch per Gated DeltaNet layer per prefill chunk and never the per-token reference loop, and
    a rollback recomputes the kept steps from the saved state in one dispatch: output identical to
    the target alone on the same path, and to the CPU path's."""
    from dflash_mlx.prefill import prefill

    if failure == "compile error":
        sources = mutated_sources("gated_delta_tape", "auto g_ = g + b_idx", "auto g_ = gate + b_idx")
    else:
        sources = mutated_sources("gated_delta_tape", *MUTATIONS["wrong gate (first step's for all)"][1:])
    recurrence = emulated_recurrence(sources)
    target, config = load_target(hf_target_dir, recurrence=recurrence)
    reference, _ = load_target(hf_target_dir)
    draft = make_draft(tmp_path, target, config, block_size=8)
    metal = recurrence.metal
    launches, recomputed = [], []
    real_run, real_recompute = metal.run, metal.recompute
    metal.run = lambda launch: launches.append((launch.name, launch.inputs[1].shape[1])) or real_run(launch)
    metal.recompute = lambda *args: recomputed.append(args[-1]) or real_recompute(*args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for prompt in prompts[:2]:
            expected, _ = take(target_only(target, prompt, GREEDY), 16)
            got, _ = take(speculative(target, draft, prompt, GREEDY, block_tokens=4), 16)
            assert_lossless(target, prompt, expected, got)
            assert_lossless(reference, prompt, take(target_only(reference, prompt, GREEDY), 16)[0], got)
    messages = [str(w.message) for w in _self_check_warnings(caught)]
    assert len(messages) == 1, messages
    assert "gated_delta_tape" in messages[0] and "replaced by mlx-lm's gated_delta kernel" in messages[0]
    expected = "MetalCompileError" if failure == "compile error" else "differs from the reference"
    assert expected in messages[0], messages[0]
    if failure == "compile error":  # the compiler's own words reach the user
        assert "undeclared identifier 'gate'" in messages[0], messages[0]
    assert recomputed and all(0 < keep < 4 for keep in recomputed)  # rejected blocks: the kept steps again
    assert not any(name == "tape_replay" for name, _ in launches)
    report = kernels_used(target)
    assert any(k.startswith("gated_delta_tape") and v != "ok" for k, v in report.items())
    assert any(k.startswith(kernels.MLX_LM_KERNEL) for k in report) and all(
        v == "ok" for k, v in report.items() if k.startswith(kernels.MLX_LM_KERNEL))

    # A prefill once every signature is checked (the last token alone, as prefill feeds it): one
    # mlx-lm dispatch per layer and chunk.
    launches.clear()
    loops = []
    real_reference = kernels.gated_delta_reference
    monkeypatch.setattr(kernels, "gated_delta_reference", lambda *a: loops.append(1) or real_reference(*a))
    prompt = mx.concatenate([prompts[0], prompts[1], prompts[2]])[:20]
    prefill(target, prompt, target.make_cache(), step_size=64)
    layers = sum(layer.is_linear for layer in target.layers)
    assert sorted(launches) == sorted([(kernels.MLX_LM_KERNEL, T) for T in (19, 1) for _ in range(layers)])
    assert not loops


# Quantized targets and drafts: every quantized matmul of 1..16 rows through the verify kernel.
WRONG_ROW = ("static_cast<float>(x[r * K + k])", "static_cast<float>(x[k])")


def route_every_shape(metal: kernels.MetalKernels, target, draft, impl=None):
    """Route ``target`` and ``draft`` so that every quantized matmul shape they have (at bfloat16 and
    float32 activations: the draft's on M1/M2) runs ``impl``'s kernel (the per-row one unless given)
    at every row count; returns the ``QuantizedMatmuls``."""
    from dflash_mlx import quantized

    shapes = [s for dtype in (mx.bfloat16, mx.float32) for s in quantized.shapes_of([target, draft], dtype=dtype)]
    matmuls = quantized.QuantizedMatmuls(metal, {s: impl or quantized.OURS for s in shapes})
    target.use_quantized_matmuls(matmuls)
    draft.use_quantized_matmuls(matmuls)
    return matmuls


def quantized_mac_pair(path, draft_dir, bits, sources=None, self_check=True, impl=None):
    """A quantized target (bfloat16 checkpoint) and w``bits`` draft on the Mac path: recurrence
    kernels and verify-matmul kernels emulated, the kernel (``impl``: the per-row one unless given)
    chosen for every shape it has a form for."""
    from dflash_mlx.models.dflash import quantize_draft

    target, config = load_target(path, recurrence=emulated_recurrence())
    nn.quantize(target, group_size=32, bits=bits)
    draft = make_draft(draft_dir, target, config, block_size=8, seed=4)
    quantize_draft(draft, f"w{bits}:gs32")
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, sources), self_check=self_check)
    route_every_shape(metal, target, draft, impl)
    assert all(layer.kernel_matmuls is not None for layer in [*target.layers, *draft.layers])
    return target, draft, metal


SMALL_VOCAB = 128  # the emulator runs 8 GPU threads per output column: keep the head small


@pytest.fixture(scope="module")
def bf16_target_dir(tmp_path_factory):
    """Two layers, one of each kind: every quantized matmul shape of the real targets' layers."""
    return make_hf_target(tmp_path_factory.mktemp("mac_q_target"), vocab_size=SMALL_VOCAB, dtype="bfloat16", seed=3,
                          num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def small_prompts():
    return random_prompts(3, SMALL_VOCAB, seed=8)


@pytest.mark.slow  # every matmul runs in the C++ emulator
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_pairs_are_lossless_through_the_verify_kernel(bf16_target_dir, tmp_path, bits, small_prompts):
    """Greedy output of a w4 (w8) target with a w4 (w8) draft equals the target alone at blocks
    2 and 8 and at every acceptance length (block 4), with decode steps, verify blocks and draft passes all
    through the kernel (each specialization self-checked, none fell back)."""
    target, draft, metal = quantized_mac_pair(bf16_target_dir, tmp_path, bits)
    check_greedy_lossless(target, draft, small_prompts[:1], [2, 8], n=16)
    assert check_every_acceptance_length(target, small_prompts[1:2]) == set(range(4))
    report = {k: v for k, v in metal.report().items() if k.startswith("quantized_verify")}
    rows = {int(k.split("Rows=")[1].split()[0]) for k in report}
    assert {1, 2, 4, 8} <= rows and set(report.values()) == {"ok"}, report  # decode, and blocks 2, 4 and 8


@pytest.mark.slow  # every matmul runs in the C++ emulator
def test_a_quantized_pair_is_lossless_through_the_tile_kernel(bf16_target_dir, tmp_path, small_prompts):
    """The same with every quantized matmul through the simdgroup-matrix tile kernel (decode steps
    padded to the 8-row tile, blocks of 2 and 8 in it, the 16-row form self-checked too)."""
    from dflash_mlx import quantized

    target, draft, metal = quantized_mac_pair(bf16_target_dir, tmp_path, 4, impl=quantized.TILE)
    check_greedy_lossless(target, draft, small_prompts[:1], [2, 8], n=16)
    report = {k: v for k, v in metal.report().items() if k.startswith("quantized_verify_tile")}
    rows = {int(k.split("Rows=")[1].split()[0]) for k in report}
    assert rows == {8, 16} and set(report.values()) == {"ok"}, report
    assert not any(k.startswith("quantized_verify ") for k in metal.report())  # no layer on the per-row kernel


@pytest.mark.slow  # builds a mutated kernel in the emulator
def test_a_mutated_verify_kernel_fails_the_lossless_test(bf16_target_dir, tmp_path, small_prompts):
    """Rows past the first reading the first row's input: decode steps (one row) stay right,
    verify blocks go wrong, and speculative output leaves the target's."""
    from dflash_mlx import quantized

    sources = mutated_sources(quantized.KERNEL, *WRONG_ROW)
    target, _, _ = quantized_mac_pair(bf16_target_dir, tmp_path, 4, sources, self_check=False)
    with pytest.raises(AssertionError):
        check_every_acceptance_length(target, small_prompts)
