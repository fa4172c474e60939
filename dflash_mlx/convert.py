"""Converters: a z-lab draft checked against and packaged for a target's tokenizer; HF targets to MLX.

z-lab's drafts were trained for the base Qwen3.5 tokenizer. A target such as Qwopus3.5-9B-Coder
adds tokens (ids 248070..248076), and older drafts use mask id 248070, one of them. ``convert_draft``
fetches only what it needs (draft weights and config; the target's config and tokenizer, never
its weights), checks the pair, and writes an MLX draft folder that records the checks.
Every output is written to a temporary folder and renamed into place at the end.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from . import loading
from .checkpoint_files import DRAFT_FILES, TOKENIZER_FILES, refuse_existing, staging, text_part
from .errors import ConversionError
from .models.dflash import DraftArgs, quantize_draft, resolve_taps
from .quant import parse_quant

DEFAULT_DRAFT = "z-lab/Qwen3.5-9B-DFlash"
DEFAULT_TARGET = "Jackrong/Qwopus3.5-9B-Coder"
# The tokenizer z-lab's Qwen3.5 drafts were trained with.
DEFAULT_BASE_TOKENIZER = "Qwen/Qwen3.5-9B"

METADATA_KEY = "dflash_mlx"


@dataclass
class PairReport:
    """What the checks of a draft/target pair found."""

    checks: List[Dict[str, str]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    def record(self, name: str, ok: bool, detail: str, severity: str = "error") -> None:
        status = "ok" if ok else severity
        self.checks.append({"check": name, "status": status, "detail": detail})
        if not ok:
            (self.errors if severity == "error" else self.warnings).append(detail)


class _Vocabulary:
    """The parts of a tokenizer the checks need, read straight from ``tokenizer.json``."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> Dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        return [self._tok.id_to_token(i) for i in ids] if isinstance(ids, list) else self._tok.id_to_token(ids)


def tokenizer_fingerprint(folder: Path) -> Optional[str]:
    """sha256 of a tokenizer's vocabulary (token -> id, added tokens included)."""
    tokenizer = _tokenizer(folder)
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _tokenizer(folder: Path):
    try:
        if (folder / "tokenizer.json").exists():
            return _Vocabulary(folder)
        if not any((folder / f).exists() for f in ("tokenizer.model", "vocab.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ConversionError(f"cannot read the tokenizer in {folder}: {e}") from e


def check_pair(draft_config: Dict, target_dir: Path, base_tokenizer_dir: Optional[Path] = None) -> PairReport:
    """Does this draft fit this target and its tokenizer? Hard mismatches are errors; a mask id
    on a real token, or tokens the draft never saw, are warnings that name the tokens."""
    report = PairReport()
    target = text_part(loading.read_config(target_dir))
    args = DraftArgs.from_dict(draft_config)
    hidden, layers, rows = target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]
    if args.architecture == "DFlash2DraftModel":
        report.record("kind", True, f"DFlash2: selector top-{args.selector_top_k} at rank {args.selector_rank}, "
                      f"convolutions of {args.conv_kernel_size} taps in groups of {args.conv_group_size}")
        report.record(
            "selector codebooks cover the vocabulary", args.vocab_size == rows,
            f"codebooks have {args.vocab_size} rows, target embedding {rows}"
            + ("" if args.vocab_size == rows else ": the selector would index past its codebooks"),
        )
    else:
        report.record("kind", True, "DFlash")
    report.record(
        "hidden_size", args.hidden_size == hidden,
        f"draft hidden_size {args.hidden_size}, target {hidden}"
        + ("" if args.hidden_size == hidden else ": this draft was made for another model size"),
    )
    try:
        report.record("target_layer_ids", True, f"taps {resolve_taps(args.target_layer_ids, args.num_hidden_layers, layers)}")
    except ValueError as e:
        report.record("target_layer_ids", False, str(e))
    mask = args.mask_token_id
    report.record(
        "mask_token_id in embedding", 0 <= mask < rows,
        f"mask id {mask}, target embedding has {rows} rows"
        + ("" if 0 <= mask < rows else ": the draft's mask cannot be embedded by this target"),
    )
    tokenizer = _tokenizer(target_dir)
    if tokenizer is None:
        report.record("tokenizer", False, f"{target_dir} has no tokenizer files")
        return report
    size = len(tokenizer)
    report.record(
        "tokenizer fits embedding", size <= rows,
        f"tokenizer has {size} tokens for {rows} embedding rows"
        + ("" if size <= rows else ": token ids past the table would crash the target"),
    )
    if mask < size:
        report.record(
            "mask_token_id is not a token", False,
            f"mask id {mask} is the real token {tokenizer.convert_ids_to_tokens(mask)!r} of the target's tokenizer: "
            "the draft will take that token for a mask; use a draft with a mask id outside the tokenizer",
            severity="warning",
        )
    else:
        report.record("mask_token_id is not a token", True, f"mask id {mask} is past the tokenizer's {size} tokens")
    base = _tokenizer(base_tokenizer_dir) if base_tokenizer_dir is not None else None
    if base is not None:
        new_ids = list(range(len(base), size))
        names = tokenizer.convert_ids_to_tokens(new_ids)
        listing = ", ".join(f"{i} {n!r}" for i, n in zip(new_ids, names))
        report.record(
            "tokens the draft never saw", not new_ids,
            f"{len(new_ids)} target tokens beyond the draft's original {len(base)}-token vocabulary: {listing}"
            + (f" (the mask id {mask} is one of them)" if mask in new_ids else "")
            if new_ids else f"the target adds no tokens to the draft's {len(base)}-token vocabulary",
            severity="warning",
        )
    return report


def _model_card(meta: Dict) -> str:
    lines = [
        "# DFlash draft for dflash-mlx",
        "",
        f"- draft: `{meta['draft']}` (revision `{meta['draft_revision']}`)",
        f"- target tokenizer: `{meta['target']}` (revision `{meta['target_revision']}`)",
        f"- base tokenizer the draft was trained with: `{meta['base_tokenizer']}`",
        f"- quantization: {meta['quantization'] or 'none'}",
        f"- target tokenizer sha256 (vocabulary): `{meta['target_tokenizer_sha256']}`",
        "",
        "## Checks",
        "",
        "| check | status | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {c['check']} | {c['status']} | {c['detail']} |" for c in meta["checks"]]
    if meta["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in meta["warnings"]]
    lines += ["", "Use it with `dflash_mlx.load(target, draft=<this folder>)`.", ""]
    return "\n".join(lines)


def convert_draft(
    output: str | Path,
    draft: str = DEFAULT_DRAFT,
    target: str = DEFAULT_TARGET,
    quant: Optional[str] = None,
    revision: Optional[str] = None,
    target_revision: Optional[str] = None,
    base_tokenizer: Optional[str] = DEFAULT_BASE_TOKENIZER,
    force: bool = False,
) -> Tuple[Path, PairReport]:
    """Fetch, check and write a ready-to-run MLX draft for ``target``'s tokenizer."""
    output = Path(output)
    refuse_existing(output, force)
    parse_quant(quant)  # a bad spec fails before any download
    draft_dir, draft_rev = loading.fetch(draft, DRAFT_FILES, revision)
    target_dir, target_rev = loading.fetch(target, TOKENIZER_FILES, target_revision)
    base_dir = None
    if base_tokenizer:
        base_dir, _ = loading.fetch(base_tokenizer, TOKENIZER_FILES)
    draft_config = loading.read_config(draft_dir)
    target_layers = text_part(loading.read_config(target_dir))["num_hidden_layers"]
    try:
        report = check_pair(draft_config, target_dir, base_dir)
    except (KeyError, ValueError) as e:
        raise ConversionError(f"cannot check the pair: {e}") from e
    if report.errors:
        raise ConversionError("the draft does not fit the target:\n  - " + "\n  - ".join(report.errors))
    try:
        model, _ = loading.load_draft(draft_dir)
    except (loading.CheckpointError, ValueError) as e:
        raise ConversionError(str(e)) from e
    ids = resolve_taps(model.args.target_layer_ids, model.args.num_hidden_layers, target_layers)
    quantization = quantize_draft(model, quant)
    config = model.args.to_config(ids, target_layers)
    meta = {
        "draft": draft, "draft_revision": draft_rev, "target": target, "target_revision": target_rev,
        "base_tokenizer": base_tokenizer, "quantization": quantization,
        "target_tokenizer_sha256": tokenizer_fingerprint(target_dir),
        "checks": report.checks, "warnings": report.warnings,
    }
    config[METADATA_KEY] = meta
    if quantization:
        config["quantization"] = quantization
    with staging(output, force) as folder:
        mx.save_safetensors(str(folder / "model.safetensors"), model.layout_weights())
        (folder / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        for name in TOKENIZER_FILES:
            if name != "config.json" and (target_dir / name).exists():
                shutil.copy(target_dir / name, folder / name)
        (folder / "README.md").write_text(_model_card(meta))
    return output, report
