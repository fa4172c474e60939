"""OpenAI's Responses API on the live server, through the official `openai` SDK: reasoning and
function_call items, the streamed events, a function-call round trip through the prefix cache,
and a clear 400 for what is not supported."""

from __future__ import annotations

import json

import openai
import pytest

from tests.scripted import openai_client, write_scripted_pair

REASONING = "The quick brown fox"
CALL = "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_scripted_pair(tmp_path_factory.mktemp("responses"), f"{REASONING}</think>{CALL}")


@pytest.fixture(scope="module")
def client(pair):
    with openai_client(pair) as client:
        yield client


def create(client, **kwargs):
    kwargs = {"model": "target", "input": "weather in Paris?", "tools": TOOLS, "temperature": 0, **kwargs}
    return client.responses.create(**kwargs)


def test_reasoning_and_function_call_items(client, pair):
    response = create(client)
    assert response.status == "completed" and [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == REASONING
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    from dflash_mlx import generate
    from dflash_mlx.api import load

    model, tokenizer = load(str(pair[0]), draft=str(pair[1]))  # the library's greedy text, split into the items
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in TOOLS]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "weather in Paris?"}], tools=tools, add_generation_prompt=True)
    assert len(ids) == response.usage.input_tokens
    assert generate(model, tokenizer, ids, max_tokens=60) == f"{REASONING}</think>{CALL}"


def test_the_codex_example_points_at_the_responses_api():
    from pathlib import Path

    config = (Path(__file__).resolve().parents[1] / "examples/editors/codex-config.toml").read_text()
    assert 'wire_api = "responses"' in config and 'base_url = "http://127.0.0.1:8080/v1"' in config
    assert 'model_provider = "dflash-mlx"' in config and "[model_providers.dflash-mlx]" in config


def test_the_streamed_events(client):
    events = list(create(client, stream=True))
    kinds = [e.type for i, e in enumerate(events) if i == 0 or e.type != events[i - 1].type]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert json.loads("".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")) == {"city": "Paris"}
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_a_function_call_round_trip_reuses_the_cache(client):
    first = create(client)
    call = first.output[1]
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "reasoning", "id": first.output[0].id, "summary": [], "content": [{"type": "reasoning_text", "text": REASONING}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}]
    second = create(client, input=items)
    assert second.usage.input_tokens > first.usage.input_tokens
    # The first prompt up to its last 64-token checkpoint (the answer's states came from decoding: prefilled again).
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens - 1) // 64 * 64


def test_without_tools_the_answer_is_a_message(client):
    response = create(client, tools=[], instructions="Be brief.")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == CALL  # with no tools, a call-shaped answer is text
    events = list(create(client, tools=[], instructions="Be brief.", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CALL


def test_reasoning_effort_none_turns_thinking_off(client):
    response = create(client, reasoning={"effort": "none"})
    assert all(item.type != "reasoning" for item in response.output)
    assert response.usage.input_tokens < create(client).usage.input_tokens + 10


def test_max_output_tokens_inside_the_reasoning_is_incomplete(client):
    response = create(client, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning"]


@pytest.mark.parametrize("options, message", [
    (dict(previous_response_id="resp_1"), "previous_response_id is not supported"),
    (dict(extra_body={"background": True}), "background"),
    (dict(extra_body={"conversation": "conv_1"}), "conversation"),
    (dict(input=[{"type": "image_generation_call", "id": "x"}]), "input items of type 'image_generation_call'"),
])
def test_what_is_not_supported_is_a_clear_400(client, options, message):
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, **options)
    assert message in refused.value.body["message"]


def test_chat_completions_stream_the_same_call_as_tool_call_deltas(client):
    """The same server through chat completions: the reasoning apart, the call parsed, streamed
    as delta.tool_calls (id and name first, then argument fragments)."""
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in TOOLS]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    reply = client.chat.completions.create(model="target", messages=messages, tools=tools, temperature=0, max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == REASONING
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(model="target", messages=messages, tools=tools, temperature=0,
                                                 max_tokens=60, stream=True))
    calls = [c for chunk in chunks for ch in chunk.choices for c in (ch.delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"} and len(calls) > 2
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
