"""`dflash-mlx train-draft`: the DFlash objective lowers the loss, and the draft it writes is usable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import tiny
from dflash_mlx.api import load
from dflash_mlx.loading import load_draft
from dflash_mlx.models.dflash import DFlashDraft, DraftArgs
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from dflash_mlx.train import (
    TrainConfig,
    answer_windows,
    block_hidden,
    block_logits,
    content_match_init,
    corpus_chats,
    new_draft_config,
    train_draft,
)
from tests import subprocess_env
from tests.conftest import make_hf_target, training_setup
from tests.test_lossless import take

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target_dir, corpus, model, tokenizer = training_setup(root)
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


@pytest.mark.slow  # trains twice
def test_resume_continues_the_run(setup):
    """A 30-step run interrupted after its step-20 save and resumed takes the steps an uninterrupted 30-step run
    takes: the same batches, losses and weights (not only the saved losses read back)."""
    root, _, corpus, model, tokenizer = setup
    out = root / "resumed"

    def interrupt(step, loss):
        if step == 21:
            raise KeyboardInterrupt  # as Ctrl-C would, one step after the step-20 save

    with pytest.raises(KeyboardInterrupt):
        train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=30, **CONFIG), num_layers=1, on_step=interrupt)
    assert json.loads((out / "training_state" / "state.json").read_text())["step"] == 20
    more = train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=30, **CONFIG), resume=True)
    assert json.loads((out / "training_state" / "state.json").read_text())["step"] == 30
    straight = train_draft(model.target, tokenizer, [corpus], root / "straight", TrainConfig(steps=30, **CONFIG), num_layers=1)
    assert len(more) == len(straight) == 30
    np.testing.assert_allclose(more, straight, rtol=1e-5, atol=1e-6)
    resumed, uninterrupted = (mx.load(str(d / "model.safetensors")) for d in (out, root / "straight"))
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        np.testing.assert_allclose(np.array(resumed[key].astype(mx.float32)), np.array(uninterrupted[key].astype(mx.float32)),
                                   rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.slow  # trains through the CLI
def test_cli_trains_and_rejects_bad_input(setup, tmp_path):
    _, target_dir, corpus, _, _ = setup
    base = [sys.executable, "-m", "dflash_mlx.cli", "train-draft", "-m", str(target_dir)]
    done = subprocess.run(
        base + ["--data", str(corpus), "--out", str(tmp_path / "d"), "--steps", "12", "--seq-len", "64",
                "--anchors", "4", "--block-size", "4", "--layers", "1", "--taps", "0,2", "--save-every", "6"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "draft written to" in done.stdout and (tmp_path / "d" / "model.safetensors").exists()
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]
    for args, message in (
        (["--data", str(tmp_path / "none.txt"), "--out", str(tmp_path / "e")], "does not exist"),
        (["--data", str(corpus), "--out", str(tmp_path / "d")], "already exists and is not empty"),
        (["--data", str(corpus), "--out", str(tmp_path / "f"), "--resume"], "nothing to resume"),
        (["--data", str(corpus), "--out", str(tmp_path / "g"), "--taps", "1,9"], "taps [9] are not layers of the 4-layer target"),
        (["--data", str(corpus), "--out", str(tmp_path / "h"), "--taps", "a"], "expected layer numbers"),
    ):
        bad = subprocess.run(base + args, capture_output=True, text=True, cwd=ROOT, timeout=300, env=subprocess_env())
        assert bad.returncode == 1 and message in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # trains a draft
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


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied-embedding target (what content-match init needs) and a chat corpus with answers."""
    root = tmp_path_factory.mktemp("tied")
    target_dir = make_hf_target(root / "target", tie=True)
    model, tokenizer = load(str(target_dir))
    lines = []
    for i in range(12):
        code = tiny._CORPUS.splitlines()[i % 6]
        user = f"Copy this line {i}:\n{code}"
        lines.append(json.dumps({"text": f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{code}<|im_end|>\n"}))
    corpus = root / "chats.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    return root, target_dir, corpus, model, tokenizer


def test_answers_only_anchors_blocks_in_answers_and_windows_start_at_a_chat(tied):
    _, _, corpus, _, tokenizer = tied
    ids, answer, starts = corpus_chats([corpus], tokenizer)
    assert len(starts) == 12 and answer.any() and not answer.all()
    first = int(np.flatnonzero(answer)[0])
    first_answer = tokenizer.decode(ids[first : first + int(np.argmax(~answer[first:]))].tolist())
    assert first_answer.endswith("<|im_end|>") and "Copy this line" not in first_answer
    config = TrainConfig(seq_len=64, anchors=3, block_size=3)
    windows = answer_windows(ids, answer, starts, config, np.random.default_rng(0))
    for _ in range(10):
        window, anchors = next(windows)
        offset = next(s for s in starts if np.array_equal(ids[s : s + window.size], np.array(window)))
        assert all(answer[offset + a] for a in np.array(anchors).tolist())
        assert int(np.array(anchors).max()) <= window.size - config.block_size
    with pytest.raises(ValueError, match="no assistant answer"):
        next(answer_windows(ids, np.zeros_like(answer), starts, config, np.random.default_rng(0)))


def test_content_match_init_points_the_anchor_slot_at_the_position_before_it(tied):
    _, _, _, model, _ = tied
    target = model.target
    last = target.args.num_hidden_layers - 1
    config = new_draft_config(target, 2, 4, target.args.vocab_size - 1, [1, last], block_only_layers=1, causal=True)
    assert config["layer_types"] == ["full_attention", "block_attention"] and "sliding_window" not in config
    assert config["is_causal"] is True
    draft = DFlashDraft(DraftArgs.from_dict(config)).bind(target)
    content_match_init(draft, target)
    rng = np.random.default_rng(0)
    N, H = 40, target.args.hidden_size
    tokens = mx.array(rng.integers(0, 300, N).astype(np.int32))
    for a in (10, 25, 39):
        features = rng.normal(size=(1, N, 2 * H)).astype(np.float32)
        # the state before the anchor is the one that predicted it: the anchor's own embedding
        features[0, a - 1, H:] = np.array(target.embed_tokens.weight[int(tokens[a])])
        ctx = draft.hidden_norm(draft.fc(mx.array(features)))[:, :a]
        layer = draft.layers[0]
        q, _, _ = layer.self_attn.project(layer.input_layernorm(draft._embed(tokens[a : a + 1][None])))
        keys, _ = layer.self_attn.project_context(ctx)
        scores = draft.rope(q, offset=a)[0, 0, 0] @ draft.rope(keys)[0, 0].T * layer.self_attn.scale
        weights = np.array(mx.softmax(scores))
        assert weights.argmax() == a - 1 and weights[a - 1] > 0.5, (a, weights.argmax(), weights.max())
        # RoPE's one-position turn is undone: the match scores what an unrotated one would
        # (q_norm and k_norm at 2.0: at most 4 * sqrt(head_dim)); without the undo it is ~3% lower.
        assert float(scores[a - 1]) > 0.985 * 4 * draft.args.head_dim**0.5


def test_content_match_init_refuses_what_it_cannot_do(setup, tied):
    untied = setup[3].target
    config = new_draft_config(untied, 1, 4, untied.args.vocab_size - 1, [untied.args.num_hidden_layers - 1])
    with pytest.raises(ValueError, match="tied embeddings"):
        content_match_init(DFlashDraft(DraftArgs.from_dict(config)).bind(untied), untied)
    target = tied[3].target
    config = new_draft_config(target, 1, 4, target.args.vocab_size - 1, [1])
    with pytest.raises(ValueError, match="include 3 in the taps"):
        content_match_init(DFlashDraft(DraftArgs.from_dict(config)).bind(target), target)
    with pytest.raises(ValueError, match="block-only layers must be 0..0"):
        new_draft_config(target, 1, 4, 511, [1], block_only_layers=1)


@pytest.mark.slow  # trains a draft
def test_the_recipe_trains_and_writes_a_draft_our_loader_takes(tied, tmp_path):
    _, target_dir, corpus, model, tokenizer = tied
    out = tmp_path / "recipe"
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", "train-draft", "-m", str(target_dir), "--data", str(corpus),
         "--out", str(out), "--steps", "6", "--seq-len", "64", "--anchors", "4", "--block-size", "4", "--layers", "2",
         "--taps", "1,3", "--block-only-layers", "1", "--causal", "--init", "content-match", "--answers-only",
         "--decay-gamma", "2", "--save-every", "6"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "block_attention"] and config["is_causal"]
    draft, _ = load_draft(out)
    draft.bind(model.target)
    prompt = mx.array(tokenizer.encode("def fibonacci(n):"))
    expected, _ = take(target_only(model.target, prompt, Sampler()), 16)
    got, _ = take(speculative(model.target, draft, prompt, Sampler(), block_tokens=4), 16)
    assert got == expected
    bad = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", "train-draft", "-m", str(target_dir), "--data", str(corpus),
         "--out", str(tmp_path / "bad"), "--init", "clever"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=subprocess_env(),
    )
    assert bad.returncode == 1 and "init must be 'random' or 'content-match'" in bad.stderr and "Traceback" not in bad.stderr


# -- DFlash2 drafts (--arch dflash2) ---------------------------------------------------------------

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)


def _new_dflash2(model, tokenizer, block_size=4, layers=2):
    from dflash_mlx.train import DFlash2Shape, _new_draft

    config = TrainConfig(block_size=block_size)
    return _new_draft(model.target, tokenizer, config, layers, None, None, 0, False, "random", DFlash2Shape(**DFLASH2))[0]


def test_a_new_dflash2_draft_starts_as_the_dflash_draft_it_wraps(setup):
    """Identity convolutions and a selector that adds nothing: the walk is the head's argmax."""
    _, _, _, model, tokenizer = setup
    draft = _new_dflash2(model, tokenizer)
    x = mx.random.normal((1, 4, draft.args.hidden_size))
    conv = draft.layers[0].attention_conv
    once, kernel = conv.prepare(x)
    np.testing.assert_allclose(np.array(once), np.array(x), atol=1e-6)
    np.testing.assert_allclose(np.array(conv.finish(x, kernel)), np.array(x), atol=1e-6)
    hidden = mx.random.normal((1, 3, draft.args.hidden_size))
    logits = draft.logits(hidden)
    tokens, _, _ = draft.candidate_selector.select(hidden, logits, mx.array([5]), 0.0)
    assert tokens.tolist() == mx.argmax(logits, axis=-1).tolist()


def test_the_dflash2_training_forward_is_the_inference_forward(setup):
    """Every anchor's block in the batched training pass equals inference's pass over that block
    with the context before it (convolutions and selector perturbed away from their start)."""
    _, _, _, model, tokenizer = setup
    draft = _new_dflash2(model, tokenizer, block_size=4)
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = conv.base_kernel + 0.3 * mx.random.normal(conv.base_kernel.shape)
            conv.kernel_projection.weight = 0.05 * mx.random.normal(conv.kernel_projection.weight.shape)
    tokens = mx.array(np.random.default_rng(1).integers(0, 400, 32).astype(np.int32))
    features = model.target.forward(tokens[None], taps=draft.target_layer_ids)[1]
    anchors = [6, 17]
    batched = block_hidden(draft, features, tokens, mx.array(anchors, dtype=mx.int32))
    for row, anchor in enumerate(anchors):
        cache = draft.make_cache()
        draft.add_context(features[:, :anchor], cache)
        block = mx.array([tokens[anchor].item()] + [draft.mask_token_id] * 3)
        np.testing.assert_allclose(np.array(batched[row]), np.array(draft.hidden(block[None], cache)[0]), atol=1e-4)


def test_dflash2_training_teaches_the_selector_and_writes_a_draft_zlab_reads(setup, monkeypatch):
    from dflash_mlx.models.dflash2 import DFlash2Draft
    from dflash_mlx.train import DFlash2Shape, selector_loss
    from tests.test_interop import zlab_load

    root, target_dir, corpus, model, tokenizer = setup
    out = root / "draft-dflash2"
    train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=40, **CONFIG), num_layers=1,
                dflash2=DFlash2Shape(**DFLASH2))
    draft, config = load_draft(out)
    assert isinstance(draft, DFlash2Draft) and config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["selector_top_k"] == 8
    draft.bind(model.target)
    # The selector learned: on a window of the corpus its loss is below what it was at the start.
    tokens = mx.array(tokenizer.encode(tiny._CORPUS)[:64])
    logits, features = model.target.forward(tokens[None], taps=draft.target_layer_ids)
    labels = mx.concatenate([tokens[:1], mx.argmax(logits[0, :-1], axis=-1).astype(tokens.dtype)])
    anchors = mx.arange(4, 56, 4)
    slot_labels = labels[anchors[:, None] + mx.arange(1, 4)[None, :]]
    previous = mx.concatenate([tokens[anchors][:, None], slot_labels[:, :-1]], axis=1)
    weights = mx.ones((3,))

    def head_part(d):
        logits = block_logits(d, features, tokens, anchors)
        return nn.losses.cross_entropy(logits.astype(mx.float32), slot_labels).mean().item()

    def selector_part(d):
        hidden = block_hidden(d, features, tokens, anchors)
        return selector_loss(d.candidate_selector, hidden, d.logits(hidden), previous, slot_labels, weights).item()

    # The body learned (against a fresh draft), and so did the selector (against the one it started
    # with, on the trained body: the total loss mixes the two, and which slots count for the
    # selector moves as the head learns).
    assert head_part(draft) < head_part(_new_dflash2(model, tokenizer, layers=1)) - 0.3
    start = _new_dflash2(model, tokenizer, layers=1)
    start.update({k: v for k, v in draft.parameters().items() if k != "candidate_selector"})
    assert selector_part(draft) < selector_part(start) - 0.05
    # Lossless, and z-lab's own loader proposes the same walk from what we wrote.
    prompt = mx.array(tokenizer.encode("def fibonacci(n):"))
    expected, _ = take(target_only(model.target, prompt, Sampler()), 24)
    got, _ = take(speculative(model.target, draft, prompt, Sampler(), block_tokens=4), 24)
    assert got == expected
    reference = zlab_load(out, monkeypatch).bind(model.target)
    cache = draft.make_cache()
    draft.add_context(features, cache)
    block = mx.array([26] + [draft.mask_token_id] * 3)
    mine, _ = draft.propose(block, cache, Sampler())
    walk, _, _ = reference.propose(block[None], features, reference.make_cache(), 0.0, logits_start=1)
    assert mine.tolist() == walk[0].tolist()


def test_cli_trains_a_dflash2_draft_and_refuses_bad_shapes(setup, tmp_path):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    root, target_dir, corpus, _, _ = setup
    args = ["train-draft", "--model", str(target_dir), "--data", str(corpus), "--seq-len", "48", "--anchors", "4",
            "--block-size", "4", "--layers", "1"]
    runner = CliRunner()
    bad = runner.invoke(app, args + ["--out", str(tmp_path / "bad"), "--arch", "dflash2", "--conv-group-size", "7"])
    assert bad.exit_code == 1 and "--conv-group-size 7 must divide the target's hidden size 64" in bad.output
    assert not (tmp_path / "bad").exists()
    wrong = runner.invoke(app, args + ["--out", str(tmp_path / "x"), "--arch", "dflash3"])
    assert wrong.exit_code == 1 and "--arch 'dflash3'" in wrong.output
    done = runner.invoke(app, args + ["--out", str(tmp_path / "ok"), "--arch", "dflash2", "--steps", "3",
                                      "--selector-rank", "8", "--selector-top-k", "4"])
    assert done.exit_code == 0, done.output
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("selector_rank", "selector_top_k")} == {"selector_rank": 8, "selector_top_k": 4}


def test_a_trained_dflash_draft_becomes_the_dflash2_draft_that_wraps_it(setup, tmp_path):
    """--from-draft with --arch dflash2: the DFlash draft's weights (stored in bfloat16, trained in
    float32), identity convolutions and a selector that adds nothing, so the DFlash2 draft proposes
    what the DFlash draft proposed; training runs from there; what cannot be is refused by name."""
    from typer.testing import CliRunner

    from dflash_mlx.cli import app
    from dflash_mlx.models.dflash2 import DFlash2Draft
    from dflash_mlx.train import DFlash2Shape, draft_from

    _, target_dir, corpus, model, tokenizer = setup
    target = model.target
    config = tiny.draft_config(json.loads((target_dir / "config.json").read_text()), block_size=4, target_layer_ids=[0, 2])
    start = tmp_path / "dflash"
    tiny.write_draft(start, config, seed=5)
    weights = mx.load(str(start / "model.safetensors"))
    mx.save_safetensors(str(start / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    plain, _ = load_draft(start)
    plain.set_dtype(mx.float32)
    plain.bind(target)
    wrapped, wrapped_config = draft_from(start, target, DFlash2Shape(**DFLASH2))
    assert isinstance(wrapped, DFlash2Draft) and wrapped_config["architectures"] == ["DFlash2DraftModel"]
    assert wrapped_config["dflash_config"]["target_layer_ids"] == [0, 2] and wrapped.block_size == 4
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(wrapped.parameters()))
    prompt = mx.array(tokenizer.encode("class Stack:\n    def push(self, item):"))[None]
    _, features = target.forward(prompt, taps=plain.target_layer_ids)
    walks = []
    for draft in (plain, wrapped):
        cache = draft.make_cache()
        draft.add_context(features, cache)
        walks.append(draft.propose(mx.array([int(prompt[0, -1])] + [draft.mask_token_id] * 3), cache, Sampler())[0].tolist())
    assert walks[0] == walks[1]

    runner = CliRunner()
    base = ["train-draft", "--model", str(target_dir), "--data", str(corpus), "--seq-len", "48", "--anchors", "4"]
    dflash2 = ["--arch", "dflash2", "--selector-rank", "16", "--selector-top-k", "8"]
    done = runner.invoke(app, base + dflash2 + ["--out", str(tmp_path / "d2"), "--from-draft", str(start), "--steps", "3"])
    assert done.exit_code == 0, done.output
    written = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"] and written["dflash_config"]["target_layer_ids"] == [0, 2]
    quantized = tmp_path / "quantized"  # what a converted --quant draft says of itself
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 4}}))
    (quantized / "model.safetensors").symlink_to(start / "model.safetensors")
    for extra, message in (
        (["--from-draft", str(tmp_path / "d2")], "is a DFlash2 draft: train it with --arch dflash2"),
        (dflash2 + ["--from-draft", str(quantized)], "is quantized: start from the unquantized draft"),
        (dflash2 + ["--from-draft", str(start), "--layers", "3"], "--layers: the draft given with --from-draft decides its own shape"),
        (dflash2 + ["--from-draft", str(start), "--resume"], "--from-draft starts a new run"),
        (dflash2 + ["--from-draft", str(tmp_path / "nowhere")], f"--from-draft {tmp_path / 'nowhere'}"),
    ):
        bad = runner.invoke(app, base + ["--out", str(tmp_path / "x")] + extra)
        assert bad.exit_code == 1 and message in bad.output, (extra, bad.output)
        assert not (tmp_path / "x").exists()



def test_training_stops_at_the_first_diverged_step(setup):
    """A diverging run raises at its first non-finite loss, before writing that step's draft (the
    last checkpoint stays finite), instead of running every step and checking at the end."""
    root, _, corpus, model, tokenizer = setup
    out = root / "diverged"
    config = TrainConfig(steps=200, **{**CONFIG, "learning_rate": 1e9, "warmup": 1, "save_every": 1})
    seen = []
    with pytest.raises(RuntimeError, match=r"diverged at step \d+ .*--learning-rate \(now 1000000000"):
        train_draft(model.target, tokenizer, [corpus], out, config, num_layers=1,
                    on_step=lambda step, loss: seen.append(loss))
    assert 0 < len(seen) < config.steps and all(np.isfinite(seen))
    assert all(bool(mx.all(mx.isfinite(w))) for w in mx.load(str(out / "model.safetensors")).values())


def test_resuming_takes_the_drafts_block_size_without_changing_the_callers_config(setup):
    root, _, corpus, model, tokenizer = setup
    out = root / "resumed-block"
    train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=1, **CONFIG), num_layers=1)
    given = TrainConfig(steps=1, **{**CONFIG, "block_size": 3})
    train_draft(model.target, tokenizer, [corpus], out, given, resume=True)
    assert given == TrainConfig(steps=1, **{**CONFIG, "block_size": 3})
    assert json.loads((out / "config.json").read_text())["dflash_config"]["block_size"] == CONFIG["block_size"]


def test_train_refuses_a_run_that_cannot_start_naming_the_flag(tmp_path):
    """What `train-draft` checks before it loads the target is train's own rule (the CLI calls it)."""
    from dflash_mlx.train import DFlash2Shape, check_run, parse_taps

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    check_run([corpus], tmp_path / "new", resume=False, from_draft=False)
    check_run([corpus], full, resume=True, from_draft=False)  # a resume continues what is there
    for args, message in (
        (([tmp_path / "none.txt"], tmp_path / "new", False, False), "--data"),
        (([corpus], full, False, False), "already exists and is not empty"),
        (([corpus], full, True, True), "--from-draft starts a new run"),
    ):
        with pytest.raises(ValueError, match=message):
            check_run(*args)
    assert parse_taps("1, 3,5") == [1, 3, 5] and parse_taps(" ") is None
    with pytest.raises(ValueError, match="--taps 'a': expected layer numbers"):
        parse_taps("a")
    assert DFlash2Shape.for_arch("dflash", 2, 16, 256, 16) is None
    assert DFlash2Shape.for_arch("dflash2", 3, 8, 64, 4) == DFlash2Shape(3, 8, 64, 4)
    with pytest.raises(ValueError, match="--arch 'dflash3': choose 'dflash' or 'dflash2'"):
        DFlash2Shape.for_arch("dflash3", 2, 16, 256, 16)
    with pytest.raises(ValueError, match="--selector-rank 0: at least 1"):
        DFlash2Shape.for_arch("dflash", 2, 16, 0, 16)  # checked whichever the arch, as the CLI always did
