"""The README's quick start and the console script, run for real in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def run(*args, input=None, offline=False):
    env = subprocess_env(PYTHONUNBUFFERED="1")
    if offline:  # no network: any download attempt fails at once
        env.update(HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    return subprocess.run(args, capture_output=True, text=True, input=input, env=env, timeout=300, cwd=ROOT)


def test_readme_first_command_after_install_is_the_demo_and_runs_offline():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):]
    first_block = quick_start[quick_start.index("```bash") + len("```bash"):].strip().splitlines()[0]
    assert first_block.startswith("dflash-mlx generate --model demo"), first_block
    import shlex

    command, _, stdin_file = first_block.partition(" < ")
    prompt = (ROOT / stdin_file.strip()).read_text() if stdin_file else None
    args = shlex.split(command)[1:]
    done = run(sys.executable, "-m", "dflash_mlx.cli", *args, "--max-tokens", "24", input=prompt, offline=True)
    assert done.returncode == 0, done.stderr
    assert "tokens/cycle" in done.stderr
    if prompt is not None:  # the demo's edit request: its answer starts copying the file
        assert "import json" in done.stdout, done.stdout


@pytest.mark.slow  # writes a pair and runs the CLI three times
def test_readme_quick_start_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "python examples/quickstart.py /tmp/dflash-tiny" in readme
    done = run(sys.executable, "examples/quickstart.py", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "speculative output == target-only output" in done.stdout
    cli = run(
        sys.executable, "-m", "dflash_mlx.cli", "generate", "--model", str(tmp_path / "target"),
        "--draft", str(tmp_path / "draft"), "--prompt", "def fibonacci(n):", "--block-tokens", "8",
        "--max-tokens", "64", "--json",
    )
    assert cli.returncode == 0, cli.stderr
    spec = json.loads(cli.stdout)
    alone = run(
        sys.executable, "-m", "dflash_mlx.cli", "generate", "--model", str(tmp_path / "target"),
        "--max-tokens", "64", "--json", input="def fibonacci(n):",
    )
    assert json.loads(alone.stdout)["tokens"] == spec["tokens"] and 0 < len(spec["tokens"]) <= 64
    assert spec["cycles"] == len(spec["tokens"]) - 1  # a random draft: one token per cycle


def test_chat_with_the_demo_runs_offline():
    """`dflash-mlx chat --model demo` on a fresh machine: no network, a reply, a clean exit."""
    import pexpect

    env = subprocess_env(HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    child = pexpect.spawn(
        sys.executable, ["-m", "dflash_mlx.cli", "chat", "--model", "demo", "--max-tokens", "24"],
        cwd=str(ROOT), env=env, encoding="utf-8", timeout=120, dimensions=(40, 200),
    )
    child.expect(">>> ")
    child.sendline("Write a Python function `parse_header`.")
    child.expect(r"(\d+) tokens, [\d.]+ tok/s, [\d.]+ tokens/cycle")
    assert 0 < int(child.match.group(1)) <= 24
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_cli_subprocesses_run_without_torch():
    """What ``subprocess_env`` promises: the CLI's import leaves torch out (an import that needed it
    would fail here), and torch is not imported in the process."""
    code = "import sys, dflash_mlx.cli, dflash_mlx.api, dflash_mlx.server; print(sys.modules['torch'])"
    done = run(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
