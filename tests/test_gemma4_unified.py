"""Gemma 4 12B (``gemma4_unified``): the Gemma 4 dense text decoder beside encoder-free image and
audio projections, run by ``models/gemma4.py``.

A tiny random ``Gemma4UnifiedForConditionalGeneration`` written by transformers (float32, its
projections included, sliding and full layers alternating with a window of 3 tokens: shorter than
any block plus its prompt): the logits and taps against transformers', and far from them without
the window, the value norm, the layer scalars or the soft-capping; greedy speculative output with
a tiny draft in z-lab's layout token-identical to transformers' own greedy continuation and to the
target alone; mlx-vlm's layout of the same weights (``language_model.model.*``,
``vision_embedder.*``) the same model bit for bit; ``convert-target``'s folder the same model, and
at 4 bits the same tensors as MLX's ``nn.quantize`` of it; at the release's dimensions, built empty,
every tensor of transformers' shape; the named pair ``gemma-4-12b``.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx import tiny
from dflash_mlx.loading import load_target, target_family
from dflash_mlx.sampling import Sampler
from tests.conftest import VOCAB, random_prompts, spread_weights
from tests.reference import target_only
from tests.test_families import TOLERANCE, logits, stream_tokens, torch_forward
from tests.test_families_window import test_logits_match_transformers_and_not_without_the_window as window_parity
from tests.test_lossless import assert_lossless, take
from tests.test_target import PROMPT

WINDOW = 3
PROJECTIONS = ("model.vision_embedder.", "model.embed_vision.", "model.embed_audio.")


def make_unified_target(path):
    """A tiny random ``Gemma4UnifiedForConditionalGeneration`` (full layers with their own head size
    and proportional RoPE, logits soft-capped at 2 where the tiny model's reach 1, so that the cap
    bends them; tiny image and audio projections) as transformers
    saves it: the text config nested, ``per_layer_config`` for the full layers' head size."""
    import torch
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    eos = tiny.write_tokenizer(path, VOCAB)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=2.0,
                max_position_embeddings=4096, eos_token_id=eos)
    config = Gemma4UnifiedConfig(text_config=text, audio_config=dict(audio_embed_dim=8),
                                 vision_config=dict(patch_size=2, pooling_kernel_size=2, mm_embed_dim=16,
                                                    mm_posemb_size=8, output_proj_dims=16))
    torch.manual_seed(0)
    model = spread_weights(Gemma4UnifiedForConditionalGeneration(config).float().eval(), stacked=True)
    with torch.no_grad():  # scalars that matter; embedding rows small beside the layers' outputs, so
        # that the tied head does not just repeat the last token (its row, times sqrt(hidden), would
        # otherwise dominate the stream)
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("layer_scalar"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0, 0.05)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_unified_target(tmp_path_factory.mktemp("gemma4_unified"))


@pytest.fixture(scope="module")
def target(hf_dir):
    return load_target(hf_dir)[0]


def test_logits_match_transformers_and_not_without_gemma4s_parts(hf_dir, target):
    from safetensors import safe_open

    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "gemma4_unified" and "per_layer_config" in config["text_config"]
    with safe_open(str(hf_dir / "model.safetensors"), "np") as f:  # projections there, dropped by sanitize
        assert {p for p in PROJECTIONS for k in f.keys() if k.startswith(p)} == set(PROJECTIONS)
    assert type(target).__module__ == "dflash_mlx.models.gemma4"
    assert target.layers[1].self_attn.q_proj.weight.shape == (4 * 32, 64)  # the full layers' head size
    window_parity(hf_dir, target)
    _, hidden = torch_forward(hf_dir)  # taps: the residual stream after layers 0 and 2, what the draft reads
    _, taps = target.forward(mx.array(PROMPT), taps=(0, 2))
    np.testing.assert_allclose(np.array(taps[..., :64]), hidden[1], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(np.array(taps[..., 64:]), hidden[3], atol=TOLERANCE, rtol=0)


def test_mlx_vlm_layout_is_the_same_model(hf_dir, target, tmp_path):
    """mlx-vlm's names (``language_model.model.*``, ``vision_embedder.*``, ``embed_vision.*``,
    ``embed_audio.*``: how mlx-community's gemma-4-12B conversions are laid out), bit for bit."""
    import shutil

    weights = {}
    for key, value in mx.load(str(hf_dir / "model.safetensors")).items():
        key = key.removeprefix("model.")
        weights[key.replace("language_model.", "language_model.model.", 1)] = value
    assert any(k.startswith("vision_embedder.") for k in weights)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    shutil.copy(hf_dir / "config.json", tmp_path / "config.json")
    np.testing.assert_array_equal(logits(load_target(tmp_path)[0]), logits(target))


@pytest.fixture(scope="module")
def pair(hf_dir, tmp_path_factory):
    """``dflash_mlx.load`` of the target with a tiny z-lab draft (nested schema, block 16)."""
    from dflash_mlx import load

    text = json.loads((hf_dir / "config.json").read_text())["text_config"]
    draft_dir = tmp_path_factory.mktemp("draft")
    tiny.write_draft(draft_dir, tiny.draft_config(text, block_size=16), seed=3)
    return load(str(hf_dir), draft=str(draft_dir))


def transformers_greedy(path, prompt, n):
    """transformers' own greedy continuation (its cache, its sliding-window masks)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_speculative_output_is_transformers_greedy_and_the_target_alone(hf_dir, pair):
    model, tokenizer = pair
    for k, prompt in enumerate(random_prompts(2, VOCAB - 1, seed=11, low=4, high=24)):
        prompt = prompt.tolist()
        expected, _ = stream_tokens(model, tokenizer, prompt, use_draft=False)
        alone, _ = take(target_only(model.target, mx.array(prompt), Sampler()), len(expected))
        assert alone == expected
        if k == 0:
            theirs = transformers_greedy(hf_dir, prompt, len(expected))
            assert_lossless(model.target, mx.array(prompt), theirs, expected)
        for block in (4, 16):
            got, last = stream_tokens(model, tokenizer, prompt, block_tokens=block)
            assert_lossless(model.target, mx.array(prompt), expected, got)
            assert last.drafted_tokens > 0 and len(prompt) + block > WINDOW


def test_convert_target_keeps_the_model_and_quantizes_as_mlx_does(hf_dir, target, tmp_path):
    from mlx.utils import tree_flatten

    from dflash_mlx.target_conversion import convert_target

    plain = convert_target(str(hf_dir), tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    assert config["model_type"] == "gemma4_unified_text" and "per_layer_config" in config
    names = set().union(*(mx.load(str(f)).keys() for f in plain.glob("*.safetensors")))
    assert names and not any("embed_vision" in k or "embed_audio" in k or "vision_embedder" in k for k in names)
    np.testing.assert_array_equal(logits(load_target(plain)[0]), logits(target))
    got = dict(tree_flatten(load_target(convert_target(str(hf_dir), tmp_path / "q4", quant="w4:gs32"))[0].parameters()))
    reference = load_target(hf_dir)[0]
    nn.quantize(reference, group_size=32, bits=4)
    want = dict(tree_flatten(reference.parameters()))
    assert got.keys() == want.keys() and "model.layers.0.self_attn.q_proj.scales" in got
    for key in want:
        assert mx.array_equal(got[key], want[key]).item(), key


def test_every_tensor_has_transformers_shape_at_the_releases_size():
    """gemma-4-12B's published text dimensions (48 layers, hidden 3840, 16 heads, head size 512 on
    every sixth layer), built empty (torch's meta device; MLX builds lazily): the same tensors, each
    of transformers' shape. transformers zero-pads ``per_layer_config``'s keys past 9 layers ("05")."""
    import torch
    from mlx.utils import tree_flatten
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    from dflash_mlx.models import gemma4

    text = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                num_key_value_heads=8, head_dim=256, global_head_dim=512, final_logit_softcapping=30.0)
    config = json.loads(Gemma4UnifiedConfig(text_config=text).to_json_string())
    assert "05" in config["text_config"]["per_layer_config"]
    with torch.device("meta"):
        model = Gemma4UnifiedForConditionalGeneration(Gemma4UnifiedConfig(text_config=text))
    theirs = {gemma4.module_path(k): tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: v for k, v in theirs.items() if k not in (None, "lm_head.weight")}  # the head is tied
    ours = {k: tuple(v.shape) for k, v in tree_flatten(gemma4.Model(gemma4.ModelArgs.from_dict(config)).parameters())}
    assert ours == theirs
    assert ours["model.layers.5.self_attn.q_proj.weight"] == (16 * 512, 3840)
    with pytest.raises(ValueError, match="intermediate_size"):  # an override this file would not apply
        gemma4.ModelArgs.from_dict({**config["text_config"], "per_layer_config": {"05": {"intermediate_size": 1}}})


def test_the_named_pair():
    from dflash_mlx.defaults import PAIRS, resolve

    assert resolve("gemma-4-12b", None) == ("google/gemma-4-12B-it", "z-lab/gemma4-12B-it-DFlash")
    assert PAIRS["gemma-4-12b"].family == target_family({"model_type": "gemma4_unified"}) == "gemma4"
