"""OpenAI's API: chat completions (tools included), completions (fill-in-the-middle) and models.

Routes at module level over the app's ``Engine``; a request either streams server-sent events or
waits for the whole answer, and a client that goes away cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..api import GenerationResponse, encode_prompt
from .content import check_part
from .engine import ContextFull, Engine, Job, collect, current_engine, job_events
from .fields import IgnoredFields
from .errors import APIError, error_body
from ..reasoning import ReasoningSplitter, effort_kwargs, splitters, template_messages, thinking_switch
from .structured import constraint, openai_tool_choice, schema_of
from .tool_calls import ToolCall, ToolCallScanner, split_text_and_calls

router = APIRouter()


# ---- request schemas (OpenAI's, with the options we honour) ----------------------------------


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the unknown-field policy: see fields
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    # Left out: the server's defaults (its --temp/--top-p/--top-k/--min-p, else the target's
    # generation_config.json, else greedy with no filters).
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0.0, lt=1.0)
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None
    n: int = 1
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class ChatRequest(SamplingRequest):
    messages: List[Message] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[bool] = None
    response_format: Optional[Dict[str, Any]] = None
    # Thinking on or off: any of the ways clients ask (see reasoning.thinking_switch).
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    reasoning: Optional[Dict[str, Any]] = None


class CompletionRequest(SamplingRequest):
    prompt: Union[str, List[int], List[str]]
    suffix: Optional[str] = None
    echo: bool = False
    logprobs: Optional[int] = None


# Documented fields that do not apply to a local server: accepted, ignored with a log line.
NOT_APPLICABLE = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                  "safety_identifier", "web_search_options", "verbosity")
# Documented fields whose use would change what the answer means: refused, naming the field.
REFUSED = {"logit_bias": "token biases are not supported (they would change the target's distribution)",
           "top_logprobs": "logprobs are not supported",
           "audio": "audio output is not supported",
           "prediction": "predicted outputs are not supported",
           "functions": "the legacy functions field is not supported: send tools",
           "best_of": "best_of is not supported (only one completion is generated)"}


def _unsupported(req: SamplingRequest, route: str, ignored_fields: IgnoredFields) -> None:
    """Options we cannot honour get a 400 that names them, never a silent ignore; fields that do
    not apply, and fields OpenAI does not document, are ignored with a log line (see fields)."""
    extra = req.model_extra or {}
    for field, why in REFUSED.items():
        if extra.get(field):
            raise APIError(400, f"{field}: {why}", param=field, code="unsupported_parameter")
    if any(m != "text" for m in extra.get("modalities") or ()):
        raise APIError(400, "only text output is supported (modalities ['text'])", param="modalities",
                       code="unsupported_parameter")
    ignored_fields.note(route, [f for f in NOT_APPLICABLE if getattr(req, f, None) is not None or f in extra]
                 + [f for f in extra if f not in NOT_APPLICABLE and f not in REFUSED and f != "modalities"])
    checks = [
        (req.n != 1, "n", "only n=1 is supported"),
        (req.presence_penalty != 0 or req.frequency_penalty != 0, "presence_penalty", "penalties are not supported (they would change the target's distribution)"),
        (bool(getattr(req, "logprobs", None)), "logprobs", "logprobs are not supported"),
        (bool(getattr(req, "echo", False)), "echo", "echo is not supported"),
    ]
    for bad, param, message in checks:
        if bad:
            raise APIError(400, message, param=param, code="unsupported_parameter")


# ---- routes -------------------------------------------------------------------------------------


def check_model(engine: Engine, name: str) -> str:
    """The id the answer carries: any id is served by the loaded model (see ``Engine.served_name``)."""
    return engine.served_name(name)


def options(engine: Engine, req: SamplingRequest, max_tokens: Optional[int], prompt_ids) -> Dict[str, Any]:
    """The generation's options; an answer stops with ``length`` where the context is full."""
    try:
        budget = engine.answer_budget(len(prompt_ids), max_tokens)
    except ContextFull as e:
        raise APIError(400, f"This model's maximum context length is {e.limit} tokens. However, your messages resulted in "
                       f"{e.prompt_tokens} tokens. Please reduce the length of the messages.", param="messages",
                       code="context_length_exceeded") from e
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return dict(max_tokens=budget, seed=req.seed, stop=stop,
                **engine.sampling_options(req.temperature, req.top_p, req.top_k, req.min_p))


@router.get("/v1/models")
async def models(engine: Engine = Depends(current_engine)):
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(engine.metrics.started), "owned_by": "dflash-mlx"}
                                       for name in [engine.name, *sorted(engine.aliases)]]}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, request: Request, engine: Engine = Depends(current_engine)):
    model = check_model(engine, req.model)
    _unsupported(req, "/v1/chat/completions", engine.ignored_fields)
    dropped: List[str] = []
    messages = [_message_dict(m, i, dropped) for i, m in enumerate(req.messages)]
    engine.ignored_fields.drop("/v1/chat/completions", dropped, "content parts")
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    template_kwargs = {**effort_kwargs(req.reasoning_effort, req.reasoning), **(req.chat_template_kwargs or {})}
    thinking = thinking_switch(req.chat_template_kwargs, req.reasoning_effort, req.reasoning)
    if thinking is not None:
        template_kwargs["enable_thinking"] = thinking
    rendered = template_messages(engine.tokenizer, messages)
    prompt_ids = await engine.render(rendered, tools, **template_kwargs)
    opts = options(engine, req, req.max_completion_tokens or req.max_tokens, prompt_ids)
    opts["checkpoint_at"] = await engine.head_end(rendered, tools, list(prompt_ids), **template_kwargs)
    calls, tool_name = openai_tool_choice(req.tool_choice)
    grammar = constraint(engine, list(prompt_ids), schema_of(req.response_format, "response_format", nested=True), tools,
                         calls, tool_name, req.parallel_tool_calls is not False)
    if grammar is not None:  # structured outputs, a forced tool call or one call at most
        opts["constraint"] = grammar
    job = engine.submit(list(prompt_ids), opts)
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    reply = _Reply("chat.completion", model, engine.tokenizer if tools else None, tools,
                   reasoning=splitters(engine.tokenizer, prompt_ids))
    if req.stream:
        return StreamingResponse(reply.stream(job, include_usage, engine.keepalive_seconds), media_type="text/event-stream")
    return JSONResponse(await reply.whole(job, request))


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, engine: Engine = Depends(current_engine)):
    model = check_model(engine, req.model)
    _unsupported(req, "/v1/completions", engine.ignored_fields)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if req.suffix is not None:
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs a text prompt", param="suffix")
        prompt = _fill_in_the_middle(engine.tokenizer, prompt, req.suffix)
    prompt_ids = (await asyncio.to_thread(encode_prompt, engine.tokenizer, prompt)).tolist() if isinstance(prompt, str) else list(prompt)
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if max(prompt_ids) >= engine.model.target.args.vocab_size or min(prompt_ids) < 0:
        raise APIError(400, "prompt token id outside the vocabulary", param="prompt")
    opts = options(engine, req, req.max_tokens or 16, prompt_ids)
    job = engine.submit(prompt_ids, opts)
    reply = _Reply("text_completion", model)
    if req.stream:
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(reply.stream(job, include_usage, engine.keepalive_seconds), media_type="text/event-stream")
    return JSONResponse(await reply.whole(job, request))



def _message_dict(m: Message, index: int, dropped: List[str]) -> Dict[str, Any]:
    """A message as the chat template takes it: content parts (text only) joined into one string,
    the ``developer`` role (OpenAI's name for system instructions) as ``system``. Images, audio and
    files are refused (content.py); other parts (an answer's ``refusal``...) are left out, their
    types added to ``dropped`` (logged and counted, as the other routes do: fields.IgnoredFields.drop)."""
    out = m.model_dump(exclude_none=True)
    if isinstance(out.get("content"), list):
        texts = []
        for j, part in enumerate(out["content"]):
            kind, text = part.get("type"), part.get("text")
            if kind != "text":
                check_part(part, f"messages[{index}].content[{j}]")  # images, audio, files: content.py's refusal
                dropped.append(str(kind))
                continue
            if not isinstance(text, str):
                raise APIError(400, "a text content part needs a 'text' string", param=f"messages[{index}].content[{j}]")
            texts.append(text)
        out["content"] = "".join(texts)
    if out["role"] == "developer":
        out["role"] = "system"
    if "reasoning" in out and "reasoning_content" not in out:  # the alias some clients send back
        out["reasoning_content"] = out.pop("reasoning")
    if out.get("tool_calls"):
        out["tool_calls"] = [_parsed_arguments(call) for call in out["tool_calls"]]
    return out


def _parsed_arguments(call: Dict[str, Any]) -> Dict[str, Any]:
    """A call as the chat template takes it: OpenAI sends ``function.arguments`` as a JSON string,
    templates iterate it as a mapping (Qwen3.5's ``arguments|items``)."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise APIError(400, f"tool call arguments are not JSON: {e}", param="messages") from e
    return {**call, "function": {**function, "arguments": parsed}}


def _openai_call(call: ToolCall) -> Dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


def _fill_in_the_middle(tokenizer, prefix: str, suffix: str) -> str:
    """Qwen's FIM prompt: the model writes what goes between prefix and suffix."""
    vocab = tokenizer.get_vocab()
    markers = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    if not all(m in vocab for m in markers):
        raise APIError(400, "this model's tokenizer has no fill-in-the-middle tokens", param="suffix")
    return f"{markers[0]}{prefix}{markers[1]}{suffix}{markers[2]}"


class _Reply:
    """Turns a job's events into OpenAI responses (whole, or as server-sent events)."""

    def __init__(self, kind: str, model: str, tokenizer=None, tools=None, reasoning=None):
        self.kind, self.model, self.tokenizer, self.tools = kind, model, tokenizer, tools
        self.reasoning = reasoning or (lambda: ReasoningSplitter(False, enabled=False))  # a fresh splitter per answer
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _usage(self, last: Optional[GenerationResponse]) -> Dict[str, Any]:
        prompt = last.prompt_tokens if last else 0
        completion = last.generation_tokens if last else 0
        cached = last.cached_prompt_tokens if last else 0
        return {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _tool_calls(self, text: str):
        """Split model output into content and OpenAI tool_calls."""
        content, calls = split_text_and_calls(ToolCallScanner(self.tokenizer, self.tools), text)
        return (content.rstrip() if calls else content), [_openai_call(c) for c in calls]

    async def whole(self, job: Job, request: Optional[Request] = None) -> Dict[str, Any]:
        """The whole answer. Nothing is sent before it is done, so a disconnect is only seen by
        watching for it: a client that gives up frees the model at the next step."""
        text, last = await collect(job, request)
        finish = last.finish_reason if last else "stop"
        if self.kind == "text_completion":
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        else:
            thought, answer = self.reasoning().whole(text)
            content, calls = self._tool_calls(answer)
            message = {"role": "assistant", "content": content if content or not calls else None}
            if thought:
                message["reasoning_content"] = message["reasoning"] = thought
            if calls:
                message["tool_calls"], finish = calls, "tool_calls"
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage(last)}

    def _chunk(self, delta_or_text, finish=None, usage=None) -> str:
        if self.kind == "text_completion":
            choice = {"index": 0, "text": delta_or_text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        else:
            choice = {"index": 0, "delta": delta_or_text, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice] if delta_or_text is not None else []}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def _chat_deltas(self, thought: str, text: str, scanner: "ToolCallScanner", final: bool = False):
        if thought:
            yield self._chunk({"reasoning_content": thought, "reasoning": thought})
        pieces = scanner.push(text) + (scanner.flush() if final else [])
        for piece in pieces:
            if isinstance(piece, str):
                if piece.strip() or not scanner.calls:  # whitespace between calls is not content
                    yield self._chunk({"content": piece})
                continue
            yield self._chunk({"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                               "function": {"name": piece.name, "arguments": ""}}]})
            for fragment in piece.fragments():
                yield self._chunk({"tool_calls": [{"index": piece.index, "function": {"arguments": fragment}}]})

    async def stream(self, job: Job, include_usage: bool, keepalive: Optional[float] = None):
        """Server-sent events: reasoning deltas, content deltas, and each tool call as soon as its
        block closes (its id and name, then its arguments in fragments); an SSE comment every
        ``keepalive`` seconds while nothing else goes out (queued, prefilling)."""
        chat = self.kind == "chat.completion"
        splitter, scanner, last = self.reasoning(), ToolCallScanner(self.tokenizer, self.tools), None
        try:
            if chat:
                yield self._chunk({"role": "assistant", "content": ""})
            async for kind, r in job_events(job, keepalive=keepalive):
                if kind == "keepalive":
                    yield ": keep-alive\n\n"
                    continue
                if kind != "token":
                    continue
                last = r
                if not chat:
                    if r.text:
                        yield self._chunk(r.text)
                    continue
                for chunk in self._chat_deltas(*splitter.push(r.text), scanner):
                    yield chunk
            finish = last.finish_reason if last else "stop"
            if chat:
                for chunk in self._chat_deltas(*splitter.flush(), scanner, final=True):
                    yield chunk
                if scanner.calls:
                    finish = "tool_calls"
            yield self._chunk({} if chat else "", finish=finish)
            if include_usage:
                yield self._chunk(None, usage=self._usage(last))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.message, e.kind))}\n\n"
        finally:
            job.cancelled.set()  # a disconnect closes this generator: stop generating at once
