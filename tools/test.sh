#!/usr/bin/env bash
# The test suite in one command on a fresh machine (the README's, and what .ci/run calls): install
# what the suite needs (tools/install-dev.sh: this checkout with its test extras and z-lab's
# reference code; tools/install-agents.sh: the pinned coding agents, with node and npm), compile the
# sources once, then `python -m pytest -q -n 2 --dist loadscope`. Without an active virtual
# environment it makes and uses .venv in the checkout (a fresh system Python may refuse pip installs).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash tools/test.sh [--no-install | --install-only] [--dry-run] [-h] [PYTEST_ARGS...]

Install what the test suite needs, then run it (python -m pytest -q -n 2 --dist loadscope PYTEST_ARGS...).

  --no-install    skip the installs: compile the sources and run the tests only
  --install-only  install only (.ci/run checks the wheel between the installs and the tests)
  --dry-run       print each command instead of running it
  -h, --help      this help
  PYTEST_ARGS     added to pytest's arguments (e.g. -m "not slow"; after -- if one starts with --)

Uses the active virtual environment, else .venv in the checkout (made if missing and installing).
EOF
}

install=1 tests=1 dry=0
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) install=0 ;;
    --install-only) tests=0 ;;
    --dry-run) dry=1 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; pytest_args+=("$@"); break ;;
    --*) echo "tools/test.sh: unknown option '$1' (pytest's own go after --; see --help)" >&2; exit 2 ;;
    *) pytest_args+=("$1") ;;
  esac
  shift
done
if [ "$install" = 0 ] && [ "$tests" = 0 ]; then
  echo "tools/test.sh: --no-install with --install-only leaves nothing to do" >&2
  exit 2
fi

step() {
  if [ "$dry" = 1 ]; then
    printf '%q' "$1"; shift; printf ' %q' "$@"; echo
  else
    "$@"
  fi
}

cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && { [ -x .venv/bin/python ] || [ "$install" = 1 ]; }; then
  if [ ! -x .venv/bin/python ]; then
    step python3 -m venv .venv
    step .venv/bin/python -m pip install --quiet --upgrade pip
  fi
  if [ "$dry" = 1 ]; then echo ". .venv/bin/activate"; else . .venv/bin/activate; fi
fi
if [ "$install" = 1 ]; then
  step bash tools/install-dev.sh
  step bash tools/install-agents.sh
fi
if [ "$tests" = 1 ]; then
  # These machines set PYTHONDONTWRITEBYTECODE: compile our sources once, so that the suite's many
  # subprocesses (CLI runs, servers, pipeline ranks) do not each compile them again.
  if [ "$dry" = 1 ]; then echo "python -m compileall -q dflash_mlx tests > /dev/null"
  else python -m compileall -q dflash_mlx tests > /dev/null; fi
  # One worker per module (--dist loadscope): a module's fixtures (tiny checkpoints, servers) are built
  # once, not once per worker.
  step python -m pytest -q -n 2 --dist loadscope "${pytest_args[@]}"
fi
