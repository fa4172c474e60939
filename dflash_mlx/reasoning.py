"""Reasoning apart from the answer, as Qwen3.5 writes them: the generation prompt opens
``<think>`` (the template's default), the model writes its reasoning, ``</think>``, then the
answer. Editors show ``content``; the reasoning goes to ``reasoning_content``.

Handled: a prompt that already opened the block (the model starts inside it), one that did not
(the model may open it itself, or answer at once), a model that never closes it (max tokens
inside the reasoning: everything is reasoning), and templates without thinking (no split).
"""

from __future__ import annotations

from typing import Optional, Tuple

START, END = "<think>", "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning block."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def thinking_switch(chat_template_kwargs: Optional[dict], reasoning_effort: Optional[str],
                    reasoning: Optional[dict]) -> Optional[bool]:
    """``enable_thinking`` for the template from a request's ways of asking (None: the template's
    default). ``reasoning_effort`` / ``reasoning.effort`` ``"none"`` turn it off, any other effort on."""
    kwargs = chat_template_kwargs or {}
    if "enable_thinking" in kwargs:
        return bool(kwargs["enable_thinking"])
    effort = reasoning_effort if reasoning_effort is not None else (reasoning or {}).get("effort")
    if effort is None:
        return None
    return effort != "none"


class ReasoningSplitter:
    """Feeds on the answer's text as it streams; returns what is reasoning and what is content.
    Text that could still be the start of a tag is held back until it is decided."""

    def __init__(self, opened: bool, enabled: bool = True):
        self.state = "answer" if not enabled else "reasoning" if opened else "before"
        self.pending = ""
        self.strip_after_end = False

    def push(self, text: str) -> Tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        while self.pending:
            if self.state == "answer":
                if self.strip_after_end:  # the template puts a blank line after </think>
                    stripped = self.pending.lstrip("\n")
                    if not stripped:
                        self.pending = ""
                        break
                    self.pending, self.strip_after_end = stripped, False
                content, self.pending = content + self.pending, ""
            elif self.state == "before":
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending, self.state = head[len(START):].lstrip("\n"), "reasoning"
                elif START.startswith(head):
                    break  # whitespace or a partial "<think>": wait for more
                else:
                    self.state = "answer"
            else:  # reasoning
                end = self.pending.find(END)
                if end >= 0:
                    reasoning += self.pending[:end]
                    self.pending, self.state, self.strip_after_end = self.pending[end + len(END):], "answer", True
                    continue
                hold = partial_suffix(self.pending, END)
                reasoning += self.pending[: len(self.pending) - hold]
                self.pending = self.pending[len(self.pending) - hold:]
                break
        return reasoning, content

    def whole(self, text: str) -> Tuple[str, str]:
        """A whole answer at once: (reasoning, content)."""
        thought, answer = self.push(text)
        more_thought, more_answer = self.flush()
        return thought + more_thought, answer + more_answer

    def flush(self) -> Tuple[str, str]:
        """The end of the answer: whatever was held back goes where it was heading."""
        held, self.pending = self.pending, ""
        if self.state == "reasoning":
            return held, ""
        return "", held.lstrip("\n") if self.strip_after_end else held


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back until it is decided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
