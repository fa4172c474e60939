"""Checkpoints written by mlx-lm's own converter (``mlx_lm.convert``, at test time) load in ours
and match ``mlx_lm``'s model on the same files: bf16/float32, affine 4/8-bit, mxfp4 and the mixed
4/6-bit recipe, for the dense and the mixture-of-experts target."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.loading import load_target
from tests.conftest import make_hf_moe_target

PROMPT = mx.array([[5, 17, 300, 42, 99, 7, 256, 3, 128, 64, 11, 500, 2, 77]])
# (name, mlx_lm.convert arguments); MoE on this CPU in float32: MLX's CPU gather_mm has no other dtype.
RECIPES = {
    "bf16": dict(dtype="bfloat16"),
    "float32": dict(dtype="float32"),
    "affine4": dict(quantize=True, q_bits=4, q_group_size=32),
    "affine8": dict(quantize=True, q_bits=8, q_group_size=64),
    "mxfp4": dict(quantize=True, q_bits=4, q_group_size=32, q_mode="mxfp4"),
    "mixed_4_6": dict(quantize=True, quant_predicate="mixed_4_6"),
}


def multimodal(text_dir: Path, out: Path) -> Path:
    """A text-only HF checkpoint as the released multimodal layout (what mlx-lm's converter reads)."""
    out.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(text_dir / "model.safetensors"))  # bfloat16 too (numpy has none)
    mx.save_safetensors(str(out / "model.safetensors"), {k.replace("model.", "model.language_model.", 1): v
                                                          for k, v in weights.items()}, metadata={"format": "pt"})
    text = json.loads((text_dir / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1},
              "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (text_dir / name).exists():
            (out / name).write_text((text_dir / name).read_text())
    return out


@pytest.fixture(scope="module")
def sources(hf_target_dir, tmp_path_factory):
    return {"dense": multimodal(hf_target_dir, tmp_path_factory.mktemp("dense_mm")),
            "moe": make_hf_moe_target(tmp_path_factory.mktemp("moe_fused_src"), "fused")}


def mlx_lm_convert(source: Path, out: Path, recipe: str, moe: bool) -> Path:
    convert = importlib.import_module("mlx_lm.convert").convert
    args = dict(RECIPES[recipe])
    if moe:
        args.setdefault("dtype", "float32")
    convert(str(source), str(out), **args)
    return out


CASES = [("dense", r) for r in ("bf16", "affine4", "affine8", "mxfp4", "mixed_4_6")] + [
    ("moe", r) for r in ("float32", "affine4", "affine8", "mxfp4", "mixed_4_6")]


@pytest.mark.parametrize("kind,recipe", CASES, ids=[f"{k}-{r}" for k, r in CASES])
def test_mlx_lm_converted_checkpoints_match_mlx_lm(sources, tmp_path, kind, recipe):
    from mlx_lm.utils import load_model

    out = mlx_lm_convert(sources[kind], tmp_path / "mlx", recipe, moe=kind == "moe")
    config = json.loads((out / "config.json").read_text())
    ours, _ = load_target(out)
    reference, _ = load_model(out)
    want = np.array(reference(PROMPT).astype(mx.float32))
    got = np.array(ours(PROMPT).astype(mx.float32))
    tolerance = 2e-2 if recipe == "bf16" else 1e-4
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=0)
    if recipe == "mixed_4_6":  # per-layer overrides keyed by the checkpoint's own module paths
        overrides = [k for k, v in config["quantization"].items() if isinstance(v, dict)]
        assert overrides and all(k.startswith("language_model.") for k in overrides), overrides
