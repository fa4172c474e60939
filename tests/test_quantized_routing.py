"""Routing by measured speed with exactness as a budget (issue 52): a layer keeps one kernel for
every row count where that costs it at most ``quantized.EXACT_BUDGET`` (3%) over the fastest at each
row count, else takes the fastest; ``exact`` (``--exact``) keeps every layer exact; doctor says what
exactness costs and which layers run what. The kernels run on the emulator (tests/metal_emulation);
the timings are injected (``tune(measure=...)``), and the decisions they must give are worked out
by hand below, not by the code under test."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import device, doctor, kernels, quantized
from tests.metal_emulation import LOWEST_FIRST, EmulatedMetal

M3 = device.DeviceFacts("Apple M3 Pro", "applegpu_g15s", True, 15, 18 * doctor.GiB, 12 * doctor.GiB)
SMALL_HEADS = [(32, 2, 16, 4)]  # the emulator runs every GPU thread: keep the grid small
ON_M3 = lambda shape: None  # noqa: E731 - stock switches kernels across M (qmv, then qmv_wide): never exact

# Seconds per call (stand-ins) by layer width N, implementation and rows. Over the timed rows
# 1, 2, 4, 8, 16 the per-row kernel sums to 5.0 on every layer and is the exact choice:
# - N = 24: stock 0.875 at M = 1 is the only faster cell: fastest 4.875, exact costs 0.125 / 4.875
#   = 2.6% <= 3%: the layer stays on the kernel at every M;
# - N = 40: stock 0.845 at M = 1: fastest 4.845, exact costs 3.2% > 3%: stock at M = 1, the kernel
#   from M = 2 on;
# - N = 64: stock 0.5 at M = 1 and 2, the tile 0.5 at M = 8 and 16: fastest 3.0, exact costs 67%:
#   stock at M = 1-2, the kernel at M = 3-4, the tile at M = 5-16.
STOCK_AT = {24: {1: 0.875}, 40: {1: 0.845}, 64: {1: 0.5, 2: 0.5}}
TILE_AT = {64: {8: 0.5, 16: 0.5}}


def measure(which, fn):
    out = fn()
    mx.eval(out)  # the timed calls do run
    M, N = out.shape
    if which == quantized.STOCK:
        return STOCK_AT[N].get(M, 3.0)
    if which == quantized.TILE:
        return TILE_AT.get(N, {}).get(M, 5.0)
    return 1.0


def quantized_model():
    """Three quantized linears of widths 24, 40 and 64 on K = 64 (group 32, 4-bit, bfloat16)."""
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(64, n, bias=False) for n in (24, 40, 64)]

    model = Tiny()
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4)
    return model


def recording(metal):
    launches = []
    real_run = metal.run
    metal.run = lambda launch: launches.append(launch) or real_run(launch)
    return launches


def exact_bits(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))  # widening is exact: equal iff the bits are


def test_exactness_is_kept_within_its_budget_and_the_fastest_taken_beyond_it(tmp_path):
    model = quantized_model()
    layers = quantized.layers_of([model])
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    timings = {t.shape.N: t for t in quantized.tune(metal, layers, measure, stock_one=ON_M3)}
    assert quantized.EXACT_BUDGET == 0.03
    assert {n: t.exact_choice for n, t in timings.items()} == {n: quantized.OURS for n in (24, 40, 64)}
    assert timings[24].exactness_cost == pytest.approx(0.125 / 4.875)
    assert timings[40].exactness_cost == pytest.approx(0.155 / 4.845)
    assert timings[64].exactness_cost == pytest.approx(5.0 / 3.0 - 1)
    assert timings[24].choice == quantized.OURS and timings[24].is_exact
    assert not timings[40].is_exact and not timings[64].is_exact
    # What each runs at every row count 1..16 (M between timed counts takes the next timed one's).
    runs = {n: [timings[n].choice.at(M) for M in range(1, 17)] for n in (40, 64)}
    assert runs[40] == [quantized.STOCK] + [quantized.OURS] * 15
    assert runs[64] == [quantized.STOCK] * 2 + [quantized.OURS] * 2 + [quantized.TILE] * 12
    # --exact: every layer on its one kernel, whatever it costs.
    forced = quantized.tune(metal, layers, measure, stock_one=ON_M3, exact=True)
    assert {t.choice for t in forced} == {quantized.OURS} and all(t.is_exact for t in forced)
    # The cache keeps the timings; each process decides from them under its own --exact.
    cache = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    cache.record(timings.values())
    again = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    assert {s.N: c for s, c in again.choices().items()} == {n: t.choice for n, t in timings.items()}
    assert set(again.choices(exact=True).values()) == {quantized.OURS}

    # The routed layers run what was decided: the kernel at M = 1 and M = 8 on the cheap layer (each
    # verify row its decode step, bit for bit); stock's own result at M = 1 on the dear one, the
    # kernel at M = 4, the tile at M = 8.
    x = mx.random.normal((8, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    launches = recording(metal)

    def ran(layer, rows):
        launches.clear()
        y = layer(x[:rows])
        mx.eval(y)
        return y, [(launch.name, dict(launch.template)["Rows"]) for launch in launches]

    stock_of = {n: exact_bits(mx.quantized_matmul(x[:1], layer["weight"], layer["scales"], layer["biases"], transpose=True,
                                                  group_size=32, bits=4)) for n, layer in zip((24, 40, 64), model.layers)}
    quantized.route(model, quantized.QuantizedMatmuls(metal, again.choices()))
    cheap, dear = model.layers[0], model.layers[2]
    decode, one = ran(cheap, 1)
    verify, eight = ran(cheap, 8)
    assert one == [(quantized.KERNEL, 1)] and eight == [(quantized.KERNEL, 8)]
    np.testing.assert_array_equal(exact_bits(verify)[0], exact_bits(decode)[0])
    y, one = ran(dear, 1)
    assert one == [] and np.array_equal(exact_bits(y), stock_of[64])
    assert ran(dear, 4)[1] == [(quantized.KERNEL, 4)] and ran(dear, 8)[1] == [(quantized.TILE_KERNEL, 8)]
    assert quantized.routes_to_metal(dear)

    quantized.route(model, quantized.QuantizedMatmuls(metal, again.choices(exact=True), exact=True))
    decode, one = ran(dear, 1)
    verify, eight = ran(dear, 8)
    assert one == [(quantized.KERNEL, 1)] and eight == [(quantized.KERNEL, 8)]
    for r in range(8):
        np.testing.assert_array_equal(exact_bits(dear(x[r:r + 1]))[0], exact_bits(verify)[r], err_msg=f"row {r}")


def test_doctor_says_what_exactness_costs_and_which_layers_run_what(tmp_path):
    """On the emulated Mac path (an M3: stock is never one kernel for every M), the demo pair's w4
    draft: where stock is much faster at M = 1-2 (the 64-column shapes) the layers run the fastest,
    elsewhere the kernel for every M; doctor counts layers, prints the pair's cost of exactness
    (worked out here from the stand-in clock and the draft's own layer shapes) and the table;
    with --exact every layer is exact."""
    from dflash_mlx import api

    def clock(which, fn):
        out = fn()
        mx.eval(out)
        M, N = out.shape
        if which == quantized.STOCK:
            return (0.5 if N == 64 else 0.99) if M <= 2 else 3.0
        return 1.0

    plain, _ = api.load("demo", draft_quant="w4", matmuls=None)
    widths = [m["weight"].shape[0] for model in (plain.target, plain.draft) for _, m in model.named_modules()
              if isinstance(m, nn.QuantizedLinear) and m.bits == 4]
    dear, cheap = widths.count(64), len(widths) - widths.count(64)
    assert dear and cheap
    # A cheap layer: exact 5.0 against 4.98 (0.4%); a dear one: 5.0 against 0.5 + 0.5 + 3 x 1.0 = 4.0.
    cost = (5.0 * (dear + cheap)) / (4.0 * dear + 4.98 * cheap) - 1

    reports, used = {}, {}
    for exact in (False, True):
        metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
        cache = quantized.TuningCache(tmp_path / f"tuning-{exact}.json", "emulated M3")
        used[exact] = quantized.QuantizedMatmuls(metal, exact=exact)
        reports[exact] = doctor.diagnose("demo", draft_quant="w4", probe_tokens=0, facts=M3, metal=metal,
                                         kernel_shapes=SMALL_HEADS, tune=True, matmuls=used[exact],
                                         tuning_cache=cache, measure=clock, exact=exact)
    # What the layers were given to run: the report's routing, not just its text.
    assert set(used[True].choices.values()) == {quantized.OURS}
    assert {str(c) for s, c in used[False].choices.items() if s.N == 64} == {"fastest: stock M=1-2, kernel M=3-16"}
    report = reports[False]
    assert not report.failed, doctor.render(report)
    text = "\n".join(doctor.render(report))
    assert (f"quantized matmuls: of {dear + cheap} layers ({len(report.tuning)} shapes), {cheap} run the per-row verify "
            f"kernel, 0 the tile kernel and 0 stock, each one kernel at every row count (exact), {dear} the fastest") in text
    assert f"exactness: one kernel per layer for every row count costs {cost:.1%}" in text
    assert "fix: run with --exact" in text
    table = [line for line in text.splitlines() if line.startswith("  affine4")]
    assert table and all(line.endswith("fastest: stock M=1-2, kernel M=3-16 (not exact)") for line in table if " N64 " in line)
    assert all(line.endswith("kernel (exact)") for line in table if " N64 " not in line)
    forced = "\n".join(doctor.render(reports[True]))
    assert f"{dear + cheap} run the per-row verify kernel" in forced and "0 the fastest" in forced
    assert "and everywhere: --exact" in forced and "(not exact)" not in forced
    assert {row["exact"] for row in doctor.as_json(reports[True])["tuning"]} == {True}


def test_exact_reaches_load_and_every_command(monkeypatch):
    """``--exact`` on generate, chat, serve and bench (and doctor) reaches ``api.load(exact=True)``;
    ``serve`` is exact unless told ``--fastest`` (it batches: each answer bit for bit its answer
    alone); a QuantizedMatmuls built without it is refused under ``exact=True``."""
    from dflash_mlx import api
    from tests.test_cli import in_process

    seen = []

    def load(*args, **kwargs):
        seen.append(kwargs.get("exact"))
        raise ValueError("stop here")

    monkeypatch.setattr(api, "load", load)
    for command in ("generate", "chat", "serve", "bench"):
        flags = ((), ("--exact",), ("--fastest",)) if command == "serve" else ((), ("--exact",))
        for flag in flags:
            done = in_process(command, "--model", "demo", "--prompt", "x", *flag) if command == "generate" else \
                in_process(command, "--model", "demo", *flag)
            assert done.exit_code == 1 and "stop here" in done.stderr, (command, done.stdout, done.stderr)
        assert seen[-len(flags):] == ([True, True, False] if command == "serve" else [False, True]), command
        assert "--exact" in in_process(command, "--help").stdout
    monkeypatch.undo()
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    with pytest.raises(ValueError, match="exact=True"):
        api.load("demo", matmuls=quantized.QuantizedMatmuls(metal), exact=True)
