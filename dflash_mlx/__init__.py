"""dflash-mlx: lossless DFlash speculative decoding for Qwen3.5 models on MLX.

Names load on first use, so that commands which never decode (``convert``, ``--help``) start
without importing mlx-lm and transformers.
"""

import importlib
import logging

__version__ = "0.1.0"


class _NoTorchNotice(logging.Filter):
    """Drops transformers' notice, logged when it is imported without PyTorch, that "PyTorch was
    not found. Models won't be available..." (older releases: "None of PyTorch, TensorFlow >= 2.0,
    or Flax have been found..."): dflash-mlx runs its models on MLX and takes only tokenizers and
    configurations from transformers, so on a user's install (no torch) every command that makes a
    tokenizer opened with a false alarm. mlx-lm hides it too, but only when imported first, and by
    turning off all of transformers' advisory warnings; this filter lets every other message through."""

    NOTICES = ("PyTorch was not found", "None of PyTorch, TensorFlow")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTICES)


# On transformers' own logger, before anything imports it (the logger object is the one it will use).
if not any(isinstance(f, _NoTorchNotice) for f in logging.getLogger("transformers").filters):
    logging.getLogger("transformers").addFilter(_NoTorchNotice())

_EXPORTS = {
    "load": "api",
    "generate": "api",
    "stream_generate": "api",
    "DFlashModel": "api",
    "serve_pipeline": "api",
    "GenerationResponse": "api",
    "batch_generate": "scheduler",
    "PromptCache": "prompt_cache",
    "PromptCachePool": "prompt_cache",
    "Sampler": "sampling",
    "make_sampler": "sampling",
    "convert_draft": "convert",
    "convert_target": "target_conversion",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
