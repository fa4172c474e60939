"""Checkpoint folders as files: which files each kind holds (what is fetched), a config's text part,
a safetensors file's header, and writing a folder atomically. A leaf: the converters, the loader,
the models and doctor share it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Tuple

from .errors import ConversionError

DRAFT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]
TOKENIZER_FILES = [
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja", "generation_config.json",
    "tokenizer.model",
]
TARGET_FILES = TOKENIZER_FILES + ["*.safetensors", "*.safetensors.index.json", "preprocessor_config.json"]


def text_part(config: Dict) -> Dict:
    """The text model's part of a config: its ``text_config`` where it nests one (a multimodal
    Qwen3.5 release), else the config itself (not a copy)."""
    return config.get("text_config") or config


def safetensors_header(file: Path) -> Tuple[Dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets; ``__metadata__``)
    and where its data starts, reading no weights."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length)), 8 + length


def refuse_existing(output: Path, force: bool) -> None:
    """A conversion's output must not exist unless ``force`` (checked before any download too)."""
    if output.exists() and not force:
        raise ConversionError(f"{output} already exists (use --force to replace it)")


@contextmanager
def staging(output: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``output`` that becomes ``output`` only if the body succeeds."""
    output = output.expanduser().resolve()
    refuse_existing(output, force)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield staging
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            os.replace(output, old / "previous")
            os.replace(staging, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
