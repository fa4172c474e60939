"""On the PYTHONPATH of the suite's CLI, server and rank subprocesses (``tests.subprocess_env``): torch
is not there for them, as on a Mac without it. dflash-mlx never imports torch; transformers does,
whenever it is installed (its generic utilities and configuration module, under every tokenizer),
which cost each subprocess about 2 s. Test processes themselves keep torch (fixtures build
checkpoints with it). A None in ``sys.modules`` is Python's way to say a module is absent: ``import``
raises ModuleNotFoundError and ``importlib.util.find_spec`` (transformers' check) returns None."""

import sys

sys.modules["torch"] = None
