"""The app: one engine, the protocols' routers (OpenAI's chat and Responses, Anthropic's Messages),
and what they share (errors in the client's protocol's shape, API key, body limit, CORS, a log
line per request, health, metrics); ``serve`` runs it on uvicorn."""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Dict, Iterable, Optional, Sequence, Union

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import DFlashModel
from . import anthropic, openai, responses
from .engine import DEFAULT_ANSWER_TOKENS, DEFAULT_CONCURRENCY, DEFAULT_QUEUE, REQUEST_RECORD, Engine, current_engine
from .errors import APIError, error_body

LOG = logging.getLogger("dflash_mlx.server")
PROTOCOLS = {"/v1/chat/completions": "openai.chat", "/v1/completions": "openai.completions",
             "/v1/responses": "openai.responses", "/v1/messages": "anthropic.messages",
             "/v1/messages/count_tokens": "anthropic.count_tokens", "/v1/models": "openai.models"}


class AccessLog:
    """One line per request once its answer has gone out (a stream's at its end), refusals
    included: method and path, status, seconds, protocol, the model asked for, prompt tokens,
    how many came from the prefix cache, tokens generated, and why the answer ended (the
    generation's ``stop``/``length``, ``cancelled`` when the client left or the server stopped
    first, ``error``). Fields a request never reached are ``-``. Successful /health and /metrics
    polls are logged at DEBUG, refusals (4xx) at WARNING, server errors at ERROR."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record: Dict[str, Any] = {}
        token = REQUEST_RECORD.set(record)
        status, start = [500], time.perf_counter()  # 500: the app raised before answering

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            REQUEST_RECORD.reset(token)
            log_request(scope, status[0], time.perf_counter() - start, record)


def log_request(scope, status: int, seconds: float, record: Dict[str, Any]) -> None:
    path = scope.get("path", "")
    job = record.get("job")
    last = job.last if job is not None else None
    if job is None:
        finish = "-"
    elif job.error is not None:
        finish = "error"
    elif last is not None and last.finish_reason:
        finish = last.finish_reason
    else:
        finish = "cancelled"
    prompt = record.get("prompt_tokens", last.prompt_tokens if last is not None else None)
    fields = [("protocol", PROTOCOLS.get(path)), ("model", record.get("model")), ("prompt_tokens", prompt),
              ("reused_tokens", last.cached_prompt_tokens if last is not None else None),
              ("generated_tokens", last.generation_tokens if last is not None else (0 if job is not None else None)),
              ("finish", finish)]
    if status >= 500:
        level = logging.ERROR
    elif status >= 400:
        level = logging.WARNING
    elif path in ("/health", "/metrics"):
        level = logging.DEBUG
    else:
        level = logging.INFO
    LOG.log(level, "%s %s %d %.2fs %s", scope.get("method", "-"), path, status, seconds,
            " ".join(f"{name}={'-' if value is None else value}" for name, value in fields))


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413, whether the client announces the size
    (Content-Length) or streams it chunked: the body is counted as it arrives."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _refusal(self, scope):
        message = BodyTooLarge(self.limit).detail
        if scope.get("path", "").startswith("/v1/messages"):
            return JSONResponse(anthropic.error_body(413, message), status_code=413)
        return JSONResponse(error_body(message, "invalid_request_error", code="request_too_large"), status_code=413)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refusal(scope)(scope, receive, send)
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
                await self._refusal(scope)(scope, receive, send)


class BodyTooLarge(HTTPException):
    """A streamed body went over the limit. Raised from inside the body read: FastAPI passes an
    HTTPException from there through to the handlers, which answer 413 like the announced case."""

    def __init__(self, limit: int):
        super().__init__(status_code=413, detail=f"request body larger than {limit} bytes")


async def authorize(request: Request) -> None:
    """The API key, when the server has one, as OpenAI clients send it (``Authorization: Bearer``)
    or Anthropic's (``x-api-key``); compared in constant time: no timing oracle."""
    expected = request.app.state.api_key
    if expected is None:
        return
    bearer = request.headers.get("authorization", "").encode()
    x_api_key = request.headers.get("x-api-key", "").encode()
    if not (hmac.compare_digest(bearer, b"Bearer " + expected) | hmac.compare_digest(x_api_key, expected)):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer ... or x-api-key)", "authentication_error",
                       code="invalid_api_key")


def _error(request: Request, status: int, message: str, kind: str, param=None, code=None, headers=None) -> JSONResponse:
    """An error in the shape of the protocol the client spoke (Anthropic's under /v1/messages),
    logged: a refused request leaves a line in the server's output."""
    LOG.warning("%s %s -> %d %s", request.method, request.url.path, status, message)
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic.error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI, engine: Engine) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        engine.metrics.count("errors")
        return _error(request, e.status, e.message, e.kind, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        engine.metrics.count("errors")
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {(first.get('ctx') or {}).get('error', 'cannot parse')}"
            return _error(request, 400, message, "invalid_request_error")
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return _error(request, 400, message, "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        code = "request_too_large" if isinstance(e, BodyTooLarge) else None
        return _error(request, e.status_code, str(e.detail), "invalid_request_error", code=code)

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):
        engine.metrics.count("errors")
        return _error(request, 500, f"internal error: {type(e).__name__}", "server_error")


async def health(engine: Engine = Depends(current_engine)):
    return {"status": "ok", "model": engine.name, "queue_depth": engine.metrics.queued, "context_limit": engine.context_limit}


async def root(request: Request, engine: Engine = Depends(current_engine)):
    """``GET /`` and ``HEAD /``: clients probe the base URL before their first request (Claude Code
    sends ``HEAD /``); a 200 says a server is there."""
    if request.method == "HEAD":
        return Response(status_code=200)
    return {"name": "dflash-mlx", "model": engine.name, "endpoints": ["/v1/chat/completions", "/v1/completions",
            "/v1/responses", "/v1/messages", "/v1/models", "/health", "/metrics"]}


async def metrics(engine: Engine = Depends(current_engine)):
    return PlainTextResponse(engine.metrics.prometheus(engine.name, engine.prompt_caches.budget_bytes, engine.model.block_stats)
                             + engine.ignored_fields.prometheus(engine.name)
                             + prompt_cache_metrics(engine.name, engine.prompt_caches))


def prompt_cache_metrics(model: str, pool) -> str:
    """The prefix cache's tiers in Prometheus' text format: RAM hits and evictions, and with the
    disk tier its hits, bytes read and written, load seconds, evictions and size (plain counters
    the worker thread moves: read here without a lock, a scrape may see one a step behind)."""
    rows = [("dflash_prompt_cache_ram_hits_total", "counter", "Requests resumed from a history in RAM", pool.ram_hits),
            ("dflash_prompt_cache_ram_evictions_total", "counter", "Histories evicted from RAM (--prompt-cache-gb)",
             pool.evictions)]
    store = pool.store
    if store is not None:
        s = store.stats
        rows += [
            ("dflash_prompt_cache_disk_hits_total", "counter", "Requests resumed from an entry loaded from disk", s.hits),
            ("dflash_prompt_cache_disk_loaded_bytes_total", "counter", "Bytes of caches loaded from disk", s.loaded_bytes),
            ("dflash_prompt_cache_disk_load_seconds_total", "counter", "Seconds spent loading entries from disk",
             s.load_seconds),
            ("dflash_prompt_cache_disk_writes_total", "counter", "Entries written to disk", s.writes),
            ("dflash_prompt_cache_disk_written_bytes_total", "counter", "Bytes written to disk", s.written_bytes),
            ("dflash_prompt_cache_disk_write_seconds_total", "counter", "Seconds spent writing entries", s.write_seconds),
            ("dflash_prompt_cache_disk_save_seconds_total", "counter",
             "Seconds the decode thread spent handing entries to the writer", s.save_seconds),
            ("dflash_prompt_cache_disk_superseded_total", "counter",
             "Queued writes a newer entry of the same history replaced", s.superseded),
            ("dflash_prompt_cache_disk_dropped_total", "counter",
             "Queued writes dropped (the queue full, or closed without a flush)", s.dropped),
            ("dflash_prompt_cache_disk_write_errors_total", "counter", "Writes that failed (a full or read-only disk)",
             s.write_errors),
            ("dflash_prompt_cache_disk_evictions_total", "counter", "Entries removed for --prompt-cache-disk-gb",
             s.evictions),
            ("dflash_prompt_cache_disk_bad_files_total", "counter", "Corrupt or truncated entries skipped and removed",
             s.bad_files),
            ("dflash_prompt_cache_disk_bytes", "gauge", "Bytes in --prompt-cache-dir (every pair's entries)", store.nbytes),
            ("dflash_prompt_cache_disk_budget_bytes", "gauge", "--prompt-cache-disk-gb", store.budget_bytes),
        ]
    out = []
    for name, kind, doc, value in rows:
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f'{name}{{model="{model}"}} {value}']
    return "\n".join(out) + "\n"



def create_app(
    model: DFlashModel,
    tokenizer,
    model_name: str,
    api_key: Optional[str] = None,
    max_tokens_cap: Optional[int] = None,
    context_limit: Optional[int] = None,
    max_request_bytes: int = 8 << 20,
    block_tokens: Union[None, int, str] = "auto",
    prompt_cache_bytes: int = 4 << 30,
    sampling: Optional[Dict[str, Any]] = None,
    chat_template_args: Optional[Dict[str, Any]] = None,
    allowed_origins: Sequence[str] = ("*",),
    draft_quant: Optional[str] = None,
    memory_bytes: Optional[int] = None,
    model_aliases: Iterable[str] = (),
    keepalive_seconds: Optional[float] = None,
    max_concurrent: int = DEFAULT_CONCURRENCY,
    max_queue: int = DEFAULT_QUEUE,
    max_tokens_default: int = DEFAULT_ANSWER_TOKENS,
    prompt_store=None,
    prefill_step_size: Optional[int] = None,
) -> FastAPI:
    """The server's app. ``context_limit`` defaults to the longest context that fits in memory
    (``memory_bytes``, default this machine's) beside the pair's weights (``draft_quant``: how the
    draft was quantized at load) and ``prompt_cache_bytes`` (the prefix caches kept between
    requests), at most the target's ``max_position_embeddings``. ``max_tokens_cap`` (None: none)
    bounds every answer, which is otherwise what the request asks up to the context, and
    ``max_tokens_default`` tokens where the request asks no number.
    ``sampling``: the defaults for a request's temperature, top_p, top_k and min_p, over the
    target's generation_config.json; ``chat_template_args``: for every request's chat template
    (the request's own win); ``allowed_origins``: the origins browsers may call from (CORS; ``*``:
    any); ``model_aliases``: more ids /v1/models lists (any id is served, those without a log line).
    ``max_concurrent``: generations decoded together in one batch (1: one at a time);
    ``max_queue``: requests that may wait beyond those (more get a 503 with Retry-After).
    ``prompt_store``: the prefix cache's disk tier (``prompt_store.PromptStore``; None: RAM only).
    ``prefill_step_size``: prompt tokens per prefill chunk for every request (None: the backend's)."""
    engine = Engine(model, tokenizer, model_name, context_limit, max_tokens_cap, block_tokens, prompt_cache_bytes,
                    sampling=sampling, chat_template_args=chat_template_args, draft_quant=draft_quant,
                    memory_bytes=memory_bytes, max_concurrent=max_concurrent, max_queue=max_queue,
                    max_tokens_default=max_tokens_default, prompt_store=prompt_store,
                    prefill_step_size=prefill_step_size)
    engine.aliases = set(model_aliases) - {model_name}
    if keepalive_seconds is not None:
        engine.keepalive_seconds = keepalive_seconds

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.stop()  # nothing may be generating while the process exits

    app = FastAPI(title="dflash-mlx", description="OpenAI-compatible API with DFlash speculative decoding.",
                  lifespan=lifespan)
    app.state.engine = engine
    app.state.api_key = api_key.encode() if api_key is not None else None
    _add_error_handlers(app, engine)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    # As mlx_lm.server: any method and header, from the allowed origins (outside the body limit,
    # so that a browser can read its 413). The log line is outermost: it sees every answer.
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(AccessLog)
    app.add_api_route("/", root, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse)
    app.include_router(openai.router, dependencies=[Depends(authorize)])
    app.include_router(anthropic.router, dependencies=[Depends(authorize)])
    app.include_router(responses.router, dependencies=[Depends(authorize)])
    return app


class StoppingServer(uvicorn.Server):
    """uvicorn's server, cancelling the generations as soon as it begins to stop (Ctrl-C, SIGTERM):
    their clients get a 503 at once, instead of a connection cut after the graceful wait."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        self.engine.cancel_all()
        await super().shutdown(sockets)


def serve(app: FastAPI, host: str, port: int, log_level: str = "WARNING") -> None:
    """Run the app until Ctrl-C or SIGTERM, then return. Answers still open a second after the
    generations were cancelled are cut. uvicorn's own messages show from WARNING up (all of them
    at DEBUG); its access log is off: ``AccessLog`` writes ours."""
    level = log_level.upper()
    uvicorn_level = "debug" if level == "DEBUG" else ("warning" if level == "INFO" else level.lower())
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_level, access_log=False,
                            timeout_graceful_shutdown=1)
    try:
        StoppingServer(config, app.state.engine).run()
    except KeyboardInterrupt:  # uvicorn hands Ctrl-C on once it has stopped: a server's normal end
        pass
