"""Tiny checkpoints in the real layouts, written once per test session.

The target is made by transformers (torch, CPU) and written with ``save_pretrained``,
exactly as a Hugging Face Qwen3.5 text checkpoint; drafts use z-lab's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import loading, tiny
from dflash_mlx.loading import load_target
from dflash_mlx.models.dflash import DFlashDraft

VOCAB = 512


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
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**params)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # non-trivial norms, so zero-centring matters
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0, 0.5)  # spread logits: fewer near-ties in tiny vocabularies
            elif p.ndim == 2:
                p.normal_(0, p.shape[1] ** -0.5)
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
