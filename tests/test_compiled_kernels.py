"""Layers that run our kernels compile once the kernels are decided (``kernels.CompiledAfterChecks``).

On a Mac ``mx.compile`` traces ``mx.fast.metal_kernel`` like any primitive; the emulator that runs the
kernels here evaluates each launch on the host, which no trace can hold. So these tests run the
mechanism with ``TracedKernels``: a ``metal_kernel`` stand-in whose kernels are MLX graphs, each row
through the verify kernels' own reference on its own (row-independent, as the kernels are), which a
trace can hold. The kernels themselves are tested on the emulator (tests/test_quantized_verify.py) and,
compiled inside the layers, on Apple's driver (tests/test_mac_path.py, the macOS workflow).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import kernels, quantized
from dflash_mlx.loading import load_target
from dflash_mlx.models.dflash import quantize_draft
from tests.conftest import make_draft, make_hf_target, random_prompts
from tests.reference import target_only
from tests.test_emulated_metal import (GREEDY, check_every_acceptance_length, check_greedy_lossless,
                                      route_every_shape, take)

VOCAB = 64
MODES = {code: mode for mode, code in quantized.MODES.items()}


class TracedKernels:
    """``mx.fast.metal_kernel``'s interface, each kernel call an MLX graph of its reference: the verify
    kernels every row dequantized and multiplied alone (``quantized_verify_reference``), the Gated
    DeltaNet tape and replay step by step (``gated_delta_reference``, ``tape_replay_reference``).
    ``traceable``: it says so, as MLX's own is. ``calls`` counts the kernel calls Python made (a
    compiled graph replays without)."""

    traceable = True

    def __init__(self, wrong_for=None):
        self.calls = 0
        self.wrong_for = wrong_for  # an activation dtype whose kernels are off by one (their self-checks fail)

    def __call__(self, name, input_names, output_names, source):
        if name.startswith("gated_delta_tape"):
            def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
                self.calls += 1
                y, state, delta = kernels.gated_delta_reference(*inputs[:6])
                return [y.astype(output_dtypes[0]), state, delta.astype(mx.float32)]

            return kernel
        if name.startswith("tape_replay"):
            def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
                self.calls += 1
                state, k, g, delta, _, steps = inputs
                return [kernels.tape_replay_reference(state, k, g, delta, steps)]

            return kernel
        assert name.startswith("quantized_verify"), name  # mlx-lm's kernel: ours pass, it is not asked for

        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls += 1
            x, w, scales, biases, M, K, _ = inputs
            t = dict(template)
            mode = MODES[t["Mode"]]
            rows = x.reshape(M, K)
            y = [quantized.quantized_verify_reference(rows[r:r + 1], w, scales, biases if mode == "affine" else None,
                                                      t["group_size"], t["bits"], mode) for r in range(M)]
            y = mx.concatenate(y).reshape(output_shapes[0]).astype(output_dtypes[0])
            return [y + 1 if self.wrong_for is not None and t["OutT"] == self.wrong_for else y]

        return kernel


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_hf_target(tmp_path_factory.mktemp("compiled_target"), vocab_size=VOCAB, dtype="bfloat16", seed=5,
                          num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def routed_pair(target_dir, draft_dir, factory):
    """A w4 target and draft whose every quantized matmul of 1..16 rows, and the target's Gated
    DeltaNet recurrence, run ``factory``'s kernels."""
    metal = kernels.MetalKernels(factory)  # None: MLX's own metal_kernel
    target, config = load_target(target_dir, recurrence=kernels.Recurrence(metal=metal))
    nn.quantize(target, group_size=32, bits=4)
    draft = make_draft(draft_dir, target, config, block_size=4, seed=6)
    quantize_draft(draft, "w4:gs32")
    return target, draft, route_every_shape(metal, target, draft)


def kernel_layer_pieces(target) -> list:
    """Every layer's compiled functions for kernel layers at decode and verify lengths."""
    out = []
    for layer in target.layers:
        pieces = layer._compiled["kernels"]
        out.extend(pieces if isinstance(pieces, tuple) else [pieces])
    return out


def logits(target, ids):
    out = target(ids[None])
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def test_a_layer_compiles_once_its_kernels_are_decided(target_dir, tmp_path):
    """A routed layer's first call at a shape decides its kernels (self-checks, plans) on a graph it
    drops, then runs compiled; later calls at that shape replay the compiled graph (no kernel call
    from Python) with the same results; a change of choices drops the compiled graph, and the layer
    runs what the new choices say (here stock: the unrouted target's bits)."""
    factory = TracedKernels()
    target, _, matmuls = routed_pair(target_dir, tmp_path, factory)
    assert {layer.mode for layer in target.layers} == {"kernels"}
    ids = mx.array([3, 9, 27, 17], dtype=mx.int32)
    first = logits(target, ids)
    assert factory.calls > 0
    compiled = kernel_layer_pieces(target)
    assert all(isinstance(p, kernels.CompiledAfterChecks) and p.compilations == 1 for p in compiled)
    calls = factory.calls
    again = logits(target, ids)
    assert factory.calls == calls + 1  # the layers replayed; only the output head (outside them) called
    np.testing.assert_array_equal(again, first)

    plain, _ = load_target(target_dir, recurrence=kernels.Recurrence(metal=kernels.MetalKernels(TracedKernels())))
    nn.quantize(plain, group_size=32, bits=4)
    stock = logits(plain, ids)
    assert not np.array_equal(stock, first)  # else this test could not tell the kernel from stock
    matmuls.choices = {}  # the tuner's choices changed: stock for every matmul
    np.testing.assert_array_equal(logits(target, ids), stock)
    recurrences = sum(layer.is_linear for layer in target.layers)  # still a kernel: decided, then traced
    assert factory.calls == calls + 1 + 2 * recurrences and all(p.compilations == 2 for p in compiled)


def test_a_failing_check_drops_the_compiled_graph(target_dir, tmp_path):
    """A self-check that fails after a layer compiled (here: a layer's form in another activation
    dtype, whose kernel is wrong) moves the stamp: every compiled layer decides again on its next
    call and traces anew, with the same decisions where its own forms passed."""
    factory = TracedKernels(wrong_for=mx.float16)
    target, _, matmuls = routed_pair(target_dir, tmp_path, factory)
    ids = mx.array([5, 1, 44], dtype=mx.int32)
    first = logits(target, ids)
    compiled = kernel_layer_pieces(target)
    gate = target.layers[1].mlp.gate_proj
    with pytest.warns(RuntimeWarning, match="failed its self-check"):
        assert not quantized.form_usable(matmuls.metal, mx.float16, gate["weight"], gate["scales"], gate["biases"],
                                         gate.group_size, gate.bits, gate.mode)
    np.testing.assert_array_equal(logits(target, ids), first)
    assert all(p.compilations == 2 for p in compiled)


def test_a_recurrence_on_the_kernels_compiles_once_decided(target_dir):
    """An unquantized target whose Gated DeltaNet layers run the recurrence kernels: those layers
    (and only those) compile once the kernels are decided, then replay without a kernel call."""
    factory = TracedKernels()
    target, _ = load_target(target_dir, recurrence=kernels.Recurrence(metal=kernels.MetalKernels(factory)))
    assert {layer.is_linear: layer.mode for layer in target.layers} == {True: "kernels", False: "attention"}
    ids = mx.array([8, 2, 30], dtype=mx.int32)
    first = logits(target, ids)
    linear = [layer._compiled["kernels"] for layer in target.layers if layer.is_linear]
    assert all(isinstance(p, kernels.CompiledAfterChecks) and p.compilations == 1 for p in linear)
    calls = factory.calls
    np.testing.assert_array_equal(logits(target, ids), first)
    assert factory.calls == calls


def test_greedy_is_lossless_with_compiled_kernel_layers(target_dir, tmp_path):
    """Greedy speculation through compiled kernel layers (target and draft) equals the target alone
    at blocks 2 and 4 and at every acceptance length, and the same tokens as the layers run plain
    (the stand-in marked untraceable, as the emulator is)."""
    target, draft, _ = routed_pair(target_dir, tmp_path / "a", TracedKernels())
    prompts = random_prompts(2, VOCAB, seed=2)
    check_greedy_lossless(target, draft, prompts[:1], [2, 4], n=12)
    assert check_every_acceptance_length(target, prompts[1:2]) == set(range(4))
    assert all(isinstance(piece, kernels.CompiledAfterChecks) for layer in draft.layers
               for piece in (layer._before_attention, layer._after_attention))

    untraced = TracedKernels()
    untraced.traceable = False
    plain_target, _, _ = routed_pair(target_dir, tmp_path / "b", untraced)
    assert all(not isinstance(layer._pieces("kernels")[0], kernels.CompiledAfterChecks)
               for layer in plain_target.layers if not layer.is_linear)
    for prompt in prompts:
        assert take(target_only(target, prompt, GREEDY), 12)[0] == take(target_only(plain_target, prompt, GREEDY), 12)[0]


METAL = mx.metal.is_available()
REQUIRED = os.environ.get("DFLASH_MLX_REQUIRE_METAL") == "1"


@pytest.mark.skipif(not METAL and not REQUIRED, reason="needs an Apple GPU (Metal)")
def test_compiled_kernel_layers_on_an_apple_gpu(target_dir, tmp_path):
    """The same on Apple's driver, with the real kernels (``mx.fast.metal_kernel`` traced by
    ``mx.compile``): every layer compiles once its kernels are decided, a repeated call dispatches
    no kernel from Python inside the layers, and greedy speculation equals the target alone at
    blocks 2 and 4 and at every acceptance length."""
    target, draft, matmuls = routed_pair(target_dir, tmp_path, None)
    assert matmuls.traceable
    ids = mx.array([3, 9, 27, 17], dtype=mx.int32)
    first = logits(target, ids)
    pieces = kernel_layer_pieces(target)
    assert all(isinstance(p, kernels.CompiledAfterChecks) and p.compilations == 1 for p in pieces)
    runs = []
    real_run = matmuls.metal.run
    matmuls.metal.run = lambda launch: runs.append(launch.name) or real_run(launch)
    np.testing.assert_array_equal(logits(target, ids), first)
    assert len(runs) == 1  # the output head, outside the layers
    matmuls.metal.run = real_run
    prompts = random_prompts(2, VOCAB, seed=2)
    check_greedy_lossless(target, draft, prompts[:1], [2, 4], n=12)
    assert check_every_acceptance_length(target, prompts[1:2]) == set(range(4))
    report = {k: v for k, v in matmuls.metal.report().items() if k.startswith("quantized_verify")}
    assert report and set(report.values()) == {"ok"}, matmuls.metal.report()


def test_the_compiled_layer_cost_example_runs_and_compiling_fuses():
    """``examples/compiled_layer_cost.py`` at small settings: both columns measured, and the compiled
    layers dispatch fewer operations than the plain ones (the norms, RoPE and activations fused)."""
    import sys
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import compiled_layer_cost
    finally:
        sys.path.remove(examples)
    results = compiled_layer_cost.measure([1], calls=5, repeats=1)
    (plain_us, plain_ops), (compiled_us, compiled_ops) = results[1]["plain"], results[1]["compiled"]
    assert min(plain_us, compiled_us) > 0 and compiled_ops < plain_ops


def test_a_batch_through_compiled_kernel_layers_is_each_request_alone():
    """The demo pair, w4, every quantized matmul and the recurrence on the stand-in's kernels, its
    layers compiled once decided: requests decoded together under a GPU's batch rules (two rows a
    sequence at least, sixteen a pass), greedy and seeded, arriving at different rounds, are each
    bit for bit (tokens and log-probs) the request alone; every batch shape decided, then traced."""
    from dflash_mlx.api import load
    from tests.test_batch_alone import RULES, chat, check

    model, tokenizer = load("demo")
    metal = kernels.MetalKernels(TracedKernels())
    nn.quantize(model.target, group_size=32, bits=4)
    quantize_draft(model.draft, "w4:gs32")
    model.target.use_recurrence(kernels.Recurrence(metal=metal))
    route_every_shape(metal, model.target, model.draft)
    specs = [dict(prompt=chat(i, 120), max_tokens=12, block_tokens=4) for i in range(2)]
    specs.append(dict(prompt=chat(7, 120), max_tokens=12, block_tokens=4, temp=0.9, seed=3))
    check(model, tokenizer, specs, [0, 0, 1], RULES["gpu rules"])
    assert all(p.compilations >= 1 for p in kernel_layer_pieces(model.target))
