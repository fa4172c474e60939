"""Content parts that chat completions and Responses leave out of the prompt are logged and counted
(``/metrics`` ``dflash_dropped_content_blocks_total``, by route and type), as Messages' blocks are.

Oracle: the prompt the server counts (``usage``) is the tiny target's own template rendering of the
conversation with the dropped parts' text absent (``apply_chat_template``), and each dropped part
adds one to its route's and type's counter.
"""

from __future__ import annotations

import logging
import re

import pytest

from dflash_mlx import tiny

REFUSAL = {"type": "refusal", "refusal": "I can't help with that."}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from fastapi.testclient import TestClient

    from dflash_mlx.api import load
    from dflash_mlx.server import create_app

    target, draft = tiny.write_pair(tmp_path_factory.mktemp("dropped"))
    model, tokenizer = load(str(target), draft=str(draft))
    with TestClient(create_app(model, tokenizer, "tiny")) as client:
        yield client, tokenizer


def dropped(client, route: str, kind: str) -> float:
    """The counter for ``route`` and ``kind`` in /metrics (0 before any)."""
    pattern = rf'^dflash_dropped_content_blocks_total\{{model="tiny",route="{re.escape(route)}",type="{re.escape(kind)}"\}} (\S+)$'
    found = re.search(pattern, client.get("/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def expected_tokens(tokenizer, messages) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


TEXT_ONLY = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there"},
             {"role": "user", "content": "Again"}]


def test_chat_completions_count_the_parts_they_leave_out(served, caplog):
    client, tokenizer = served
    route = "/v1/chat/completions"
    messages = [TEXT_ONLY[0], {"role": "assistant", "content": [{"type": "text", "text": "Hi "}, REFUSAL,
                                                                 {"type": "text", "text": "there"}, REFUSAL]},
                TEXT_ONLY[2]]
    before = dropped(client, route, "refusal")
    with caplog.at_level(logging.INFO, logger="dflash_mlx.server"):
        reply = client.post(route, json={"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == expected_tokens(tokenizer, TEXT_ONLY)
    assert dropped(client, route, "refusal") == before + 2
    assert f"{route}: ignored content parts: refusal" in caplog.text


def test_responses_count_the_parts_they_leave_out(served, caplog):
    client, tokenizer = served
    route = "/v1/responses"
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there"}, REFUSAL]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_text", "text": "ok"}, {"type": "custom_part", "x": 1}]},
             {"type": "message", "role": "user", "content": "Again"}]
    before = {kind: dropped(client, route, kind) for kind in ("refusal", "custom_part")}
    with caplog.at_level(logging.INFO, logger="dflash_mlx.server"):
        reply = client.post(route, json={"model": "tiny", "input": items, "max_output_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    expected = [TEXT_ONLY[0], {"role": "assistant", "content": "Hi there", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}, TEXT_ONLY[2]]
    assert reply.json()["usage"]["input_tokens"] == expected_tokens(tokenizer, expected)
    assert {kind: dropped(client, route, kind) - before[kind] for kind in before} == {"refusal": 1, "custom_part": 1}
    assert f"{route}: ignored content parts: custom_part, refusal" in caplog.text


def test_a_refused_request_counts_nothing(served):
    """An image beside a dropped part is refused (content.py) and nothing is counted."""
    client, _ = served
    route = "/v1/chat/completions"
    before = dropped(client, route, "refusal")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    reply = client.post(route, json={"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "assistant", "content": [REFUSAL]}, {"role": "user", "content": [image]}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[1].content[0]", reply.text
    assert dropped(client, route, "refusal") == before
