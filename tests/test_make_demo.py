"""examples/make_demo.py's target stages, on a tiny transformers checkpoint and a few edit chats."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_mlx.api import load
from tests.conftest import make_hf_target

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import make_demo  # noqa: E402

SNIPPET = '''def scale(values, factor):
    """Multiply every value."""
    return [v * factor for v in values]


def total(values):
    return sum(values)
'''


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    root = tmp_path_factory.mktemp("make_demo")
    target_dir = make_hf_target(root / "target", tie=True)
    rng = random.Random(0)
    lines = []
    for _ in range(6):
        user, answer = make_demo.edit_example(SNIPPET, rng)
        lines.append(json.dumps({"text": make_demo.chat(user, answer, think=False)}))
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    return corpus, target_dir


def test_edit_examples_are_found_and_labelled_on_the_answer_only(build):
    corpus, target_dir = build
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    examples = make_demo.edit_examples(corpus, tokenizer, seq_len=4096)
    assert len(examples) == 6
    ids, labels = make_demo.answer_batches(examples, 3, tokenizer.pad_token_id)(np.random.default_rng(0))
    assert ids.shape == labels.shape and ids.shape[0] == 3
    for row in range(3):
        answer = labels[row][labels[row] != -100].tolist()
        assert answer and tokenizer.decode(answer).rstrip().endswith("<|im_end|>")


@pytest.mark.slow  # trains a stage
def test_lookahead_stage_trains_every_offset_and_saves_a_plain_target(build, tmp_path):
    corpus, target_dir = build
    work = tmp_path / "target"
    subprocess.run(["cp", "-r", str(target_dir), str(work)], check=True)
    per_offset = make_demo.train_lookahead_stage(corpus, work, steps=3, batch=2, seq_len=4096, lr=1e-3, seed=0, horizon=3)
    assert len(per_offset) == 3 and all(len(row) == 3 and all(math.isfinite(x) for x in row) for row in per_offset)
    # Zero-initialised heads start as the next-token head: the far offsets begin worse than +1.
    assert per_offset[0][2] > per_offset[0][0]
    model, _ = load(str(work))  # the heads are not saved: the normal loading path takes it as it is
    assert model.target.args.num_hidden_layers == 4


@pytest.mark.parametrize("flags, message", [
    (["--lookahead-horizon", "1"], "--lookahead-horizon 1"),
    (["--lookahead-round", "300:1e-3"], "'300:1e-3': expected STEPS:LR:WEIGHT"),
    (["--lookahead-round", "300:0:1"], "'300:0:1': steps must be >= 0, lr > 0"),
])
def test_bad_lookahead_options_are_refused(flags, message, tmp_path):
    done = subprocess.run([sys.executable, "examples/make_demo.py", "--work", str(tmp_path / "w"), *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "w").exists()  # refused before any work


@pytest.mark.slow  # trains a few rounds
def test_lookahead_rounds_parse_and_weight_the_heads(build, tmp_path):
    from safetensors.numpy import load_file

    assert make_demo.lookahead_round("300:5e-4:0.3") == (300, 5e-4, 0.3)
    corpus, target_dir = build
    trained = {}
    for name, stage in {
        "copy": lambda d: make_demo.train_copy_stage(corpus, d, steps=2, batch=2, seq_len=4096, lr=1e-3, seed=0),
        "weight 0": lambda d: make_demo.train_lookahead_stage(corpus, d, 2, 2, 4096, 1e-3, 0, horizon=3, weight=0.0),
        "weight 1": lambda d: make_demo.train_lookahead_stage(corpus, d, 2, 2, 4096, 1e-3, 0, horizon=3, weight=1.0),
    }.items():
        work = tmp_path / name.replace(" ", "")
        subprocess.run(["cp", "-r", str(target_dir), str(work)], check=True)
        stage(work)
        trained[name] = load_file(str(work / "model.safetensors"))
    # Weight 0 leaves only the next-token loss: the same update as the copy stage; weight 1 moves it.
    differs = lambda a, b: max(float(np.abs(a[k] - b[k]).max()) for k in a)  # noqa: E731
    assert differs(trained["weight 0"], trained["copy"]) < 1e-5
    assert differs(trained["weight 1"], trained["copy"]) > 1e-4


def test_install_cast_keeps_a_loadable_checkpoint_in_the_new_dtype(build, tmp_path):
    import mlx.core as mx
    from transformers import Qwen3_5ForCausalLM

    _, target_dir = build
    work = tmp_path / "target"
    subprocess.run(["cp", "-r", str(target_dir), str(work)], check=True)
    before, _ = load(str(work))
    ids = mx.array([[5, 9, 200, 31, 7]])
    expected = before.target(ids).astype(mx.float32)
    make_demo.cast_checkpoint(work, "bfloat16")
    assert json.loads((work / "config.json").read_text())["dtype"] == "bfloat16"
    assert not list(work.glob("*.partial.*"))
    after, _ = load(str(work))
    assert after.target.embed_tokens.weight.dtype == mx.bfloat16
    got = after.target(ids).astype(mx.float32)
    assert float(mx.abs(got - expected).max()) < 0.1 * float(mx.abs(expected).max())  # rounding, not damage
    hf = Qwen3_5ForCausalLM.from_pretrained(str(work))  # and transformers still reads it
    assert str(hf.dtype) == "torch.bfloat16"


def test_corpus_only_writes_the_edit_chats_and_stops(tmp_path):
    """--corpus-only: the data `train-draft --model demo --from-draft demo` takes (docs/training.md)."""
    done = subprocess.run([sys.executable, "examples/make_demo.py", "--work", str(tmp_path / "w"), "--corpus-only",
                           "--max-files", "4", "--draft-chats", "5"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    edits = [json.loads(line)["text"] for line in (tmp_path / "w" / "edit_corpus.jsonl").read_text().splitlines()]
    assert 0 < len(edits) <= 5 and all(make_demo.is_edit(text) for text in edits)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["corpus.jsonl", "edit_corpus.jsonl"]
