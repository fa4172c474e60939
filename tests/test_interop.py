"""What we write, others read: our drafts in z-lab's reference loader (PyPI ``dflash`` 0.1.0,
``dflash/model_mlx.py``, installed with ``--no-deps``), ours-only options refused there by name,
and the demo target in mlx-lm's own model."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import api, tiny
from dflash_mlx.loading import load_draft
from dflash_mlx.train import TrainConfig, train_draft
from tests.conftest import training_setup
from tests.test_mlx_layouts import multimodal

try:
    import dflash.model_mlx as zlab
except ImportError as e:  # the oracle is part of the test install, not optional
    raise ImportError("z-lab's reference code is missing: pip install --no-deps dflash==0.1.0 (see .ci/run)") from e


def zlab_load(folder, monkeypatch):
    """z-lab's own ``load_draft``, reading ``folder`` where it would read a Hub snapshot."""
    monkeypatch.setattr(zlab, "snapshot_download", lambda repo, allow_patterns=None: str(folder))
    return zlab.load_draft("local/draft")


def assert_same_proposals(folder, model, monkeypatch, block=4):
    """z-lab's model and ours on the same context features and block: the same logits."""
    reference = zlab_load(folder, monkeypatch).bind(model.target)
    ours, _ = load_draft(folder)
    ours.bind(model.target)
    taps = ours.target_layer_ids
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])
    _, features = model.target.forward(prompt, taps=taps)
    tokens = mx.array([[26] + [ours.mask_token_id] * (block - 1)])
    cache = ours.make_cache()
    ours.add_context(features, cache)
    mine = ours(tokens, cache)
    theirs = reference(tokens, features, reference.make_cache(), logits_start=1)
    np.testing.assert_allclose(np.array(mine.astype(mx.float32)), np.array(theirs.astype(mx.float32)), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    _, corpus, model, tokenizer = training_setup(root)
    return root, model, tokenizer, corpus


@pytest.mark.parametrize("causal", [False, True])
def test_train_draft_output_loads_in_zlab_and_proposes_the_same(pair, tmp_path, monkeypatch, causal):
    root, model, tokenizer, corpus = pair
    out = tmp_path / "draft"
    train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=3, seq_len=64, anchors=8, block_size=4),
                num_layers=2, causal=causal)
    config = json.loads((out / "config.json").read_text())
    assert config["num_target_layers"] == model.target.args.num_hidden_layers
    assert config.get("is_causal", False) == causal  # top level, where z-lab reads it
    assert_same_proposals(out, model, monkeypatch)


def test_block_only_layers_are_ours_and_refused_by_zlab_by_name(pair, tmp_path, monkeypatch):
    root, model, tokenizer, corpus = pair
    out = tmp_path / "draft"
    train_draft(model.target, tokenizer, [corpus], out, TrainConfig(steps=2, seq_len=64, anchors=8, block_size=4),
                num_layers=2, block_only_layers=1)
    assert json.loads((out / "config.json").read_text())["layer_types"] == ["full_attention", "block_attention"]
    with pytest.raises(ValueError, match=r"Unsupported draft layer_types: \['block_attention'\]"):
        zlab_load(out, monkeypatch)
    demo = api.defaults.DEMO_DIR / "draft"
    with pytest.raises(ValueError, match="block_attention"):
        zlab_load(demo, monkeypatch)


def test_the_old_encoding_of_block_only_layers_still_loads_the_same(tmp_path):
    """Drafts written before ``block_attention``: a ``sliding_attention`` layer with window 1."""
    demo = api.defaults.DEMO_DIR / "draft"
    shutil.copytree(demo, tmp_path / "old")
    config = json.loads((demo / "config.json").read_text())
    config["layer_types"] = ["full_attention", "sliding_attention"]
    config["sliding_window"] = 1
    config["dflash_config"]["is_causal"] = config.pop("is_causal")
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    model, tokenizer = api.load("demo")
    prompt = "def add(a, b):"
    old, _ = api.load("demo", draft=str(tmp_path / "old"))
    texts = [api.generate(m, tokenizer, prompt, max_tokens=16, block_tokens=4) for m in (model, old)]
    assert texts[0] == texts[1]
    new_draft, _ = load_draft(demo)
    old_draft, _ = load_draft(tmp_path / "old")
    assert [l.self_attn.sliding_window for l in new_draft.layers] == [l.self_attn.sliding_window for l in old_draft.layers]
    assert [l.self_attn.is_causal for l in new_draft.layers] == [l.self_attn.is_causal for l in old_draft.layers]


def test_converted_drafts_load_in_zlab(pair, tmp_path, monkeypatch):
    """`dflash-mlx convert`'s output (nested schema, num_target_layers) in z-lab's loader."""
    from dflash_mlx.convert import convert_draft

    root, model, tokenizer, _ = pair
    text = json.loads((model.target_path / "config.json").read_text())
    tiny.write_draft(root / "zlab", tiny.draft_config(text, block_size=4, is_causal=True), seed=3)
    out, _ = convert_draft(tmp_path / "out", draft=str(root / "zlab"), target=str(model.target_path), base_tokenizer=None)
    assert json.loads((out / "config.json").read_text())["num_target_layers"] == text["num_hidden_layers"]
    assert_same_proposals(out, model, monkeypatch)


def test_the_demo_target_reads_the_same_in_mlx_lm(tmp_path):
    """mlx-lm places full attention by ``full_attention_interval`` alone: the demo's config carries
    it beside ``layer_types`` (every third layer), and mlx-lm's model then equals ours."""
    from mlx_lm.utils import load_model

    demo = api.defaults.DEMO_DIR / "target"
    assert json.loads((demo / "config.json").read_text())["full_attention_interval"] == 3
    ours, _ = api.load("demo")
    folder = multimodal(demo, tmp_path / "mm")
    reference, _ = load_model(folder)
    prompt = mx.array([[5, 17, 300, 42, 99, 7, 256, 3]])
    np.testing.assert_allclose(np.array(reference(prompt).astype(mx.float32)), np.array(ours.target(prompt).astype(mx.float32)),
                               atol=5e-2, rtol=0)
