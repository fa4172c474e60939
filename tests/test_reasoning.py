"""The reasoning split on Qwen3.5's format (the tests render their own copy of it)."""

from __future__ import annotations

import pytest

from dflash_mlx.reasoning import ReasoningSplitter, opens_reasoning, thinking_switch

# The generation prompts Qwen3.5's template renders, thinking on (its default) and off.
THINKING_PROMPT = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n"
NO_THINKING_PROMPT = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
ANSWER = "The user greets me.\n</think>\n\nHello! How can I help?"


def split(splitter, text, pieces):
    """Feed ``text`` in pieces of the given sizes; returns the joined (reasoning, content)."""
    reasoning = content = ""
    start = 0
    for size in pieces:
        r, c = splitter.push(text[start:start + size])
        reasoning, content, start = reasoning + r, content + c, start + size
    r, c = splitter.push(text[start:])
    reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


def test_the_prompt_says_whether_the_model_starts_inside_its_reasoning():
    assert opens_reasoning(THINKING_PROMPT)
    assert not opens_reasoning(NO_THINKING_PROMPT)
    assert not opens_reasoning("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("pieces", [[], [1] * len(ANSWER), [3, 5, 7, 11, 13, 17], [21, 2, 1]])
def test_reasoning_and_answer_split_wherever_the_tags_fall_in_the_stream(pieces):
    reasoning, content = split(ReasoningSplitter(opened=True), ANSWER, pieces)
    assert reasoning == "The user greets me.\n" and content == "Hello! How can I help?"


def test_a_model_that_opens_its_reasoning_itself():
    reasoning, content = split(ReasoningSplitter(opened=False), "<think>\nPlan.\n</think>\n\nDone.", [2, 3, 4])
    assert (reasoning, content) == ("Plan.\n", "Done.")


def test_an_answer_without_reasoning_stays_content():
    assert split(ReasoningSplitter(opened=False), "Hello there", [1, 1, 1]) == ("", "Hello there")
    assert split(ReasoningSplitter(opened=False), " <thin", []) == ("", " <thin")  # never became the tag


def test_a_reasoning_block_never_closed_is_all_reasoning():
    """max_tokens reached inside the reasoning: nothing is answer, nothing is lost."""
    reasoning, content = split(ReasoningSplitter(opened=True), "Still thinking </thi", [4, 4])
    assert (reasoning, content) == ("Still thinking </thi", "")


def test_templates_without_thinking_are_not_split():
    assert split(ReasoningSplitter(opened=True, enabled=False), ANSWER, [5]) == ("", ANSWER)


@pytest.mark.parametrize("request_fields, expected", [
    (dict(), None),
    (dict(chat_template_kwargs={"enable_thinking": False}), False),
    (dict(chat_template_kwargs={"enable_thinking": True}, reasoning_effort="none"), True),
    (dict(reasoning_effort="none"), False),
    (dict(reasoning_effort="high"), True),
    (dict(reasoning={"effort": "none"}), False),
    (dict(reasoning={"effort": "low"}), True),
])
def test_the_ways_clients_switch_thinking(request_fields, expected):
    fields = {"chat_template_kwargs": None, "reasoning_effort": None, "reasoning": None, **request_fields}
    assert thinking_switch(**fields) is expected
