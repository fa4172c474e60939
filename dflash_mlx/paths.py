"""Where dflash-mlx keeps what it makes: converted pairs, kernel tunings (``$DFLASH_MLX_HOME``).

A leaf: the tuner (``quantized``) and the named models (``defaults``) both need it, and the named
models import the converters, which import the models; keeping it here keeps those layers apart.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("DFLASH_MLX_HOME", "~/.cache/dflash-mlx")).expanduser()
