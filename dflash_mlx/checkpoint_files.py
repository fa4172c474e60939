"""Checkpoint folders as files: which files each kind holds (what is fetched), and writing one
atomically. A leaf that both converters share."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import ConversionError

DRAFT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]
TOKENIZER_FILES = [
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja", "generation_config.json",
    "tokenizer.model",
]
TARGET_FILES = TOKENIZER_FILES + ["*.safetensors", "*.safetensors.index.json", "preprocessor_config.json"]


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
