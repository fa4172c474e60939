"""Thinking models through the server: reasoning apart from the answer, streamed and not, the
switches, and earlier reasoning sent back; on a target that answers a fixed Qwen3.5-style text."""

from __future__ import annotations

import pytest

from dflash_mlx import generate
from dflash_mlx.api import load
from tests import subprocess_env
from tests.scripted import openai_client, write_scripted_pair

REASONING, ANSWER = "The quick brown fox", " jumps over a block"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_scripted_pair(tmp_path_factory.mktemp("thinking"), f"{REASONING}</think>{ANSWER}")


@pytest.fixture(scope="module")
def client(pair):
    with openai_client(pair) as client:
        yield client


@pytest.fixture(scope="module")
def local(pair):
    return load(str(pair[0]), draft=str(pair[1]))


MESSAGES = [{"role": "user", "content": "hello"}]


def ask(client, **kwargs):
    kwargs = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, **kwargs}
    return client.chat.completions.create(model="target", **kwargs)


def test_the_reasoning_is_apart_from_the_answer(client, local):
    reply = ask(client)
    message = reply.choices[0].message
    assert message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    assert message.reasoning_content == REASONING and message.reasoning == REASONING  # and the alias
    model, tokenizer = local  # the same greedy text as the library, split at </think>
    assert generate(model, tokenizer, MESSAGES, max_tokens=40) == f"{REASONING}</think>{ANSWER}"


def test_streamed_reasoning_comes_as_reasoning_deltas(client):
    chunks = list(ask(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_content:])


def test_max_tokens_inside_the_reasoning_leaves_it_all_reasoning(client):
    reply = ask(client, max_tokens=2)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and not message.content
    assert REASONING.startswith(message.reasoning_content) and message.reasoning_content


@pytest.mark.parametrize("switch", [dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
                                    dict(reasoning_effort="none"), dict(extra_body={"reasoning": {"effort": "none"}})])
def test_thinking_switched_off_renders_the_closed_block(client, local, switch):
    model, tokenizer = local
    reply = ask(client, **switch)
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False)
    assert reply.usage.prompt_tokens == len(expected_prompt)
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) is None  # nothing opened a block: all of it is answer
    assert message.content == generate(model, tokenizer, MESSAGES, max_tokens=40, enable_thinking=False)


def test_earlier_reasoning_goes_back_into_the_template(client, local):
    _, tokenizer = local
    history = MESSAGES + [{"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
                          {"role": "user", "content": "again"}]
    reply = ask(client, messages=history)
    rendered = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert f"<think>\n{REASONING}\n</think>\n\n{ANSWER}" in rendered
    assert reply.usage.prompt_tokens == len(tokenizer.apply_chat_template(history, add_generation_prompt=True))
    alias = [dict(m) for m in history]
    alias[1] = {"role": "assistant", "content": ANSWER, "reasoning": REASONING}  # the alias some clients send
    assert ask(client, messages=alias).usage.prompt_tokens == reply.usage.prompt_tokens


def test_the_served_model_id_is_what_the_user_named(tmp_path):
    from dflash_mlx.cli import served_name
    from dflash_mlx.convert import DEFAULT_TARGET

    assert served_name(None) == DEFAULT_TARGET == "Jackrong/Qwopus3.5-9B-Coder"
    assert served_name("demo") == "demo"
    assert served_name("Qwen/Qwen3.5-9B") == "Qwen/Qwen3.5-9B"
    (tmp_path / "my-model").mkdir()
    assert served_name(str(tmp_path / "my-model")) == "my-model"


def test_chat_shows_the_reasoning_dimmed_and_keeps_it_apart(local):
    import io

    from dflash_mlx.chat import DIM, RESET, ChatSession

    model, tokenizer = local
    session = ChatSession(model, tokenizer, think=True, generation={"max_tokens": 40})
    out = io.StringIO()
    session.ask("hello", out=out)
    assert out.getvalue().replace(RESET + DIM, "") == f"{DIM}{REASONING}{RESET}{ANSWER}\n"  # dim, token by token
    assert session.history[-1] == {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}


def test_slash_think_toggles_thinking(pair):
    import sys

    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "dflash_mlx.cli", "chat", "-m", str(pair[0]), "-d", str(pair[1]),
                                           "--max-tokens", "40", "--think"],
                          env=subprocess_env(HF_HUB_OFFLINE="1"), encoding="utf-8", timeout=120)
    child.expect(">>> ")
    child.sendline("/think")
    child.expect(r"\(thinking off\)")
    child.expect(">>> ")
    child.sendline("/think")
    child.expect(r"\(thinking on\)")
    child.expect(">>> ")
    child.sendline("hello")
    child.expect("jumps over a block")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
