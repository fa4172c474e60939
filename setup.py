"""Package discovery: every ``dflash_mlx`` package is found, and ``metal/`` ships as ``dflash_mlx.metal``.

A hand-written list went stale once (wheels lacked ``server/`` and ``pipeline/``); pyproject's
``find`` cannot add a package mapped from another folder beside the ones it finds, hence this file.
``.ci/check-wheel`` installs the wheel and imports every module to keep it true.
"""

from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["dflash_mlx", "dflash_mlx.*"]) + ["dflash_mlx.metal"])
