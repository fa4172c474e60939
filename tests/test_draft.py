"""Draft configs (legacy and nested schemas, sliding layers, windows) and every bad-config error."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import load, loading, tiny
from dflash_mlx.models.dflash import (
    DraftArgs,
    evenly_spaced_layer_ids,
    quantize_draft,
)
from dflash_mlx.quant import parse_quant
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from tests.reference import target_only
from tests.conftest import VOCAB, make_draft, random_prompts
from tests.test_lossless import assert_lossless, take

PROMPT = random_prompts(1, VOCAB, seed=3, low=12, high=13)[0]


def draft_logits(draft, context, block=4):
    cache = draft.make_cache()
    draft.add_context(context, cache)
    tokens = mx.array([[7] + [draft.mask_token_id] * (block - 1)])
    return np.array(draft(tokens, cache))


def context_features(target, draft):
    return target.forward(PROMPT[None], taps=draft.target_layer_ids)[1]


def test_legacy_and_nested_schemas_build_the_same_draft(tmp_path, target, target_config):
    legacy = make_draft(tmp_path / "legacy", target, target_config, schema="legacy", seed=4)
    nested = make_draft(tmp_path / "nested", target, target_config, schema="nested", seed=4)
    assert legacy.args.block_size == nested.args.block_size == 16
    assert legacy.args.mask_token_id == nested.args.mask_token_id == VOCAB - 1
    assert legacy.target_layer_ids == nested.target_layer_ids == [1, 2]
    features = context_features(target, nested)
    np.testing.assert_array_equal(draft_logits(legacy, features), draft_logits(nested, features))


def test_sliding_layers_window_the_context_and_stay_lossless(tmp_path, target, target_config):
    sliding = make_draft(
        tmp_path / "sliding", target, target_config, seed=4,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4,
    )
    full = make_draft(tmp_path / "full", target, target_config, seed=4)
    attn = sliding.layers[0].self_attn
    assert attn.is_causal and not sliding.layers[1].self_attn.is_causal
    # Two context keys (the cache keeps window-1 = 3, two visible to block slot 1), causal block.
    mask = np.array(attn._mask(3, 3))
    assert mask.tolist() == [
        [True, True, True, True, False, False],
        [False, True, True, True, True, False],
        [False, False, True, True, True, True],
    ]
    features = context_features(target, full)
    assert not np.allclose(draft_logits(sliding, features), draft_logits(full, features))
    expected, _ = take(target_only(target, PROMPT, Sampler()), 20)
    got, _ = take(speculative(target, sliding, PROMPT, Sampler(), block_tokens=8), 20)
    assert_lossless(target, PROMPT, expected, got)


@pytest.mark.parametrize("is_causal", [None, True])
def test_a_block_only_layer_reads_no_context_and_training_agrees_with_decoding(tmp_path, target, target_config, is_causal):
    """``sliding_window: 1`` leaves a layer only its block (causal): a layer that gathers from
    the anchor slot what an earlier layer read from the context. With ``is_causal`` the full
    layer's block is causal too (decoding passes MLX's named "causal" mask, training builds it)."""
    from dflash_mlx.train import block_logits

    draft = make_draft(
        tmp_path / "block-only", target, target_config, seed=5,
        layer_types=["full_attention", "sliding_attention"], sliding_window=1, is_causal=is_causal,
    )
    assert draft.layers[0].self_attn.is_causal == bool(is_causal)
    cache = draft.make_cache()
    assert cache[1].window == 0
    features = context_features(target, draft)
    draft.add_context(features, cache)
    # The block-only layer stores nothing but still counts positions (its block's RoPE offset).
    assert cache[1].keys is None and cache[1].offset == cache[0].offset == PROMPT.size
    assert cache[1].rewind(3) and cache[1].offset == 3
    tokens = PROMPT
    anchors = mx.array([4, 9], dtype=mx.int32)
    trained = np.array(block_logits(draft, features, tokens, anchors))
    for row, a in enumerate(np.array(anchors).tolist()):
        decoding = draft.make_cache()
        draft.add_context(features[:, :a], decoding)
        block = mx.concatenate([tokens[a : a + 1], mx.full((draft.block_size - 1,), draft.mask_token_id, dtype=tokens.dtype)])
        np.testing.assert_allclose(trained[row], np.array(draft(block[None], decoding))[0], atol=2e-4)
    expected, _ = take(target_only(target, PROMPT, Sampler()), 20)
    got, _ = take(speculative(target, draft, PROMPT, Sampler(), block_tokens=8), 20)
    assert_lossless(target, PROMPT, expected, got)


def test_context_window_keeps_only_recent_tokens(target, draft):
    features = context_features(target, draft)
    block = mx.array([[7] + [draft.mask_token_id] * 3])
    windowed = draft.make_cache(window=5)
    draft.add_context(features, windowed)
    # The same draft shown only the last 5 context tokens, at their true positions.
    recent = draft.make_cache()
    for c in recent:
        c.offset = c.start = PROMPT.size - 5
    draft.add_context(features[:, -5:], recent)
    np.testing.assert_allclose(np.array(draft(block, windowed)), np.array(draft(block, recent)), atol=1e-5)
    assert windowed[0].offset == PROMPT.size
    expected, _ = take(target_only(target, PROMPT, Sampler()), 16)
    got, _ = take(speculative(target, draft, PROMPT, Sampler(), block_tokens=4, draft_window=5), 16)
    assert_lossless(target, PROMPT, expected, got)


def test_a_window_evicts_old_context_when_the_buffer_fills(target, draft):
    """Past the buffer's capacity (256 rows) a windowed cache drops what the window no longer
    shows, and the draft then reads exactly what a cache given only the recent tokens reads."""
    tokens = mx.array(np.random.default_rng(4).integers(0, 500, (1, 300)).astype(np.int32))
    _, features = target.forward(tokens, taps=draft.target_layer_ids)
    windowed = draft.make_cache(window=5)
    for start in range(0, 300, 50):  # chunks, as prefill and cycles append them
        draft.add_context(features[:, start : start + 50], windowed)
    assert windowed[0].start > 0  # the eviction branch ran
    assert windowed[0].offset == 300
    recent = draft.make_cache()
    for c in recent:
        c.offset = c.start = 300 - 5
    draft.add_context(features[:, -5:], recent)
    block = mx.array([[7] + [draft.mask_token_id] * 3])
    np.testing.assert_allclose(np.array(draft(block, windowed)), np.array(draft(block, recent)), atol=1e-5)


def test_default_taps_follow_the_evenly_spaced_rule(tmp_path, target, target_config):
    assert evenly_spaced_layer_ids(32, 1) == [16]
    assert evenly_spaced_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    config = tiny.draft_config(target_config, num_layers=2)
    del config["dflash_config"]["target_layer_ids"]
    tiny.write_draft(tmp_path, {**config, "dflash_config": {**config["dflash_config"], "target_layer_ids": [0, 0]}})
    (tmp_path / "config.json").write_text(json.dumps(config))
    draft, _ = loading.load_draft(tmp_path)
    assert draft.bind(target).target_layer_ids == evenly_spaced_layer_ids(4, 2) == [1, 1]


def write_config(tmp_path, target_config, **changes):
    config = tiny.draft_config(target_config)
    tiny.write_draft(tmp_path, config)
    for key, value in changes.items():
        if key in config["dflash_config"]:
            config["dflash_config"][key] = value
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    return config


def test_missing_mask_token_id_is_an_error(tmp_path, target_config):
    config = write_config(tmp_path, target_config)
    del config["dflash_config"]["mask_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no mask_token_id"):
        loading.load_draft(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(target_layer_ids=[1, 9]), r"taps \[9\] are not layers of the 4-layer target"),
        (dict(mask_token_id=VOCAB), "mask_token_id 512 outside the target vocabulary"),
    ],
)
def test_draft_target_mismatches_are_errors(tmp_path, target, target_config, change, message):
    write_config(tmp_path, target_config, **change)
    draft, _ = loading.load_draft(tmp_path)
    with pytest.raises(ValueError, match=message):
        draft.bind(target)


def test_hidden_size_mismatch_is_an_error(tmp_path, target, target_config):
    other = tiny.target_config(VOCAB, hidden_size=32, head_dim=16)
    tiny.write_draft(tmp_path, tiny.draft_config(other))
    draft, _ = loading.load_draft(tmp_path)
    with pytest.raises(ValueError, match="draft hidden_size 32 != target hidden_size 64"):
        draft.bind(target)


def test_sliding_layers_need_a_window(target_config):
    config = tiny.draft_config(target_config, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="no sliding_window"):
        DraftArgs.from_dict(config)


def test_block_tokens_beyond_the_draft_block_is_an_error(target, draft):
    with pytest.raises(ValueError, match="block_tokens '17': more than the draft's block size 16"):
        next(speculative(target, draft, PROMPT, Sampler(), block_tokens=17))


def test_block_tokens_one_is_plain_decoding(target, draft):
    expected, _ = take(target_only(target, PROMPT, Sampler()), 10)
    assert take(speculative(target, draft, PROMPT, Sampler(), block_tokens=1), 10)[0] == expected


def test_quantization_specs():
    assert parse_quant("w4") == (4, 64)
    assert parse_quant("w8:gs32") == (8, 32)
    assert parse_quant("none") is None and parse_quant(None) is None
    for bad in ("w7", "q4", "w4:gs48", "w4:32", "4"):
        with pytest.raises(ValueError, match="bad quantization"):
            parse_quant(bad)


def test_w8_draft_is_quantized_and_smaller(tmp_path, target, target_config):
    draft = make_draft(tmp_path, target, target_config)
    features = context_features(target, draft)
    full_precision = draft_logits(draft, features)  # also compiles the layers' pieces
    before = sum(v.nbytes for _, v in nn.utils.tree_flatten(draft.parameters()))
    assert quantize_draft(draft, "w8:gs32") == {"group_size": 32, "bits": 8}
    after = sum(v.nbytes for _, v in nn.utils.tree_flatten(draft.parameters()))
    assert isinstance(draft.fc, nn.QuantizedLinear) and after < 0.5 * before
    # Quantizing after a first use is picked up (no stale compiled graph), and w8 stays close.
    fresh = make_draft(tmp_path / "fresh", target, target_config)
    quantize_draft(fresh, "w8:gs32")
    np.testing.assert_array_equal(draft_logits(draft, features), draft_logits(fresh, features))
    assert not np.array_equal(draft_logits(draft, features), full_precision)
    np.testing.assert_allclose(draft_logits(draft, features), full_precision, atol=0.1)
    # The target's embedding and head stay untouched: they are not the draft's parameters.
    assert isinstance(target.model.embed_tokens, nn.Embedding) and isinstance(target.lm_head, nn.Linear)


def test_mask_id_on_a_real_token_warns(tmp_path):
    target_dir, draft_dir = tiny.write_pair(tmp_path)
    config = json.loads((draft_dir / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 300  # a merge the tokenizer really uses
    (draft_dir / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="mask_token_id 300 is the real token"):
        load(str(target_dir), draft=str(draft_dir))
