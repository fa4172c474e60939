"""dflash-mlx: lossless DFlash speculative decoding for Qwen3.5 models on MLX.

Names load on first use, so that commands which never decode (``convert``, ``--help``) start
without importing mlx-lm and transformers.
"""

import importlib

__version__ = "0.1.0"

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
