"""Anthropic's Messages API (what Claude Code speaks with ``ANTHROPIC_BASE_URL``): ``POST
/v1/messages``, streamed or not, and ``POST /v1/messages/count_tokens``.

Messages become the chat template's: text, ``tool_use`` blocks (the assistant's calls) and
``tool_result`` blocks (``tool`` turns), ``thinking`` blocks back as ``reasoning_content``. The
answer comes back as content blocks: ``thinking`` (the reasoning), ``text`` and ``tool_use``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .engine import ContextFull, Engine, Job, collect, current_engine, job_events, note
from .errors import APIError
from .tool_calls import ToolCallScanner, answer_parts

router = APIRouter()


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[str, List[Block]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: Optional[str] = None
    input_schema: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send metadata and betas we have no use for
    model: str
    messages: List[Message] = Field(..., min_length=1)
    system: Optional[Union[str, List[Block]]] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)  # left out: the server's default
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False


def _text(content) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(b.get("text", "") if isinstance(b, dict) else (b.text or "") for b in content
                   if (b.get("type") if isinstance(b, dict) else b.type) == "text")


def chat_messages(req: CountTokensRequest) -> List[Dict[str, Any]]:
    """The conversation as the chat template takes it."""
    out: List[Dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "user":
            text = "".join(b.text or "" for b in m.content if b.type == "text")
            for b in m.content:
                if b.type == "tool_result":
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
            if text or not any(b.type == "tool_result" for b in m.content):
                out.append({"role": "user", "content": text})
            continue
        message: Dict[str, Any] = {"role": "assistant", "content": "".join(b.text or "" for b in m.content if b.type == "text")}
        thinking = "".join(b.thinking or "" for b in m.content if b.type == "thinking")
        if thinking:
            message["reasoning_content"] = thinking
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}}
                 for b in m.content if b.type == "tool_use"]
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tools(req: CountTokensRequest) -> Optional[List[Dict[str, Any]]]:
    if not req.tools or (req.tool_choice or {}).get("type") == "none":
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in req.tools]


def _thinking(req: CountTokensRequest) -> Optional[bool]:
    kind = (req.thinking or {}).get("type")
    return None if kind is None else kind == "enabled"


async def _prompt(engine: Engine, req: CountTokensRequest) -> List[int]:
    choice = (req.tool_choice or {}).get("type")
    if choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice {choice!r} is not supported: use 'auto' or 'none'", param="tool_choice")
    extra = {} if _thinking(req) is None else {"enable_thinking": _thinking(req)}
    return await engine.render(chat_messages(req), _tools(req), **extra)


def _check_model(engine: Engine, name: str) -> None:
    note(model=name)
    if name != engine.name:
        raise APIError(404, f"model {name!r} not found; this server serves {engine.name!r}", "not_found_error", param="model")


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, engine: Engine = Depends(current_engine)):
    _check_model(engine, req.model)
    prompt = await _prompt(engine, req)
    note(prompt_tokens=len(prompt))
    return {"input_tokens": len(prompt)}


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request, engine: Engine = Depends(current_engine)):
    _check_model(engine, req.model)
    prompt = await _prompt(engine, req)
    try:
        budget = engine.answer_budget(len(prompt), req.max_tokens)
    except ContextFull as e:
        raise APIError(400, str(e), param="messages") from e
    job = engine.submit(prompt, dict(max_tokens=budget, stop=req.stop_sequences or [],
                                     **engine.sampling_options(req.temperature, req.top_p, req.top_k)))
    tools = _tools(req)
    reply = _Reply(engine.name, engine.splitter(prompt), lambda: ToolCallScanner(engine.tokenizer if tools else None, tools))
    if req.stream:
        return StreamingResponse(reply.stream(job), media_type="text/event-stream")
    return JSONResponse(await reply.whole(job, request))


def _stop_reason(last, calls: int) -> Optional[str]:
    if calls:
        return "tool_use"
    if last is None:
        return "end_turn"
    if last.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if getattr(last, "stop_sequence", None) else "end_turn"


class _Reply:
    """A job's events as a Messages response, whole or as Anthropic's server-sent events."""

    def __init__(self, model: str, splitter, scanner):
        self.model, self.splitter, self.scanner = model, splitter, scanner
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def _usage(self, last, output_tokens: Optional[int] = None) -> Dict[str, int]:
        prompt = last.prompt_tokens if last else 0
        cached = last.cached_prompt_tokens if last else 0
        return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
                "output_tokens": output_tokens if output_tokens is not None else (last.generation_tokens if last else 0)}

    async def whole(self, job: Job, request: Optional[Request] = None) -> Dict[str, Any]:
        text, last = await collect(job, request, "api_error")
        scanner = self.scanner()
        thought, words, calls = answer_parts(text, self.splitter(), scanner)
        content: List[Dict[str, Any]] = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        if words.strip() or not (calls or content):  # an answer cut off in its thinking has no text
            content.append({"type": "text", "text": words.rstrip() if calls else words})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": _stop_reason(last, scanner.calls),
                "stop_sequence": getattr(last, "stop_sequence", None) if last else None, "usage": self._usage(last)}

    async def stream(self, job: Job):
        """message_start; per block content_block_start / _delta / _stop; message_delta; message_stop."""
        splitter, scanner, blocks, last = self.splitter(), self.scanner(), _Blocks(), None
        try:
            yield _event("message_start", {"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": self._usage(None, 0)}})
            async for kind, r in job_events(job, "api_error"):
                if kind == "token":
                    last = r
                    for event in blocks.add(*splitter.push(r.text), scanner):
                        yield event
            thought, text = splitter.flush()
            for event in blocks.add(thought, text, scanner, final=True):
                yield event
            for event in blocks.close():
                yield event
            yield _event("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": _stop_reason(last, scanner.calls), "stop_sequence": getattr(last, "stop_sequence", None)},
                "usage": {"output_tokens": last.generation_tokens if last else 0}})
            yield _event("message_stop", {"type": "message_stop"})
        except APIError as e:
            yield _event("error", {"type": "error", "error": {"type": e.kind, "message": e.message}})
        finally:
            job.cancelled.set()  # a disconnect closes this generator: stop generating at once


class _Blocks:
    """The content blocks of a streamed answer: which one is open, and the events that move on."""

    def __init__(self):
        self.index, self.open = -1, None

    def _start(self, kind: str, block: Dict[str, Any]):
        yield from self.close()
        self.index, self.open = self.index + 1, kind
        yield _event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def close(self):
        if self.open is not None:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = None

    def add(self, thought: str, text: str, scanner: ToolCallScanner, final: bool = False):
        if thought:
            if self.open != "thinking":
                yield from self._start("thinking", {"type": "thinking", "thinking": ""})
            yield self._delta({"type": "thinking_delta", "thinking": thought})
        for piece in scanner.push(text) + (scanner.flush() if final else []):
            if isinstance(piece, str):
                if self.open != "text" and not piece.strip():
                    continue  # whitespace between blocks opens nothing
                if self.open != "text":
                    yield from self._start("text", {"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": piece})
                continue
            yield from self._start("tool_use", {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            for fragment in piece.fragments():
                yield self._delta({"type": "input_json_delta", "partial_json": fragment})
            yield from self.close()

    def _delta(self, delta: Dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


def _event(name: str, data: Dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def error_body(status: int, message: str) -> Dict[str, Any]:
    """Anthropic's error shape."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
