"""Tool calls in an answer's text, found as it streams, in the format the model's chat template
teaches (``reasoning.chat_format``): Qwen's ``<tool_call>`` blocks (Qwen3.5 and Qwen3-Coder's
``<function=NAME>`` with ``<parameter=P>`` values, Qwen3's JSON) and Gemma 4's ``<|tool_call>call:NAME{..}
<tool_call|>``, parsed by mlx-lm's parser for the template, which types values by the tool's JSON
schema; gpt-oss's harmony calls (``to=functions.NAME``, JSON arguments; ``reasoning.HarmonySplitter``
hands them over); Llama 3.1's answer that is a JSON call (``{"name": .., "parameters": ..}``,
optionally after ``<|python_tag|>``). Text outside the calls passes through.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from ..reasoning import H_CALL, H_CHANNEL, H_ENDS, H_MESSAGE, HARMONY, LLAMA3, chat_format, partial_suffix

PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: Dict[str, Any]
    id: str
    index: int  # its place among the answer's calls

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments)

    def fragments(self, size: int = 16) -> List[str]:
        """The JSON arguments in pieces, as streamed calls send them (clients concatenate)."""
        text = self.arguments_json
        return [text[i:i + size] for i in range(0, len(text), size)]


class ToolCallScanner:
    """``push(text)`` returns, in order, plain text and each ``ToolCall`` whose block has closed.
    A block that does not parse comes back as the text it was (nothing is lost)."""

    def __init__(self, tokenizer, tools: Optional[List[Dict[str, Any]]]):
        kind = chat_format(getattr(tokenizer, "chat_template", None)) if tokenizer is not None and tools else None
        self.start = self.end = None
        self.leading = kind == LLAMA3  # the whole answer is the call, or none of it is
        self.parser = None
        if kind == HARMONY:
            self.start, self.end, self.parser = H_CALL, H_ENDS[1], harmony_call
        elif kind is not None and not self.leading and getattr(tokenizer, "has_tool_calling", False):
            self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
            self.parser = tokenizer.tool_parser
        self.tokenizer, self.tools = tokenizer, tools
        self.pending, self.inside = "", False
        self.decided = False  # Llama 3.1: the answer's start has shown whether it is a call
        self.calls = 0

    def push(self, text: str) -> List[Union[str, ToolCall]]:
        if self.leading:
            return self._push_leading(text)
        if self.start is None:
            return [text] if text else []
        self.pending += text
        out: List[Union[str, ToolCall]] = []
        while self.pending:
            if not self.inside:
                at = self.pending.find(self.start)
                if at < 0:
                    hold = partial_suffix(self.pending, self.start)
                    out.append(self.pending[: len(self.pending) - hold])
                    self.pending = self.pending[len(self.pending) - hold:]
                    break
                out.append(self.pending[:at])
                self.pending, self.inside = self.pending[at:], True
            else:
                end = self.pending.find(self.end)
                if end < 0:
                    break
                block, self.pending = self.pending[: end + len(self.end)], self.pending[end + len(self.end):]
                self.inside = False
                out.extend(self._parse(block))
        return [piece for piece in out if not isinstance(piece, str) or piece]

    def flush(self) -> List[Union[str, ToolCall]]:
        """The answer ended: an unclosed block is text (Llama 3.1: a held answer is a call if it parses)."""
        held, self.pending, self.inside = self.pending, "", False
        if self.leading and held and not self.decided:
            return self._leading_calls(held)
        return [held] if held else []

    def _push_leading(self, text: str) -> List[Union[str, ToolCall]]:
        """Llama 3.1 writes a call as its whole answer: an answer that starts with ``{`` or
        ``<|python_tag|>`` is held to its end (``flush``); any other passes through at once."""
        if self.decided:
            return [text] if text else []
        self.pending += text
        head = self.pending.lstrip()
        if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
            return []
        held, self.pending, self.decided = self.pending, "", True
        return [held]

    def _leading_calls(self, text: str) -> List[Union[str, ToolCall]]:
        """A held Llama 3.1 answer: its JSON calls (``;``-separated, ``parameters`` or
        ``arguments``), or, when any part is not one, the text it was."""
        body = text.strip()
        body = body[len(PYTHON_TAG):].strip() if body.startswith(PYTHON_TAG) else body
        decoder, at, calls = json.JSONDecoder(), 0, []
        try:
            while at < len(body):
                call, at = decoder.raw_decode(body, at)
                name, arguments = call.get("name"), call.get("parameters", call.get("arguments", {}))
                if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                    raise ValueError(f"not a call: {call!r}")
                calls.append(ToolCall(name, arguments, "call_" + uuid.uuid4().hex[:24], self.calls + len(calls)))
                while at < len(body) and body[at] in " \n\t;":
                    at += 1
        except (ValueError, AttributeError):
            return [text]
        if not calls:
            return [text]
        self.calls += len(calls)
        return calls

    def _parse(self, block: str) -> List[Union[str, ToolCall]]:
        """The block's calls; a block the parser refuses, or whose calls lack a name or have
        arguments that are not a JSON object, is not a call: it stays text, the stream goes on."""
        body = block[len(self.start): -len(self.end)].strip()
        calls = []
        try:
            parsed = self.parser(body, self.tools)
            for call in parsed if isinstance(parsed, list) else [parsed]:
                name, arguments = call["name"], call.get("arguments") or {}
                if isinstance(arguments, str):
                    arguments = json.loads(arguments)
                if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                    raise ValueError(f"not a call: {call!r}")
                calls.append(ToolCall(name, arguments, "call_" + uuid.uuid4().hex[:24], self.calls + len(calls)))
            if not calls:
                raise ValueError("no call in the block")
        except Exception:
            return [block]  # not a well-formed call: leave it as text
        self.calls += len(calls)
        return calls


def harmony_call(body: str, tools=None) -> Dict[str, Any]:
    """A harmony call as ``HarmonySplitter`` hands it over (``functions.NAME<|channel|>commentary
    json<|message|>ARGS``): its name without the ``functions.`` namespace, its JSON arguments."""
    header, _, arguments = body.partition(H_MESSAGE)
    name = header.split(H_CHANNEL, 1)[0].strip()
    return {"name": name[len("functions."):] if name.startswith("functions.") else name,
            "arguments": json.loads(arguments) if arguments.strip() else {}}


def answer_parts(text: str, splitter, scanner: ToolCallScanner):
    """A whole answer: its reasoning, its text outside tool-call blocks, and its calls."""
    thought, answer = splitter.whole(text)
    words, calls = split_text_and_calls(scanner, answer)
    return thought, words, calls


def split_text_and_calls(scanner: ToolCallScanner, text: str):
    """The whole answer at once: its text (outside the blocks) and its calls."""
    pieces = scanner.push(text) + scanner.flush()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]
