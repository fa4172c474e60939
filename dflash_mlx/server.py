"""A local OpenAI-compatible server (FastAPI on uvicorn) for editors and agents.

FastAPI is the Python ecosystem's standard for typed HTTP APIs: request validation, an OpenAPI
schema (``/openapi.json``, what fuzzers and SDK generators read) and SSE streaming over ASGI.

One generation runs at a time: requests queue for a single worker thread, which also owns the
prefix cache (editors resend the same long context) and therefore needs no locking. A client
that disconnects cancels its generation at the next committed step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import (
    DFlashModel,
    GenerationResponse,
    RunTotals,
    encode_prompt,
    stream_generate,
)
from .prompt_cache import PromptCache


LOG = logging.getLogger("dflash_mlx.server")


def model_context_length(model: DFlashModel) -> Optional[int]:
    """The target's trained context (``max_position_embeddings`` of its config), if it says."""
    from .loading import read_config

    if model.target_path is None:
        return None
    config = read_config(model.target_path)
    value = (config.get("text_config") or config).get("max_position_embeddings", config.get("max_position_embeddings"))
    return int(value) if value else None


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(message: str, kind: str, param=None, code=None) -> Dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request schemas (OpenAI's, with the options we honour) ----------------------------------


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
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


class CompletionRequest(SamplingRequest):
    prompt: Union[str, List[int], List[str]]
    suffix: Optional[str] = None
    echo: bool = False
    logprobs: Optional[int] = None


def _unsupported(req: SamplingRequest) -> None:
    """Options we cannot honour get a 400, never a silent ignore."""
    checks = [
        (req.n != 1, "n", "only n=1 is supported"),
        (req.presence_penalty != 0 or req.frequency_penalty != 0, "presence_penalty", "penalties are not supported (they would change the target's distribution)"),
        (bool(getattr(req, "logprobs", None)), "logprobs", "logprobs are not supported"),
        (bool(getattr(req, "echo", False)), "echo", "echo is not supported"),
    ]
    fmt = getattr(req, "response_format", None)
    checks.append((fmt is not None and fmt.get("type") not in (None, "text"), "response_format", "only response_format 'text' is supported"))
    choice = getattr(req, "tool_choice", None)
    checks.append((choice not in (None, "auto", "none"), "tool_choice", "tool_choice must be 'auto' or 'none'"))
    for bad, param, message in checks:
        if bad:
            raise APIError(400, message, param=param, code="unsupported_parameter")


# ---- the generation worker ----------------------------------------------------------------------


@dataclass
class Metrics:
    """What /metrics reports: finished generations plus the server's own counters."""

    totals: RunTotals = field(default_factory=RunTotals)
    errors: int = 0
    cancelled: int = 0
    queued: int = 0
    last_tps: float = 0.0
    started: float = field(default_factory=time.time)
    # The event loop and the worker thread both count: every update holds this lock.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str, delta: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + delta)

    def add(self, last: GenerationResponse) -> None:
        with self.lock:
            self.totals.add(last)
            self.last_tps = last.generation_tps

    def prometheus(self, model: str) -> str:
        t = self.totals
        rows = [
            ("dflash_requests_total", "counter", "Completed generation requests", t.runs),
            ("dflash_request_errors_total", "counter", "Requests answered with an error", self.errors),
            ("dflash_requests_cancelled_total", "counter", "Generations cancelled by a disconnect", self.cancelled),
            ("dflash_queue_depth", "gauge", "Generations waiting or running", self.queued),
            ("dflash_prompt_tokens_total", "counter", "Prompt tokens received", t.prompt_tokens),
            ("dflash_cached_prompt_tokens_total", "counter", "Prompt tokens reused from the prefix cache", t.cached_prompt_tokens),
            ("dflash_generated_tokens_total", "counter", "Tokens generated", t.tokens),
            ("dflash_generation_tokens_per_second", "gauge", "Decode speed over all requests", t.tokens_per_second),
            ("dflash_last_generation_tokens_per_second", "gauge", "Decode speed of the last request", self.last_tps),
            ("dflash_tokens_per_cycle", "gauge", "Committed tokens per target step", t.tokens_per_cycle),
            ("dflash_acceptance_rate", "gauge", "Accepted share of drafted tokens", t.acceptance_rate),
        ]
        out = []
        for name, kind, doc, value in rows:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f'{name}{{model="{model}"}} {value}']
        out += ["# HELP dflash_cycles_total Target steps after the prompt, by draft block size (1: plain decoding)",
                "# TYPE dflash_cycles_total counter"]
        for block, cycles in sorted(t.block_histogram.items()):
            out.append(f'dflash_cycles_total{{model="{model}",block_tokens="{block}"}} {cycles}')
        return "\n".join(out) + "\n"


@dataclass
class Job:
    prompt: Any
    options: Dict[str, Any]
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, payload=None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


class Engine:
    def __init__(self, model: DFlashModel, tokenizer, name: str, context_limit: Optional[int], max_tokens_cap: int):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.context_limit, self.max_tokens_cap = context_limit, max_tokens_cap
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate")
        self.prompt_cache = PromptCache()
        self.metrics = Metrics()

    def submit(self, prompt, options: Dict[str, Any]) -> Job:
        job = Job(prompt, options, asyncio.Queue(), asyncio.get_running_loop())
        self.metrics.count("queued")
        self.worker.submit(self._run, job)
        return job

    def _run(self, job: Job) -> None:
        last = None
        try:
            if job.cancelled.is_set():
                return
            stream = stream_generate(self.model, self.tokenizer, job.prompt, prompt_cache=self.prompt_cache, **job.options)
            for last in stream:
                if job.cancelled.is_set():
                    stream.close()
                    self.metrics.count("cancelled")
                    break
                job.emit("token", last)
            if last is not None:
                self.metrics.add(last)
        except Exception as e:  # reported to the client as a 500 in OpenAI's shape, logged in full here
            LOG.exception("generation failed")
            self.metrics.count("errors")
            job.emit("error", f"{type(e).__name__}: {e}")
        finally:
            self.metrics.count("queued", -1)
            job.emit("done", last)


# ---- the app ------------------------------------------------------------------------------------


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413, whether the client announces the size
    (Content-Length) or streams it chunked: the body is counted as it arrives."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _refusal(self):
        return JSONResponse(error_body(BodyTooLarge(self.limit).detail, "invalid_request_error", code="request_too_large"),
                            status_code=413)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refusal()(scope, receive, send)
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:  # read outside FastAPI's body parsing, which answers it itself
            if not started:
                await self._refusal()(scope, receive, send)


class BodyTooLarge(HTTPException):
    """A streamed body went over the limit. Raised from inside the body read: FastAPI passes an
    HTTPException from there through to the handlers, which answer 413 like the announced case."""

    def __init__(self, limit: int):
        super().__init__(status_code=413, detail=f"request body larger than {limit} bytes")


def create_app(
    model: DFlashModel,
    tokenizer,
    model_name: str,
    api_key: Optional[str] = None,
    max_tokens_cap: int = 4096,
    context_limit: Optional[int] = None,
    max_request_bytes: int = 8 << 20,
    block_tokens: Union[None, int, str] = "auto",
) -> FastAPI:
    engine = Engine(model, tokenizer, model_name, context_limit, max_tokens_cap)
    app = FastAPI(title="dflash-mlx", description="OpenAI-compatible API with DFlash speculative decoding.")
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        engine.metrics.count("errors")
        return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        engine.metrics.count("errors")
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {(first.get('ctx') or {}).get('error', 'cannot parse')}"
            return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        code = "request_too_large" if isinstance(e, BodyTooLarge) else None
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", code=code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(_, e: Exception):
        engine.metrics.count("errors")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    app.add_middleware(BodyLimit, limit=max_request_bytes)
    expected_authorization = f"Bearer {api_key}".encode() if api_key is not None else None

    async def authorize(request: Request) -> None:
        if expected_authorization is None:
            return
        header = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(header, expected_authorization):  # constant time: no timing oracle
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"model {name!r} not found; this server serves {model_name!r}", param="model", code="model_not_found")

    limit = context_limit if context_limit is not None else model_context_length(model)

    def options(req: SamplingRequest, max_tokens: Optional[int], prompt_ids) -> Dict[str, Any]:
        """The generation's options; the context limit counts the prompt and the tokens it may
        generate (an answer stops with ``length`` where the context is full)."""
        if limit is not None and len(prompt_ids) >= limit:
            raise APIError(
                400, f"prompt has {len(prompt_ids)} tokens; the context limit is {limit} (prompt and answer together)",
                param="messages", code="context_length_exceeded",
            )
        budget = min(max_tokens or max_tokens_cap, max_tokens_cap)
        if limit is not None:
            budget = min(budget, limit - len(prompt_ids))
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        return dict(
            max_tokens=budget, temp=req.temperature, top_p=req.top_p,
            top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=stop, block_tokens=block_tokens,
        )

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": engine.metrics.queued}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return engine.metrics.prometheus(model_name)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(engine.metrics.started), "owned_by": "dflash-mlx"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req.model)
        _unsupported(req)
        messages = [_message_dict(m) for m in req.messages]
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        try:  # off the event loop: a long conversation takes a while to render and tokenize
            prompt_ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tools=tools,
                                                 add_generation_prompt=True, tokenize=True)
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template to these messages: {e}", param="messages") from e
        opts = options(req, req.max_completion_tokens or req.max_tokens, prompt_ids)
        job = engine.submit(list(prompt_ids), opts)
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        reply = _Reply("chat.completion", model_name, tokenizer if tools else None, tools)
        if req.stream:
            return StreamingResponse(reply.stream(job, include_usage), media_type="text/event-stream")
        return JSONResponse(await reply.whole(job, request))

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        _unsupported(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if req.suffix is not None:
            if not isinstance(prompt, str):
                raise APIError(400, "suffix needs a text prompt", param="suffix")
            prompt = _fill_in_the_middle(tokenizer, prompt, req.suffix)
        prompt_ids = (await asyncio.to_thread(encode_prompt, tokenizer, prompt)).tolist() if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max(prompt_ids) >= model.target.args.vocab_size or min(prompt_ids) < 0:
            raise APIError(400, "prompt token id outside the vocabulary", param="prompt")
        opts = options(req, req.max_tokens or 16, prompt_ids)
        job = engine.submit(prompt_ids, opts)
        reply = _Reply("text_completion", model_name)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(reply.stream(job, include_usage), media_type="text/event-stream")
        return JSONResponse(await reply.whole(job, request))

    return app


async def _cancel_on_disconnect(request: Request, job: Job, every: float = 0.1) -> None:
    while not job.cancelled.is_set():
        if await request.is_disconnected():
            job.cancelled.set()
            return
        await asyncio.sleep(every)


def _message_dict(m: Message) -> Dict[str, Any]:
    out = m.model_dump(exclude_none=True)
    if isinstance(out.get("content"), list):  # OpenAI content parts: keep the text ones
        out["content"] = "".join(p.get("text", "") for p in out["content"] if p.get("type") == "text")
    if out["role"] == "developer":
        out["role"] = "system"
    return out


def _fill_in_the_middle(tokenizer, prefix: str, suffix: str) -> str:
    """Qwen's FIM prompt: the model writes what goes between prefix and suffix."""
    vocab = tokenizer.get_vocab()
    markers = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    if not all(m in vocab for m in markers):
        raise APIError(400, "this model's tokenizer has no fill-in-the-middle tokens", param="suffix")
    return f"{markers[0]}{prefix}{markers[1]}{suffix}{markers[2]}"


class _Reply:
    """Turns a job's events into OpenAI responses (whole, or as server-sent events)."""

    def __init__(self, kind: str, model: str, tokenizer=None, tools=None):
        self.kind, self.model, self.tokenizer, self.tools = kind, model, tokenizer, tools
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
        """Split model output into content and OpenAI tool_calls (mlx-lm's parser for the template)."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "has_tool_calling", False) or tok.tool_call_start not in text:
            return text, []
        content, calls = text.split(tok.tool_call_start, 1)[0], []
        for block in text.split(tok.tool_call_start)[1:]:
            body = block.split(tok.tool_call_end, 1)[0].strip()
            try:
                parsed = tok.tool_parser(body, self.tools)
            except Exception:
                return text, []  # not a well-formed call: leave it as text
            for call in parsed if isinstance(parsed, list) else [parsed]:
                arguments = call.get("arguments", {})
                calls.append({
                    "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                    "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
                })
        return content.rstrip(), calls

    async def _events(self, job: Job):
        try:
            while True:
                kind, payload = await job.queue.get()
                if kind == "error":
                    raise APIError(500, payload, "server_error")
                yield kind, payload
                if kind == "done":
                    return
        finally:
            job.cancelled.set()  # the client went away (or we are done): free the model

    async def whole(self, job: Job, request: Optional[Request] = None) -> Dict[str, Any]:
        """The whole answer. Nothing is sent before it is done, so a disconnect is only seen by
        watching for it: a client that gives up frees the model at the next step."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job)) if request is not None else None
        text, last = "", None
        try:
            async for kind, r in self._events(job):
                if kind == "token":
                    text, last = text + r.text, r
        finally:
            if watcher is not None:
                watcher.cancel()
        finish = last.finish_reason if last else "stop"
        if self.kind == "text_completion":
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        else:
            content, calls = self._tool_calls(text)
            message = {"role": "assistant", "content": content if content or not calls else None}
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

    async def stream(self, job: Job, include_usage: bool):
        chat = self.kind == "chat.completion"
        held, last = "", None  # with tools, text from the first tool-call marker on is held back
        try:
            if chat:
                yield self._chunk({"role": "assistant", "content": ""})
            async for kind, r in self._events(job):
                if kind != "token":
                    continue
                last = r
                text = r.text
                if chat and self.tokenizer is not None and (held or self.tokenizer.tool_call_start in text):
                    held += text
                    continue
                if text:
                    yield self._chunk({"content": text} if chat else text)
            finish = last.finish_reason if last else "stop"
            if held:
                content, calls = self._tool_calls(held)
                if content:
                    yield self._chunk({"content": content})
                if calls:
                    deltas = [{**c, "index": i} for i, c in enumerate(calls)]
                    yield self._chunk({"tool_calls": deltas})
                    finish = "tool_calls"
            yield self._chunk({} if chat else "", finish=finish)
            if include_usage:
                yield self._chunk(None, usage=self._usage(last))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.message, e.kind))}\n\n"
        finally:
            job.cancelled.set()  # a disconnect closes this generator: stop generating at once
