"""Anthropic's Messages API on the live server, through the official `anthropic` SDK: thinking and
tool_use blocks, the streamed event sequence, a tool_result round trip that hits the prefix cache,
count_tokens, x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from dflash_mlx import generate
from dflash_mlx.api import load
from tests.scripted import running_server, write_scripted_pair

KEY = "sk-ant-test"
REASONING = "The quick brown fox"
CALL = "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>"
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_scripted_pair(tmp_path_factory.mktemp("anthropic"), f"{REASONING}</think>{CALL}")


@pytest.fixture(scope="module")
def server(pair):
    with running_server(pair, "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(pair):
    return load(str(pair[0]), draft=str(pair[1]))


def create(client, messages=ASK, **kwargs):
    """The SDK's call (it sends no temperature: the server's default applies; this target ships no
    generation_config.json, so that is greedy, as mlx_lm.server's)."""
    return client.messages.create(model="target", max_tokens=kwargs.pop("max_tokens", 60), messages=messages,
                                  tools=kwargs.pop("tools", TOOLS), **kwargs)


def test_the_answer_comes_as_thinking_and_tool_use_blocks(client, local):
    reply = create(client)
    assert [b.type for b in reply.content] == ["thinking", "tool_use"] and reply.stop_reason == "tool_use"
    assert reply.content[0].thinking == REASONING
    call = reply.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("call_")
    model, tokenizer = local  # the library's greedy text for the same conversation
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
             for t in TOOLS]
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    assert generate(model, tokenizer, ids, max_tokens=60) == f"{REASONING}</think>{CALL}"
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(ids)


def events(server, body):
    with httpx.stream("POST", f"{server}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    return names, data


def test_the_streamed_event_sequence(server, client):
    body = {"model": "target", "max_tokens": 60, "messages": ASK, "tools": TOOLS, "stream": True, "temperature": 0}
    names, data = events(server, body)
    collapsed = [n for i, n in enumerate(names) if (i == 0 or n != names[i - 1] or n != "content_block_delta") and n != "ping"]
    assert names[:2] == ["message_start", "ping"]  # as Anthropic's API sends it (and again while a request waits)
    assert collapsed == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                         "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    starts = [d["content_block"] for d in data if d["type"] == "content_block_start"]
    assert starts[0]["type"] == "thinking" and starts[1] == {"type": "tool_use", "id": starts[1]["id"], "name": "get_weather", "input": {}}
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas if d["type"] == "thinking_delta") == REASONING
    assert json.loads("".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")) == {"city": "Paris"}
    assert next(d for d in data if d["type"] == "message_delta")["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(model="target", max_tokens=60, messages=ASK, tools=TOOLS) as stream:
        final = stream.get_final_message()  # the SDK assembles the same blocks from the events
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == {"city": "Paris"}


def test_a_five_turn_tool_dialogue_hits_the_cache_for_everything_before_the_new_turn(client):
    messages, before = list(ASK), None
    for turn in range(5):
        reply = create(client, messages)
        total = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
        if before is not None:  # the previous request's prompt is in the cache up to its last 64-token checkpoint
            assert reply.usage.cache_read_input_tokens >= (before - 1) // 64 * 64, turn
        before = total
        call = reply.content[1]
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": f"{18 + turn}C, sunny"}]}]
    assert reply.usage.cache_read_input_tokens > reply.usage.input_tokens  # most of a long dialogue is reused


def test_thinking_disabled_and_count_tokens(client, local):
    _, tokenizer = local
    reply = create(client, tools=[], thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in reply.content)
    expected = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(expected)
    counted = client.messages.count_tokens(model="target", messages=ASK, thinking={"type": "disabled"})
    assert counted.input_tokens == len(expected)


def test_stop_sequences_say_which_one_stopped(client):
    reply = create(client, stop_sequences=["brown"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "brown"
    assert reply.content[0].type == "thinking" and reply.content[0].thinking == "The quick "


def test_auth_and_errors_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model="target", max_tokens=4, messages=ASK)
    other = client.messages.create(model="claude-haiku-4-5", max_tokens=4, messages=ASK)  # any name: the loaded model
    assert other.model == "claude-haiku-4-5"
    bad = httpx.post(f"{server}/v1/messages", json={"model": "target", "messages": ASK}, headers={"x-api-key": KEY})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.json()["error"]["message"]


def test_an_oversized_body_is_refused_in_anthropics_shape(server):
    big = {"model": "target", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (9 << 20)}]}
    r = httpx.post(f"{server}/v1/messages", json=big, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_the_sdk_example_runs_against_the_server(server):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "examples/editors/anthropic_sdk.py", server, KEY, "target"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "stop_reason: tool_use" in done.stdout and "after the tool: tool_use" in done.stdout
    claude = (root / "examples/editors/claude-code.sh").read_text()
    assert "ANTHROPIC_BASE_URL" in claude and "ANTHROPIC_MODEL" in claude


def test_a_text_answer_streams_as_text_deltas(server):
    """Without tools a call-shaped answer is text: thinking block, then a text block of text_deltas."""
    body = {"model": "target", "max_tokens": 60, "messages": ASK, "stream": True, "temperature": 0}
    names, data = events(server, body)
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    text = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == CALL and next(d for d in data if d["type"] == "message_delta")["delta"]["stop_reason"] == "end_turn"
