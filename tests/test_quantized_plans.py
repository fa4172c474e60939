"""A routed quantized matmul decides once per layer, activation dtype and shape what its calls need
(``quantized.MatmulPlan``: the implementation, the launch, the kernel object, the checks' outcome)
and decides again only when the choices change, a self-check fails or the layer's arrays are
replaced; and its host cost (``examples/routed_matmul_cost.py``)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import kernels, quantized
from tests.metal_emulation import LOWEST_FIRST, EmulatedMetal, mutated_sources

ROOT = Path(__file__).resolve().parents[1]


def exact(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))  # widening is exact: equal iff the bits are


def quantized_linear(K: int, N: int, seed: int, dtype=mx.bfloat16) -> nn.QuantizedLinear:
    layer = nn.Linear(K, N, bias=False)
    layer.update({"weight": mx.random.normal((N, K), key=mx.random.key(seed)) * K**-0.5})
    layer.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)


class Counted:
    """Counts calls of ``module.name`` (the real function still runs)."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def launches_of(metal):
    launches = []
    real_run = metal.run
    metal.run = lambda launch: launches.append(launch) or real_run(launch)
    return launches


def test_a_routed_layer_decides_once_not_at_every_call(monkeypatch):
    """Forty calls of each of a decode step (M = 1) and a verify block (M = 8), alternating, through
    the per-row kernel: the self-checks' scan (``form_usable``), the decision (``plan``), the kernel
    object (``metal_kernel``) and the signature of the launch are each made once per shape, not per
    call; every call still reaches the kernel with its own x and gives the bits of a call that
    decided afresh (``QuantizedMatmuls.matmul``). Replacing the layer's weights, or changing the
    choices, makes it decide again, once."""
    stock = quantized_linear(64, 24, seed=0)
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    matmuls = quantized.QuantizedMatmuls(metal)
    layer = quantized.QuantizedLinear(stock, matmuls)
    matmuls.choices = {s: quantized.OURS for s in quantized.shapes_of([layer], dtype=mx.bfloat16)}
    usable = Counted(monkeypatch, quantized, "form_usable")
    signatures = Counted(monkeypatch, kernels, "input_signature")
    xs = {M: mx.random.normal((1, M, 64), key=mx.random.key(M)).astype(mx.bfloat16) for M in (1, 8)}
    outputs = {M: [exact(layer(x))] for M, x in xs.items()}  # the first calls decide (the self-checks run)
    launches = launches_of(metal)
    for _ in range(39):
        for M, x in xs.items():
            outputs[M].append(exact(layer(x)))
    assert usable.calls == 2 and matmuls.plans == 2  # one decision per shape, not 80
    builds = metal.builds
    assert builds >= 1 and len(launches) == 78
    assert {id(launch.inputs[0]) for launch in launches} == {id(x) for x in xs.values()}  # x as it came, no reshape
    assert [(launch.name, launch.inputs[4]) for launch in launches[:2]] == [(quantized.KERNEL, 1), (quantized.KERNEL, 8)]
    signatures.calls = 0
    for M, x in xs.items():
        layer(x)
        fresh = matmuls.matmul(x, layer["weight"], layer["scales"], layer["biases"], 32, 4, "affine")
        assert fresh.shape == (1, M, 24)
        for got in outputs[M]:
            np.testing.assert_array_equal(got, exact(fresh))
    assert signatures.calls > 0  # the fresh decisions computed signatures; the routed calls computed none
    signatures.calls = 0
    for M, x in xs.items():
        layer(x)
    assert signatures.calls == 0 and metal.builds == builds and matmuls.plans == 4

    layer.update({"weight": layer["weight"] + 0})  # the same values, new arrays: decide again
    for _ in range(3):
        for x in xs.values():
            layer(x)
    assert matmuls.plans == 6 and usable.calls == 6  # the two fresh matmuls above, and these two
    matmuls.choices[next(iter(matmuls.choices))] = quantized.STOCK  # the tuner changed its mind
    count = len(launches)
    for _ in range(3):
        for x in xs.values():
            np.testing.assert_array_equal(exact(layer(x)), exact(stock(x)))
    assert matmuls.plans == 8 and len(launches) == count  # stock now: no launch


def test_a_failed_check_makes_every_layer_decide_again(monkeypatch):
    """Layer A has decided on the kernel (its checks passed) and runs it. Then layer B, one output
    column (so its scales pass in the ``constant`` address space: the same specialization, another
    signature), fails its self-check (a kernel mutated under that signature only). The failure makes
    the specialization untrusted (``MetalKernels.usable``), so A decides again at its next call and
    runs stock from then on, bit for bit MLX's own, deciding once more and no more."""
    a, b = quantized_linear(64, 24, seed=1), quantized_linear(64, 1, seed=2)
    x = mx.random.normal((1, 1, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    signature_b = quantized.quantized_verify_launch(x[0], b["weight"], b["scales"], b["biases"], 32, 4).signature
    assert ("bfloat16", "c") in signature_b
    broken = mutated_sources(quantized.KERNEL, "metal::fma(scale, static_cast<float>(q), bias)",
                             "scale * static_cast<float>(q)")  # the bias dropped
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, {kernels.kernel_name(quantized.KERNEL, signature_b):
                                                              broken[quantized.KERNEL]}))
    matmuls = quantized.QuantizedMatmuls(metal)
    routed_a, routed_b = quantized.QuantizedLinear(a, matmuls), quantized.QuantizedLinear(b, matmuls)
    matmuls.choices = {s: quantized.OURS for s in quantized.shapes_of([routed_a, routed_b], dtype=mx.bfloat16)}
    routed_a(x)  # decides: A's checks pass
    launches = launches_of(metal)
    routed_a(x)
    assert [launch.inputs[6] for launch in launches] == [24] and matmuls.plans == 1 and metal.failures == 0
    with pytest.warns(RuntimeWarning, match="failed its self-check"):
        np.testing.assert_array_equal(exact(routed_b(x)), exact(b(x)))
    assert metal.failures == 1 and matmuls.plans == 2
    launches.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure was reported once, with B
        for _ in range(3):
            np.testing.assert_array_equal(exact(routed_a(x)), exact(a(x)))
    assert launches == [] and matmuls.plans == 3  # A decided again once, and runs stock


def test_the_host_cost_example_runs_and_routed_calls_stay_near_stock():
    """``examples/routed_matmul_cost.py`` at small settings: every column measured, the routed
    layers reaching the (stubbed) kernel. A routed call cost ~100x MLX's graph build when it decided
    at every call and ~3.5x since (docs/kernels.md); the bound here is loose against a busy machine."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import routed_matmul_cost
    finally:
        sys.path.remove(str(ROOT / "examples"))
    results = routed_matmul_cost.measure(1024, 512, [1, 8], calls=500, repeats=5)
    for op, layer, ours, tile in results.values():
        assert min(op, layer, ours, tile) > 0
        assert ours < 20 * op and tile < 20 * op
