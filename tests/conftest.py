"""Tiny checkpoints in the real layouts, written once per test session.

The target is made by transformers (torch, CPU) and written with ``save_pretrained``,
exactly as a Hugging Face Qwen3.5 text checkpoint; drafts use z-lab's layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import loading, tiny
from dflash_mlx.loading import load_target
from dflash_mlx.models.dflash import DFlashDraft

VOCAB = 512


def spread_weights(model, stacked: bool = False):
    """A transformers model's random weights made telling for a tiny model: non-trivial norms (so
    that zero-centring matters), a spread embedding (fewer near-ties in tiny vocabularies) and
    unit-gain matrices (``stacked``: expert stacks and convolution kernels too)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0, 0.5)
            elif p.ndim == 2 or (stacked and p.ndim > 2):
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


def make_hf_target(
    path: Path, vocab_size: int = VOCAB, seed: int = 0, tie: bool = False, dtype: str = "float32", **overrides
) -> Path:
    """A random ``Qwen3_5ForCausalLM`` saved by transformers (in ``dtype``), with our tiny tokenizer."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    eos = tiny.write_tokenizer(path, vocab_size) if vocab_size >= 300 else None
    params = tiny.target_config(vocab_size, tie_word_embeddings=tie, eos_token_id=eos, **overrides)
    for key in ("architectures", "model_type", "dtype"):
        params.pop(key)
    torch.manual_seed(seed)
    model = spread_weights(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**params)).float().eval())
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def hf_target_dir(tmp_path_factory) -> Path:
    return make_hf_target(tmp_path_factory.mktemp("hf_target"))


@pytest.fixture(scope="session")
def target(hf_target_dir):
    model, _ = load_target(hf_target_dir)
    return model


@pytest.fixture(scope="session")
def target_config(hf_target_dir) -> dict:
    return json.loads((hf_target_dir / "config.json").read_text())


def make_draft(tmp_path: Path, target_model, target_config: dict, **kwargs) -> DFlashDraft:
    """Write a z-lab draft for ``target_config`` and load it bound to ``target_model``."""
    seed = kwargs.pop("seed", 1)
    config = tiny.draft_config(target_config, **kwargs)
    tiny.write_draft(tmp_path, config, seed=seed)
    draft, _ = loading.load_draft(tmp_path)
    return draft.bind(target_model)


@pytest.fixture(scope="session")
def draft(tmp_path_factory, target, target_config) -> DFlashDraft:
    return make_draft(tmp_path_factory.mktemp("draft"), target, target_config, block_size=16)


def random_prompts(n: int, vocab: int, seed: int = 0, low: int = 3, high: int = 20):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.integers(0, vocab - 1, rng.integers(low, high)).astype(np.int32)) for _ in range(n)]


def moe_text_params(vocab_size: int = VOCAB, **overrides) -> dict:
    """A 4-layer Qwen3.5 mixture of experts: 8 experts, 2 per token, a shared expert."""
    params = tiny.target_config(vocab_size, **overrides)
    for key in ("architectures", "dtype", "intermediate_size"):
        params.pop(key, None)
    params.update(model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                  shared_expert_intermediate_size=96)
    params.update(overrides)
    return params


def make_hf_moe_target(path: Path, layout: str = "per_expert", vocab_size: int = VOCAB, seed: int = 0,
                       dtype: str = "float32", **overrides) -> Path:
    """A random ``Qwen3_5MoeForCausalLM`` saved by transformers (one tensor per expert, as
    transformers 5 writes it), or rewritten in the published BF16 release's multimodal layout with
    fused experts (``layout="fused"``: ``model.language_model.*``, ``experts.gate_up_proj``)."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    eos = tiny.write_tokenizer(path, vocab_size) if vocab_size >= 300 else None
    params = moe_text_params(vocab_size, eos_token_id=eos, **overrides)
    params.pop("model_type")
    torch.manual_seed(seed)
    model = spread_weights(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**params)).float().eval(), stacked=True)
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    if layout == "per_expert":
        return path
    assert layout == "fused", layout
    config = json.loads((path / "config.json").read_text())
    weights = load_file(str(path / "model.safetensors")) if dtype == "float32" else None
    if weights is None:  # numpy has no bfloat16: go through torch
        from safetensors.torch import load_file as load_torch, save_file as save_torch

        weights, save, stack = load_torch(str(path / "model.safetensors")), save_torch, torch.stack
        cat = torch.cat
    else:
        save, stack, cat = save_file, np.stack, np.concatenate
    E = params["num_experts"]
    fused = {}
    for layer in range(params["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate = [weights.pop(f"{prefix}.{e}.gate_proj.weight") for e in range(E)]
        up = [weights.pop(f"{prefix}.{e}.up_proj.weight") for e in range(E)]
        down = [weights.pop(f"{prefix}.{e}.down_proj.weight") for e in range(E)]
        fused[f"{prefix}.gate_up_proj"] = stack([cat([g, u], 0) for g, u in zip(gate, up)])
        fused[f"{prefix}.down_proj"] = stack(down)
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "lm_head.weight" if k == "lm_head.weight" else k): v for k, v in {**weights, **fused}.items()}
    (path / "model.safetensors").unlink()
    save(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = {**config, "model_type": "qwen3_5_moe_text"}
    text.pop("architectures", None)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": text,
        "vision_config": {"depth": 1}, "tie_word_embeddings": config.get("tie_word_embeddings", False)}))
    return path


def training_setup(root: Path):
    """The tiny pair, a corpus of its text, and the loaded target: what draft training needs."""
    from dflash_mlx.api import load

    target_dir, _ = tiny.write_pair(root)
    corpus = root / "corpus.txt"
    corpus.write_text(tiny._CORPUS * 20)
    model, tokenizer = load(str(target_dir))
    return target_dir, corpus, model, tokenizer


def dflash2_config(target: Dict, num_layers: int = 2, block_size: int = 8, sliding_window: int = 64,
                   conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 16,
                   selector_top_k: int = 8, **dflash) -> Dict:
    """A z-lab DFlash2 config for ``target`` (the published drafter's schema: every layer
    ``sliding_attention``, bidirectional inside the block, conv and selector under ``dflash_config``)."""
    config = tiny.draft_config(target, num_layers=num_layers, block_size=block_size, sliding_window=sliding_window,
                          layer_types=["sliding_attention"] * num_layers, is_causal=False)
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                                   selector_rank=selector_rank, selector_top_k=selector_top_k, **dflash)
    return config


def write_dflash2_draft(path: Path, config: Dict, seed: int = 1, dtype=np.float32) -> Dict:
    """Random DFlash2 weights in z-lab's layout: DFlash's, plus each layer's two convolutions and the
    candidate selector (its codebooks stored without ``.weight``)."""
    tiny.write_draft(path, config, seed=seed, dtype=dtype)
    from safetensors.numpy import load_file, save_file

    w = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed + 1000)
    H, V = config["hidden_size"], config["vocab_size"]
    d = config["dflash_config"]
    K, G, R = d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"]
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = tiny.normal(rng, (2, K, H), 0.3)
            base[:, 0] += 1.0  # near the identity, as a trained one starts
            w[f"layers.{i}.{conv}.base_kernel"] = base
            w[f"layers.{i}.{conv}.kernel_projection.weight"] = tiny.normal(rng, (2 * K * H // G, H), 0.1 * H**-0.5)
    w["candidate_selector.hidden_projection.weight"] = tiny.normal(rng, (R, H), H**-0.5)
    w["candidate_selector.predecessor_codebook"] = tiny.normal(rng, (V, R), 1.0)
    w["candidate_selector.successor_codebook"] = tiny.normal(rng, (V, R), 1.0)
    save_file({k: v.astype(dtype) for k, v in w.items()}, str(path / "model.safetensors"))
    return config


# ---- the plain-attention families (Qwen3, Qwen3-MoE, Llama) ------------------------------------------

FAMILIES = ("qwen3", "llama", "qwen3_moe")


def family_params(family: str, vocab_size: int = VOCAB, **overrides) -> dict:
    """A tiny 4-layer config of ``family`` as transformers 5 takes it: Qwen3 (per-head q/k norms),
    Llama 3.1 (its ``llama3`` RoPE scaling, with an original context of 32 so that the scaled
    frequencies turn within a short prompt) or Qwen3-MoE (8 experts, top 2 renormalized, layer 2 a
    dense MLP through ``mlp_only_layers``)."""
    params = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama":
        params.update(rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    elif family == "qwen3_moe":
        params.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[2])
    params.update(overrides)
    return params


def release_config(config: dict) -> dict:
    """A config as transformers 5 saves it, rewritten as the published checkpoints declare theirs
    (transformers 4's fields, what mlx-lm 0.32 reads): ``rope_theta`` and ``rope_scaling`` at the
    top instead of ``rope_parameters``, Qwen3-MoE's ``num_experts`` instead of ``num_local_experts``."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    return config


def make_hf_family_target(path: Path, family: str, vocab_size: int = VOCAB, seed: int = 0, dtype: str = "float32",
                          style: str = "release", **overrides) -> Path:
    """A random ``Qwen3ForCausalLM``, ``LlamaForCausalLM`` or ``Qwen3MoeForCausalLM`` saved by
    transformers (in ``dtype``; experts one tensor each, as Qwen3-MoE releases store them), with our
    tiny tokenizer. ``style="release"``: its config.json as the published checkpoints write it
    (``release_config``); ``"transformers5"``: as transformers 5 saves it."""
    import torch
    import transformers

    classes = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Config"), "llama": ("LlamaForCausalLM", "LlamaConfig"),
               "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig")}
    model_class, config_class = (getattr(transformers, name) for name in classes[family])
    eos = tiny.write_tokenizer(path, vocab_size) if vocab_size >= 300 else None
    torch.manual_seed(seed)
    config = config_class(**family_params(family, vocab_size, eos_token_id=eos, **overrides))
    model = spread_weights(model_class(config).float().eval(), stacked=True)
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    if style == "release":
        config_file = path / "config.json"
        config_file.write_text(json.dumps(release_config(json.loads(config_file.read_text())), indent=2))
    else:
        assert style == "transformers5", style
    return path
