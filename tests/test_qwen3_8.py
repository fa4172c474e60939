"""Qwen3.8 targets: the release's config (``Qwen3_5ForConditionalGeneration``, every text field it
adds) in the multimodal layout transformers writes, against transformers, with a DFlash2 draft."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dflash_mlx import loading, tiny
from dflash_mlx import speculative as loop
from tests.reference import target_only
from dflash_mlx.loading import CheckpointError, load_target
from dflash_mlx.sampling import Sampler
from tests.conftest import dflash2_config, spread_weights, write_dflash2_draft
from tests.test_lossless import assert_lossless, take
from tests.test_target import PROMPT

# The text fields of Qwen/Qwen3.8-27B's config.json beyond a Qwen3.5 text config (its sizes are
# tiny.target_config's): Qwen3.6's gate and multi-token-prediction fields, interleaved M-RoPE.
QWEN3_8_TEXT = dict(
    attn_output_gate=True, output_gate_type="swish", mamba_ssm_dtype="float32", mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False, full_attention_interval=4, partial_rotary_factor=0.25,
    rope_parameters={"mrope_interleaved": True, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.25,
                     "rope_theta": 10_000_000, "rope_type": "default"},
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


@pytest.fixture(scope="module")
def qwen3_8_dir(tmp_path_factory):
    """A random ``Qwen3_5ForConditionalGeneration`` with Qwen3.8's text fields, saved by transformers
    (``model.language_model.*`` and the vision tower), plus the release's MTP layer."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen3_8")
    eos = tiny.write_tokenizer(path, 512)
    text = {k: v for k, v in tiny.target_config(512, eos_token_id=eos).items() if k not in ("architectures", "dtype")}
    text.update(QWEN3_8_TEXT)
    config = Qwen3_5Config(text_config=text, vision_config=VISION, image_token_id=500, video_token_id=501,
                           vision_start_token_id=502, vision_end_token_id=503, tie_word_embeddings=False)
    torch.manual_seed(8)
    model = spread_weights(Qwen3_5ForConditionalGeneration(config).float().eval())
    model.save_pretrained(str(path))
    weights = load_file(str(path / "model.safetensors"))
    weights["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    weights["mtp.layers.0.mlp.gate_proj.weight"] = np.zeros((128, 64), np.float32)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits.numpy()
    return path, logits


def test_the_release_config_loads_and_matches_transformers(qwen3_8_dir):
    path, expected = qwen3_8_dir
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    assert config["text_config"]["output_gate_type"] == "swish" and "vision_config" in config
    model, _ = load_target(path)
    np.testing.assert_allclose(np.array(model(mx.array(PROMPT))), expected, atol=1e-4, rtol=0)


def _edited(path, folder, edit):
    """The checkpoint at ``path`` with ``edit`` applied to its config, in ``folder``."""
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").symlink_to(path / "model.safetensors")
    return folder


def test_qwen3_8_model_types_load_as_the_same_layers(qwen3_8_dir, tmp_path):
    """Some re-exports name Qwen3.8's layers ``qwen3_8`` / ``qwen3_8_text``."""
    path, expected = qwen3_8_dir

    def rename(config):
        config["model_type"], config["text_config"]["model_type"] = "qwen3_8", "qwen3_8_text"

    model, _ = load_target(_edited(path, tmp_path, rename))
    np.testing.assert_allclose(np.array(model(mx.array(PROMPT))), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("gate", ["sigmoid", "gelu"])
def test_another_delta_net_gate_is_refused_by_name(qwen3_8_dir, tmp_path, gate):
    """vLLM also runs a sigmoid gate (Qwen3.8-Flash-Next's): computing silu instead would be wrong."""
    path, _ = qwen3_8_dir
    folder = _edited(path, tmp_path, lambda config: config["text_config"].update(output_gate_type=gate))
    with pytest.raises(CheckpointError, match=f"output_gate_type '{gate}'"):
        load_target(folder)


def test_a_dflash2_draft_on_qwen3_8_is_lossless(qwen3_8_dir, tmp_path):
    """The published Qwen3.8 drafter is a DFlash2 one (block 8, sliding window, bidirectional)."""
    path, _ = qwen3_8_dir
    target, config = load_target(path)
    write_dflash2_draft(tmp_path, dflash2_config(config["text_config"], block_size=8), seed=8)
    draft, _ = loading.load_draft(tmp_path)
    draft = draft.bind(target)
    prompt = mx.array(PROMPT[0].astype(np.int32))
    expected, _ = take(target_only(target, prompt, Sampler()), 24)
    got, _ = take(loop.speculative(target, draft, prompt, Sampler(), block_tokens=8), 24)
    assert_lossless(target, prompt, expected, got)
