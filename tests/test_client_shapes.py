"""Real clients' request bodies, recorded whole (tests/fixtures/clients/, written by
tests/fixtures/record.py: the pinned clients in a loopback-only namespace through a recording proxy,
against `serve` on a scripted pair), replayed against a live server: Claude Code's ToolSearch turn
(deferred tools and a ``tool_reference``), Claude Code reading a picture (an image inside a
``tool_result``), Codex sending an image, the openai SDK's ``parse()`` and ``llm --schema`` (the
answers follow the recorded schemas).

The oracles are the recorded bodies themselves and what the clients promise the model: the tools
marked ``defer_loading``, the names the ``tool_reference`` blocks carry, the ``<function>`` encoding
ToolSearch's own description announces; the chat template is the scripted pair's (Qwen3.5's format)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import pytest

from dflash_mlx import agents, scripted
from dflash_mlx.server.anthropic import MessagesRequest, _tools, chat_messages
from dflash_mlx.server.engine import late_system_as_user
from tests.test_server import server_log, start_server, stop_server

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "clients"


def recorded(name: str) -> list:
    """The recorded requests of a fixture: (path with query, headers, body)."""
    requests = json.loads((FIXTURES / f"{name}.json").read_text())["requests"]
    return [(r["path"] + (f"?{r['query']}" if r["query"] else ""), r["headers"], r["body"]) for r in requests]


def where_blocks(body: dict, kind: str) -> list:
    """Each (i, j, k) where ``messages[i].content[j]`` is a tool_result whose ``content[k]`` is of ``kind``."""
    return [(i, j, k) for i, m in enumerate(body["messages"]) if isinstance(m["content"], list)
            for j, b in enumerate(m["content"]) if b["type"] == "tool_result" and isinstance(b.get("content"), list)
            for k, part in enumerate(b["content"]) if part["type"] == kind]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """What `--model scripted` serves."""
    return scripted.cached_pair(tmp_path_factory.mktemp("shapes"), agents.scripted_script())


@pytest.fixture(scope="module")
def server(pair):
    # A small default cap: a schema-bound answer of the scripted pair that never closed would stop there.
    process, url = start_server(*pair, "--model-name", "scripted", "--max-tokens-default", "512")
    yield url, process
    stop_server(process)


@pytest.fixture(scope="module")
def answering_server(pair):
    """The same, answering without reasoning (``--chat-template-args``): the scripted model never
    closes a reasoning block, so under a grammar that starts after one it would reason to the cap."""
    process, url = start_server(*pair, "--model-name", "scripted", "--max-tokens-default", "512",
                                "--chat-template-args", '{"enable_thinking": false}')
    yield url, process
    stop_server(process)


def metric(url: str, name: str, **labels) -> float:
    """A sample's value from /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and want in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def tool_list(prompt: str) -> list:
    """The tools a rendered prompt lists: the JSON objects after its first ``<tools>``, up to ``</tools>``."""
    decoder, at, out = json.JSONDecoder(), prompt.index("<tools>") + len("<tools>"), []
    while True:
        at = len(prompt) - len(prompt[at:].lstrip())
        if prompt.startswith("</tools>", at):
            return out
        tool, at = decoder.raw_decode(prompt, at)
        out.append(tool)


def sse(text: str) -> list:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# Claude Code's deferred tools -----------------------------------------------------------------


def test_the_toolsearch_recording_has_the_shapes_under_test():
    """What the rest relies on, read from the recording: the first turn defers the placeholder; the
    next one adds WebFetch, deferred, and its tool_result holds a tool_reference to it."""
    (_, headers, first), (_, _, after) = recorded("claude_toolsearch")
    assert "advanced-tool-use" in headers["anthropic-beta"]
    assert [t["name"] for t in first["tools"] if t.get("defer_loading")] == ["DeferredToolPlaceholder"]
    assert [t["name"] for t in after["tools"] if t.get("defer_loading")] == ["WebFetch", "DeferredToolPlaceholder"]
    (i, j, k), = where_blocks(after, "tool_reference")
    assert after["messages"][i]["content"][j]["content"][k]["tool_name"] == "WebFetch"


@pytest.fixture(scope="module")
def render(pair):
    """A Messages body's prompt text through the pair's chat template, as the server renders it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pair[0]))

    def render(body, generation=True):
        req = MessagesRequest(**body)
        messages = chat_messages(req)
        return tokenizer.apply_chat_template(late_system_as_user(messages) or messages, tools=_tools(req),
                                             add_generation_prompt=generation, tokenize=False)
    return render


def schemas_in_tool_response(prompt: str) -> list:
    """The tools whose schemas the prompt's one tool response holds, as one ``<functions>`` block
    of ``<function>`` lines (None when it is not that)."""
    (response,) = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
    match = re.fullmatch(r"<functions>\n((?:<function>.*</function>\n)+)</functions>", response, re.S)
    return match and [json.loads(line[len("<function>"):-len("</function>")]) for line in match.group(1).splitlines()]


def test_deferred_tools_stay_out_of_the_tool_list_and_a_reference_renders_the_schema_in_place(render):
    """Rendered with the pair's template: no deferred tool in the prompt's tool list (the
    placeholder neither); WebFetch's schema inside the tool response, as one ``<function>`` line in
    a ``<functions>`` block, keys in the order ToolSearch's description gives; the first turn's
    rendered history is a prefix of the next turn's prompt (loading a tool rewrites nothing)."""
    (_, _, first), (_, _, after) = recorded("claude_toolsearch")
    before, prompt = render(first, False), render(after)
    assert prompt.startswith(before)
    listed = [tool["function"]["name"] for tool in tool_list(prompt)]
    assert listed == [t["name"] for t in after["tools"] if not t.get("defer_loading")]
    (schema,) = schemas_in_tool_response(prompt)
    (web_fetch,) = [t for t in after["tools"] if t["name"] == "WebFetch"]
    assert schema == {"description": web_fetch["description"], "name": "WebFetch", "parameters": web_fetch["input_schema"]}
    (search,) = [t for t in after["tools"] if t["name"] == "ToolSearch"]
    promised = re.search(r"<function>\{(.*?)\}</function>", search["description"]).group(1)
    assert list(schema) == re.findall(r'"(\w+)":', promised)
    assert prompt.count('"name": "WebFetch"') == 1  # there, and nowhere else


def test_references_in_a_row_load_their_tools_in_one_block(render):
    """ToolSearch's ``select:A,B`` answers with a reference per tool: one ``<functions>`` block, in
    their order, text around it kept in place."""
    (_, _, after) = recorded("claude_toolsearch")[1]
    body = copy.deepcopy(after)
    (i, j, k), = where_blocks(body, "tool_reference")
    body["messages"][i]["content"][j]["content"][k + 1:k + 1] = [{"type": "tool_reference", "tool_name": "Write"}]
    by_name = {t["name"]: t for t in body["tools"]}
    assert [s["name"] for s in schemas_in_tool_response(render(body))] == ["WebFetch", "Write"]
    assert schemas_in_tool_response(render(body))[1]["parameters"] == by_name["Write"]["input_schema"]
    body["messages"][i]["content"][j]["content"].insert(k, {"type": "text", "text": "Loaded:"})
    assert re.search(r"<tool_response>\nLoaded:<functions>\n<function>.*</function>\n<function>.*</function>\n</functions>\n"
                     r"</tool_response>", render(body), re.S)


def test_a_loaded_tool_is_callable_from_then_on():
    """The tools an answer's calls are parsed against: the listed ones, and from the turn that
    loaded it, WebFetch; never the placeholder."""
    (_, _, first), (_, _, after) = recorded("claude_toolsearch")
    names = lambda body, loaded: [t["function"]["name"] for t in _tools(MessagesRequest(**body), loaded=loaded)]
    eager = [t["name"] for t in first["tools"] if not t.get("defer_loading")]
    assert names(first, True) == names(first, False) == eager
    assert names(after, False) == eager
    assert sorted(names(after, True)) == sorted(eager + ["WebFetch"])


def test_the_toolsearch_turns_through_the_server_reuse_the_whole_first_turn(server):
    """Both recorded turns, replayed as sent (streamed): the turn after ToolSearch reads all but the
    last few tokens of the first turn from the prefix cache, and is answered."""
    url, _ = server
    (path, headers, first), (_, _, after) = recorded("claude_toolsearch")
    usage = []
    for body in (first, after):
        r = httpx.post(url + path, json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        events = sse(r.text)
        usage.append(events[-2]["usage"])
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == \
        scripted.Script().after_tool
    prompt = usage[0]["input_tokens"] + usage[0]["cache_read_input_tokens"]
    assert usage[1]["cache_read_input_tokens"] >= prompt - 64, usage


def test_a_reference_to_no_tool_of_the_request_is_refused_naming_it(server):
    url, _ = server
    (path, headers, _), (_, _, after) = recorded("claude_toolsearch")
    body = copy.deepcopy(after)
    (i, j, k), = where_blocks(body, "tool_reference")
    body["messages"][i]["content"][j]["content"][k]["tool_name"] = "NoSuchTool"
    r = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=headers)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith(f"messages[{i}].content[{j}].content[{k}]: ") and "'NoSuchTool'" in message


def test_blocks_dropped_inside_a_tool_result_are_logged_and_counted(server):
    """A block the prompt leaves out (here a search_result beside the recorded tool_reference) is
    named in the server's log and counted in /metrics, once per block."""
    url, process = server
    (path, headers, _), (_, _, after) = recorded("claude_toolsearch")
    body = copy.deepcopy(after)
    (i, j, _), = where_blocks(body, "tool_reference")
    extra = {"type": "search_result", "source": "https://example.com", "title": "t", "content": [{"type": "text", "text": "x"}]}
    body["messages"][i]["content"][j]["content"] += [extra, extra]
    labels = dict(route="/v1/messages", type="search_result")
    before = metric(url, "dflash_dropped_content_blocks_total", **labels)
    assert httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=headers).status_code == 200
    assert metric(url, "dflash_dropped_content_blocks_total", **labels) == before + 2
    assert "ignored content blocks inside tool_result: search_result" in server_log(process)


# Pictures -------------------------------------------------------------------------------------


def test_claude_codes_picture_in_a_tool_result_is_refused_naming_the_block(server):
    url, _ = server
    (path, headers, _), (_, _, after) = recorded("claude_image")
    (i, j, k), = where_blocks(after, "image")
    for route in (path, "/v1/messages/count_tokens"):
        r = httpx.post(url + route, json=after, headers=headers, timeout=120)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"messages[{i}].content[{j}].content[{k}]: image content")


def test_codexs_picture_is_refused_naming_the_part(server):
    url, _ = server
    ((path, headers, body),) = recorded("codex_image")
    (where,) = [f"input[{i}].content[{j}]" for i, item in enumerate(body["input"]) if item.get("type") == "message"
                for j, part in enumerate(item["content"]) if part["type"] == "input_image"]
    r = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == where, r.text


# Structured outputs: the recorded schemas, answered as JSON that follows them ---------------------


def follows(value, schema: dict) -> bool:
    """``value`` against the flat object schemas these clients send (properties of JSON types, the
    required ones present, none other where ``additionalProperties`` is false): written from JSON
    Schema's definitions, not the server's grammar engine."""
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    if not isinstance(value, dict):
        return False
    properties = schema.get("properties", {})
    if any(name not in value for name in schema.get("required", [])):
        return False
    if schema.get("additionalProperties") is False and set(value) - set(properties):
        return False
    for name, item in value.items():
        kind = properties.get(name, {}).get("type")
        if kind is not None and (not isinstance(item, types[kind]) or (kind in ("integer", "number") and isinstance(item, bool))):
            return False
    return True


@pytest.mark.parametrize("name", ["openai_parse", "llm_schema"])
def test_json_schema_requests_are_answered_with_json_that_follows_the_schema(answering_server, pair, name):
    """The openai SDK's ``parse()`` (whole) and ``llm --schema`` (streamed) send ``response_format``
    json_schema and no max_tokens: the answer, within the server's default cap, is JSON that follows
    the schema (when recorded, before structured outputs, both got a 400)."""
    url, _ = answering_server
    ((path, headers, body),) = recorded(name)
    schema = body["response_format"]["json_schema"]["schema"]
    assert body["response_format"]["type"] == "json_schema" and "max_tokens" not in body
    r = httpx.post(url + path, json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        chunks = [c for c in sse(r.text) if c.get("choices")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    else:
        content, finish = r.json()["choices"][0]["message"]["content"], [r.json()["choices"][0]["finish_reason"]]
    if finish == ["length"]:
        # The scripted model never closes a free string: the answer reached the cap inside one. It
        # is a prefix the schema's grammar accepts (llguidance's matcher, compiled here from the
        # recorded schema; free text fails it from its first character).
        assert content.startswith("{") and schema_prefix(pair, schema, content), content[:200]
        return
    assert finish == ["stop"], (finish, content[-200:])
    assert follows(json.loads(content), schema), content


def schema_prefix(pair, schema, text: str) -> bool:
    """Whether ``text`` starts a JSON document ``schema`` accepts, token by token."""
    import llguidance
    import llguidance.hf
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(pair[0])
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer._tokenizer),
                                   llguidance.LLMatcher.grammar_from_json_schema(schema))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and not matcher.is_error()
