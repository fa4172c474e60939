"""Two policies of the live server that every route shares: an answer whose request gives no
max_tokens stops at `serve --max-tokens-default` (within the context), and content the target
cannot read (images, documents, audio) is refused with a 400 naming the part, on chat completions,
Responses and Messages alike, in the shapes the clients send (Codex's `--image` and its view_image
tool's output, Claude Code's picture inside a tool_result)."""

from __future__ import annotations

import httpx
import pytest

from tests.scripted import running_server, write_scripted_pair

DEFAULT = 7  # --max-tokens-default, small: the endless pair never ends an answer by itself
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
DATA_URL = f"data:image/png;base64,{PNG}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The endless pair (an answer only a limit stops), with a small default answer and a context
    that holds much more than it: a request without max_tokens would otherwise run to the context's end."""
    pair = write_scripted_pair(tmp_path_factory.mktemp("policies"), "The quick brown fox", loop=True,
                               max_position_embeddings=1 << 20)
    with running_server(pair, "--max-tokens-default", str(DEFAULT), "--context-size", "400") as url:
        yield url


def post(url, path, body):
    return httpx.post(f"{url}{path}", json=body, timeout=120)


USER = [{"role": "user", "content": "go on"}]


def test_an_answer_without_max_tokens_stops_at_the_default(server):
    chat = post(server, "/v1/chat/completions", {"model": "target", "messages": USER}).json()
    assert chat["usage"]["completion_tokens"] == DEFAULT and chat["choices"][0]["finish_reason"] == "length", chat
    response = post(server, "/v1/responses", {"model": "target", "input": "go on"}).json()
    assert response["usage"]["output_tokens"] == DEFAULT and response["status"] == "incomplete", response
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    streamed = post(server, "/v1/chat/completions", {"model": "target", "messages": USER, "stream": True,
                                                     "stream_options": {"include_usage": True}}).text
    assert f'"completion_tokens":{DEFAULT}' in streamed.replace(" ", ""), streamed[-500:]
    # A request's own number wins over the default, above it too; the context stays the ceiling.
    asked = post(server, "/v1/chat/completions", {"model": "target", "messages": USER, "max_tokens": DEFAULT + 5}).json()
    assert asked["usage"]["completion_tokens"] == DEFAULT + 5, asked
    whole = post(server, "/v1/chat/completions", {"model": "target", "messages": USER, "max_tokens": 100000}).json()
    assert whole["usage"]["prompt_tokens"] + whole["usage"]["completion_tokens"] == 400, whole["usage"]


# (route, body, where): each places one unreadable part; `where` is what the refusal must name.
IMAGE_PART = {"type": "image_url", "image_url": {"url": DATA_URL}}
CHAT = [
    ([{"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE_PART]}], "messages[1].content[1]", "image"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "messages[0].content[0]", "audio"),
    ([{"role": "user", "content": [{"type": "text", "text": "summarise"},
                                   {"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA", "filename": "a.pdf"}}]}],
     "messages[0].content[1]", "file"),
]


@pytest.mark.parametrize("messages, where, what", CHAT)
def test_chat_completions_refuse_what_the_target_cannot_read(server, messages, where, what):
    r = post(server, "/v1/chat/completions", {"model": "target", "max_tokens": 4, "messages": messages})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == where and error["code"] == "unsupported_content", r.text
    assert error["message"].startswith(f"{where}: {what} content") and "text-only target" in error["message"], error


CODEX_IMAGE = [  # `codex exec --image pic.png "..."`: the picture first in the user's message
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": DATA_URL},
                                                    {"type": "input_text", "text": "What is in this picture?"}]},
]
VIEW_IMAGE = [  # Codex's view_image tool: the picture comes back as the call's output
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look at pic.png"}]},
    {"type": "function_call", "call_id": "call_1", "name": "view_image", "arguments": '{"path": "pic.png"}'},
    {"type": "function_call_output", "call_id": "call_1",
     "output": [{"type": "input_text", "text": "pic.png"}, {"type": "input_image", "image_url": DATA_URL}]},
]
A_FILE = [{"type": "message", "role": "user", "content": [
    {"type": "input_text", "text": "summarise"}, {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,AAAA"}]}]


@pytest.mark.parametrize("items, where, what", [(CODEX_IMAGE, "input[1].content[0]", "image"),
                                                (VIEW_IMAGE, "input[2].output[1]", "image"),
                                                (A_FILE, "input[0].content[1]", "file")])
def test_responses_refuse_what_the_target_cannot_read(server, items, where, what):
    """Images and files were dropped here, and the answer came as if none had been sent."""
    r = post(server, "/v1/responses", {"model": "target", "max_output_tokens": 4, "input": items})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == where, r.text
    assert error["message"].startswith(f"{where}: {what} content") and "text-only target" in error["message"], error


IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
READ_PICTURE = [  # Claude Code's Read tool on a picture: the image inside the tool_result
    {"role": "user", "content": [{"type": "text", "text": "What is in pic.png?"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/w/pic.png"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE_BLOCK]},
                                 {"type": "text", "text": "go on"}]},
]
PASTED = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE_BLOCK]}]
DOCUMENT = [{"role": "user", "content": [
    {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AAAA"}},
    {"type": "text", "text": "summarise"}]}]


@pytest.mark.parametrize("messages, where, what", [(READ_PICTURE, "messages[2].content[0].content[0]", "image"),
                                                   (PASTED, "messages[0].content[1]", "image"),
                                                   (DOCUMENT, "messages[0].content[0]", "document")])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_refuse_what_the_target_cannot_read(server, messages, where, what, path):
    """A picture inside a tool_result was dropped here (the model saw an empty tool response)."""
    r = post(server, path, {"model": "target", "max_tokens": 4, "messages": messages})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error", r.text
    assert body["error"]["message"].startswith(f"{where}: {what} content"), body
    assert "text-only target" in body["error"]["message"]


def test_text_around_the_refused_parts_still_serves(server):
    """The same requests without the unreadable part are answered: the refusal is about the part."""
    tool_text = [{**READ_PICTURE[2], "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "text", "text": "a PNG, 1x1"}]}, {"type": "text", "text": "go on"}]}]
    r = post(server, "/v1/messages", {"model": "target", "max_tokens": 3, "messages": READ_PICTURE[:2] + tool_text})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3, r.text
    view_text = VIEW_IMAGE[:2] + [{**VIEW_IMAGE[2], "output": [{"type": "input_text", "text": "pic.png"}]}]
    r = post(server, "/v1/responses", {"model": "target", "max_output_tokens": 3, "input": view_text})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3, r.text
