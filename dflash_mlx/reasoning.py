"""Reasoning apart from the answer, as Qwen3.5 writes them: the generation prompt opens
``<think>`` (the template's default), the model writes its reasoning, ``</think>``, then the
answer. Editors show ``content``; the reasoning goes to ``reasoning_content``. Other families
(``chat_format``, read from the chat template): Qwen3's and Gemma 4's tags (``splitters``), gpt-oss's
harmony channels (``HarmonySplitter``), none for Llama 3.1.

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


def effort_kwargs(reasoning_effort: Optional[str], reasoning: Optional[dict]) -> dict:
    """The request's reasoning effort for templates that take one (gpt-oss's ``reasoning_effort``:
    low, medium or high; other templates ignore it): ``reasoning_effort`` or ``reasoning.effort``."""
    effort = reasoning_effort if reasoning_effort is not None else (reasoning or {}).get("effort")
    return {"reasoning_effort": effort} if effort in ("low", "medium", "high") else {}


class WholeAnswer:
    """A splitter's ``whole``: an answer given at once, pushed and flushed."""

    def whole(self, text: str) -> Tuple[str, str]:
        """A whole answer at once: (reasoning, content)."""
        thought, answer = self.push(text)
        more_thought, more_answer = self.flush()
        return thought + more_thought, answer + more_answer


class ReasoningSplitter(WholeAnswer):
    """Feeds on the answer's text as it streams; returns what is reasoning and what is content.
    Text that could still be the start of a tag is held back until it is decided. ``start`` and
    ``end`` are the family's tags (Qwen's ``<think>``/``</think>`` unless told: see ``splitters``)."""

    def __init__(self, opened: bool, enabled: bool = True, start: str = START, end: str = END):
        self.state = "answer" if not enabled else "reasoning" if opened else "before"
        self.pending = ""
        self.strip_after_end = False
        self.strip_after_start = False  # the newline after the start tag may come in a later piece
        self.start, self.end = start, end

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
                if head.startswith(self.start):
                    self.pending, self.state = head[len(self.start):], "reasoning"
                    self.strip_after_start = True
                elif self.start.startswith(head):
                    break  # whitespace or a partial "<think>": wait for more
                else:
                    self.state = "answer"
            else:  # reasoning
                if self.strip_after_start:
                    stripped = self.pending.lstrip("\n")
                    if not stripped:
                        self.pending = ""
                        break
                    self.pending, self.strip_after_start = stripped, False
                end = self.pending.find(self.end)
                if end >= 0:
                    reasoning += self.pending[:end]
                    self.pending, self.state, self.strip_after_end = self.pending[end + len(self.end):], "answer", True
                    continue
                hold = partial_suffix(self.pending, self.end)
                reasoning += self.pending[: len(self.pending) - hold]
                self.pending = self.pending[len(self.pending) - hold:]
                break
        return reasoning, content

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


# Each family's answer format, read from the loaded chat template (never from the model's name).
QWEN, GEMMA4, HARMONY, LLAMA3 = "qwen", "gemma4", "harmony", "llama3"
GEMMA4_START, GEMMA4_END = "<|channel>thought", "<channel|>"
# Harmony (gpt-oss): each message is a header, <|message|>, its text, and an end (<|end|>, or
# <|call|> / <|return|>, the stop tokens, which the answer's text does not carry).
H_START, H_CHANNEL, H_MESSAGE, H_ENDS = "<|start|>", "<|channel|>", "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
H_CALL = H_START + "assistant to="  # a call as the template writes it back (see HarmonySplitter)


def chat_format(chat_template) -> str:
    """The answer format a chat template teaches: ``harmony`` (gpt-oss's channels), ``gemma4``
    (``<|channel>thought`` … ``<channel|>``, ``<|tool_call>`` blocks), ``llama3`` (Llama 3.1's bare
    JSON calls), else ``qwen`` (``<think>``, ``<tool_call>``: Qwen3, Qwen3-Coder, Qwen3.5)."""
    template = chat_template if isinstance(chat_template, str) else ""
    if H_CHANNEL in template and H_MESSAGE in template:
        return HARMONY
    if "<|channel>" in template and "<channel|>" in template:
        return GEMMA4
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return LLAMA3
    return QWEN


def template_messages(tokenizer, messages):
    """Messages as the family's template reads them: gpt-oss's takes an answer's reasoning as
    ``thinking`` (the routes carry it as ``reasoning_content``), and refuses it beside the content of
    an answer that calls a tool (it is left out there); Gemma 4's reads tool results only as
    ``tool_responses`` (see ``gemma4_tool_turns``); other templates take them as they are."""
    kind = chat_format(getattr(tokenizer, "chat_template", None))
    if kind == GEMMA4:
        return gemma4_tool_turns(messages)
    if kind != HARMONY:
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("reasoning_content") and "thinking" not in m:
            thought, m = m["reasoning_content"], {k: v for k, v in m.items() if k != "reasoning_content"}
            if not (m.get("tool_calls") and m.get("content")):
                m["thinking"] = thought
        out.append(m)
    return out


def gemma4_tool_turns(messages):
    """Tool results as Gemma 4's template documents them: it writes a ``tool`` message's ``content``
    as bare text, and ``tool_responses`` (``[{"name": .., "response": ..}]``) as
    ``<|tool_response>response:NAME{value:..}<tool_response|>`` in a ``<|turn>tool`` turn. The
    routes send OpenAI-style ``{"role": "tool", "tool_call_id", "content"}``: consecutive ones
    become one turn, each named after the call it answers (``unknown`` where no call has its id,
    as the template writes a nameless one); the response is the text the client sent."""
    names, out, turn = {}, [], None
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "tool" or "tool_responses" in m:
            for call in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
                if isinstance(call, dict) and call.get("id") is not None:
                    names[call["id"]] = (call.get("function") or call).get("name")
            out.append(m)
            continue
        name = m.get("name") or names.get(m.get("tool_call_id")) or "unknown"
        response = {"name": name, "response": m.get("content") if m.get("content") is not None else ""}
        if out and out[-1] is turn:
            turn["tool_responses"].append(response)
        else:
            turn = {"role": "tool", "tool_responses": [response]}
            out.append(turn)
    return out


def splitters(tokenizer, prompt_ids):
    """Fresh reasoning splitters for the answers to a prompt, in the tokenizer's family format:
    on when the template thinks, starting inside the reasoning when the prompt opened it."""
    template = getattr(tokenizer, "chat_template", None) or ""
    kind = chat_format(template)
    if kind == HARMONY:
        return HarmonySplitter
    if kind == LLAMA3:
        return lambda: ReasoningSplitter(False, enabled=False)
    start, end = (GEMMA4_START, GEMMA4_END) if kind == GEMMA4 else (START, END)
    thinks = start in template
    tail = tokenizer.decode(list(prompt_ids)[-16:]) if thinks else ""
    opened = thinks and tail.rfind(start) > tail.rfind(end)
    return lambda: ReasoningSplitter(opened, enabled=thinks, start=start, end=end)


class HarmonySplitter(WholeAnswer):
    """gpt-oss's harmony messages apart: ``analysis`` is reasoning, ``final`` (and ``commentary``
    meant for the user) is content. A message to a tool (``to=functions.NAME`` in its header) goes to
    the content side written as its template writes calls back
    (``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>``), where
    the tool-call scanner takes it; offered no tools, a client reads the raw call. Headers are held
    until their ``<|message|>``, and text that could start an end tag until it is decided."""

    def __init__(self):
        self.pending, self.header, self.inside = "", None, False

    def push(self, text: str) -> Tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        while self.pending:
            if not self.inside:  # a header: [<|start|>role][ to=X]<|channel|>name[ to=X][ <|constrain|>json]
                at = self.pending.find(H_MESSAGE)
                if at < 0:
                    break
                self.header, self.pending, self.inside = self.pending[:at], self.pending[at + len(H_MESSAGE):], True
                recipient = self._recipient()
                if recipient:
                    content += f"{H_CALL}{recipient}{H_CHANNEL}commentary json{H_MESSAGE}"
                continue
            ends = [(self.pending.find(tag), tag) for tag in H_ENDS if tag in self.pending]
            if ends:
                at, tag = min(ends)
                body, self.pending, self.inside = self.pending[:at], self.pending[at + len(tag):], False
                r, c = self._body(body, closed=True)
                reasoning, content = reasoning + r, content + c
                continue
            hold = max(partial_suffix(self.pending, tag) for tag in H_ENDS)
            r, c = self._body(self.pending[: len(self.pending) - hold], closed=False)
            reasoning, content = reasoning + r, content + c
            self.pending = self.pending[len(self.pending) - hold:]
            break
        return reasoning, content

    def _recipient(self) -> str:
        for part in self.header.replace(H_CHANNEL, " ").replace("<|constrain|>", " ").split():
            if part.startswith("to=") and part != "to=assistant":
                return part[len("to="):]
        return ""

    def _channel(self) -> str:
        after = self.header.split(H_CHANNEL, 1)[1] if H_CHANNEL in self.header else ""
        return (after.replace("<|constrain|>", " ").split() or [""])[0]

    def _body(self, text: str, closed: bool) -> Tuple[str, str]:
        """A message's text (``closed``: up to its end tag): where it goes."""
        if self._recipient():
            return "", text + (H_ENDS[1] if closed else "")
        if self._channel() == "analysis":
            return text, ""
        return "", text

    def flush(self) -> Tuple[str, str]:
        """The answer ended (a call ends at its stop token ``<|call|>``, which the text lacks)."""
        held, self.pending = self.pending, ""
        if not self.inside:
            return "", held  # a header that never reached its message: the text it was
        self.inside = False
        return self._body(held, closed=True)
