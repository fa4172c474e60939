"""What a user's install runs, in real subprocesses: `dflash-mlx agent` with none of the test extras
importable (httpx, the SDKs, pytest's helpers, torch...), through a stand-in client that makes a
tool round trip; `serve --model scripted` and `serve --model demo` with the context `agent` gives
the demo; and no false alarm from transformers about PyTorch on a machine without it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from dflash_mlx import agents, defaults, scripted
from tests import subprocess_env
from tests.test_server import start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
# The test extras of pyproject.toml (and what they pull in) that no user path may import; transformers
# stays: mlx-lm depends on it.
TEST_ONLY = ["httpx", "openai", "anthropic", "pexpect", "hypothesis", "torch", "scipy", "matplotlib", "pytest",
             "xdist", "clang", "setuptools"]
NO_TORCH_NOTICE = "PyTorch was not found"

# A stand-in for Codex: reads the provider dflash-mlx agent gave it on the command line, asks the
# server (Responses API, urllib) with Codex's shell tool, runs nothing but answers the call with the
# marker, sends the result back and prints the final answer. Its arguments go to ARGS_FILE.
FAKE_CODEX = '''\
import json, os, re, sys, urllib.request

args = sys.argv[1:]
open(os.environ["FAKE_CLIENT_ARGS"], "w").write(json.dumps(args))
base = re.search(r'base_url = "([^"]+)"', " ".join(args)).group(1)
model = json.loads([a for a in args if a.startswith("model=")][0].split("=", 1)[1])
key = os.environ[{key!r}]
tool = {{"type": "function", "name": "exec_command", "description": "Run a shell command",
         "parameters": {{"type": "object", "properties": {{"cmd": {{"type": "string"}}}}, "required": ["cmd"]}}}}
items = [{{"type": "message", "role": "user", "content": [{{"type": "input_text", "text": args[-1]}}]}}]

def ask():
    body = json.dumps({{"model": model, "input": items, "tools": [tool], "max_output_tokens": 200}}).encode()
    request = urllib.request.Request(base + "/responses", body, {{"Content-Type": "application/json",
                                                                  "Authorization": "Bearer " + key}})
    return json.load(urllib.request.urlopen(request, timeout=120))["output"]

calls = [item for item in ask() if item["type"] == "function_call"]
assert calls and calls[0]["name"] == "exec_command", calls
items += [{{k: calls[0][k] for k in ("type", "call_id", "name", "arguments")}},
          {{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": {marker!r}}}]
print("".join(part["text"] for item in ask() if item["type"] == "message" for part in item["content"]))
'''


def without_test_extras(tmp_path: Path) -> dict:
    """A subprocess environment where the test extras cannot be imported (as in a plain `pip install .`),
    without what mlx-lm put into this process's environment (TRANSFORMERS_NO_ADVISORY_WARNINGS)."""
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({TEST_ONLY!r}))\n")
    env = {**subprocess_env(), "PYTHONPATH": str(hide), "DFLASH_MLX_HOME": str(tmp_path / "home")}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    return env


@pytest.mark.slow  # a server and a client in subprocesses
def test_agent_runs_a_client_with_a_tool_round_trip_without_the_test_extras(tmp_path):
    """`dflash-mlx agent codex --model scripted -- exec PROMPT`, as the README has it, from a folder
    outside any Git repository: the server starts and answers, the client gets the scripted pair's
    call to its shell tool (the pair shared by every client picks Codex's by the tool's name) and its
    answer once the result came back; `codex exec` gets --skip-git-repo-check; no test extra was
    needed and transformers said nothing about PyTorch."""
    env = without_test_extras(tmp_path)
    client = tmp_path / "codex"
    client.write_text(f"#!{sys.executable}\n" + FAKE_CODEX.format(key=agents.KEY_VARIABLE, marker=agents.MARKER))
    client.chmod(client.stat().st_mode | stat.S_IEXEC)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", "agent", "codex", "--model", "scripted", "--client-bin", str(client),
         "--", "exec", f"Please {scripted.ASK}."],
        cwd=work, env={**env, "FAKE_CLIENT_ARGS": str(tmp_path / "args.json")}, capture_output=True, text=True, timeout=300,
    )
    log = (tmp_path / "home" / "agent-serve.log").read_text() if (tmp_path / "home" / "agent-serve.log").exists() else ""
    assert done.returncode == 0, (done.stderr[-3000:], log[-3000:])
    assert done.stdout.strip() == scripted.Script().after_tool, done.stdout
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[-3:] == ["exec", "--skip-git-repo-check", f"Please {scripted.ASK}."], args
    assert "model_context_window=262144" in args and 'model="scripted"' in args
    for text in (done.stderr, log):
        assert "Traceback" not in text and NO_TORCH_NOTICE not in text, text[-3000:]


def test_codex_exec_gets_the_git_check_skipped_once():
    def argv(*args):
        return agents.launch("codex", "http://127.0.0.1:9", "m", 4096, args=list(args)).argv

    assert argv("exec", "hi")[-3:] == ["exec", "--skip-git-repo-check", "hi"]
    assert argv("e", "hi")[-3:] == ["e", "--skip-git-repo-check", "hi"]  # exec's alias
    assert argv("exec", "--skip-git-repo-check", "hi").count("--skip-git-repo-check") == 1
    assert "--skip-git-repo-check" not in argv("resume", "--last") and "--skip-git-repo-check" not in argv()


def test_the_scripted_pair_calls_the_shell_tool_of_the_client_that_asks(tmp_path, monkeypatch):
    """One pair for every client: the call follows the tools the request offers (Claude Code's
    Bash, Codex's exec_command, opencode's bash), Claude Code's where none of them is offered."""
    from dflash_mlx.api import load, stream_generate

    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    target, draft = agents.scripted_pair()
    assert agents.scripted_pair() == (target, draft)  # made once, then found
    model, tokenizer = load(str(target), draft=str(draft))
    ask = [{"role": "user", "content": f"Please {scripted.ASK}."}]

    def answer(messages, *names):
        tools = [{"type": "function", "function": {"name": n, "description": "", "parameters": {}}} for n in names]
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
        return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=64))

    for client, call in agents.SCRIPTED_CALLS.items():
        assert answer(ask, "Read", call.name, "Write").endswith(call.text()), client
    assert answer(ask, "run_shell_command").endswith(agents.SCRIPTED_CALLS["claude"].text())
    assert answer([{"role": "user", "content": "hi"}], "bash") == scripted.Script().plain
    result = [*ask, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "bash", "arguments": {}}}]},
              {"role": "tool", "content": agents.MARKER}]
    assert answer(result, "bash") == scripted.Script().after_tool


@pytest.mark.slow  # two servers in subprocesses
def test_serve_takes_the_scripted_pair_and_gives_the_demo_the_agents_context(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    process, url = start_server("scripted", agents.scripted_pair()[1])
    try:
        health = httpx.get(f"{url}/health").json()
        assert health["model"] == "scripted" and health["context_limit"] == scripted.CONTEXT
        body = {"model": "scripted", "messages": [{"role": "user", "content": f"Please {scripted.ASK}."}],
                "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]}
        call = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "bash" and json.loads(call["function"]["arguments"])["command"] == f"echo {agents.MARKER}"
    finally:
        stop_server(process)
    process, url = start_server(defaults.DEMO, defaults.demo()[1])  # serve --model demo (its own draft named)
    try:
        assert httpx.get(f"{url}/health").json()["context_limit"] == defaults.DEMO_CONTEXT
        assert "context limit 65536 tokens (the demo pair's default" in process.log.read_text()
        assert "answers without max_tokens stop at 32768 tokens" in process.log.read_text()
    finally:
        stop_server(process)
    from dflash_mlx.cli import _agent_serve_args

    assert _agent_serve_args("claude", "demo", None, "none", None)[2] == defaults.DEMO_CONTEXT  # the one rule
    assert defaults.context_size("demo", 5000) == 5000 and defaults.context_size("other", None) is None


def test_the_cli_default_answer_cap_is_the_servers():
    from dflash_mlx import cli
    from dflash_mlx.server.engine import DEFAULT_ANSWER_TOKENS

    assert cli.DEFAULT_ANSWER_TOKENS == DEFAULT_ANSWER_TOKENS == 32768
    done = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "serve", "--help"], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=120)
    assert "--max-tokens-default" in done.stdout and "32768" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "serve", "--max-tokens-default", "0"],
                             capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert refused.returncode == 1 and "--max-tokens-default must be at least 1" in refused.stderr


def test_no_pytorch_notice_from_transformers_and_other_warnings_pass(tmp_path):
    """Without torch (as on a Mac, or a plain install), transformers announces on import that
    PyTorch was not found. Making the scripted pair imports transformers before mlx-lm (which would
    silence it): the notice must not show, a warning of transformers' own still must; nor does the
    notice show on the CLI's starts."""
    env = subprocess_env(DFLASH_MLX_HOME=str(tmp_path))  # torch hidden
    # mlx-lm, imported by this test process, set this for itself (it hides every advisory warning of
    # transformers): a user's shell has no such variable.
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    code = textwrap.dedent("""
        from dflash_mlx import agents
        agents.scripted_pair()
        from transformers.utils import logging
        logging.get_logger("transformers").warning("another transformers warning")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert NO_TORCH_NOTICE not in done.stderr and "another transformers warning" in done.stderr, done.stderr
    for args in (["--help"], ["generate", "--model", "demo", "-p", "def add(a, b):", "--max-tokens", "4"]):
        run = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", *args], capture_output=True, text=True, env=env,
                             timeout=300)
        assert run.returncode == 0 and NO_TORCH_NOTICE not in run.stderr, run.stderr
