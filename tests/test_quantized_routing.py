"""Routing by measured speed with exactness as a budget (issue 52): a layer keeps one kernel for
every row count where that costs it at most ``quantized.EXACT_BUDGET`` (3%) over the fastest at each
row count, else takes the fastest; ``exact`` (``--exact``) keeps every layer exact; doctor says what
exactness costs and which layers run what; the Splash kernel taken where it measured fastest,
given up where its self-check fails, timings saved before it still loading. The kernels run on the
emulator (tests/metal_emulation); the timings are injected (``tune(measure=...)``), and the
decisions they must give are worked out by hand below, not by the code under test."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import device, doctor, kernels, quantized
from tests.metal_emulation import LOWEST_FIRST, EmulatedMetal, mutated_sources
from tests.test_quantized_verify import recording

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


def demo_layers_by_width():
    """The demo pair's 4-bit layers (w4 draft): how many are 64 wide (the injected clocks' dear
    shape) and how many are not; both kinds present."""
    from dflash_mlx import api

    plain, _ = api.load("demo", draft_quant="w4", matmuls=None)
    widths = [m["weight"].shape[0] for model in (plain.target, plain.draft) for _, m in model.named_modules()
              if isinstance(m, nn.QuantizedLinear) and m.bits == 4]
    dear, cheap = widths.count(64), len(widths) - widths.count(64)
    assert dear and cheap
    return dear, cheap


def test_doctor_says_what_exactness_costs_and_which_layers_run_what(tmp_path):
    """On the emulated Mac path (an M3: stock is never one kernel for every M), the demo pair's w4
    draft: where stock is much faster at M = 1-2 (the 64-column shapes) the layers run the fastest,
    elsewhere the kernel for every M; doctor counts layers, prints the pair's cost of exactness
    (worked out here from the stand-in clock and the draft's own layer shapes) and the table;
    with --exact every layer is exact."""

    def clock(which, fn):
        out = fn()
        mx.eval(out)
        M, N = out.shape
        if which == quantized.STOCK:
            return (0.5 if N == 64 else 0.99) if M <= 2 else 3.0
        return 1.0

    dear, cheap = demo_layers_by_width()
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


# ---- The Splash kernel (quantized.SPLASH) routed by measured speed ----
# Stand-in seconds per call: the per-row kernel 1.0 and the tile 0.8 at every row count, stock 3.0
# (0.2 at M = 1-2 on the 64-column layer), the Splash kernel 0.5 (1.5 at M = 1-4 on the 40-column
# layer). Over the timed rows 1, 2, 4, 8, 16, worked out by hand:
# - N = 24: Splash 2.5 against the tile's 4.0 and fastest at every row count: Splash, exact, at every M;
# - N = 40: Splash 5.5, the tile 4.0 (the exact choice); fastest the tile at M = 1-4 (2.4) and Splash
#   at 8 and 16 (1.0): 3.4, exact costs 4.0 / 3.4 - 1 = 17.6%: the tile at M = 1-4, Splash at 5-16;
# - N = 64: Splash 2.5 (the exact choice); fastest stock at M = 1-2 (0.4) and Splash above (1.5): 1.9,
#   exact costs 2.5 / 1.9 - 1 = 31.6%: stock at M = 1-2, Splash at 3-16.
# Under --exact: Splash, the tile, Splash, each at every M.
def splash_clock(which, fn):
    out = fn()
    mx.eval(out)  # the timed calls do run
    M, N = out.shape
    if which == quantized.STOCK:
        return 0.2 if N == 64 and M <= 2 else 3.0
    return {quantized.OURS: 1.0, quantized.TILE: 0.8}.get(which, 1.5 if N == 40 and M <= 4 else 0.5)


def splash_oracle(x, layer):
    """``layer(x)`` through the Splash kernel's shipped source launched by hand (its template and grid
    written here from the .metal file's parameters, not by ``quantized``), padded to 16 rows."""
    M, K = x.shape
    N = layer["weight"].shape[0]
    launch = kernels.Launch("quantized_verify_splash", (x, layer["weight"], layer["scales"], layer["biases"], M, K, N),
                            (("OutT", mx.bfloat16), ("MatT", mx.bfloat16), ("Mat", 2), ("Rows", 16), ("bits", 4),
                             ("group_size", 32), ("Mode", 0)),
                            grid=(32, 4 * -(-N // 32), 1), output_shapes=((M, N),), output_dtypes=(mx.bfloat16,))
    return exact_bits(kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST), self_check=False).run(launch)[0])


def cancelling_model_and_rows(rows=12):
    """``quantized_model`` with each layer's second group of K repeating its first, and ``rows`` rows
    of x whose second half negates the first (``quantized.cancelling_layer``'s idea): every exact
    output is 0, so each is the rounding error of its summation order, even in bfloat16."""
    model = quantized_model()
    for layer in model.layers:
        half = mx.random.normal((layer["weight"].shape[0], 32), key=mx.random.key(layer["weight"].shape[0]))
        w, scales, biases = mx.quantize(mx.concatenate([half, half], axis=1).astype(mx.bfloat16), 32, 4)
        layer.update({"weight": w, "scales": scales, "biases": biases})
    u = (mx.random.uniform(-1.0, 1.0, (rows, 32), key=mx.random.key(9)) * 2048).astype(mx.bfloat16)
    return model, mx.concatenate([u, -u], axis=1)


def test_the_tuner_routes_the_splash_kernel_where_it_measured_fastest(tmp_path):
    model, x = cancelling_model_and_rows()
    layers = quantized.layers_of([model])
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    timings = {t.shape.N: t for t in quantized.tune(metal, layers, splash_clock, stock_one=ON_M3)}
    assert all(set(t.splash_s) == set(quantized.TUNED_ROWS) for t in timings.values())
    splash, tile, stock = quantized.SPLASH, quantized.TILE, quantized.STOCK
    assert {n: t.exact_choice for n, t in timings.items()} == {24: splash, 40: tile, 64: splash}
    assert timings[24].choice == splash and timings[24].is_exact and timings[24].exactness_cost == 0
    assert timings[40].exactness_cost == pytest.approx(4.0 / 3.4 - 1)
    assert timings[64].exactness_cost == pytest.approx(2.5 / 1.9 - 1)
    assert [timings[40].choice.at(M) for M in range(1, 17)] == [tile] * 4 + [splash] * 12
    assert [timings[64].choice.at(M) for M in range(1, 17)] == [stock] * 2 + [splash] * 14
    forced = {t.shape.N: t for t in quantized.tune(metal, layers, splash_clock, stock_one=ON_M3, exact=True)}
    assert {n: t.choice for n, t in forced.items()} == {24: splash, 40: tile, 64: splash}
    assert all(t.is_exact for t in forced.values())
    lines = quantized.render_timings(timings.values())
    assert "M=8 stock/kernel/tile/splash" in lines[0]
    assert any(" N24 " in line and "3000000.0/1000000.0/800000.0/500000.0" in line and line.endswith("splash (exact)")
               for line in lines)
    # The cache keeps the Splash column (with its source's hash) and decides from it again.
    cache = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    cache.record(forced.values())
    again = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    assert again.missing(layers) == [] and {s.N: c for s, c in again.choices(exact=True).items()} == \
        {24: splash, 40: tile, 64: splash}

    # Exact routing: each layer's one kernel at every M; on the Splash layers every call is the Splash
    # kernel (a decode step padded to 8 rows), each verify row bit for bit its decode step and the
    # Splash kernel's own result launched by hand.
    quantized.route(model, quantized.QuantizedMatmuls(metal, again.choices(exact=True), exact=True))
    launches = recording(metal)
    told_apart = False
    for layer in model.layers:
        N = layer["weight"].shape[0]
        name = quantized.KERNEL_OF[forced[N].choice]
        for M in (1, 5, 12):
            launches.clear()
            verify = exact_bits(layer(x[:M]))
            assert {(launch.name, dict(launch.template)["Rows"]) for launch in launches} == \
                {(name, 8 if M <= 8 else 16)}, (N, M)
            for r in range(M):
                np.testing.assert_array_equal(verify[r], exact_bits(layer(x[r:r + 1]))[0], err_msg=f"N={N} row {r}/{M}")
            if name == quantized.SPLASH_KERNEL:
                np.testing.assert_array_equal(verify, splash_oracle(x[:M], layer))
                per_row = quantized.QuantizedMatmuls(metal).matmul(x[:M], layer["weight"], layer["scales"],
                                                                  layer["biases"], 32, 4, "affine", always=True)
                told_apart |= not np.array_equal(verify, exact_bits(per_row))
    assert told_apart  # the per-row kernel rounds differently somewhere: the comparison can tell them apart
    assert all(quantized.routes_to_metal(layer) for layer in model.layers)


def test_a_splash_kernel_failing_its_self_check_gives_way_to_the_next(tmp_path):
    """A Splash kernel that drops the bias fails its self-check while the tuner asks: it is not timed
    (its column says "failed"), each layer takes the next (the tile: 4.0 against the per-row
    kernel's 5.0), with one warning naming the Splash kernel. A layer whose choice is Splash set
    without timings (nothing measured ranks the others against stock) runs stock at every row count
    instead, bit for bit stock's result; with its timings it takes their next best (below)."""
    from tests.test_splash import MUTATIONS

    broken = mutated_sources(quantized.SPLASH_KERNEL, *MUTATIONS["bias dropped"])
    model = quantized_model()
    layers = quantized.layers_of([model])
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, broken))
    with pytest.warns(RuntimeWarning, match="quantized_verify_splash bfloat16 bfloat16 Mat=2 Rows=8 .* failed its self-check"):
        timings = quantized.tune(metal, layers, splash_clock, stock_one=ON_M3, exact=True)
    assert all(t.splash_s is None and t.choice == quantized.TILE for t in timings)
    assert all(line.split()[6].endswith("/failed") for line in quantized.render_timings(timings)[1:])
    cache = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    cache.record(timings)
    assert {t.splash_s for t in quantized.TuningCache(tmp_path / "tuning.json", "emulated M3").timings()} == {None}

    x = mx.random.normal((8, 64), key=mx.random.key(6)).astype(mx.bfloat16)
    saved = {s: quantized.SPLASH for s in layers}
    fresh = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, broken))
    quantized.route(model, quantized.QuantizedMatmuls(fresh, saved, exact=True))
    launches = recording(fresh)
    layer = model.layers[1]
    stock = mx.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], transpose=True, group_size=32, bits=4)
    with pytest.warns(RuntimeWarning, match="quantized_verify_splash .* failed its self-check"):
        np.testing.assert_array_equal(exact_bits(layer(x)), exact_bits(stock))
    launches.clear()
    np.testing.assert_array_equal(exact_bits(layer(x[:1])), exact_bits(stock[:1]))
    assert launches == []  # no kernel at M = 1 either


# ---- A saved choice failing its self-check at run time (a driver changed since the timings) ----
# Stand-in timings saved for every layer, seconds per call at M = 1, 2, 4, 8, 16: stock 3.0 (0.2 at
# M = 1-2 on the 64-column layer), the per-row kernel 1.0, the tile 0.8, Splash 0.5. Worked out by
# hand: Splash is the exact choice (2.5) and fastest everywhere but at M = 1-2 on N = 64 (fastest
# 0.4 + 1.5 = 1.9, exact costs 32%): saved "splash", and on N = 64 without --exact "fastest: stock
# M=1-2, splash M=3-16". Without Splash: the tile (4.0 against 5.0), fastest everywhere but there
# (0.4 + 2.4 = 2.8, exact costs 43%): "fastest: stock M=1-2, tile M=3-16" without --exact, the tile at
# every M with it. Without Splash and the tile: the per-row kernel (5.0; on N = 64 fastest 0.4 + 3.0 =
# 3.4, 47%). Without all three: stock.
def saved_timings(tmp_path, layers):
    def at(value, low=None):
        return {m: (low if low is not None and m <= 2 else value) for m in quantized.TUNED_ROWS}

    cache = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    cache.record(quantized.Timing(s, at(3.0, 0.2 if s.N == 64 else None), at(1.0), at(0.8), None, False, at(0.5))
                 for s in layers)
    return quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")


def by_hand(kernel, x, layer):
    """``layer(x)`` through the per-row or tile kernel's shipped source launched by hand (template
    and grid written here from the .metal files' parameters, not by ``quantized``)."""
    M, K = x.shape
    N = layer["weight"].shape[0]
    per_row = kernel == quantized.KERNEL
    rows = next(r for r in ((1, 2, 4, 8, 16) if per_row else (8, 16)) if M <= r)
    launch = kernels.Launch(kernel, (x, layer["weight"], layer["scales"], layer["biases"], M, K, N),
                            (("OutT", mx.bfloat16), ("Rows", rows), ("bits", 4), ("group_size", 32), ("Mode", 0)),
                            grid=(32, -(-N // 4), 1) if per_row else (32, 4 * -(-N // 32), 1), output_shapes=((M, N),),
                            output_dtypes=(mx.bfloat16,))
    return exact_bits(kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST), self_check=False).run(launch)[0])


def ran_on(layer, launches):
    """The kernels and row forms launched on ``layer``'s weights (not the self-checks' layers)."""
    return [(launch.name, dict(launch.template)["Rows"]) for launch in launches if launch.inputs[1] is layer["weight"]]


def self_check_warnings(caught):
    return [str(w.message) for w in caught if "failed its self-check" in str(w.message)]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "budget"])
def test_a_saved_choice_failing_its_self_check_at_run_time_gives_way_to_the_next_best(tmp_path, exact):
    """Timings saved where Splash passed (above); in this process it drops the bias and fails its
    self-check. Each layer then runs what the timings give without it, by the tuner's rule: under
    --exact the tile at every row count (N = 64 too: not stock at M = 1-2), else the tile, and on
    N = 64 stock at M = 1-2 and the tile above. Checked through the kernels each call launched and
    their bits: the tile kernel's own, launched by hand, on cancelling rows (where the per-row kernel
    and stock round differently); stock's own at M = 1 on N = 64. One warning, naming the Splash
    specialization and what the first layer runs instead; one plan per layer and row count."""
    from tests.test_splash import MUTATIONS

    model, x = cancelling_model_and_rows()
    cache = saved_timings(tmp_path, quantized.layers_of([model]))
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, mutated_sources(quantized.SPLASH_KERNEL,
                                                                              *MUTATIONS["bias dropped"])))
    matmuls = quantized.QuantizedMatmuls.from_cache(metal, cache, exact)
    splash, tile, stock = quantized.SPLASH, quantized.TILE, quantized.STOCK
    saved_64 = splash if exact else quantized.Fastest(((1, stock), (2, stock), (4, splash), (8, splash), (16, splash)))
    assert {s.N: c for s, c in matmuls.choices.items()} == {24: splash, 40: splash, 64: saved_64}
    quantized.route(model, matmuls)
    launches = recording(metal)
    widest = model.layers[2]  # first: the warning names its next best
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second round: the plans kept, no check again
            for layer in (widest, *model.layers[:2]):
                N = layer["weight"].shape[0]
                for M in (1, 5, 12):
                    launches.clear()
                    y = exact_bits(layer(x[:M]))
                    ran = ran_on(layer, launches)
                    if N == 64 and M == 1 and not exact:
                        stock_y = mx.quantized_matmul(x[:1], layer["weight"], layer["scales"], layer["biases"],
                                                      transpose=True, group_size=32, bits=4)
                        assert ran == [] and np.array_equal(y, exact_bits(stock_y)), (N, M)
                    else:
                        assert ran == [(quantized.TILE_KERNEL, 8 if M <= 8 else 16)], (N, M, ran)
                        np.testing.assert_array_equal(y, by_hand(quantized.TILE_KERNEL, x[:M], layer), err_msg=f"{N} {M}")
    warned = self_check_warnings(caught)
    instead = "quantized_verify_tile at every row count" if exact else "fastest: stock M=1-2, tile M=3-16"
    assert len(warned) == 1 and "quantized_verify_splash bfloat16 bfloat16 Mat=2 Rows=8" in warned[0], warned
    assert f"replaced by {instead} on the layers affine4 gs32 K64 N64 bfloat16 (the next best of their timings)" in warned[0]
    assert matmuls.plans == 9  # three layers at three row counts, each decided once
    # The tile's bits are not the per-row kernel's or stock's here: the comparisons above can tell.
    layer = model.layers[0]
    tile_y = by_hand(quantized.TILE_KERNEL, x, layer)
    assert not np.array_equal(tile_y, by_hand(quantized.KERNEL, x, layer))
    assert not np.array_equal(tile_y, exact_bits(mx.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"],
                                                                       transpose=True, group_size=32, bits=4)))


def test_saved_kernels_failing_one_after_another_end_on_stock(tmp_path):
    """The same saved timings under --exact. Splash and the tile broken: the layers run the per-row
    kernel at every row count (its own bits, launched by hand), one warning each naming what runs
    instead (the tile for Splash, the per-row kernel for the tile). All three broken: stock at every
    row count, bit for bit stock's, the per-row kernel's warning naming stock."""
    from tests.test_quantized_tile import TILE_MUTATIONS
    from tests.test_quantized_verify import MUTATIONS as ROW_MUTATIONS
    from tests.test_splash import MUTATIONS

    model, x = cancelling_model_and_rows()
    quantized.route(model, None)  # routed layers, pointed at each process's matmuls below
    layer = model.layers[1]
    cache = saved_timings(tmp_path, quantized.layers_of([model]))
    broken = {**mutated_sources(quantized.SPLASH_KERNEL, *MUTATIONS["bias dropped"]),
              **mutated_sources(quantized.TILE_KERNEL, *TILE_MUTATIONS["bias dropped"])}
    everything = {**broken, **mutated_sources(quantized.KERNEL, *ROW_MUTATIONS["bias dropped"])}
    stock_y = exact_bits(mx.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], transpose=True,
                                             group_size=32, bits=4))
    for sources, runs in ((broken, quantized.KERNEL), (everything, None)):
        metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, sources))
        quantized.route(model, quantized.QuantizedMatmuls.from_cache(metal, cache, exact=True))
        launches = recording(metal)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for M in (1, 12):
                launches.clear()
                y = exact_bits(layer(x[:M]))
                if runs is None:
                    assert ran_on(layer, launches) == [] and np.array_equal(y, stock_y[:M]), M
                else:
                    assert ran_on(layer, launches) == [(runs, 1 if M == 1 else 16)]
                    np.testing.assert_array_equal(y, by_hand(runs, x[:M], layer))
        warned = self_check_warnings(caught)
        expected = [("quantized_verify_splash", "quantized_verify_tile"), ("quantized_verify_tile", "quantized_verify")]
        if runs is None:
            expected.append(("quantized_verify ", "MLX's stock quantized_matmul"))
        assert len(warned) == len(expected), warned
        for message, (kernel, instead) in zip(warned, expected):
            assert f"kernel {kernel}" in message and f"replaced by {instead} at every row count on the layers " \
                   f"affine4 gs32 K64 N40 bfloat16" in message, message
    assert not np.array_equal(by_hand(quantized.KERNEL, x, layer), stock_y)  # the two can be told apart


def test_timings_saved_before_the_splash_column_still_load(tmp_path):
    """An entry as the tuner wrote it before the Splash kernel was timed (no ``splash_us``) loads and
    decides among stock, the per-row kernel and the tile, not missing; an entry whose Splash column
    was timed on another Splash source counts as missing (timed again), its other columns kept;
    one timed on this source offers Splash."""
    import json

    model = quantized_model()
    shapes = sorted(quantized.layers_of([model]), key=lambda s: s.N)
    us = lambda v: {str(m): v for m in quantized.TUNED_ROWS}  # noqa: E731
    old = {"stock_us": us(3.0), "kernel_us": us(1.0), "tile_us": us(2.0), "stock_one_kernel": None}
    source = quantized.source_hash(quantized.SPLASH_KERNEL)
    entries = {s.key(): {"shape": s.__dict__, **old} for s in shapes}
    entries[shapes[1].key()].update(splash_us=us(0.5), splash_source="0" * 12)
    entries[shapes[2].key()].update(splash_us=us(0.5), splash_source=source)
    (tmp_path / "tuning.json").write_text(json.dumps({"emulated M3": entries}))
    cache = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    timings = {t.shape.N: t for t in cache.timings()}
    assert [timings[n].splash_s for n in (24, 40)] == [{}, {}] and timings[64].splash_s == {m: 0.5e-6 for m in
                                                                                             quantized.TUNED_ROWS}
    assert {s.N: c for s, c in cache.choices().items()} == {24: quantized.OURS, 40: quantized.OURS, 64: quantized.SPLASH}
    assert cache.missing(shapes) == [shapes[1]]
    assert quantized.render_timings([timings[24]])[1].split()[6] == "3.0/1.0/2.0/-"


def test_doctor_names_the_splash_kernel_where_it_runs(tmp_path):
    """doctor --tune on the emulated M3 with the demo pair's w4 draft, where the Splash kernel measured
    fastest: 0.9 at every row count on the narrow shapes (the others 1.0, stock 3.0: Splash exact,
    free), and on the 64-column shapes 0.5 from M = 8 on with stock 0.5 at M = 1-2 (exact Splash
    4.0 against fastest 3.0: over budget, stock M=1-2 and Splash above). doctor counts the layers
    on it; under --exact every layer runs it. Read back without --tune from timings saved before
    the Splash column, doctor says it was not timed and nothing runs it; from timings where it
    failed its self-check, says so without failing the pair."""
    import json

    def clock(which, fn):
        out = fn()
        mx.eval(out)
        M, N = out.shape
        if which == quantized.STOCK:
            return 0.5 if N == 64 and M <= 2 else 3.0
        if which == quantized.SPLASH:
            return (0.5 if M >= 8 else 1.0) if N == 64 else 0.9
        return 1.0

    dear, cheap = demo_layers_by_width()
    texts = {}
    for exact in (False, True):
        metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
        cache = quantized.TuningCache(tmp_path / f"tuning-{exact}.json", "emulated M3")
        report = doctor.diagnose("demo", draft_quant="w4", probe_tokens=0, facts=M3, metal=metal,
                                 kernel_shapes=SMALL_HEADS, tune=True, matmuls=quantized.QuantizedMatmuls(metal, exact=exact),
                                 tuning_cache=cache, measure=clock, exact=exact)
        assert not report.failed, doctor.render(report)
        texts[exact] = "\n".join(doctor.render(report))
    assert (f"0 run the per-row verify kernel, 0 the tile kernel, {cheap} the Splash kernel and 0 stock, each one kernel "
            f"at every row count (exact), {dear} the fastest") in texts[False]
    assert f"; {dear} of them the Splash kernel at some row counts)" in texts[False]
    table = [line for line in texts[False].splitlines() if line.startswith("  affine4")]
    assert all(line.endswith("fastest: stock M=1-2, splash M=3-16 (not exact)" if " N64 " in line else "splash (exact)")
               for line in table)
    assert f"0 the tile kernel, {dear + cheap} the Splash kernel and 0 stock" in texts[True]
    assert "not timed" not in texts[True]

    path = tmp_path / "tuning-True.json"
    saved = json.loads(path.read_text())
    for entry in saved["emulated M3"].values():
        del entry["splash_us"], entry["splash_source"]
    path.write_text(json.dumps(saved))
    old = doctor.diagnose("demo", draft_quant="w4", probe_tokens=0, facts=M3,
                          metal=kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)), kernel_shapes=SMALL_HEADS,
                          tuning_cache=quantized.TuningCache(path, "emulated M3"), exact=True)
    text = "\n".join(doctor.render(old))
    shapes = len(saved["emulated M3"])
    assert f"{dear + cheap} run the per-row verify kernel, 0 the tile kernel and 0 stock" in text
    assert f"the Splash kernel not timed for {shapes} of the {shapes} shapes" in text and not old.failed
    # Saved where the Splash kernel failed its self-check: said, not offered, the pair not failed.
    for entry in saved["emulated M3"].values():
        entry.update(splash_us=None, splash_source=quantized.source_hash(quantized.SPLASH_KERNEL))
    path.write_text(json.dumps(saved))
    failed = doctor.diagnose("demo", draft_quant="w4", probe_tokens=0, facts=M3,
                             metal=kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)), kernel_shapes=SMALL_HEADS,
                             tuning_cache=quantized.TuningCache(path, "emulated M3"), exact=True)
    text = "\n".join(doctor.render(failed))
    assert f"{dear + cheap} run the per-row verify kernel, 0 the tile kernel and 0 stock" in text and not failed.failed
    assert f"the Splash kernel failed its self-check for {shapes} shapes (not offered there)" in text
