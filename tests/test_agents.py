"""The real clients against `serve`: Claude Code, Codex and opencode at their pinned versions
(tools/install-agents.sh), each run non-interactively inside a private network namespace with only
loopback up, against the scripted pair (`--model scripted`'s): a plain prompt, and one where the model calls
the client's shell tool and the client sends its result back. Each run exits 0, the tool's output
reaches the client, and the server's log has no refusal (4xx) or failure (5xx).

The clients not installed is a failure that says how to install them, not a skip: CI installs them,
and a skip there would hide a broken install behind a green suite. A developer without npm
deselects them: `pytest -m "not agents"`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx import agents, scripted
from tests import agent_clients

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("DFLASH_MLX_AGENTS", ROOT / ".agents")) / "node_modules" / ".bin"
pytestmark = [pytest.mark.agents, pytest.mark.slow]  # the real clients, one server each


def namespace() -> list:
    prefix = agent_clients.namespace()
    if prefix is None:
        pytest.fail("cannot make a network namespace (unshare -n, or unshare -rn without root): the clients must not "
                    "reach anything but loopback, so they are not run here")
    return prefix


def run_client(client: str, tmp_path: Path) -> dict:
    binary = BIN / client
    if not binary.exists():
        pytest.fail(f"{agents.DOCS[client]} is not installed at {binary}: run tools/install-agents.sh (npm installs the "
                    f"pinned {', '.join(agents.PACKAGES.values())} into .agents/), or set DFLASH_MLX_AGENTS to a folder "
                    "holding them; to run the suite without them: pytest -m 'not agents'")
    command = f'exec "{sys.executable}" -m tests.agent_run {client} "{BIN}" "{tmp_path}"'
    done = subprocess.run(agent_clients.in_namespace(namespace(), command), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text())


def check(results: dict) -> None:
    log = results["server_log"]
    refused = [line for line in log.splitlines() if " -> 4" in line or " -> 5" in line]
    plain, tool = results["plain"], results["tool"]
    for run in (plain, tool):  # every exchange the proxy saw, whatever the server logs
        failed = [r for r in run["requests"] if r.get("status", 0) >= 400 or "status" not in r]
        assert not failed, (failed, run["stderr"][-2000:])
    assert plain["rc"] == 0, plain
    assert scripted.Script().plain in plain["stdout"], plain
    assert tool["rc"] == 0, tool
    assert agents.MARKER in tool["stdout"], tool  # the tool ran and the client saw its output
    assert scripted.Script().after_tool in tool["stdout"], tool  # the answer to the request that carried it
    assert not refused, log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("client", agents.CLIENTS)
def test_the_client_runs_a_prompt_and_a_tool_round_trip(client, tmp_path):
    check(run_client(client, tmp_path))
