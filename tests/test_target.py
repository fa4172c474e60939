"""The Qwen3.5 target against transformers and mlx-lm, in every checkpoint layout we load."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

from dflash_mlx.loading import CheckpointError, load_target
from tests.conftest import make_hf_target

PROMPT = np.array([[5, 17, 300, 42, 99, 7, 256, 3, 128, 64, 11, 500, 2, 77]], dtype=np.int64)


def torch_logits(path, ids=PROMPT, hidden=False):
    import torch
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=hidden)
    if hidden:
        return out.logits.numpy(), [h.numpy() for h in out.hidden_states]
    return out.logits.numpy()


def test_logits_match_transformers(hf_target_dir, target):
    ref, hidden = torch_logits(hf_target_dir, hidden=True)
    ours, taps = target.forward(mx.array(PROMPT), taps=(0, 2))
    np.testing.assert_allclose(np.array(ours), ref, atol=1e-4, rtol=0)
    # Taps are the residual stream after each chosen layer (HF's hidden_states[i + 1]).
    H = target.args.hidden_size
    np.testing.assert_allclose(np.array(taps[..., :H]), hidden[1], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.array(taps[..., H:]), hidden[3], atol=1e-4, rtol=0)


def assert_cached_decoding_matches_the_full_forward(target, atol=1e-5):
    """Token by token and in chunks of 5, through the caches: the full forward's logits."""
    full = np.array(target(mx.array(PROMPT)))
    cache = target.make_cache()
    steps = [np.array(target(mx.array(PROMPT[:, i : i + 1]), cache)) for i in range(PROMPT.shape[1])]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=atol, rtol=0)
    cache = target.make_cache()
    chunks = [np.array(target(mx.array(PROMPT[:, s : s + 5]), cache)) for s in range(0, PROMPT.shape[1], 5)]
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), full, atol=atol, rtol=0)
    assert all(c.offset == PROMPT.shape[1] for c in cache)


def test_cached_decoding_matches_full_forward(target):
    assert_cached_decoding_matches_the_full_forward(target)


def test_multimodal_sharded_layout_loads(hf_target_dir, target, tmp_path):
    """Released Qwen3.5 checkpoints: multimodal config, model.language_model.*, vision and MTP."""
    weights = load_file(str(hf_target_dir / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((8, 8), np.float32)
    renamed["mtp.layers.0.mlp.gate_proj.weight"] = np.zeros((8, 8), np.float32)
    keys = sorted(renamed)
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    index = {"metadata": {}, "weight_map": {}}
    for i, names in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: renamed[k] for k in names}, str(tmp_path / name), metadata={"format": "pt"})
        index["weight_map"].update({k: name for k in names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    text_config = json.loads((hf_target_dir / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text_config, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = load_target(tmp_path)
    np.testing.assert_array_equal(np.array(model(mx.array(PROMPT))), np.array(target(mx.array(PROMPT))))


def test_matches_mlx_lm_qwen3_5(hf_target_dir, target):
    from mlx_lm.models import qwen3_5 as mlx_lm_qwen

    text_config = json.loads((hf_target_dir / "config.json").read_text())
    args = mlx_lm_qwen.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text_config})
    reference = mlx_lm_qwen.Model(args)
    weights = {k: mx.array(v) for k, v in load_file(str(hf_target_dir / "model.safetensors")).items()}
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    reference.load_weights(list(reference.sanitize(weights).items()))
    np.testing.assert_allclose(
        np.array(reference(mx.array(PROMPT))), np.array(target(mx.array(PROMPT))), atol=1e-4, rtol=0
    )


def save_mlx(model, config: dict, path, quantization=None):
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = dict(config)
    if quantization:
        config["quantization"] = quantization
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_checkpoint_round_trip(hf_target_dir, tmp_path, bits):
    model, config = load_target(hf_target_dir)
    nn.quantize(model, group_size=32, bits=bits)
    expected = np.array(model(mx.array(PROMPT)))
    save_mlx(model, config, tmp_path, {"group_size": 32, "bits": bits})
    loaded, _ = load_target(tmp_path)
    assert isinstance(loaded.model.layers[0].linear_attn.in_proj_qkv, nn.QuantizedLinear)
    np.testing.assert_array_equal(np.array(loaded(mx.array(PROMPT))), expected)
    full = np.array(load_target(hf_target_dir)[0](mx.array(PROMPT)))
    relative_rms = np.sqrt(((expected - full) ** 2).mean() / (full**2).mean())
    assert relative_rms < (0.35 if bits == 4 else 0.05)


def test_mlx_layout_float_round_trip(target, target_config, tmp_path):
    """Our own MLX layout (already sanitized: no conv transpose, no +1 on norms)."""
    save_mlx(target, target_config, tmp_path)
    loaded, _ = load_target(tmp_path)
    np.testing.assert_array_equal(np.array(loaded(mx.array(PROMPT))), np.array(target(mx.array(PROMPT))))


def test_tied_head_matches_transformers(tmp_path):
    path = make_hf_target(tmp_path, tie=True, seed=3)
    model, _ = load_target(path)
    assert not hasattr(model, "lm_head")
    np.testing.assert_allclose(np.array(model(mx.array(PROMPT))), torch_logits(path), atol=1e-4, rtol=0)


def test_bad_checkpoints_are_clear_errors(hf_target_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path)
    shutil.copy(hf_target_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no .safetensors"):
        load_target(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_target(tmp_path)
    config = json.loads((hf_target_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(CheckpointError, match="not a target this loads"):
        load_target(tmp_path)


def test_only_decode_and_verify_lengths_are_compiled(hf_target_dir):
    """Compiled graphs are traced per length: prefill chunks (any length) must run uncompiled, so
    that the traces stay bounded by the verify lengths, and the output does not depend on it."""
    from dflash_mlx.models.qwen3_5 import COMPILED_TOKENS

    target, _ = load_target(hf_target_dir)
    asked = []
    for layer in target.layers:
        pieces = layer._pieces
        object.__setattr__(layer, "_pieces", lambda mode, pieces=pieces: asked.append(mode) or pieces(mode))
    ids = mx.array(np.random.default_rng(0).integers(0, 500, 80), dtype=mx.int32)
    for length in (17, 23, 40, 80):
        asked.clear()
        target(ids[None, :length])
        assert set(asked) == {"plain"}, length  # the plain functions, nothing traced
    for length in (1, 4, COMPILED_TOKENS):
        asked.clear()
        target(ids[None, :length])
        assert "plain" not in asked and set(asked) <= {"attention", "chunked", "reference"}, length
    cache = target.make_cache()
    target(ids[None, :40], cache)
    stepped = target(ids[None, 40:41], cache)
    np.testing.assert_allclose(np.array(stepped[0, -1]), np.array(target(ids[None, :41])[0, -1]), atol=1e-4)


def test_each_layer_is_queued_as_it_is_built_with_the_same_numbers(target, draft, monkeypatch):
    """On the CPU every target and draft layer's output goes to ``mx.async_eval`` as soon as it
    is built (``layers.submit_layer``: MLX's CPU stream runs it while Python builds the next), and
    the numbers are those of the pass queued whole."""
    from dflash_mlx.models import layers

    block = mx.array([[3] + [draft.mask_token_id] * (draft.block_size - 1)])

    def passes():
        """The target's logits and taps on the prompt, and the draft's states on a block after it."""
        logits, features = target.forward(mx.array(PROMPT), target.make_cache(), draft.target_layer_ids)
        draft_cache = draft.make_cache()
        draft.add_context(features, draft_cache)
        return logits, features, draft.hidden(block, draft_cache)

    queued = []
    real = mx.async_eval
    monkeypatch.setattr(layers.mx, "async_eval", lambda *a: (queued.append(a), real(*a))[1])
    layered = passes()
    assert len(queued) == len(target.layers) + len(draft.layers)
    assert all(len(a) == 1 and isinstance(a[0], mx.array) for a in queued)

    monkeypatch.setattr(layers.mx, "async_eval", lambda *a: None)  # nothing queued before the end
    for ours, whole in zip(layered, passes()):
        assert mx.array_equal(ours, whole).item()
