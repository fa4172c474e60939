"""Coding agents against ``serve``: how each client is pointed at the server (``dflash-mlx agent``).

Each client gets the server's base URL, the served model's name for every model it asks for
(Claude Code's background and sub-agent models included), a placeholder key, the context
window, and its telemetry and update checks off, through its environment and its command line
only: the user's own configuration files are not touched.

The pinned versions are the ones the tests run (``tools/install-agents.sh``); the scripted calls
are what the scripted pair (``dflash_mlx.scripted``) calls for each client: its shell tool, with
the parameters that client's tool takes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .scripted import Call, Script, cached_pair

CLIENTS = ("claude", "codex", "opencode")
PACKAGES = {"claude": "@anthropic-ai/claude-code@2.1.332", "codex": "@openai/codex@0.171.0", "opencode": "opencode-ai@1.18.33"}
DOCS = {"claude": "Claude Code", "codex": "Codex CLI", "opencode": "opencode"}
MARKER = "scripted-tool-output"  # what the scripted call prints
SCRIPTED_CALLS = {
    "claude": Call("Bash", [("command", f"echo {MARKER}"), ("description", "Print a marker")]),
    "codex": Call("exec_command", [("cmd", f"echo {MARKER}")]),
    "opencode": Call("bash", [("command", f"echo {MARKER}"), ("description", "Print a marker")]),
}
PROVIDER = "dflash_mlx"  # the provider id in Codex's and opencode's configuration
KEY_VARIABLE = "DFLASH_MLX_API_KEY"

# Telemetry, error reports, update checks and other traffic off (documented by each client).
QUIET = {
    "claude": {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"},
    "codex": {},  # on its command line: check_for_update_on_startup, analytics, feedback
    "opencode": {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                 "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"},
}


def scripted_script() -> Script:
    """What the scripted pair (``--model scripted``) answers: fixed texts, and, asked to "run the
    scripted tool", a call to the shell tool of whichever client asks (the first of
    ``SCRIPTED_CALLS`` whose name the request's tools offer; Claude Code's where none does)."""
    return Script(calls=[SCRIPTED_CALLS[client] for client in CLIENTS])


def scripted_pair():
    """The scripted pair's folders (target, draft), made under ``$DFLASH_MLX_HOME/scripted`` on first use."""
    from .paths import home

    return cached_pair(home() / "scripted", scripted_script())


@dataclass
class Launch:
    argv: List[str]
    env: Dict[str, str]  # set on top of the caller's environment
    unset: Sequence[str] = ()  # removed from it


def launch(client: str, base_url: str, model: str, context: Optional[int], api_key: Optional[str] = None,
           args: Sequence[str] = (), binary: Optional[str] = None) -> Launch:
    """The command line and environment that run ``client`` against the server at ``base_url``
    (``http://host:port``, no ``/v1``) serving ``model``; ``args`` go to the client."""
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r}: choose from {', '.join(CLIENTS)}")
    key = api_key or "none"
    binary = binary or client
    env = dict(QUIET[client])
    if client == "claude":
        env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_AUTH_TOKEN=key, ANTHROPIC_MODEL=model,
                   ANTHROPIC_SMALL_FAST_MODEL=model, ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
                   ANTHROPIC_DEFAULT_SONNET_MODEL=model, ANTHROPIC_DEFAULT_OPUS_MODEL=model)
        if context:
            env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(context)
        # A key of the user's for Anthropic's API must not go to this server (nor conflict with the token).
        return Launch([binary, *args], env, unset=("ANTHROPIC_API_KEY",))
    if client == "codex":
        provider = {"name": "dflash-mlx", "base_url": f"{base_url}/v1", "wire_api": "responses", "env_key": KEY_VARIABLE}
        overrides = [f"model_provider={json.dumps(PROVIDER)}", f"model={json.dumps(model)}",
                     f"model_providers.{PROVIDER}={_toml_table(provider)}", "check_for_update_on_startup=false",
                     "analytics.enabled=false", "feedback.enabled=false"]
        if context:
            overrides.append(f"model_context_window={context}")
        env[KEY_VARIABLE] = key
        return Launch([binary, *[a for o in overrides for a in ("-c", o)], *_codex_args(args)], env)
    limit = {"context": context, "output": min(32000, context)} if context else None
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "model": f"{PROVIDER}/{model}",
              "provider": {PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": "dflash-mlx",
                                      "options": {"baseURL": f"{base_url}/v1", "apiKey": key},
                                      "models": {model: {"name": model, **({"limit": limit} if limit else {})}}}}}
    env["OPENCODE_CONFIG_CONTENT"] = json.dumps(config)
    return Launch([binary, *args], env)


CODEX_EXEC = ("exec", "e")  # the non-interactive subcommand and its alias
SKIP_GIT_CHECK = "--skip-git-repo-check"


def _codex_args(args: Sequence[str]) -> List[str]:
    """The client's arguments, with ``--skip-git-repo-check`` after ``exec`` (or ``e``) unless given:
    ``codex exec`` refuses to run outside a Git repository without it, and an agent pointed at a
    local server is often started in a scratch folder (the interactive client asks instead)."""
    args = list(args)
    if args and args[0] in CODEX_EXEC and SKIP_GIT_CHECK not in args:
        args.insert(1, SKIP_GIT_CHECK)
    return args


def _toml_table(values: Dict[str, str]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) + "}"


def environment(launch_: Launch, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The client's whole environment: ``base`` (the caller's) with the launch's changes."""
    env = dict(os.environ if base is None else base)
    for name in launch_.unset:
        env.pop(name, None)
    env.update(launch_.env)
    return env
