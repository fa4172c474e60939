"""Anthropic's Messages API (what Claude Code speaks with ``ANTHROPIC_BASE_URL``): ``POST
/v1/messages``, streamed or not, and ``POST /v1/messages/count_tokens``.

Messages become the chat template's: text, ``tool_use`` blocks (the assistant's calls) and
``tool_result`` blocks (``tool`` turns), ``thinking`` blocks back as ``reasoning_content``,
``system`` messages in place. The answer comes back as content blocks: ``thinking`` (the
reasoning), ``text`` and ``tool_use``. Fields and tools that do not apply: see ``fields``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .content import check_part, check_parts
from .engine import ContextFull, Engine, Job, collect, current_engine, job_events, note
from .errors import APIError
from .fields import IgnoredFields, ignored_tools_header
from ..reasoning import splitters, template_messages
from .structured import anthropic_tool_choice, constraint, schema_of
from .tool_calls import ToolCallScanner, answer_parts

router = APIRouter()
ROUTE = "/v1/messages"
# Blocks the template renders; images and documents are refused (content.py), others (server tools'
# results...) are left out, logged and counted (fields.IgnoredFields.drop).
READ_BLOCKS = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}
# Inside a tool_result: text, and tool_reference (a deferred tool loaded: its schema, in place).
RESULT_BLOCKS = {"text", "tool_reference"}
# Documented fields that do not apply to a local server: accepted, ignored with a log line.
NOT_APPLICABLE = ("metadata", "service_tier", "context_management", "container", "inference_geo", "cache_control")


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]  # Claude Code sends system messages between the turns
    content: Union[str, List[Block]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Optional[str] = None  # None or "custom": the client's own; others run on Anthropic's side
    name: str
    description: Optional[str] = None
    input_schema: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    defer_loading: Optional[bool] = None  # out of the prompt's tool list until a tool_reference loads it


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the unknown-field policy: see fields
    model: str
    messages: List[Message] = Field(..., min_length=1)
    system: Optional[Union[str, List[Block]]] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None
    output_config: Optional[Dict[str, Any]] = None
    mcp_servers: Optional[List[Dict[str, Any]]] = None


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


def _schema_line(tool: Tool) -> str:
    """A tool's definition as Claude Code's ToolSearch promises the model: one ``<function>`` line
    of JSON (description, name, parameters), the encoding of the tool list atop its prompt."""
    schema = {"description": tool.description or "", "name": tool.name, "parameters": tool.input_schema}
    return f"<function>{json.dumps(schema, ensure_ascii=False)}</function>"


def _result_text(content, tools: Dict[str, Tool]) -> str:
    """A tool_result's text: its text blocks, and each run of ``tool_reference`` blocks (ToolSearch
    loading deferred tools) as a ``<functions>`` block of those tools' schemas, where it stands.
    Other blocks are left out (``_check`` refuses images, logs and counts the rest)."""
    if isinstance(content, str) or content is None:
        return content or ""
    out: List[str] = []
    run: List[str] = []  # the schema lines of the tool_reference blocks in a row
    for block in content + [{}]:  # an empty block ends the last run
        kind = block.get("type")
        if kind == "tool_reference":
            run.append(_schema_line(tools[block.get("tool_name")]))
            continue
        if run:
            out.append("<functions>\n" + "\n".join(run) + "\n</functions>")
            run = []
        if kind == "text":
            out.append(block.get("text") or "")
    return "".join(out)


def chat_messages(req: CountTokensRequest) -> List[Dict[str, Any]]:
    """The conversation as the chat template takes it; system messages stay where they are (the
    engine makes later ones user turns if the template refuses them there)."""
    tools = {t.name: t for t in _custom(req)}
    out: List[Dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "system":
            out.append({"role": "system", "content": _text(m.content)})
            continue
        if m.role == "user":
            text = "".join(b.text or "" for b in m.content if b.type == "text")
            for b in m.content:
                if b.type == "tool_result":
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b.content, tools)})
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


def _hosted(req: CountTokensRequest) -> List[str]:
    """The tools that run on Anthropic's side (web search, code execution...) and MCP servers: a
    local server has neither, so they are left out."""
    tools = [t.name for t in req.tools or [] if t.type not in (None, "custom")]
    return tools + [f"mcp:{s.get('name', '?')}" for s in req.mcp_servers or []]


def _custom(req: CountTokensRequest) -> List[Tool]:
    """The client's own tools (those of other types run on Anthropic's side: ``_hosted``)."""
    return [t for t in req.tools or [] if t.type in (None, "custom")]


def _referenced(req: CountTokensRequest) -> set:
    """The names the conversation's ``tool_reference`` blocks load (inside tool results)."""
    return {r.get("tool_name") for m in req.messages if not isinstance(m.content, str) for b in m.content
            if b.type == "tool_result" and isinstance(b.content, list)
            for r in b.content if r.get("type") == "tool_reference"}


def _tools(req: CountTokensRequest, loaded: bool = False) -> Optional[List[Dict[str, Any]]]:
    """The tools the template renders: the client's own less those marked ``defer_loading`` (Claude
    Code's deferred tools and its placeholder), which stay out of the prompt's tool list, so that
    loading one (its schema comes in a tool result, ``_result_text``) leaves the prefix as it was.
    With ``loaded``, the tools the model may call: those plus the deferred ones a reference loaded."""
    if not req.tools or (req.tool_choice or {}).get("type") == "none":
        return None
    referenced = _referenced(req) if loaded else set()
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
             for t in _custom(req) if not t.defer_loading or t.name in referenced]
    return tools or None


def _thinking(req: CountTokensRequest) -> Optional[bool]:
    """``enable_thinking`` for the template: ``enabled`` (with its budget) and ``adaptive`` (the
    model decides, as Qwen3.5 does when it thinks) on, ``disabled`` off, none: the template's default."""
    kind = (req.thinking or {}).get("type")
    if kind is None:
        return None
    if kind not in ("enabled", "adaptive", "disabled"):
        return None  # logged by _check
    return kind != "disabled"


def _check(req: CountTokensRequest, ignored_fields: IgnoredFields) -> None:
    """Refuse what cannot be honoured; log what is ignored (the unknown-field policy: see fields)."""
    anthropic_tool_choice(req.tool_choice)  # a choice it cannot honour: a 400 naming it
    _format(req)
    ignored = [f for f in NOT_APPLICABLE if getattr(req, f, None) is not None or f in (req.model_extra or {})]
    ignored += [f for f in req.model_extra or {} if f not in NOT_APPLICABLE and f != "output_format"]
    ignored += [f"output_config.{k}" for k in req.output_config or {} if k != "format"]
    if (req.thinking or {}).get("budget_tokens") is not None:
        ignored.append("thinking.budget_tokens")  # the model thinks until it closes its reasoning
    if (req.thinking or {}).get("display") is not None:
        ignored.append("thinking.display")
    if (req.thinking or {}).get("type") not in (None, "enabled", "adaptive", "disabled"):
        ignored.append(f"thinking.type={req.thinking['type']}")
    ignored_fields.note(ROUTE, ignored)
    _check_content(req)
    _check_references(req)
    system = [] if isinstance(req.system, str) else [b.type for b in req.system or [] if b.type != "text"]
    blocks = [b.type for m in req.messages if not isinstance(m.content, str) for b in m.content if b.type not in READ_BLOCKS]
    ignored_fields.drop(ROUTE, system + blocks, "content blocks")
    nested = [str(r.get("type")) for m in req.messages if not isinstance(m.content, str) for b in m.content
              if b.type == "tool_result" and isinstance(b.content, list) for r in b.content
              if r.get("type") not in RESULT_BLOCKS]
    ignored_fields.drop(ROUTE, nested, "content blocks inside tool_result")
    ignored_fields.note(ROUTE, _hosted(req), "hosted tools")


def _format(req: CountTokensRequest):
    """(schema, its place) from ``output_config.format`` or the beta's top-level ``output_format``."""
    given = [(f, p) for f, p in (((req.output_config or {}).get("format"), "output_config.format"),
                                 ((req.model_extra or {}).get("output_format"), "output_format")) if f is not None]
    if len(given) > 1:
        raise APIError(400, "send output_config.format or output_format, not both", param="output_format")
    return (schema_of(given[0][0], given[0][1], nested=False), given[0][1]) if given else (None, "output_config.format")


def _check_references(req: CountTokensRequest) -> None:
    """A ``tool_reference`` must name one of the request's own tools (its schema is what it renders)."""
    names = {t.name for t in _custom(req)}
    for i, m in enumerate(req.messages):
        for j, block in enumerate([] if isinstance(m.content, str) else m.content):
            for k, part in enumerate(block.content if block.type == "tool_result" and isinstance(block.content, list) else []):
                if part.get("type") == "tool_reference" and part.get("tool_name") not in names:
                    where = f"messages[{i}].content[{j}].content[{k}]"
                    raise APIError(400, f"{where}: tool_reference names {part.get('tool_name')!r}, which is not among the "
                                        "request's tools", param=where)


def _check_content(req: CountTokensRequest) -> None:
    """Images and documents, in a message or inside a ``tool_result`` (Claude Code reading a
    picture), are refused naming the block: the target reads text only (content.py)."""
    if not isinstance(req.system, str):
        check_parts(req.system, "system")
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            continue
        for j, block in enumerate(m.content):
            check_part(block, f"messages[{i}].content[{j}]")
            if block.type == "tool_result":
                check_parts(block.content, f"messages[{i}].content[{j}].content")


async def _prompt(engine: Engine, req: CountTokensRequest) -> List[int]:
    _check(req, engine.ignored_fields)
    extra = {} if _thinking(req) is None else {"enable_thinking": _thinking(req)}
    return await engine.render(template_messages(engine.tokenizer, chat_messages(req)), _tools(req), **extra)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, engine: Engine = Depends(current_engine)):
    engine.served_name(req.model)
    prompt = await _prompt(engine, req)
    note(prompt_tokens=len(prompt))
    return JSONResponse({"input_tokens": len(prompt)}, headers=ignored_tools_header(_hosted(req)))


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request, engine: Engine = Depends(current_engine)):
    model = engine.served_name(req.model)
    prompt = await _prompt(engine, req)
    try:
        budget = engine.answer_budget(len(prompt), req.max_tokens)
    except ContextFull as e:  # Anthropic's words, which Claude Code recognises (it compacts and retries)
        raise APIError(400, f"prompt is too long: {e.prompt_tokens} tokens > {e.maximum} maximum", param="messages") from e
    tools = _tools(req, loaded=True)
    calls, tool_name, parallel = anthropic_tool_choice(req.tool_choice)
    schema, where = _format(req)
    grammar = constraint(engine, prompt, schema, tools, calls, tool_name, parallel, schema_param=where)
    extra = {} if _thinking(req) is None else {"enable_thinking": _thinking(req)}
    head = await engine.head_end(template_messages(engine.tokenizer, chat_messages(req)), _tools(req), prompt, **extra)
    job = engine.submit(prompt, dict(max_tokens=budget, stop=req.stop_sequences or [], checkpoint_at=head,
                                     **engine.sampling_options(req.temperature, req.top_p, req.top_k),
                                     **({} if grammar is None else {"constraint": grammar})))
    reply = _Reply(model, splitters(engine.tokenizer, prompt), lambda: ToolCallScanner(engine.tokenizer if tools else None, tools))
    headers = ignored_tools_header(_hosted(req))
    if req.stream:
        return StreamingResponse(reply.stream(job, len(prompt), engine.keepalive_seconds), media_type="text/event-stream",
                                 headers=headers)
    return JSONResponse(await reply.whole(job, request), headers=headers)


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

    def _usage(self, last, prompt_tokens: int = 0) -> Dict[str, int]:
        """Anthropic's usage: ``input_tokens`` are the prompt's tokens not read from the prefix cache.
        Before the answer (``last`` None) the whole prompt, as far as is known then."""
        prompt = last.prompt_tokens if last else prompt_tokens
        cached = last.cached_prompt_tokens if last else 0
        return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
                "output_tokens": last.generation_tokens if last else 0}

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

    async def stream(self, job: Job, prompt_tokens: int = 0, keepalive: Optional[float] = None):
        """message_start and a ping; per block content_block_start / _delta / _stop; message_delta
        (with the whole usage); message_stop. A ping every ``keepalive`` seconds while nothing else
        goes out (queued, prefilling), as Anthropic's API sends them."""
        splitter, scanner, blocks, last = self.splitter(), self.scanner(), _Blocks(), None
        try:
            yield _event("message_start", {"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": self._usage(None, prompt_tokens)}})
            yield _event("ping", {"type": "ping"})
            async for kind, r in job_events(job, "api_error", keepalive):
                if kind == "keepalive":
                    yield _event("ping", {"type": "ping"})
                elif kind == "token":
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
                "usage": self._usage(last, prompt_tokens)})
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
            413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
