"""The scripted pair's chat template drops the reasoning of answers before the last user query, as
Qwen's does, and the prefix cache lives with that rewrite: through the server, a new user turn
prefills again only its own new tokens and what the template rewrote (plus the grid's rounding), as
``usage`` counts them. The oracle for where the rewrite begins is the two prompts rendered apart
from the server (``apply_chat_template`` on the messages the client sends)."""

from __future__ import annotations

import copy
import json

import pytest

from dflash_mlx import agents, scripted
from dflash_mlx.api import load
from dflash_mlx.cache import GRID

TOOLS = [{"type": "function", "function": {"name": "Bash", "description": "Run a shell command. " * 20,
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from fastapi.testclient import TestClient

    from dflash_mlx.server import create_app

    target, draft = scripted.cached_pair(tmp_path_factory.mktemp("scripted"), agents.scripted_script())
    model, tokenizer = load(str(target), draft=str(draft))
    with TestClient(create_app(model, tokenizer, "scripted")) as client:
        yield client, tokenizer


def rendered(tokenizer, messages):
    """The prompt's tokens, rendered here (tool-call arguments as the mapping the server makes of them)."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)


def test_a_new_user_turn_prefills_only_its_tokens_and_what_the_template_rewrote(served):
    client, tokenizer = served

    def send(messages):
        body = {"model": "scripted", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 64}
        reply = client.post("/v1/chat/completions", json=body).json()
        return reply["choices"][0]["message"], reply["usage"]

    messages = [{"role": "system", "content": "You are a coding agent. " * 40},
                {"role": "user", "content": f"Please {scripted.ASK} now."}]
    first, usage1 = send(messages)
    reasoning = first["reasoning_content"]
    assert reasoning and first["tool_calls"] and usage1["prompt_tokens_details"]["cached_tokens"] == 0
    messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "a\nb"}]
    second, usage2 = send(messages)  # after a tool result: the reasoning stays (no new user query)
    assert reasoning in tokenizer.decode(rendered(tokenizer, messages))
    messages += [second, {"role": "user", "content": "Thanks. What next?"}]
    before, after = rendered(tokenizer, messages[:-2]), rendered(tokenizer, messages)
    assert reasoning not in tokenizer.decode(after)  # a new user query: the first answer loses its reasoning
    rewrite = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert rewrite < usage1["prompt_tokens"] + 1  # inside the first answer (right after its prompt)
    third, usage3 = send(messages)
    cached = usage3["prompt_tokens_details"]["cached_tokens"]
    assert usage3["prompt_tokens"] == len(after)
    # What it prefills again: from the rewrite on (its own tokens, the rewritten answers), and the
    # rewrite's offset into its 64-token grid step.
    assert cached == rewrite - rewrite % GRID, (cached, rewrite, len(before), len(after))


def test_a_new_session_resumes_at_the_end_of_the_head_it_shares(tmp_path):
    """An agent's second session (or the first after a restart) sends the same head (system prompt
    and tools) with another task: it resumes at the head's end (on the grid), as the server pins a
    checkpoint there, not at the nearest evenly spaced checkpoint before it. The head's end is
    found here apart from the server, as the tokens the two sessions' prompts share."""
    from fastapi.testclient import TestClient

    from dflash_mlx.server import create_app

    target, draft = scripted.cached_pair(tmp_path / "scripted", agents.scripted_script())
    model, tokenizer = load(str(target), draft=str(draft))
    system = {"role": "system", "content": "You are a coding agent. Follow the repository's rules. " * 60}
    sessions = [[system, {"role": "user", "content": task}] for task in
                ("Fix the failing test in the parser, then run the whole suite. " * 12, "Say hi.")]
    prompts = [rendered(tokenizer, s) for s in sessions]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    with TestClient(create_app(model, tokenizer, "scripted")) as client:
        cached = []
        for messages in sessions:
            body = {"model": "scripted", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 2}
            cached.append(client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"]
                          ["cached_tokens"])
    assert cached[0] == 0 and cached[1] == shared // GRID * GRID, (cached, shared, [len(p) for p in prompts])
