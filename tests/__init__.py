"""Helpers the suite's modules share."""

from __future__ import annotations

import os
from pathlib import Path

HIDE_TORCH = Path(__file__).parent / "hide_torch"


def subprocess_env(**extra: str) -> dict:
    """The environment for a CLI, server or rank subprocess: this process's, with torch hidden from
    it (``hide_torch/sitecustomize.py``: about 2 s less per subprocess, as on a Mac without torch;
    nothing dflash-mlx runs uses it), and ``extra``."""
    path = os.pathsep.join([str(HIDE_TORCH)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {**os.environ, "PYTHONPATH": path, **extra}
