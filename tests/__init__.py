"""Helpers the suite's modules share."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

HIDE_TORCH = Path(__file__).parent / "hide_torch"
# The prefix cache's disk tier of every CLI or server the suite starts: a folder of this test
# process's own, not the user's ~/.cache (``--prompt-cache-dir``'s environment variable).
PROMPT_CACHE_DIR = tempfile.mkdtemp(prefix="dflash-mlx-test-prompt-cache-")
atexit.register(shutil.rmtree, PROMPT_CACHE_DIR, True)


def subprocess_env(**extra: str) -> dict:
    """The environment for a CLI, server or rank subprocess: this process's, with torch hidden from
    it (``hide_torch/sitecustomize.py``: about 2 s less per subprocess, as on a Mac without torch;
    nothing dflash-mlx runs uses it), its prefix cache's disk tier in ``PROMPT_CACHE_DIR``, and
    ``extra``."""
    path = os.pathsep.join([str(HIDE_TORCH)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {**os.environ, "PYTHONPATH": path, "DFLASH_MLX_PROMPT_CACHE_DIR": PROMPT_CACHE_DIR, **extra}
