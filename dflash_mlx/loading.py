"""Finding checkpoints (local folder or Hugging Face repo) and building models from them."""

from __future__ import annotations

import glob
import json
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .checkpoint_files import text_part
from .errors import CheckpointError
from .models import dflash as dflash_model

WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def fetch(repo_or_path: str | Path, patterns: List[str], revision: Optional[str] = None) -> Tuple[Path, str]:
    """A local folder as it is, or the listed files of a Hugging Face repo (fetched into the HF
    cache; HF_HOME, HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE and resuming a dropped connection are
    huggingface_hub's own). Returns the folder and the revision it holds."""
    path = Path(repo_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; expected a checkpoint folder")
        return path, "local"
    if str(repo_or_path).startswith((".", "/", "~")) or str(repo_or_path).count("/") != 1:
        raise CheckpointError(f"no checkpoint folder at {repo_or_path!s} (and it is not a Hugging Face repo id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = str(repo_or_path)
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except RepositoryNotFoundError as e:
        raise CheckpointError(f"repo {repo} not found on the Hub (private? set HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"repo {repo} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        raise CheckpointError(
            f"cannot download {repo}: the Hub is unreachable (or HF_HUB_OFFLINE is set) and it is not in the local "
            f"cache; fetch it once while online (`huggingface-cli download {repo}`)"
        ) from e
    except Exception as e:  # HTTP errors, connections dropped mid-file, disk errors
        raise CheckpointError(f"download of {repo} failed: {type(e).__name__}: {e}") from e
    return folder, folder.name


def resolve_path(path_or_repo: str | Path, revision: Optional[str] = None) -> Path:
    """A checkpoint folder: local, or a whole Hugging Face repo's weights, config and tokenizer."""
    return fetch(path_or_repo, WEIGHT_PATTERNS, revision)[0]


def read_config(path: Path) -> Dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path} has no config.json")
    with open(config_file) as f:
        return json.load(f)


def read_weights(path: Path) -> Dict[str, mx.array]:
    """All safetensors of a folder; single-file and sharded layouts alike."""
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {path}")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:  # mlx raises plain RuntimeError/ValueError on bad files
            raise CheckpointError(f"cannot read {f}: {e}") from e
    return weights


def mlx_quantization(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The MLX quantization block of a config (``quantization`` or ``quantization_config``, at the
    top or in ``text_config``; OpenAI's ``mxfp4`` as MLX's ``mxfp4`` mode, the layers that hold
    scales); other frameworks' blocks (FP8, NVFP4, GPTQ...) are refused by name."""
    for where in (config, config.get("text_config") or {}):
        for key in ("quantization", "quantization_config"):
            block = where.get(key)
            if not block:
                continue
            if "bits" in block or "group_size" in block:
                return block
            method = block.get("quant_method", "unknown")
            if method == "mxfp4":  # OpenAI's gpt-oss release: its experts in MXFP4, which MLX runs as they are
                return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
            raise CheckpointError(f"quantization method {method!r} ({key}) is not MLX's: load the BF16 release, "
                                  "or convert it with `dflash-mlx convert-target --quant w4`")
    return None


def quantize_from_config(model: nn.Module, quantization: Dict[str, Any], weights: Dict[str, mx.array],
                         module_path: Callable[[str], Optional[str]] = lambda key: key) -> None:
    """Turn the layers that the checkpoint stores quantized into quantized layers. Per-layer
    overrides (siblings of ``bits``/``group_size``) are keyed by the checkpoint's own module paths,
    mapped through ``module_path``, and read as mlx-lm reads them: the layer's own parameters,
    whatever they leave out (or set to null, as ``"group_size": null``) MLX's default for the
    layer's mode (affine unless it says otherwise); ``false`` keeps a layer unquantized."""
    defaults = {"group_size": quantization.get("group_size"), "bits": quantization.get("bits"),
                "mode": quantization.get("mode", "affine")}
    overrides: Dict[str, Any] = {}
    for key, value in quantization.items():
        if isinstance(value, (dict, bool)) and key not in defaults:
            path = module_path(key)
            if path is not None:
                overrides[path] = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return overrides.get(path, True)

    nn.quantize(model, group_size=defaults["group_size"], bits=defaults["bits"], mode=defaults["mode"],
                class_predicate=predicate)


# model_type -> (the model file under models/, "dense" or "moe"). Qwen3.6 and Qwen3.8 releases say
# ``qwen3_5`` (Qwen3.8-27B's config.json declares ``Qwen3_5ForConditionalGeneration``); some
# re-exports of Qwen3.8 name the same layers ``qwen3_8``.
TARGET_TYPES = {
    "qwen3_5": ("qwen3_5", "dense"), "qwen3_5_text": ("qwen3_5", "dense"),
    "qwen3_5_moe": ("qwen3_5_moe", "moe"), "qwen3_5_moe_text": ("qwen3_5_moe", "moe"),
    "qwen3_8": ("qwen3_5", "dense"), "qwen3_8_text": ("qwen3_5", "dense"),
    "qwen3": ("qwen3", "dense"), "qwen3_moe": ("qwen3_moe", "moe"), "llama": ("llama", "dense"),
    "gpt_oss": ("gpt_oss", "moe"),
    "gemma4": ("gemma4", "dense"), "gemma4_text": ("gemma4", "dense"),  # "moe" where enable_moe_block
    # gemma-4-12B: the same text decoder beside encoder-free image/audio projections (models/gemma4.py)
    "gemma4_unified": ("gemma4", "dense"), "gemma4_unified_text": ("gemma4", "dense"),
}
DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def _target_entry(config: Dict[str, Any]) -> Tuple[str, str]:
    if set(config.get("architectures") or ()) & set(DRAFT_ARCHITECTURES):
        raise CheckpointError("this is a DFlash draft, not a target: pass it as the draft (--draft)")
    model_type = config.get("model_type", "")
    entry = TARGET_TYPES.get(model_type) or TARGET_TYPES.get(text_part(config).get("model_type", ""))
    if entry is None:
        families = ", ".join(sorted(TARGET_TYPES))
        raise CheckpointError(f"model_type {model_type!r} is not a target this loads (model types: {families})")
    return entry


def target_family(config: Dict[str, Any]) -> str:
    """The model file (``models.<name>``) for a target's config (multimodal or text-only)."""
    return _target_entry(config)[0]


def target_kind(config: Dict[str, Any]) -> str:
    """``"dense"`` or ``"moe"`` (a mixture of experts) for a target's config."""
    family, kind = _target_entry(config)
    if family == "gemma4" and text_part(config).get("enable_moe_block"):
        return "moe"
    return kind


def target_module(config: Dict[str, Any]):
    """The model file for a target's config: ``models.qwen3_5``, ``qwen3_5_moe``, ``qwen3``,
    ``qwen3_moe``, ``llama``, ``gpt_oss`` or ``gemma4``. Each has ``ModelArgs`` (``from_dict``), ``Model`` (with ``sanitize``)
    and ``module_path`` (a checkpoint's tensor or module name as the model names it)."""
    import importlib

    return importlib.import_module(f".models.{target_family(config)}", __package__)


def read_target(path: Path) -> Tuple[Any, Dict[str, Any], Dict[str, mx.array]]:
    """A target built from its config (parameters not loaded), the config, and its sanitized
    weights, lazily loaded: nothing is read until evaluated."""
    config = read_config(path)
    try:
        module = target_module(config)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
        return model, config, model.sanitize(read_weights(path))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def load_target(path: Path, recurrence=None, stage_of=None) -> Tuple[Any, Dict[str, Any]]:
    """A target (the ``Model`` of its family's file, ``target_module``: Qwen3.5 dense or mixture of
    experts, Qwen3, Qwen3-MoE, Llama) and its config. ``recurrence`` (``kernels.Recurrence``)
    overrides how its Gated DeltaNet layers run (Qwen3.5); by default the kernels on an Apple GPU,
    the chunked pure-MLX form on the CPU.
    ``stage_of(model, weights)``: a pipeline rank's ``pipeline.stages.Stage``, given the model and
    its (lazily loaded) weights; only that stage's weights are then read."""
    model, config, weights = read_target(path)
    module_path = target_module(config).module_path
    if stage_of is not None:
        stage = stage_of(model, weights)
        stage.keep_only(model)
        weights = {name: v for k, v in weights.items() if (name := stage.local_name(k)) is not None}
        module_path = partial(_stage_path, stage, module_path)
    quantization = mlx_quantization(config)
    if quantization:
        quantize_from_config(model, quantization, weights, module_path)
    if recurrence is not None:
        model.use_recurrence(recurrence)
    model = _load_weights(model, weights, path)
    if mx.default_device() == mx.cpu:
        model.experts_in_float32()  # MLX's CPU gather_mm computes only in float32 (no experts: nothing)
    return model, config


def _stage_path(stage, module_path: Callable[[str], Optional[str]], key: str) -> Optional[str]:
    """A checkpoint's module name as a pipeline stage's model names it (None: another rank's)."""
    name = module_path(key)
    return None if name is None else stage.local_name(name)


def _load_weights(model: nn.Module, weights: Dict[str, mx.array], path: Path) -> nn.Module:
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{path}: weights do not match its config: {e}") from e
    mx.eval(model.parameters())
    model.eval()
    return model


def draft_class(args: "dflash_model.DraftArgs"):
    """DFlash or DFlash2, as the config's ``architectures`` says."""
    if args.architecture == "DFlash2DraftModel":
        from .models.dflash2 import DFlash2Draft

        return DFlash2Draft
    return dflash_model.DFlashDraft


def load_draft(path: Path) -> Tuple[dflash_model.DFlashDraft, Dict[str, Any]]:
    config = read_config(path)
    args = dflash_model.DraftArgs.from_dict(config)
    model = draft_class(args)(args)
    weights = model.sanitize(read_weights(path))
    quantization = mlx_quantization(config)
    if quantization:
        quantize_from_config(model, quantization, weights)
    return _load_weights(model, weights, path), config
