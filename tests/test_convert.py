"""`dflash-mlx convert` against a local fake Hugging Face Hub, in the real file layouts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load, tiny
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from tests import subprocess_env
from tests.fake_hub import FakeHub
from tests.test_lossless import take

ROOT = Path(__file__).resolve().parents[1]
BASE_VOCAB = 248070  # Qwen3.5's tokenizer: ids 0..248069
ADDED = ["<|audio_start|>", "<|audio_end|>", "<|audio_bos|>", "<|audio_eos|>", "<|audio_sep|>", "<|audio_mask|>", "<|audio_pad|>"]
EMBEDDING_ROWS = 248320


def write_qwen_tokenizer(path: Path, added=()) -> None:
    """A word-level tokenizer with Qwen3.5's size and special-token ids (plus ``added`` at the end)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>", 248068: "<think>", 248069: "</think>"}
    vocab = {f"w{i}": i for i in range(248044)}
    for i in range(248044, BASE_VOCAB):
        vocab[specials.get(i, f"<|special_{i}|>")] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=tiny.CHAT_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": list(specials.values())})
    if added:
        fast.add_tokens(list(added), special_tokens=True)
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Repos of a fake hub, and a local tiny target with the Qwopus-sized vocabulary."""
    root = tmp_path_factory.mktemp("hub")
    target_config = tiny.target_config(EMBEDDING_ROWS, tie_word_embeddings=True, eos_token_id=248046)
    base = root / "base"
    base.mkdir()
    write_qwen_tokenizer(base)
    (base / "config.json").write_text(json.dumps(target_config))
    qwopus = root / "qwopus"
    qwopus.mkdir()
    write_qwen_tokenizer(qwopus, ADDED)
    (qwopus / "config.json").write_text(json.dumps(target_config))
    (qwopus / "model.safetensors").write_bytes(b"\0" * 4096)  # weights the converter must never fetch
    drafts = {
        "nested": tiny.draft_config(target_config, mask_token_id=248077, block_size=8),
        "legacy": tiny.draft_config(target_config, mask_token_id=248070, block_size=8, schema="legacy"),
        "other-size": tiny.draft_config(tiny.target_config(EMBEDDING_ROWS, hidden_size=32, head_dim=16), mask_token_id=248077),
        "bad-taps": tiny.draft_config(target_config, mask_token_id=248077, target_layer_ids=[1, 7]),
        "bad-mask": tiny.draft_config(target_config, mask_token_id=EMBEDDING_ROWS + 5),
        # over huggingface_hub's 10 MB download chunk, so that a dropped transfer has bytes to resume from
        "big": {**tiny.draft_config(target_config, mask_token_id=248077, block_size=8), "intermediate_size": 8192},
    }
    for name, config in drafts.items():
        tiny.write_draft(root / name, config, seed=2, dtype=np.float32)
    corrupt = root / "corrupt"
    shutil.copytree(root / "nested", corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + b"\0" * 64)
    local_target = root / "local-target"
    tiny.write_target(local_target, target_config, seed=4)
    write_qwen_tokenizer(local_target, ADDED)
    return root, local_target


@contextmanager
def serving(root: Path):
    """A fake hub serving the world's repos under their Hub names."""
    with FakeHub() as hub:
        hub.add("Qwen/Qwen3.5-9B", root / "base")
        hub.add("Jackrong/Qwopus3.5-9B-Coder", root / "qwopus")
        hub.add("z-lab/Qwen3.5-9B-DFlash", root / "nested")
        for name in ("legacy", "other-size", "bad-taps", "bad-mask", "corrupt", "big"):
            hub.add(f"z-lab/{name}", root / name)
        yield hub


@pytest.fixture()
def hub(world):
    with serving(world[0]) as hub:
        yield hub


@pytest.fixture(scope="module")
def default_conversion(world, tmp_path_factory):
    """``convert`` with its defaults, run once for the tests that read its output (about 3 s a run):
    the finished process, the output folder, the hub's requests and the draft's commit."""
    tmp_path = tmp_path_factory.mktemp("default-conversion")
    with serving(world[0]) as hub:
        done = run_cli(hub, tmp_path, "--out", str(tmp_path / "draft-qwopus"))
        return done, tmp_path / "draft-qwopus", list(hub.requests), hub.commit("z-lab/Qwen3.5-9B-DFlash")


def run_cli(hub, tmp_path, *args, offline=False):
    env = {**subprocess_env(), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", "convert", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def test_default_pair_converts_with_named_warnings(default_conversion):
    done, out, requests, draft_commit = default_conversion
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    meta = config["dflash_mlx"]
    assert config["dflash_config"] == {"block_size": 8, "mask_token_id": 248077, "target_layer_ids": [1, 2]}
    assert meta["draft"] == "z-lab/Qwen3.5-9B-DFlash" and meta["draft_revision"] == draft_commit
    [added] = meta["warnings"]
    assert "7 target tokens beyond the draft's original 248070-token vocabulary" in added
    assert "248070 '<|audio_start|>'" in added and "248076 '<|audio_pad|>'" in added
    assert "mask id" not in added  # 248077 is past the tokenizer
    assert (out / "tokenizer.json").exists() and (out / "README.md").exists()
    assert "Qwopus3.5-9B-Coder" in (out / "README.md").read_text()
    # Only config and tokenizer of the target: never its weights.
    assert not any("qwopus" in p.lower() and p.endswith(".safetensors") for _, p in requests)
    assert "tokens the draft never saw" in done.stderr


@pytest.mark.slow  # whole-CLI subprocesses
def test_legacy_draft_with_mask_on_a_real_token_is_loudly_flagged(hub, tmp_path):
    out = tmp_path / "legacy"
    done = run_cli(hub, tmp_path, "--draft", "z-lab/legacy", "--out", str(out))
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert "block_size" not in config and config["dflash_config"]["mask_token_id"] == 248070  # normalized schema
    warnings = " ".join(config["dflash_mlx"]["warnings"])
    assert "mask id 248070 is the real token '<|audio_start|>'" in warnings
    assert "(the mask id 248070 is one of them)" in warnings
    assert "WARNING: 2 suspicious fit(s)" in done.stderr


@pytest.mark.slow  # converts and quantizes checkpoints through the fake hub
def test_converted_drafts_load_and_are_lossless_w4_smaller(hub, tmp_path, world, default_conversion):
    _, local_target = world
    done, plain, _, _ = default_conversion
    w4 = tmp_path / "w4"
    assert done.returncode == 0, done.stderr
    assert run_cli(hub, tmp_path, "--out", str(w4), "--quant", "w4:gs32").returncode == 0
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(w4) < 0.4 * size(plain)
    assert json.loads((w4 / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 4}
    prompt = mx.array([11, 248045, 500, 9000, 248046, 77], dtype=mx.int32)
    expected = None  # the same target under both drafts: its own tokens once
    for folder in (plain, w4):
        model, _ = load(str(local_target), draft=str(folder))
        if expected is None:
            expected, _ = take(target_only(model.target, prompt, Sampler()), 8)
        # 8 tokens, 7 verify cycles (a cycle costs about 0.25 s with this vocabulary): the random
        # draft's blocks are rejected, every cycle the same kind as in a longer run.
        got, _ = take(speculative(model.target, model.draft, prompt, Sampler(), block_tokens=8), 8)
        assert got == expected


@pytest.mark.slow  # serves a fake hub and interrupts downloads
def test_offline_and_resumed_downloads(hub, tmp_path):
    # A connection that always drops (huggingface_hub retries it 5 times, 1 s apart): a clean failure.
    hub.break_after[("z-lab/big", "model.safetensors")] = 1000
    broken = run_cli(hub, tmp_path, "--draft", "z-lab/big", "--out", str(tmp_path / "a"))
    assert broken.returncode == 1 and "download of z-lab/big failed" in broken.stderr
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.*"))
    hub.break_after.clear()
    # The run again, into the same folder (one conversion for both checks: about 3 s each): a connection
    # dropped mid-file once, huggingface_hub asks for the rest (a Range request from the bytes it has
    # written, whole 10 MB chunks) and the run succeeds.
    hub.break_once[("z-lab/big", "model.safetensors")] = 11_000_000
    assert run_cli(hub, tmp_path, "--draft", "z-lab/big", "--out", str(tmp_path / "a")).returncode == 0
    assert [r for p, r in hub.ranges if p.startswith("/z-lab/big/")] == [f"bytes={10 * 1024 * 1024}-"], hub.ranges
    # Everything is cached now: offline works, and a later run needs no network.
    offline = run_cli(hub, tmp_path, "--draft", "z-lab/big", "--out", str(tmp_path / "b"), offline=True)
    assert offline.returncode == 0, offline.stderr
    missing = run_cli(hub, tmp_path, "--draft", "z-lab/legacy", "--out", str(tmp_path / "c"), offline=True)
    assert missing.returncode == 1 and "HF_HUB_OFFLINE" in missing.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--draft", "z-lab/does-not-exist"], "repo z-lab/does-not-exist not found"),
        (["--draft", "z-lab/corrupt"], "cannot read"),
        pytest.param(["--draft", "z-lab/other-size"], "draft hidden_size 32, target 64: this draft was made for another model size", marks=pytest.mark.slow),
        pytest.param(["--draft", "z-lab/bad-taps"], "taps [7] are not layers of the 4-layer target", marks=pytest.mark.slow),
        pytest.param(["--draft", "z-lab/bad-mask"], "mask id 248325, target embedding has 248320 rows", marks=pytest.mark.slow),
        pytest.param(["--quant", "w5:gs3"], "bad quantization", marks=pytest.mark.slow),
    ],
)
def test_bad_inputs_fail_cleanly(hub, tmp_path, args, message):
    out = tmp_path / "out"
    done = run_cli(hub, tmp_path, *args, "--out", str(out))
    assert done.returncode == 1, done.stdout
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.slow  # whole-CLI subprocesses
def test_existing_output_needs_force(hub, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    done = run_cli(hub, tmp_path, "--out", str(out))
    assert done.returncode == 1 and "already exists (use --force" in done.stderr
    assert (out / "keep.txt").exists()
    assert run_cli(hub, tmp_path, "--out", str(out), "--force").returncode == 0
    assert (out / "config.json").exists() and not (out / "keep.txt").exists()


@pytest.mark.slow  # whole-CLI subprocesses
def test_draft_for_another_tokenizer_warns_on_load(hub, tmp_path, world):
    _, local_target = world
    out = tmp_path / "draft"
    assert run_cli(hub, tmp_path, "--out", str(out), "--target", "Qwen/Qwen3.5-9B").returncode == 0
    with pytest.warns(UserWarning, match="converted for the tokenizer of 'Qwen/Qwen3.5-9B'"):
        load(str(local_target), draft=str(out))


def test_target_conversion_loads_in_ours(hf_target_dir, target, tmp_path):
    """Streamed conversion: float output equal to the source; 4-bit output equal, tensor for tensor,
    to quantizing the loaded model in memory (what mlx-lm's converter does)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dflash_mlx.convert import ConversionError
    from dflash_mlx.loading import load_target
    from dflash_mlx.target_conversion import convert_target

    prompt = mx.array([[5, 17, 300, 42, 99, 7]])
    seen = []
    convert_target(str(hf_target_dir), tmp_path / "f32", progress=lambda done, total, peak: seen.append((done, total, peak)))
    assert seen and seen[-1][0] == seen[-1][1] and seen[-1][2] > 0
    converted, config = load_target(tmp_path / "f32")
    assert config["model_type"] == "qwen3_5_text"
    np.testing.assert_array_equal(np.array(converted(prompt)), np.array(target(prompt)))
    convert_target(str(hf_target_dir), tmp_path / "q4", quant="w4:gs32")
    quantized, config = load_target(tmp_path / "q4")
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    reference, _ = load_target(hf_target_dir)
    nn.quantize(reference, group_size=32, bits=4)
    want, got = dict(tree_flatten(reference.parameters())), dict(tree_flatten(quantized.parameters()))
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(np.array(got[key]), np.array(want[key]), err_msg=key)
    assert (tmp_path / "q4" / "tokenizer.json").exists()
    with pytest.raises(ConversionError, match="already exists"):
        convert_target(str(hf_target_dir), tmp_path / "q4")
    with pytest.raises(ConversionError, match="already an MLX quantized checkpoint"):
        convert_target(str(tmp_path / "q4"), tmp_path / "again")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_moe_target_conversion(tmp_path, layout):
    """Both HF expert layouts -> stacked 4-bit experts, the router and shared-expert gate at 8 bits."""
    from dflash_mlx.loading import load_target
    from dflash_mlx.target_conversion import convert_target
    from tests.conftest import make_hf_moe_target

    source = make_hf_moe_target(tmp_path / "src", layout)
    convert_target(str(source), tmp_path / "q4", quant="w4:gs32")
    config = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text"
    assert config["quantization"]["model.layers.0.mlp.gate"] == {"bits": 8, "group_size": 64}
    model, _ = load_target(tmp_path / "q4")
    assert model.layers[0].mlp.switch_mlp.gate_proj.bits == 4 and model.layers[0].mlp.gate.bits == 8
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    reference, _ = load_target(source)  # quantized in memory with the same recipe
    eight_bit = lambda path, m: {"group_size": 64, "bits": 8} if path.endswith(("mlp.gate", "shared_expert_gate")) else True  # noqa: E731
    nn.quantize(reference, group_size=32, bits=4, class_predicate=lambda p, m: hasattr(m, "to_quantized") and eight_bit(p, m))
    want, got = dict(tree_flatten(reference.parameters())), dict(tree_flatten(model.parameters()))
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(np.array(got[key]), np.array(want[key]), err_msg=key)


def test_moe_target_conversion_equals_mlx_lm_convert(tmp_path):
    """Our 4-bit MoE conversion writes what ``mlx_lm.convert`` writes with the same settings (its
    model's own quant_predicate: the router and shared-expert gate at 8 bits): the same
    quantization overrides, and every tensor equal bit for bit once loaded."""
    from mlx.utils import tree_flatten

    from dflash_mlx.loading import load_target
    from dflash_mlx.target_conversion import convert_target
    from tests.conftest import make_hf_moe_target
    from tests.test_mlx_layouts import mlx_lm_convert

    source = make_hf_moe_target(tmp_path / "src", "fused")
    convert_target(str(source), tmp_path / "ours", quant="w4:gs32")
    mlx_lm_convert(source, tmp_path / "mlx_lm", "affine4", moe=True)
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization"]
    theirs = json.loads((tmp_path / "mlx_lm" / "config.json").read_text())["quantization"]
    overrides = {k.removeprefix("language_model."): v for k, v in theirs.items() if isinstance(v, dict)}
    assert overrides and {k: v for k, v in ours.items() if isinstance(v, dict)} == overrides
    assert {k: v for k, v in ours.items() if not isinstance(v, dict)} == {"group_size": 32, "bits": 4, "mode": "affine"}
    got = dict(tree_flatten(load_target(tmp_path / "ours")[0].parameters()))
    want = dict(tree_flatten(load_target(tmp_path / "mlx_lm")[0].parameters()))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(np.array(got[key]), np.array(want[key]), err_msg=key)


def test_tensors_read_from_disk_a_slice_at_a_time_quantize_the_same(hf_target_dir, tmp_path):
    """The direct row reads that keep large tensors out of memory (forced here for every eligible
    tensor, bf16 source) give the same bytes as quantizing the loaded tensors."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dflash_mlx import loading, target_conversion
    from dflash_mlx.models.qwen3_5 import module_path
    from tests.conftest import make_hf_target

    source = make_hf_target(tmp_path / "bf16", dtype="bfloat16")
    config = loading.read_config(source)
    folder = tmp_path / "out"
    folder.mkdir()
    quantization = target_conversion.convert_tensors(source, config, folder, (4, 32), direct_read_bytes=0,
                                                     shard_bytes=64 * 1024)
    assert len(list(folder.glob("*.safetensors"))) > 1  # several shards, one index
    readers = target_conversion.row_readers(source, module_path, 0)
    assert "lm_head.weight" in readers and "model.layers.0.mlp.gate_proj.weight" in readers
    text = target_conversion.text_config(config)
    (folder / "config.json").write_text(json.dumps({**text, "quantization": quantization}))
    converted, _ = loading.load_target(folder)
    reference, _ = loading.load_target(source)
    nn.quantize(reference, group_size=32, bits=4)
    want, got = dict(tree_flatten(reference.parameters())), dict(tree_flatten(converted.parameters()))
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(np.array(got[key].astype(mx.float32)), np.array(want[key].astype(mx.float32)), err_msg=key)
