"""tools/test.sh, the one command that runs the suite (the README's, the one .ci/run calls): run for
real in a copy of its checkout whose install scripts, ``python`` and ``python3`` are stand-ins that
write down how they were called, so that its arguments are checked without installing or running
the suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLS = ["install-dev.sh", "install-agents.sh"]


def stand_in(path: Path, name: str, extra: str = "") -> None:
    path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "$TEST_SH_LOG"\n{extra}')
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path):
    """A checkout with the script, stand-in install scripts, and on PATH a ``python`` and a
    ``python3`` whose ``-m venv DIR`` makes DIR a stand-in environment (its ``python`` says so)."""
    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "test.sh", root / "tools" / "test.sh")
    for name in INSTALLS:
        stand_in(root / "tools" / name, name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir / "python", "python")
    stand_in(bin_dir / "python3", "python3", 'if [ "$1 $2" = "-m venv" ]; then\n'
             '  mkdir -p "$3/bin"\n'
             f'  printf \'#!/usr/bin/env bash\\necho "venv-python $*" >> "$TEST_SH_LOG"\\n\' > "$3/bin/python"\n'
             '  chmod +x "$3/bin/python"\n'
             '  printf \'export VIRTUAL_ENV="%s"; export PATH="$VIRTUAL_ENV/bin:$PATH"\\n\' "$PWD/$3" > "$3/bin/activate"\n'
             'fi\n')
    return root, bin_dir


def run(checkout, *args: str, venv: str = "/active/venv"):
    """(exit status, the calls the stand-ins saw, stdout, stderr)."""
    root, bin_dir = checkout
    log = root.parent / "calls.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", TEST_SH_LOG=str(log))
    if venv:
        env["VIRTUAL_ENV"] = venv
    done = subprocess.run(["bash", "tools/test.sh", *args], cwd=root, capture_output=True, text=True, env=env,
                          timeout=30)
    calls = [line.rstrip() for line in log.read_text().splitlines()] if log.exists() else []
    return done.returncode, calls, done.stdout, done.stderr


TESTS = ["python -m compileall -q dflash_mlx tests", "python -m pytest -q -n 2 --dist loadscope"]


def test_installs_then_runs_the_suite(checkout):
    assert run(checkout)[:2] == (0, INSTALLS + TESTS)


def test_halves_and_pytest_arguments(checkout):
    assert run(checkout, "--install-only")[:2] == (0, INSTALLS)
    assert run(checkout, "--no-install")[:2] == (0, TESTS)
    assert run(checkout, "--no-install", "-m", "not slow", "-k", "x")[:2] == (0, [TESTS[0], TESTS[1] + " -m not slow -k x"])
    assert run(checkout, "--no-install", "--", "--lf", "-x")[:2] == (0, [TESTS[0], TESTS[1] + " --lf -x"])


def test_a_failing_step_stops_it_with_its_status(checkout):
    root, _ = checkout
    stand_in(root / "tools" / "install-dev.sh", "install-dev.sh", "exit 3\n")
    assert run(checkout)[:2] == (3, ["install-dev.sh"])


@pytest.mark.parametrize("args, words", [(["--bogus"], "unknown option '--bogus'"),
                                         (["--no-install", "--install-only"], "nothing to do")])
def test_refuses_what_it_cannot_do(checkout, args, words):
    status, calls, out, err = run(checkout, *args)
    assert status == 2 and words in err and not calls


def test_help_and_dry_run(checkout):
    status, calls, out, _ = run(checkout, "--help")
    assert status == 0 and not calls
    for option in ("--no-install", "--install-only", "--dry-run", "PYTEST_ARGS"):
        assert option in out
    status, calls, out, _ = run(checkout, "--dry-run", "-k", "a b")
    assert status == 0 and not calls
    assert out.splitlines() == ["bash tools/install-dev.sh", "bash tools/install-agents.sh",
                                TESTS[0] + " > /dev/null", TESTS[1] + r" -k a\ b"]


def test_makes_a_virtual_environment_without_one(checkout):
    """On a fresh machine (no active environment, no .venv) it makes .venv and runs everything in
    it; with --no-install it makes none; a .venv already there is used."""
    root, _ = checkout
    assert run(checkout, "--no-install", venv="")[:2] == (0, TESTS)
    assert not (root / ".venv").exists()
    status, calls, _, _ = run(checkout, venv="")
    assert status == 0 and calls == ["python3 -m venv .venv", "venv-python -m pip install --quiet --upgrade pip",
                                     *INSTALLS, *("venv-" + c for c in TESTS)]
    assert run(checkout, "--no-install", venv="")[:2] == (0, ["venv-" + c for c in TESTS])


def test_ci_and_the_readme_call_it():
    """.ci/run: a fresh environment, the installs, the wheel's check, then the tests, in that order;
    the README's test command is the script, alone."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    steps = ["python3 -m venv .venv-ci", ". .venv-ci/bin/activate", "bash tools/test.sh --install-only",
             "bash .ci/check-wheel", "bash tools/test.sh --no-install"]
    assert [line for line in ci if line in steps] == steps
    assert not any("pytest" in line or "install-dev" in line for line in ci)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Tests\n"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert block.strip() == "bash tools/test.sh"
