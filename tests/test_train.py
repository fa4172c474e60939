"""`dflash-mlx train-draft`: the DFlash objective lowers the loss, and the draft it writes is usable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import tiny
from dflash_mlx.api import load
from dflash_mlx.loading import load_draft
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative, target_only
from dflash_mlx.train import TrainConfig, block_logits, train_draft
from tests.test_lossless import take

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target_dir, _ = tiny.write_pair(root)
    corpus = root / "corpus.txt"
    corpus.write_text(tiny._CORPUS * 20)
    model, tokenizer = load(str(target_dir))
    return root, target_dir, corpus, model, tokenizer


CONFIG = dict(seq_len=64, anchors=8, block_size=4, learning_rate=3e-3, warmup=5, save_every=20)
RULE_CONFIG = dict(seq_len=48, anchors=16, block_size=4, learning_rate=3e-3, warmup=10, save_every=1000)
STEPS_FOR_RULE = 200


@pytest.mark.parametrize("labels", ["target", "corpus"])
def test_a_few_steps_lower_the_loss_and_the_draft_is_lossless(setup, labels):
    root, target_dir, corpus, model, tokenizer = setup
    out = root / f"draft-{labels}"
    losses = train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=60, labels=labels, **CONFIG), num_layers=1)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.5
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 4 and "model.safetensors" in {p.name for p in out.iterdir()}
    draft, _ = load_draft(out)  # z-lab layout: our loader (and the converter) take it as it is
    draft.bind(model.target)
    prompt = mx.array(tokenizer.encode("def fibonacci(n):"))
    expected, _ = take(target_only(model.target, prompt, Sampler()), 24)
    got, _ = take(speculative(model.target, draft, prompt, Sampler(), block_tokens=4), 24)
    assert got == expected


def test_anchor_blocks_see_only_the_context_before_them(setup):
    """Changing tokens at or after an anchor must not change that anchor's block logits."""
    root, _, corpus, model, tokenizer = setup
    out = root / "draft-target"
    if not out.exists():
        train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=5, **CONFIG), num_layers=1)
    draft, _ = load_draft(out)
    draft.bind(model.target)
    tokens = mx.array(np.random.default_rng(0).integers(0, 400, 40).astype(np.int32))
    features = model.target.forward(tokens[None], taps=draft.target_layer_ids)[1]
    anchors = mx.array([10, 20], dtype=mx.int32)
    changed = mx.array(np.asarray(features))
    changed[:, 10:] = 0.0  # features at and after the first anchor
    a = block_logits(draft, features, tokens, anchors)
    b = block_logits(draft, changed, tokens, anchors)
    np.testing.assert_allclose(np.array(a[0]), np.array(b[0]), atol=1e-5)
    assert not np.allclose(np.array(a[1]), np.array(b[1]), atol=1e-3)


def test_resume_continues_the_run(setup):
    root, _, corpus, model, tokenizer = setup
    out = root / "resumed"
    first = train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=20, **CONFIG), num_layers=1)
    more = train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=30, **CONFIG), resume=True)
    assert len(first) == 20 and len(more) == 30 and more[:20] == first
    assert json.loads((out / "training_state" / "state.json").read_text())["step"] == 30


def test_cli_trains_and_rejects_bad_input(setup, tmp_path):
    _, target_dir, corpus, _, _ = setup
    base = [sys.executable, "-m", "dflash_mlx.cli", "train-draft", "-m", str(target_dir)]
    done = subprocess.run(
        base + ["--data", str(corpus), "--out", str(tmp_path / "d"), "--steps", "12", "--seq-len", "64",
                "--anchors", "4", "--block-size", "4", "--layers", "1", "--taps", "0,2", "--save-every", "6"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "draft written to" in done.stdout and (tmp_path / "d" / "model.safetensors").exists()
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]
    for args, message in (
        (["--data", str(tmp_path / "none.txt"), "--out", str(tmp_path / "e")], "does not exist"),
        (["--data", str(corpus), "--out", str(tmp_path / "d")], "already exists and is not empty"),
        (["--data", str(corpus), "--out", str(tmp_path / "f"), "--resume"], "nothing to resume"),
        (["--data", str(corpus), "--out", str(tmp_path / "g"), "--taps", "1,9"], "tap 9 is not a layer"),
        (["--data", str(corpus), "--out", str(tmp_path / "h"), "--taps", "a"], "expected layer numbers"),
    ):
        bad = subprocess.run(base + args, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert bad.returncode == 1 and message in bad.stderr and "Traceback" not in bad.stderr


def test_the_draft_learns_a_rule_the_unigram_cannot_guess(setup, tmp_path):
    """A corpus where every character fixes the next one (one cycle of distinct characters).

    Unigram statistics give ~1/len(cycle) of the slots right; the rule is only in the block's
    anchor and the context, so a draft that reads neither (a broken mask, RoPE or feature path,
    or a training plateau at the unigram) fails here, which a falling loss alone does not show.
    """
    _, _, _, model, tokenizer = setup
    cycle = "QZ7X@K3V!J9W#M5Y$R2U%P8G&H4N*"
    corpus = tmp_path / "cycle.txt"
    corpus.write_text(cycle * 400)
    out = tmp_path / "draft"
    train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=STEPS_FOR_RULE, labels="corpus", **RULE_CONFIG), num_layers=1)
    draft, _ = load_draft(out)
    draft.bind(model.target)
    B, correct = draft.block_size, []
    for phase in range(0, len(cycle), 4):  # windows as long as the training ones, every phase of the cycle
        ids = tokenizer.encode((cycle[phase:] + cycle * 2)[: RULE_CONFIG["seq_len"]], add_special_tokens=False)
        tokens = mx.array(np.array(ids, dtype=np.int32))
        features = model.target.forward(tokens[None], taps=draft.target_layer_ids)[1]
        anchors = np.arange(1, len(ids) - B + 1).astype(np.int32)
        predicted = np.array(mx.argmax(block_logits(draft, features, tokens, mx.array(anchors)), axis=-1))
        correct.append(predicted == np.array(ids)[anchors[:, None] + np.arange(1, B)[None, :]])
    accuracy = np.concatenate(correct).mean()
    unigram = 1 / len(cycle)  # every character is equally frequent
    assert accuracy > 0.9, f"slot accuracy {accuracy:.2f}; the unigram gets {unigram:.2f}"
