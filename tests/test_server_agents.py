"""What coding agents send, as captured from the real clients (Claude Code 2.1.332, Codex 0.171.0,
opencode 1.18.33; docs/server.md tabulates them), distilled to small requests against the live
server on a scripted pair whose template refuses what Qwen3.5's refuses: each is answered, not
refused; usage, keep-alives, model names, context overflow and the unknown-field policy."""

from __future__ import annotations

import asyncio
import json
import time
import types

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_mlx import scripted, tiny
from dflash_mlx.server.anthropic import MessagesRequest, _thinking
from dflash_mlx.server.engine import DEFAULT_ANSWER_TOKENS, ContextFull, Engine
from tests.test_server import server_log, start_server

CONTEXT = 8192
SCRIPT = scripted.Script(call=scripted.Call("spawn_agent", [("message", "look around")]))
PLAIN, AFTER_TOOL = SCRIPT.plain, SCRIPT.after_tool

# Claude Code's first request, distilled: a billing line and cached blocks in `system`, a system
# message after the user's, custom tools and a server tool, adaptive thinking, fields of its own.
CLAUDE = {
    "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.a44; cc_entrypoint=sdk-cli;"},
               {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>skills</system-reminder>"},
                                              {"type": "text", "text": "Say hello.", "cache_control": {"type": "ephemeral"}}]},
                 {"role": "system", "content": [{"type": "text", "text": "Hook context: the repository is clean."}]}],
    "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {
                  "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
              {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": "{\"device_id\":\"d\",\"session_id\":\"s\"}"},
}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent", "strict": False,
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}}
# Codex's first request, distilled: two developer items, its own fields, a namespace of functions and a
# hosted tool.
CODEX = {
    "model": "gpt-5.2-codex", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a2378f-4c4e", "client_metadata": {"session_id": "01a2378f-4c4e", "turn_id": "t1"},
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
              {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<skills_instructions/>"},
                                                                   {"type": "input_text", "text": "<permissions/>"}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": scripted.ASK}]}],
    "tools": [{"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
               "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
              {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents", "tools": [SPAWN]},
              {"type": "web_search", "external_web_access": False}],
}
# opencode's turn after a tool call: the call's arguments as the JSON string OpenAI sends.
OPENCODE = {
    "model": "scripted", "max_tokens": 32000, "stream": True, "stream_options": {"include_usage": True},
    "tools": [{"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "description": {"type": "string"}}}}}],
    "messages": [{"role": "system", "content": "You are opencode."},
                 {"role": "user", "content": scripted.ASK},
                 {"role": "assistant", "content": "", "reasoning_content": "The user asked for the tool.",
                  "tool_calls": [{"id": "call_1", "type": "function", "function": {
                      "name": "bash", "arguments": "{\"command\":\"echo hi\",\"description\":\"Print\"}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "hi\n"}],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pair = scripted.write_pair(tmp_path_factory.mktemp("agents"), SCRIPT, context=CONTEXT)
    process, url = start_server(*pair, "--model-name", "scripted", "--model-alias", "claude-haiku-4-5",
                                "--max-request-bytes", "100000")
    yield url, process
    process.terminate()
    process.wait(10)


def sse(response: httpx.Response):
    """(event name or None, data) for each event; comments as (":", text)."""
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith(":"):
            out.append((":", line[1:].strip()))
        elif line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((name, json.loads(line[len("data: "):])))
            name = None
    return out


def test_claude_codes_first_request_is_answered_with_usage_as_anthropic_reports_it(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/messages?beta=true", json=CLAUDE, headers={"anthropic-version": "2023-06-01"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-dflash-ignored-tools"] == "web_search"
    events = sse(r)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["model"] == "claude-sonnet-4-5" and start["usage"]["input_tokens"] > 100
    final = events[-2][1]["usage"]
    assert final["input_tokens"] + final["cache_read_input_tokens"] == start["usage"]["input_tokens"]
    assert final["output_tokens"] > 0
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == PLAIN
    # The system message after the user's went in as a user turn, in place: the template refused it
    # where it was, and the prompt counts it.
    counted = httpx.post(f"{url}/v1/messages/count_tokens", json={k: CLAUDE[k] for k in ("model", "system", "messages", "tools")})
    without = {**CLAUDE, "messages": CLAUDE["messages"][:1]}
    fewer = httpx.post(f"{url}/v1/messages/count_tokens", json={k: without[k] for k in ("model", "system", "messages", "tools")})
    assert counted.json()["input_tokens"] > fewer.json()["input_tokens"] + 5


@pytest.mark.parametrize("thinking, on", [({"type": "enabled", "budget_tokens": 2048}, True), ({"type": "disabled"}, False),
                                          ({"type": "adaptive"}, True), ({"type": "adaptive", "display": "omitted"}, True),
                                          (None, None)])
def test_every_thinking_form_is_understood(server, thinking, on):
    url, _ = server
    body = {"model": "scripted", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], "thinking": thinking}
    assert _thinking(MessagesRequest(**body)) is on
    r = httpx.post(f"{url}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["content"][-1]["text"] == PLAIN


def test_any_model_name_is_served_the_aliases_listed_and_the_root_answers(server):
    url, process = server
    for name in ("claude-haiku-4-5", "claude-haiku-4-5-20251001", "scripted"):
        r = httpx.post(f"{url}/v1/messages", json={"model": name, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == name
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["scripted", "claude-haiku-4-5"]
    assert httpx.head(url).status_code == 200 and httpx.get(url).json()["model"] == "scripted"


def test_codexs_first_request_calls_a_namespaced_function_and_names_the_ignored_tool(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/responses", json=CODEX, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-dflash-ignored-tools"] == "web_search"
    events = sse(r)
    done = [d for n, d in events if n == "response.completed"][0]["response"]
    call = [item for item in done["output"] if item["type"] == "function_call"][0]
    # The namespace's function reached the template (the parser typed the call by its schema).
    assert call["name"] == "spawn_agent" and call["namespace"] == "multi_agent_v1"
    assert json.loads(call["arguments"]) == {"message": "look around"} and done["model"] == "gpt-5.2-codex"
    # The round trip: the call's output back, with the reasoning item Codex returns.
    reasoning = [item for item in done["output"] if item["type"] == "reasoning"][0]
    follow = {**CODEX, "stream": False, "input": CODEX["input"] + [
        {**reasoning, "encrypted_content": None}, {k: call[k] for k in ("type", "id", "call_id", "name", "arguments", "namespace")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "spawned"}]}
    again = httpx.post(f"{url}/v1/responses", json=follow, timeout=120)
    assert again.status_code == 200 and again.json()["output"][-1]["content"][0]["text"] == AFTER_TOOL
    assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_a_later_developer_item_stays_in_place(server):
    url, _ = server
    late = {**CODEX, "stream": False, "input": CODEX["input"][:3] + [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Approvals changed."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    r = httpx.post(f"{url}/v1/responses", json=late, timeout=120)
    assert r.status_code == 200 and r.json()["output"][-1]["content"][0]["text"] == PLAIN


def test_opencodes_turn_after_a_tool_call_takes_string_arguments(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json=OPENCODE, timeout=120)
    assert r.status_code == 200, r.text
    chunks = [d for n, d in sse(r)]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == AFTER_TOOL
    assert chunks[-1]["usage"]["prompt_tokens"] > 50
    bad = {**OPENCODE, "stream": False, "messages": OPENCODE["messages"][:2] + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{oops"}}]}]}
    refused = httpx.post(f"{url}/v1/chat/completions", json=bad)
    assert refused.status_code == 400 and "arguments are not JSON" in refused.json()["error"]["message"]


def test_context_overflow_is_worded_as_each_api_words_it(server):
    url, _ = server
    long = "word " * (2 * CONTEXT)
    r = httpx.post(f"{url}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": long}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("prompt is too long: ") and message.endswith(f" tokens > {CONTEXT - 1} maximum")
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": long}]})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/responses", json={"model": "m", "input": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_refusals_and_ignored_fields_leave_a_line_in_the_servers_output(tmp_path):
    pair = scripted.write_pair(tmp_path, SCRIPT, context=CONTEXT)
    process, url = start_server(*pair, "--model-name", "scripted", "--model-alias", "claude-haiku-4-5")
    try:
        httpx.post(f"{url}/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": "resp_1"})
        ask = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        httpx.post(f"{url}/v1/messages", json={"model": "claude-haiku-4-5", **ask, "made_up_field": 1}, timeout=120)
        httpx.post(f"{url}/v1/messages", json={"model": "claude-haiku-4-5-20251001", **ask}, timeout=120)
        httpx.post(f"{url}/v1/messages", json={**CLAUDE, "stream": False}, timeout=120)
        httpx.post(f"{url}/v1/responses", json={**CODEX, "stream": False}, timeout=120)
        httpx.post(f"{url}/v1/chat/completions", json={"model": "scripted", "max_tokens": 2, "store": False,
                                                       "made_up_field": 1, "messages": ask["messages"]}, timeout=120)
    finally:
        process.terminate()
        process.wait(15)
        output = server_log(process)
        process.log.unlink(missing_ok=True)
    assert "POST /v1/responses -> 400 previous_response_id is not supported" in output
    assert "/v1/messages: ignored fields: made_up_field" in output
    assert "/v1/responses: ignored fields: client_metadata, include, prompt_cache_key, store" in output
    assert "/v1/messages: ignored hosted tools: web_search" in output
    assert "/v1/chat/completions: ignored fields: made_up_field, store" in output
    assert "model 'claude-haiku-4-5-20251001' requested: served by 'scripted'" in output
    assert "'claude-haiku-4-5' requested" not in output  # an alias is served silently


@pytest.mark.parametrize("field, value", [("made_up_field", 1), ("store", False), ("metadata", {"a": "b"})])
def test_chat_completions_accept_fields_that_do_not_apply(server, field, value):
    body = {"model": "scripted", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value}
    assert httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=120).status_code == 200


@pytest.mark.parametrize("field, value", [("logit_bias", {"5": 10}), ("modalities", ["text", "audio"]),
                                          ("prediction", {"type": "content", "content": "x"})])
def test_chat_completions_refuse_fields_that_would_change_the_answer(server, field, value):
    body = {"model": "scripted", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value}
    r = httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_answers_are_as_long_as_the_client_asks_up_to_the_context():
    def budget(cap, limit, prompt, requested, default=DEFAULT_ANSWER_TOKENS):
        engine = types.SimpleNamespace(max_tokens_cap=cap, context_limit=limit, max_tokens_default=default)
        return Engine.answer_budget(engine, prompt, requested)

    assert budget(None, 262144, 40000, 32000) == 32000  # Claude Code's 32,000 (a 4096 cap once cut it)
    assert budget(None, 40500, 40000, 32000) == 500 and budget(None, 40500, 40000, None) == 500
    assert budget(4096, 262144, 40000, 32000) == 4096  # the operator's --max-tokens
    # No max_tokens (Codex, Continue, llm, Aider): --max-tokens-default, not the rest of a 262k context.
    assert budget(None, 262144, 40000, None) == 32768 and budget(None, None, 10, None) == 32768
    assert budget(None, 262144, 40000, None, default=100) == 100 and budget(50, 262144, 40000, None) == 50
    assert budget(None, 262144, 40000, 50000) == 50000  # a request's own number above the default wins
    with pytest.raises(ContextFull) as full:
        budget(None, 40000, 40000, 8)
    assert full.value.maximum == 39999


def test_keepalives_go_out_while_a_request_waits(tmp_path, monkeypatch):
    """A stream whose generation has not started (the model busy with another, or a long prefill)
    gets Anthropic's pings and OpenAI's SSE comments instead of silence. The worker is held back
    0.3 s before each generation here, as a busy model would hold it."""
    from dflash_mlx.api import load
    from dflash_mlx.server import create_app

    target, draft = tiny.write_pair(tmp_path)
    model, tokenizer = load(str(target), draft=str(draft))
    from dflash_mlx.server.engine import Engine

    schedule = Engine._request

    def held_back(self, job):  # the worker busy for 0.3 s before the request joins its scheduler
        time.sleep(0.3)
        return schedule(self, job)

    monkeypatch.setattr(Engine, "_request", held_back)
    app = create_app(model, tokenizer, "tiny", keepalive_seconds=0.02, max_concurrent=1)

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            question = [{"role": "user", "content": "hi"}]
            messages = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": question,
                                                              "stream": True})
            chat = await client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": question,
                                                                   "stream": True})
            return messages, chat

    messages, chat = asyncio.run(ask())
    names = [n for n, _ in sse(messages)]
    assert names[:4] == ["message_start", "ping", "ping", "ping"] and "content_block_start" in names
    comments = [i for i, (n, _) in enumerate(sse(chat)) if n == ":"]
    assert len(comments) >= 2 and comments[0] == 1  # after the role chunk, before any content


def test_the_agent_launcher_points_each_client_at_the_server_without_its_files(tmp_path, monkeypatch):
    from dflash_mlx import agents
    from dflash_mlx.cli import _agent_serve_args

    claude = agents.launch("claude", "http://127.0.0.1:9", "qwopus", 65536)
    assert claude.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and claude.env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "qwopus"
    assert claude.env["DISABLE_TELEMETRY"] == "1" and "ANTHROPIC_API_KEY" in claude.unset
    assert "ANTHROPIC_API_KEY" not in agents.environment(claude, {"ANTHROPIC_API_KEY": "sk-ant-real"})
    codex = agents.launch("codex", "http://127.0.0.1:9", "qwopus", 65536, args=["exec", "hi"])
    assert codex.argv[-3:] == ["exec", "--skip-git-repo-check", "hi"] and "model_context_window=65536" in codex.argv
    assert 'model_providers.dflash_mlx={name = "dflash-mlx", base_url = "http://127.0.0.1:9/v1", wire_api = "responses", ' \
           'env_key = "DFLASH_MLX_API_KEY"}' in codex.argv and "analytics.enabled=false" in codex.argv
    opencode = json.loads(agents.launch("opencode", "http://127.0.0.1:9", "qwopus", 65536).env["OPENCODE_CONFIG_CONTENT"])
    assert opencode["model"] == "dflash_mlx/qwopus" and opencode["provider"]["dflash_mlx"]["options"]["baseURL"].endswith("/v1")
    monkeypatch.setenv("DFLASH_MLX_HOME", str(tmp_path))
    args, name, context = _agent_serve_args("codex", "scripted", None, "none", None)
    assert name == "scripted" and context == scripted.CONTEXT and args[-2:] == ["--model", "scripted"]  # serve makes the pair
    assert _agent_serve_args("claude", "demo", None, "none", None)[2] == 65536  # the demo's 4,096 holds no agent


anything = st.recursive(st.none() | st.booleans() | st.integers(-3, 12) | st.text(max_size=8),
                        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
                        max_leaves=8)
responses_tools = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "namespace", "web_search", "custom"]) | anything},
    optional={"name": st.text(max_size=5) | anything, "parameters": anything,
              "tools": st.lists(st.fixed_dictionaries({}, optional={"type": anything, "name": st.text(max_size=4) | anything}),
                                max_size=2) | anything}), max_size=3)
responses_items = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | anything},
    optional={"role": st.sampled_from(["user", "developer", "system", "assistant"]) | anything, "content": anything,
              "summary": anything, "namespace": anything, "arguments": st.text(max_size=5), "call_id": anything}), max_size=4)
claude_blocks = st.text(max_size=5) | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "server_tool_use"]) | st.text(max_size=5)},
    optional={"text": anything, "content": anything, "input": anything, "name": anything, "thinking": anything}), max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(tools=responses_tools, items=responses_items,
       extra=st.dictionaries(st.sampled_from(["prompt_cache_key", "client_metadata", "background", "conversation", "made_up"]),
                             anything, max_size=3))
def test_fuzzed_agent_shaped_responses_requests_never_get_a_server_error(server, tools, items, extra):
    r = httpx.post(f"{server[0]}/v1/responses", json={"model": "m", "input": items or "hi", "tools": tools,
                                                      "max_output_tokens": 2, **extra}, timeout=60)
    assert r.status_code < 500, r.text


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": claude_blocks}),
                         min_size=1, max_size=3),
       extra=st.dictionaries(st.sampled_from(["thinking", "output_config", "mcp_servers", "context_management", "tools"]),
                             anything, max_size=3))
def test_fuzzed_agent_shaped_messages_requests_never_get_a_server_error(server, messages, extra):
    r = httpx.post(f"{server[0]}/v1/messages", json={"model": "m", "max_tokens": 2, "messages": messages, **extra}, timeout=60)
    assert r.status_code < 500, r.text
