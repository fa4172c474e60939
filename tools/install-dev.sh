#!/usr/bin/env bash
# Everything the test suite needs, into the active Python environment: this checkout (editable)
# with its test extras, and z-lab's reference code, the oracle of the interop tests. z-lab's
# package pins versions that conflict with ours and needs none of its dependencies for what the
# tests call, hence --no-deps. The README's test instructions and .ci/run both run this script.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e ".[test]"
python -m pip install --quiet --no-deps "dflash==0.1.0"
