"""OpenAI's Responses API (what Codex speaks): ``POST /v1/responses``, streamed or not.

``input`` is a string or items (messages, ``function_call``, ``function_call_output``,
``reasoning``); the answer comes back as output items: ``reasoning``, ``message`` (output_text)
and ``function_call``. Nothing is stored: ``previous_response_id`` is refused, clients resend the
conversation (the prefix cache makes that cheap). Function tools and ``namespace`` tools' functions
reach the template; hosted tools and fields that do not apply: see ``fields``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .content import check_parts
from .engine import ContextFull, Engine, Job, collect, current_engine, job_events
from .fields import IgnoredFields, ignored_tools_header
from .errors import APIError
from ..reasoning import effort_kwargs, splitters, template_messages, thinking_switch
from .structured import constraint, openai_tool_choice, schema_of
from .tool_calls import ToolCall, ToolCallScanner, answer_parts

router = APIRouter()
ROUTE = "/v1/responses"
# Documented fields that do not apply to a local server: accepted, ignored with a log line.
NOT_APPLICABLE = ("store", "include", "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                  "service_tier", "stream_options", "max_tool_calls", "client_metadata")
# Documented fields whose use this server cannot honour (stored state, background runs): refused.
REFUSED = {"conversation": "conversations are not stored here: send the whole conversation as input",
           "prompt": "stored prompt templates are not available here: send instructions and input",
           "background": "background responses are not supported (nothing is stored to poll)"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the unknown-field policy: see fields
    model: str
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)  # left out: the server's defaults
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    reasoning: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    text: Optional[Dict[str, Any]] = None
    include: Optional[List[str]] = None
    metadata: Optional[Dict[str, Any]] = None
    user: Optional[str] = None
    truncation: Optional[str] = None


def _unsupported(req: ResponsesRequest, ignored_fields: IgnoredFields) -> None:
    """Options this server cannot honour get a 400 that names them; fields that do not apply are
    ignored with a log line (see fields)."""
    if req.previous_response_id:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the whole "
                       "conversation as input (its prefix cache reuses what was sent before)", param="previous_response_id")
    extra = req.model_extra or {}
    for field, why in REFUSED.items():
        if extra.get(field):
            raise APIError(400, f"{field}: {why}", param=field)
    if extra.get("top_logprobs"):
        raise APIError(400, "top_logprobs: logprobs are not supported", param="top_logprobs")
    ignored_fields.note(ROUTE, [f for f in NOT_APPLICABLE if getattr(req, f, None) is not None]
                 + [f for f in extra if f not in NOT_APPLICABLE and f not in REFUSED])
    ignored_fields.note(ROUTE, _hosted(req), "hosted tools")
    if req.truncation not in (None, "disabled"):
        raise APIError(400, "truncation 'auto' is not supported: the context limit is checked instead", param="truncation")


def _text(content, where: str = "input") -> str:
    """A content's text (its text parts, joined); a part the target cannot read (an image, a
    file) is refused, naming it (``where``: the content's place in the request)."""
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of parts", param="input")
    check_parts(content, where)
    return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict)
                   and part.get("type") in TEXT_PARTS)


# The content parts whose text the prompt takes; others (a ``refusal``...) are left out, logged and
# counted (``_dropped_parts``); images and files are refused (content.py).
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def _dropped_parts(req: ResponsesRequest) -> List[str]:
    """The type of each content part of the input that ``_text`` leaves out of the prompt (a
    message's, a reasoning item's or a function call output's), for ``IgnoredFields.drop``."""
    items = req.input if isinstance(req.input, list) else []
    return [str(part.get("type")) if isinstance(part, dict) else "non-object part"
            for item in items if isinstance(item, dict) for key in ("content", "output")
            if isinstance(item.get(key), list) for part in item[key]
            if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS)]


def _leading_system(instructions: Optional[str], items: List[Dict[str, Any]]):
    """``instructions`` and the ``system``/``developer`` messages before the first other item, as one
    system message at the start, in order (Codex sends two developer items; Qwen's templates take
    one system message); the items after them."""
    texts = [instructions] if instructions else []
    start = 0
    for item in items:
        if item.get("type", "message") != "message" or item.get("role") not in ("system", "developer"):
            break
        texts.append(_text(item.get("content"), f"input[{start}].content"))
        start += 1
    texts = [t for t in texts if t]
    return ([{"role": "system", "content": "\n\n".join(texts)}] if texts else []), items[start:]


def chat_messages(req: ResponsesRequest) -> List[Dict[str, Any]]:
    """The input as the chat template takes it: the instructions and leading system/developer items
    one system message, function calls joining the assistant turn before them, their outputs tool
    turns, reasoning items the next answer's reasoning_content. Later system/developer items stay
    in place (the engine makes them user turns if the template refuses them there)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    out, rest = _leading_system(req.instructions, items)
    first = len(items) - len(rest)  # the index in ``input`` of the first item left
    reasoning = None

    def assistant() -> Dict[str, Any]:
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for index, item in enumerate(rest, start=first):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = {"developer": "system"}.get(role, role) if isinstance(role, str) else role
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"input message role {item.get('role')!r} is not supported", param="input")
            out.append({"role": role, "content": _text(item.get("content"), f"input[{index}].content")})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "reasoning":
            summary = item.get("summary") if isinstance(item.get("summary"), list) else []
            reasoning = _text(item.get("content"), f"input[{index}].content") or "".join(str(s.get("text") or "") for s in summary if isinstance(s, dict))
        elif kind == "function_call":
            turn = assistant()
            if reasoning:
                turn["reasoning_content"], reasoning = reasoning, None
            try:
                arguments = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError as e:
                raise APIError(400, f"function_call arguments are not JSON: {e}", param="input") from e
            turn.setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"), "arguments": arguments}})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, f"input[{index}].output")})
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported", param="input")
    return out


def _functions(req: ResponsesRequest):
    """The function tools, a ``namespace`` tool's functions among them: (namespace or None, tool)."""
    for tool in req.tools or []:
        if tool.get("type") == "function":
            yield None, _named(tool)
        elif tool.get("type") == "namespace":
            inner_tools = tool.get("tools")
            for inner in inner_tools if isinstance(inner_tools, list) else []:
                if isinstance(inner, dict) and inner.get("type", "function") == "function":
                    yield tool.get("name"), _named(inner)


def _named(tool: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, "every function tool needs a name", param="tools")
    return tool


def _hosted(req: ResponsesRequest) -> List[str]:
    """Tools that are neither functions nor namespaces of functions: hosted ones (``web_search``,
    ``file_search``, ``code_interpreter``, ``mcp``...) and grammar-bound ``custom`` tools, which
    this server cannot run or parse: they are left out of the prompt."""
    return [str(t.get("type")) if t.get("type") != "custom" else f"custom:{t.get('name')}" for t in req.tools or []
            if t.get("type") not in ("function", "namespace")]


def _tools(req: ResponsesRequest) -> Optional[List[Dict[str, Any]]]:
    if not req.tools or req.tool_choice == "none":
        return None
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                               "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}
             for _, t in _functions(req)]
    return tools or None


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, request: Request, engine: Engine = Depends(current_engine)):
    model = engine.served_name(req.model)
    _unsupported(req, engine.ignored_fields)
    tools = _tools(req)
    thinking = thinking_switch(None, None, req.reasoning)
    extra = {**effort_kwargs(None, req.reasoning), **({} if thinking is None else {"enable_thinking": thinking})}
    messages = chat_messages(req)  # refuses what the target cannot read before anything is counted
    engine.ignored_fields.drop(ROUTE, _dropped_parts(req), "content parts")
    rendered = template_messages(engine.tokenizer, messages)
    prompt = await engine.render(rendered, tools, param="input", **extra)
    try:
        budget = engine.answer_budget(len(prompt), req.max_output_tokens)
    except ContextFull as e:  # OpenAI's words and code (Codex recognises the code)
        raise APIError(400, f"Your input exceeds the context window of this model: {e.prompt_tokens} tokens, at most "
                       f"{e.maximum}. Please adjust your input and try again.", param="input",
                       code="context_length_exceeded") from e
    sampling = engine.sampling_options(req.temperature, req.top_p)
    calls, tool_name = openai_tool_choice(req.tool_choice)
    grammar = constraint(engine, prompt, schema_of((req.text or {}).get("format"), "text.format", nested=False), tools,
                         calls, tool_name, req.parallel_tool_calls is not False, schema_param="text.format")
    head = await engine.head_end(rendered, tools, prompt, **extra)
    job = engine.submit(prompt, dict(max_tokens=budget, checkpoint_at=head, **sampling,
                                     **({} if grammar is None else {"constraint": grammar})))
    namespaces = {t["name"]: space for space, t in _functions(req) if space is not None}
    reply = _Reply(model, req, splitters(engine.tokenizer, prompt), lambda: ToolCallScanner(engine.tokenizer if tools else None, tools),
                   sampling, namespaces)
    headers = ignored_tools_header(_hosted(req))
    if req.stream:
        return StreamingResponse(reply.stream(job, engine.keepalive_seconds), media_type="text/event-stream", headers=headers)
    return JSONResponse(await reply.whole(job, request), headers=headers)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class _Reply:
    """A job's events as a Responses object, whole or as its streamed events."""

    def __init__(self, model: str, req: ResponsesRequest, splitter, scanner, sampling: Dict[str, Any],
                 namespaces: Optional[Dict[str, str]] = None):
        self.model, self.req, self.splitter, self.scanner = model, req, splitter, scanner
        self.sampling = sampling  # what the answer is sampled with (the request's, or the server's defaults)
        self.id, self.created = _item_id("resp"), int(time.time())
        self.sequence = 0
        self.namespaces = namespaces or {}  # function name -> its namespace, for the calls' items

    def call_item(self, call: ToolCall, status: str = "completed") -> Dict[str, Any]:
        item = _call_item(call, status)
        if call.name in self.namespaces:
            item["namespace"] = self.namespaces[call.name]
        return item

    def _response(self, status: str, output: List[Dict[str, Any]], last=None) -> Dict[str, Any]:
        incomplete = status == "incomplete"
        prompt = last.prompt_tokens if last else 0
        generated = last.generation_tokens if last else 0
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "parallel_tool_calls": bool(self.req.parallel_tool_calls), "temperature": self.sampling["temp"],
            "top_p": self.sampling["top_p"], "tool_choice": self.req.tool_choice or "auto", "tools": self.req.tools or [],
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": last.cached_prompt_tokens if last else 0},
                      "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + generated} if last else None,
        }

    async def whole(self, job: Job, request: Optional[Request] = None) -> Dict[str, Any]:
        text, last = await collect(job, request)
        thought, words, calls = answer_parts(text, self.splitter(), self.scanner())
        output: List[Dict[str, Any]] = [_reasoning_item(_item_id("rs"), thought)] if thought else []
        if words.strip() or not (calls or output):  # an answer cut off in its reasoning has no message
            output.append(_message_item(_item_id("msg"), words.rstrip() if calls else words))
        output += [self.call_item(c) for c in calls]
        status = "incomplete" if last is not None and last.finish_reason == "length" else "completed"
        return self._response(status, output, last)

    def _event(self, name: str, **data) -> str:
        self.sequence += 1
        return f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': self.sequence, **data})}\n\n"

    async def stream(self, job: Job, keepalive: Optional[float] = None):
        """response.created / in_progress; per output item added, its deltas, done;
        response.completed (or incomplete) with the whole response. An SSE comment every
        ``keepalive`` seconds while nothing else goes out (queued, prefilling)."""
        splitter, scanner, items, last = self.splitter(), self.scanner(), _Items(self), None
        try:
            yield self._event("response.created", response=self._response("in_progress", []))
            yield self._event("response.in_progress", response=self._response("in_progress", []))
            async for kind, r in job_events(job, keepalive=keepalive):
                if kind == "keepalive":
                    yield ": keep-alive\n\n"
                elif kind == "token":
                    last = r
                    for event in items.add(*splitter.push(r.text), scanner):
                        yield event
            for event in items.add(*splitter.flush(), scanner, final=True):
                yield event
            for event in items.close():
                yield event
            status = "incomplete" if last is not None and last.finish_reason == "length" else "completed"
            yield self._event(f"response.{status}", response=self._response(status, items.done, last))
        except APIError as e:
            yield self._event("error", code=e.code, message=e.message, param=e.param)
        finally:
            job.cancelled.set()  # a disconnect closes this generator: stop generating at once


def _reasoning_item(item_id: str, text: str) -> Dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str = "completed") -> Dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: ToolCall, status: str = "completed") -> Dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call.id[len("call_"):], "call_id": call.id, "name": call.name,
            "arguments": call.arguments_json, "status": status}


class _Items:
    """The output items of a streamed response: the open one, its text so far, and the done ones."""

    def __init__(self, reply: _Reply):
        self.reply, self.done = reply, []
        self.kind, self.item_id, self.text = None, None, ""

    def _open(self, kind: str):
        yield from self.close()
        self.kind, self.item_id, self.text = kind, _item_id("rs" if kind == "reasoning" else "msg"), ""
        index = len(self.done)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": self.item_id, "summary": [], "content": []}
            yield self.reply._event("response.output_item.added", output_index=index, item=item)
            yield self.reply._event("response.content_part.added", item_id=self.item_id, output_index=index,
                                    content_index=0, part={"type": "reasoning_text", "text": ""})
        else:
            item = _message_item(self.item_id, "", "in_progress")
            item["content"] = []
            yield self.reply._event("response.output_item.added", output_index=index, item=item)
            yield self.reply._event("response.content_part.added", item_id=self.item_id, output_index=index,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    def close(self):
        if self.kind is None:
            return
        index, event = len(self.done), self.reply._event
        if self.kind == "reasoning":
            yield event("response.reasoning_text.done", item_id=self.item_id, output_index=index, content_index=0, text=self.text)
            yield event("response.content_part.done", item_id=self.item_id, output_index=index, content_index=0,
                        part={"type": "reasoning_text", "text": self.text})
            item = _reasoning_item(self.item_id, self.text)
        else:
            yield event("response.output_text.done", item_id=self.item_id, output_index=index, content_index=0, text=self.text)
            yield event("response.content_part.done", item_id=self.item_id, output_index=index, content_index=0,
                        part={"type": "output_text", "text": self.text, "annotations": []})
            item = _message_item(self.item_id, self.text)
        yield event("response.output_item.done", output_index=index, item=item)
        self.done.append(item)
        self.kind = None

    def add(self, thought: str, text: str, scanner: ToolCallScanner, final: bool = False):
        event = self.reply._event
        if thought:
            if self.kind != "reasoning":
                yield from self._open("reasoning")
            self.text += thought
            yield event("response.reasoning_text.delta", item_id=self.item_id, output_index=len(self.done),
                        content_index=0, delta=thought)
        for piece in scanner.push(text) + (scanner.flush() if final else []):
            if isinstance(piece, str):
                if self.kind != "message" and not piece.strip():
                    continue  # whitespace between items opens nothing
                if self.kind != "message":
                    yield from self._open("message")
                self.text += piece
                yield event("response.output_text.delta", item_id=self.item_id, output_index=len(self.done),
                            content_index=0, delta=piece)
                continue
            yield from self.close()
            index, item = len(self.done), self.reply.call_item(piece, "in_progress")
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            for fragment in piece.fragments():
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=fragment)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=piece.arguments_json)
            done = self.reply.call_item(piece)
            yield event("response.output_item.done", output_index=index, item=done)
            self.done.append(done)
