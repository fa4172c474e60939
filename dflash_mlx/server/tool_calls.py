"""Tool calls in an answer's text, found as it streams: Qwen3.5's ``<tool_call>`` blocks
(``<function=NAME>`` with ``<parameter=P>`` values), parsed by mlx-lm's parser for the model's
template, which types each value by the tool's JSON schema. Text outside the blocks passes through.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from ..reasoning import partial_suffix


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
        usable = tokenizer is not None and tools and getattr(tokenizer, "has_tool_calling", False)
        self.start = tokenizer.tool_call_start if usable else None
        self.end = tokenizer.tool_call_end if usable else None
        self.tokenizer, self.tools = tokenizer, tools
        self.pending, self.inside = "", False
        self.calls = 0

    def push(self, text: str) -> List[Union[str, ToolCall]]:
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
        """The answer ended: an unclosed block is text."""
        held, self.pending, self.inside = self.pending, "", False
        return [held] if held else []

    def _parse(self, block: str) -> List[Union[str, ToolCall]]:
        """The block's calls; a block the parser refuses, or whose calls lack a name or have
        arguments that are not a JSON object, is not a call: it stays text, the stream goes on."""
        body = block[len(self.start): -len(self.end)].strip()
        calls = []
        try:
            parsed = self.tokenizer.tool_parser(body, self.tools)
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


def answer_parts(text: str, splitter, scanner: ToolCallScanner):
    """A whole answer: its reasoning, its text outside tool-call blocks, and its calls."""
    thought, answer = splitter.whole(text)
    words, calls = split_text_and_calls(scanner, answer)
    return thought, words, calls


def split_text_and_calls(scanner: ToolCallScanner, text: str):
    """The whole answer at once: its text (outside the blocks) and its calls."""
    pieces = scanner.push(text) + scanner.flush()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]
