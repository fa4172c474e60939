"""Tool calls in Qwen3.5's format: found as the answer streams, parsed by mlx-lm's parser for the
template (values typed by the tool's schema), sent as OpenAI's tool_calls deltas."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from dflash_mlx import tiny
from dflash_mlx.server.engine import Job
from dflash_mlx.server.openai import _Reply

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}, "exact": {"type": "boolean"}}}}},
]
CALL_1 = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
CALL_2 = ("<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3.5\n</parameter>\n"
          "<parameter=exact>\ntrue\n</parameter>\n</function>\n</tool_call>")
OUTPUT = f"Let me check.\n{CALL_1}\n{CALL_2}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny.write_tokenizer(path)
    return load_tokenizer(path)


def stream(tokenizer, pieces, finish="stop"):
    """The chunks ``_Reply.stream`` sends for an answer arriving in ``pieces``, each piece taken by
    the handler before the next arrives (tokens that wait together are joined into one event)."""
    async def run():
        job = Job(None, {}, asyncio.Queue(), asyncio.get_running_loop())

        async def produce():
            for i, piece in enumerate(pieces):
                job.queue.put_nowait(("token", SimpleNamespace(text=piece, finish_reason=finish if i == len(pieces) - 1 else None,
                                                               prompt_tokens=5, generation_tokens=i + 1, cached_prompt_tokens=0)))
                while not job.queue.empty():
                    await asyncio.sleep(0)
            job.queue.put_nowait(("done", None))

        producer = asyncio.create_task(produce())
        chunks = [chunk async for chunk in _Reply("chat.completion", "m", tokenizer, TOOLS).stream(job, False)]
        await producer
        return chunks

    chunks = asyncio.run(run())
    return [json.loads(c[len("data: "):]) for c in chunks if c.startswith("data: {")]


def collect(chunks):
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] = (call.get("function") or {}).get("name") or entry["name"]
                entry["arguments"] += (call.get("function") or {}).get("arguments", "")
    return content, calls, chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("size", [1, 3, 7, len(OUTPUT)])
def test_streamed_calls_come_as_tool_call_deltas_wherever_the_text_splits(tokenizer, size):
    chunks = stream(tokenizer, [OUTPUT[i:i + size] for i in range(0, len(OUTPUT), size)])
    content, calls, finish = collect(chunks)
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "add"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["arguments"]) == {"a": 2, "b": 3.5, "exact": True}  # typed by the schema
    assert all(c["id"].startswith("call_") for c in calls.values()) and calls[0]["id"] != calls[1]["id"]
    firsts = [d for chunk in chunks for ch in chunk["choices"] for d in ch["delta"].get("tool_calls") or [] if "id" in d]
    assert [d["function"]["arguments"] for d in firsts] == ["", ""]  # id and name first, then argument fragments


def test_the_first_call_is_sent_before_the_second_is_written(tokenizer):
    chunks = stream(tokenizer, ["Let me check.\n", CALL_1, "\n", CALL_2[:20]] + [CALL_2[20:]])
    kinds = [("call", d["index"]) for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls") or [] if "id" in d]
    assert kinds == [("call", 0), ("call", 1)]
    first_call = next(i for i, c in enumerate(chunks) if any("tool_calls" in ch["delta"] for ch in c["choices"]))
    assert first_call < len(chunks) - 3


def test_non_streamed_calls_are_the_same(tokenizer):
    content, calls = _Reply("chat.completion", "m", tokenizer, TOOLS)._tool_calls(OUTPUT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3.5, "exact": True})]


def test_an_unclosed_or_malformed_block_stays_text(tokenizer):
    unclosed = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"  # max tokens mid-call
    content, calls, finish = collect(stream(tokenizer, [unclosed[:9], unclosed[9:]], finish="length"))
    assert content == unclosed and not calls and finish == "length"
    malformed = "<tool_call>\nno function here\n</tool_call>"
    content, calls = _Reply("chat.completion", "m", tokenizer, TOOLS)._tool_calls(malformed)
    assert content == malformed and calls == []


def test_without_tools_nothing_is_parsed(tokenizer):
    content, calls = _Reply("chat.completion", "m", tokenizer, None)._tool_calls(OUTPUT)
    assert content == OUTPUT and calls == []


def test_a_malformed_call_stays_text_and_the_stream_goes_on():
    """A parser that returns something that is not a call (here mlx-lm's JSON parser, as Hermes
    templates use it: arguments that are not JSON, no name, not an object) leaves the block as
    text; the stream goes on, and a good call after it is still a call."""
    from mlx_lm.tool_parsers import json_tools

    tokenizer = SimpleNamespace(has_tool_calling=True, tool_call_start="<tool_call>", tool_call_end="</tool_call>",
                                tool_parser=json_tools.parse_tool_call)
    bad = ['<tool_call>{"name": "add", "arguments": "{not json"}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
           '<tool_call>["add"]</tool_call>', "<tool_call>[]</tool_call>", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>']
    good = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    output = "First." + "".join(bad) + " Then." + good
    content, calls, finish = collect(stream(tokenizer, [output[i:i + 5] for i in range(0, len(output), 5)]))
    assert content.rstrip() == "First." + "".join(bad) + " Then."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("add", {"a": 1})] and finish == "tool_calls"
