"""``dflash-mlx doctor``: its output and exit codes, the memory estimate, the kernel self-check
it reports (on the emulated kernels), and the device-dependent draft dtype."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from dflash_mlx import device, doctor, kernels
from dflash_mlx.api import load, stream_generate
from tests.metal_emulation import LOWEST_FIRST, EmulatedMetal, mutated_sources
from tests.test_cli import cli, in_process
from tests.test_kernels import MUTATIONS

M1 = device.DeviceFacts("Apple M1", "applegpu_g13s", True, 13, 16 * doctor.GiB, 11 * doctor.GiB)
M3 = device.DeviceFacts("Apple M3 Pro", "applegpu_g15s", True, 15, 18 * doctor.GiB, 12 * doctor.GiB)
SMALL_HEADS = [(32, 2, 16, 4)]  # the emulator runs every GPU thread: keep the grid small


def test_doctor_on_this_machine_says_what_it_cannot_check():
    done = cli("doctor")
    assert done.returncode == 0, done.stderr
    for line in ("device:", "GPU family:", "versions: mlx", "Metal:", "memory:", "Metal kernels:"):
        assert line in done.stdout, done.stdout
    if not mx.metal.is_available():
        assert "not checked: no Metal GPU here" in done.stdout


@pytest.mark.slow  # a doctor subprocess
def test_doctor_says_a_pair_does_not_fit_and_exits_non_zero():
    done = cli("doctor", "--model", "demo", "--memory-gb", "0.004", "--probe-tokens", "0")
    assert done.returncode == 1, done.stdout
    assert "[FAIL] fits in memory" in done.stdout and "fix: " in done.stdout
    fits = cli("doctor", "--model", "demo", "--memory-gb", "1", "--probe-tokens", "0", "--json")
    assert fits.returncode == 0, fits.stderr
    report = json.loads(fits.stdout)
    assert report["ok"] and {"target weights", "attention KV caches", "draft context cache"} <= set(report["memory_bytes"])


def test_doctor_refuses_bad_options():
    for args, message in ((["--context", "0"], "--context"), (["--draft", "x"], "--draft needs --model"),
                          (["--model", "/no/such/folder"], "/no/such/folder"),
                          (["--memory-gb", "0"], "--memory-gb must be positive"),
                          (["--probe-tokens", "-1"], "--probe-tokens"), (["--tune"], "--tune needs --model"),
                          (["--model", "demo", "--draft-quant", "w7", "--probe-tokens", "0"], "w7")):
        done = in_process("doctor", *args)
        assert done.exit_code != 0 and message in done.stderr, (args, done.stderr)


def test_doctor_sizes_each_rank_of_a_pipeline():
    """--ranks: the split `load` makes under mlx.launch (the demo over two ranks holds layers 0-3
    and 4-5, as its ranks print at load), each rank's weights and caches against the budget."""
    report = doctor.diagnose("demo", probe_tokens=0, ranks=2)
    ranks = {c.name: c for c in report.checks if c.name.startswith("rank ")}
    assert ranks["rank 0 of 2"].detail.startswith("layers 0-3: ") and ranks["rank 1 of 2"].detail.startswith("layers 4-5: ")
    assert all(c.status == doctor.OK for c in ranks.values())
    manual = doctor.diagnose("demo", probe_tokens=0, ranks=2, stages=[1, 5])
    assert {c.name: c.detail.split(":")[0] for c in manual.checks if c.name.startswith("rank ")} == {
        "rank 0 of 2": "layers 0-0", "rank 1 of 2": "layers 1-5"}
    # Each rank needs a prefill chunk's working memory on top; the last rank a little more (it also
    # holds the draft and its cache): a budget between the two fails only the last.
    need = [float(ranks[f"rank {r} of 2"].detail.split("= ")[1].split(" MiB")[0]) for r in (0, 1)]
    assert need[0] < need[1]
    budget = f"{(need[0] + need[1]) / 2 / 1024:.6f}"
    tight = in_process("doctor", "--model", "demo", "--ranks", "2", "--memory-gb", budget, "--probe-tokens", "0")
    assert tight.exit_code == 1 and "[FAIL] rank 1 of 2: layers 4-5" in tight.stdout, tight.stdout
    assert "[ok  ] rank 0 of 2" in tight.stdout  # the last rank also holds the draft and its cache
    too_many = in_process("doctor", "--model", "demo", "--ranks", "7", "--probe-tokens", "0")
    assert too_many.exit_code == 1 and "7 ranks for a target of 6 layers" in too_many.stderr
    assert in_process("doctor", "--ranks", "2").exit_code == 1


def test_doctor_tune_off_an_apple_gpu_has_nothing_to_tune():
    done = cli("doctor", "--model", "demo", "--draft-quant", "w4", "--tune", "--probe-tokens", "0")
    assert done.returncode == 0, done.stderr
    if not mx.metal.is_available():
        assert "quantized matmuls: nothing to tune: not an Apple GPU" in done.stdout, done.stdout


def test_doctor_tune_times_every_quantized_shape_of_the_pair(tmp_path):
    """On the emulated Mac path: every (K, N, bits, group size) of the demo pair's w4 draft is timed
    at the tuner's row counts (a stand-in clock: the kernels win overall, except on the 64-column
    shapes), one choice per shape for every row count, the table printed, the choices saved and used.
    On an M3 stock runs qmv for a decode step and qmv_wide or qmm for a block, so under --exact, even
    where its timings won, a shape runs a kernel of ours (the per-row one: the tile timed alike);
    tests/test_quantized_routing.py has the default, exactness as a budget."""
    from dflash_mlx import quantized

    def measure(which, fn):
        out = fn()
        mx.eval(out)  # the kernel and stock both run
        if which == quantized.STOCK:
            return 2.0
        return 3.0 if out.shape[0] <= 2 or out.shape[1] == 64 else 1.0

    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    matmuls = quantized.QuantizedMatmuls(metal, exact=True)
    cache = quantized.TuningCache(tmp_path / "tuning.json", "emulated M3")
    report = doctor.diagnose("demo", draft_quant="w4", probe_tokens=0, facts=M3, metal=metal, kernel_shapes=SMALL_HEADS,
                             tune=True, matmuls=matmuls, tuning_cache=cache, measure=measure, exact=True)
    assert not report.failed, doctor.render(report)
    shapes = {(t.shape.K, t.shape.N) for t in report.tuning}
    assert (64, 64) in shapes and all(set(t.stock_s) == set(quantized.TUNED_ROWS) for t in report.tuning)
    assert all(t.choice == quantized.OURS and t.stock_one is None for t in report.tuning)
    assert matmuls.choices == {t.shape: t.choice for t in report.tuning}
    text = "\n".join(doctor.render(report))
    layers = sum(report.tuning_layers.values())
    assert f"quantized matmuls: of {layers} layers ({len(shapes)} shapes), {layers} run the per-row verify kernel, 0 the tile" in text
    assert "affine4 gs64 K64 N64 bfloat16" in text
    saved = json.loads((tmp_path / "tuning.json").read_text())["emulated M3"]
    assert len(saved) == len(report.tuning)
    assert len(doctor.as_json(report)["tuning"]) == len(report.tuning)


def _demo_w4_shapes():
    """The demo pair's quantized matmul shapes under --draft-quant w4 and their layer counts, read off
    the loaded modules here (K from the packed weight, activations in the scales' dtype)."""
    import mlx.nn as nn

    model, _ = load("demo", draft_quant="w4", matmuls=None)
    counts = {}
    for module in (model.target, model.draft):
        for _, m in module.named_modules():
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                N, packed = m.weight.shape
                shape = dict(K=packed * 32 // m.bits, N=N, bits=m.bits, group_size=m.group_size, mode=m.mode,
                             dtype=str(m.scales.dtype).split(".")[-1])
                key = tuple(shape.items())
                counts[key] = counts.get(key, 0) + 1
    return counts


def _tuning_file(path, shapes, slow_decode=()):
    """A tuning cache as ``--tune`` writes it, by hand: at every row count the per-row kernel takes
    1 us, stock 2 us and the tile 3 us, except that stock takes 0.5 us at M = 1 for ``slow_decode``."""
    entries = {}
    for key in shapes:
        shape = dict(key)
        stock = {str(m): (0.5 if m == 1 and key in slow_decode else 2.0) for m in (1, 2, 4, 8, 16)}
        entries["/".join(map(str, shape.values()))] = {"shape": shape, "stock_us": stock, "kernel_us": dict.fromkeys(stock, 1.0),
                                                 "tile_us": dict.fromkeys(stock, 3.0), "stock_one_kernel": None}
    path.write_text(json.dumps({"emulated M3": entries}))
    return path


@pytest.mark.parametrize("exact", [False, True])
def test_doctor_without_tune_reads_what_exactness_costs_from_the_cache(tmp_path, exact):
    """Without --tune, a cache holding every shape of the pair is read, not timed again (the file is
    left as it was; nothing here could time a Metal kernel): one shape, whose stock decode step is
    4x faster than our kernel, costs 5 us exact against 4.5 us fastest (11.1%, over the 3% budget),
    so its layers run the fastest; the others run the per-row kernel. Under --exact all do."""
    from dflash_mlx import quantized

    shapes = _demo_w4_shapes()
    slow = max(shapes, key=lambda k: (shapes[k], k))
    path = _tuning_file(tmp_path / "tuning.json", shapes, slow_decode=[slow])
    written = path.read_text()
    report = doctor.diagnose("demo", draft_quant="w4", probe_tokens=0, facts=M3,
                             metal=kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)), kernel_shapes=SMALL_HEADS,
                             tuning_cache=quantized.TuningCache(path, "emulated M3"), exact=exact)
    text = "\n".join(doctor.render(report))
    layers, n_slow = sum(shapes.values()), shapes[slow]
    fastest = 0 if exact else n_slow
    assert (f"quantized matmuls: of {layers} layers ({len(shapes)} shapes), {layers - fastest} run the per-row verify "
            f"kernel, 0 the tile kernel and 0 stock, each one kernel at every row count (exact), {fastest} the fastest") in text
    cost = (layers * 5.0) / ((layers - n_slow) * 5.0 + n_slow * 4.5) - 1
    assert f"one kernel per layer for every row count costs {cost:.1%} of the pair's" in text, text
    assert f"read from {path}" in text and path.read_text() == written
    slow_key = f"affine{dict(slow)['bits']} gs{dict(slow)['group_size']} K{dict(slow)['K']} N{dict(slow)['N']}"
    row = next(line for line in text.splitlines() if slow_key in line)
    assert ("kernel (exact)" if exact else "fastest: stock M=1, kernel M=2-16 (not exact)") in row, row
    assert len(doctor.as_json(report)["tuning"]) == len(shapes)


def test_doctor_without_tune_says_not_tuned_yet(tmp_path):
    """An empty cache, and one lacking a shape of the pair: "not tuned yet (run --tune)", no table."""
    from dflash_mlx import quantized

    shapes = _demo_w4_shapes()
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST))
    partial = _tuning_file(tmp_path / "partial.json", list(shapes)[1:])
    for path, detail in ((tmp_path / "none.json", "no timings for this GPU"),
                         (partial, f"1 of the pair's {len(shapes)} quantized shapes have no timings")):
        report = doctor.diagnose("demo", draft_quant="w4", probe_tokens=0, facts=M3, metal=metal, kernel_shapes=SMALL_HEADS,
                                 tuning_cache=quantized.TuningCache(path, "emulated M3"))
        line = next(c for c in report.checks if c.name == "quantized matmuls")
        assert line.detail.startswith(f"not tuned yet (run --tune): {detail}") and not report.tuning, line
    linux = device.DeviceFacts("cpu", "x86_64", False, None, 16 * doctor.GiB, None)
    report = doctor.diagnose("demo", probe_tokens=0, facts=linux, metal=metal, kernel_shapes=SMALL_HEADS,
                             tuning_cache=quantized.TuningCache(partial, "emulated M3"))
    assert next(c for c in report.checks if c.name == "quantized matmuls").detail.startswith("nothing to tune: not an Apple GPU")


def test_memory_estimate_follows_the_shapes(hf_target_dir, target_config, tmp_path):
    from dflash_mlx import tiny

    tiny.write_draft(tmp_path, tiny.draft_config(target_config, block_size=8))
    small = doctor.estimate_memory(hf_target_dir, tmp_path, None, context=100)
    large = doctor.estimate_memory(hf_target_dir, tmp_path, None, context=1000)
    n_attn = sum(t == "full_attention" for t in target_config["layer_types"])
    per_position = n_attn * 2 * target_config["num_key_value_heads"] * target_config["head_dim"] * 4  # float32
    assert small["attention KV caches"] == per_position * 256  # mlx-lm's KVCache steps of 256
    assert large["attention KV caches"] == per_position * 1024
    assert large["draft context cache"] == 4 * small["draft context cache"]  # its ContextCache also grows by 256
    assert small["Gated DeltaNet states"] == large["Gated DeltaNet states"]  # independent of context
    w4 = doctor.estimate_memory(hf_target_dir, tmp_path, "w4", context=100)
    assert w4["draft weights"] < small["draft weights"] / 2


def test_doctor_reports_a_kernel_that_fails_its_self_check():
    broken = mutated_sources("tape_replay", *MUTATIONS["replay: gate dropped"][1:])
    metal = kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST, broken))
    report = doctor.diagnose(facts=M3, metal=metal, kernel_shapes=SMALL_HEADS)
    failed = [c for c in report.checks if c.status == doctor.FAIL]
    assert report.failed and failed and all(c.name.startswith("kernel tape_replay") for c in failed)
    assert all("differs from the reference" in c.detail and c.fix for c in failed)
    assert any(c.name.startswith("kernel gated_delta_tape") and c.status == doctor.OK for c in report.checks)
    healthy = doctor.diagnose(facts=M3, metal=kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)), kernel_shapes=SMALL_HEADS)
    assert not healthy.failed
    assert "M3 (Apple GPU generation 15)" in " ".join(c.detail for c in healthy.checks)


def test_drafts_compute_in_float32_on_gpus_without_native_bfloat16():
    assert device.draft_activation_dtype(M1) == mx.float32
    assert device.draft_activation_dtype(M3) is None
    assert device.draft_activation_dtype(device.facts()) is None or mx.metal.is_available()
    report = doctor.diagnose(facts=M1, metal=kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)), kernel_shapes=SMALL_HEADS)
    assert any(c.name == "draft activations" and "float32" in c.detail for c in report.checks)


def test_a_float32_draft_on_a_bfloat16_target_stays_lossless():
    model, tokenizer = load("demo", draft_dtype=mx.float32)
    assert model.draft.activation_dtype == mx.float32
    assert all(p.dtype == mx.float32 for _, p in _leaves(model.draft.parameters()))
    prompt = tokenizer.encode("def add(a, b):\n    return")
    fast = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    alone = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24, use_draft=False)]
    assert fast == alone


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix, tree


def test_doctor_finds_the_thinking_mode_the_demo_draft_was_trained_for():
    """The demo saw the empty thinking block in a fifth of its chats: --no-think, the CLI's
    default, costs it most of its acceptance, and doctor measures that."""
    report = doctor.diagnose("demo", probe_tokens=40)
    (check,) = [c for c in report.checks if c.name == "thinking mode"]
    assert check.status == doctor.WARN and "--think" in check.fix, check


def _wide_pair(root):
    """A tiny float32 pair whose caches are half its peak: attention and draft layers with 256-wide
    heads (16 KB of KV per token), so that an estimate without them is off by far more than 10%."""
    from dflash_mlx import tiny

    eos = tiny.write_tokenizer(root / "target", 512)
    config = tiny.write_target(root / "target", tiny.target_config(
        512, eos_token_id=eos, num_attention_heads=2, num_key_value_heads=2, head_dim=256,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]))
    draft = tiny.draft_config(config, block_size=4)
    draft.update(head_dim=256, num_key_value_heads=2, num_attention_heads=2)
    tiny.write_draft(root / "draft", draft)
    return str(root / "target"), str(root / "draft")


def measured_peak(target_dir, draft_dir, context: int, window=None) -> int:
    """The peak a DFlash run of ``context`` tokens (8 generated) adds over the loaded pair, measured
    in a process of its own (``mx.get_peak_memory`` on an allocator nothing else used)."""
    import subprocess
    import sys

    run = f"""
import mlx.core as mx, numpy as np
from dflash_mlx.api import load, stream_generate
new, base = 8, mx.get_active_memory()
mx.reset_peak_memory()
model, tokenizer = load({str(target_dir)!r}, draft={str(draft_dir)!r}, draft_window={window!r})
prompt = np.random.default_rng(0).integers(3, 400, {context} - new).tolist()
for _ in stream_generate(model, tokenizer, prompt, max_tokens=new, block_tokens=model.draft.block_size):
    pass
print(mx.get_peak_memory() - base)
"""
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.parametrize("pair,context", [pytest.param("demo", 4096, marks=pytest.mark.slow), pytest.param("demo-window", 4096, marks=pytest.mark.slow),
                                          pytest.param("wide", 3072, marks=pytest.mark.slow)])
def test_memory_estimate_agrees_with_a_measured_run(pair, context, tmp_path):
    """The estimate at a context is within 10% of the peak a DFlash run at that context measures
    (mx.get_peak_memory after the model is loaded on an empty allocator): the demo pair at 4096
    tokens (mostly a prefill chunk's working memory) with the draft's whole context and with its
    default 1024-token window (the prompt's chunks split where the window starts, the chunks
    before it untapped: 11% over without that split), and a pair with wide heads at 3072 (KV
    caches and the draft's context cache half the peak). The run is measured in a process of its
    own: in a test worker, what earlier tests left (threads, buffers, compiled graphs) moved the
    peak by up to 11%."""
    from dflash_mlx import defaults, loading

    target_dir, draft_dir = defaults.demo() if pair.startswith("demo") else _wide_pair(tmp_path)
    window = defaults.draft_window(loading.resolve_path(draft_dir)) if pair == "demo-window" else None
    measured = measured_peak(target_dir, draft_dir, context, window)
    estimate = doctor.estimate_memory(loading.resolve_path(target_dir), loading.resolve_path(draft_dir), None, context,
                                      draft_window=window)
    assert abs(sum(estimate.values()) / measured - 1) < 0.10, (measured, estimate)
