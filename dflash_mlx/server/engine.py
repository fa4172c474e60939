"""The generation engine behind every protocol: one generation at a time, in a worker thread.

The worker owns the prompt caches (a ``PromptCachePool``: editors resend the same long context,
chat clients and completion clients alternate), so nothing there needs a lock. A job is
cancelled by setting its event: between prefill chunks and at the next committed step.

The worker is a daemon that is never joined: at exit it is left parked on its queue. A thread
that ends runs MLX's thread-local compile-cache destructor, which takes the GIL; when that
happens after the interpreter began finalizing, the process aborts (``terminate called without
an active exception``). So stopping means cancelling every job and waiting for the worker to be
idle (``Engine.stop``), not ending the thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Union

from starlette.requests import Request

from ..api import DFlashModel, GenerationResponse, RunTotals, stream_generate
from ..checkpoint_files import text_part
from ..pipeline import PeerLost
from ..grammar import Grammars
from ..prompt_cache import PromptCachePool
from ..scheduler import BatchRequest, Scheduler
from .errors import APIError
from .fields import IgnoredFields

LOG = logging.getLogger("dflash_mlx.server")


def model_context_length(model: DFlashModel) -> Optional[int]:
    """The target's trained context (``max_position_embeddings`` of its config), if it says."""
    from ..loading import read_config

    if model.target_path is None:
        return None
    config = read_config(model.target_path)
    value = text_part(config).get("max_position_embeddings", config.get("max_position_embeddings"))
    return int(value) if value else None


def memory_context_limit(model: DFlashModel, draft_quant: Optional[str] = None, memory_bytes: Optional[int] = None,
                         reserve: int = 0, upper: Optional[int] = None) -> Optional[int]:
    """The longest context (prompt and answer, in tokens, at most ``upper``) whose caches fit in
    ``memory_bytes`` (default: this machine's, as ``doctor`` counts it: MLX's recommended working
    set on a Mac, physical memory elsewhere) beside the pair's weights and ``reserve`` bytes (the
    prefix caches' budget), by ``doctor``'s estimate of the pair's memory at a context. None when
    it cannot be known (no target folder, a target not all held here, no memory size)."""
    from .. import device as device_lib
    from ..doctor import estimate_memory

    if model.target_path is None or not model.runner.holds_whole_target:
        return None
    facts = device_lib.facts()
    memory_bytes = memory_bytes or facts.recommended_working_set or facts.memory_bytes
    dtype = device_lib.draft_activation_dtype(facts)  # as `load` computes the draft by default
    if not memory_bytes:
        return None
    draft_dir = model.draft_path if model.draft is not None else None

    def fits(context: int) -> bool:
        need = estimate_memory(Path(model.target_path), draft_dir and Path(draft_dir), draft_quant, context, draft_dtype=dtype)
        return sum(need.values()) + reserve <= memory_bytes

    upper = upper or 1 << 20
    try:
        if fits(upper):
            return upper
    except Exception as e:  # a layout the estimate does not know: the target's own limit then
        LOG.warning("cannot estimate the memory of this pair (%s: %s): the context limit is the target's own", type(e).__name__, e)
        return None
    low, high = 0, upper  # fits(low) or low == 0; not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# The sampling settings a request leaves out come from the server's flags, then the target's
# generation_config.json, then mlx_lm.server's defaults (greedy, no filters).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")
FALLBACK_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def generation_config_sampling(folder: Optional[Path]) -> Dict[str, float]:
    """The sampling fields of a target folder's ``generation_config.json`` ({} without one). A
    value the sampler would refuse is left out, with a warning."""
    from ..sampling import Sampler

    path = Path(folder) / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        LOG.warning("ignoring %s: %s", path, e)
        return {}
    out = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        try:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            value = int(value) if name == "top_k" else float(value)
            Sampler(**{**FALLBACK_SAMPLING, name: value})
        except ValueError as e:
            LOG.warning("ignoring %s of %s: %s", name, path, e)
            continue
        out[name] = value
    return out


def sampling_defaults(folder: Optional[Path], overrides: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """What a request that leaves a sampling field out gets: ``overrides`` (the server's
    --temp/--top-p/--top-k/--min-p, None where not given) over the target's
    ``generation_config.json`` over mlx_lm.server's defaults."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(given) - set(SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling settings: {sorted(unknown)}")
    return {**FALLBACK_SAMPLING, **generation_config_sampling(folder), **given}


class ContextFull(ValueError):
    """A prompt that leaves no room for an answer within the context limit."""

    def __init__(self, prompt_tokens: int, limit: int):
        super().__init__(f"prompt has {prompt_tokens} tokens; the context limit is {limit} (prompt and answer together)")
        self.prompt_tokens, self.limit = prompt_tokens, limit

    @property
    def maximum(self) -> int:
        """The longest prompt that still leaves room for one answer token."""
        return self.limit - 1


# Generations decoded together (``serve --max-concurrent``): an editor's completion does not wait
# for a chat answer, and on a Mac four sequences' rows cost about one pass of the weights.
DEFAULT_CONCURRENCY = 4
# Requests that may wait beyond those (``--max-queue``); more are refused with a 503 and Retry-After.
DEFAULT_QUEUE = 64
RETRY_AFTER_SECONDS = 5

# An answer's length when the request gives none (serve --max-tokens-default), within the context
# and --max-tokens: Claude Code and opencode ask 32,000; Codex, Continue, llm and Aider send nothing,
# and one answer caught in a repetition loop would otherwise hold its slot until the context is full.
DEFAULT_ANSWER_TOKENS = 32768
# Seconds a stream may stay silent (queued, or prefilling a long prompt) before a keep-alive goes out:
# clients give up on a silent stream (Claude Code after 300 s), Anthropic's API sends ping events.
KEEPALIVE_SECONDS = 10.0


# The request being answered, for its log line: the routes and the engine note what they learn
# (model, prompt tokens, the job), app.AccessLog writes the line once the answer has gone out.
REQUEST_RECORD: ContextVar[Optional[Dict[str, Any]]] = ContextVar("dflash_request_record", default=None)


def note(**fields) -> None:
    """Add to the current request's log line (nothing outside a request)."""
    record = REQUEST_RECORD.get()
    if record is not None:
        record.update(fields)


@dataclass
class Metrics:
    """What /metrics reports: finished generations plus the server's own counters."""

    totals: RunTotals = field(default_factory=RunTotals)
    errors: int = 0
    cancelled: int = 0
    cancelled_tokens: int = 0  # generated for cancelled requests before they stopped: work nobody received
    queued: int = 0
    last_tps: float = 0.0
    prompt_cache_bytes: int = 0  # measured by the worker after each generation
    prompt_cache_histories: int = 0
    active: int = 0  # sequences decoding or prefilling in the batch (--max-concurrent > 1)
    rows: int = 0  # rows of the batch's last target pass
    waiting: int = 0  # requests waiting for a slot in the batch
    first_token_seconds: float = 0.0  # summed over requests: time from submission to the first token
    first_tokens: int = 0
    last_first_token_seconds: float = 0.0
    started: float = field(default_factory=time.time)
    # The event loop and the worker thread both count: every update holds this lock.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str, delta: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + delta)

    def set(self, **gauges) -> None:
        with self.lock:
            for name, value in gauges.items():
                setattr(self, name, value)

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.first_token_seconds += seconds
            self.first_tokens += 1
            self.last_first_token_seconds = seconds

    def add(self, last: GenerationResponse) -> None:
        with self.lock:
            self.totals.add(last)
            self.last_tps = last.generation_tps

    def prometheus(self, model: str, prompt_cache_budget: int, block_stats=None) -> str:
        """The metrics in Prometheus' text format; ``block_stats`` (the pair's ``BlockStats``) adds
        the block-size controller's time: its cycles and the share of them spent exploring."""
        t = self.totals
        rows = [
            ("dflash_requests_total", "counter", "Completed generation requests", t.runs),
            ("dflash_request_errors_total", "counter", "Requests answered with an error", self.errors),
            ("dflash_requests_cancelled_total", "counter", "Generations cancelled (the client left, or the server stopped)", self.cancelled),
            ("dflash_cancelled_generated_tokens_total", "counter", "Tokens generated for cancelled requests before they stopped",
             self.cancelled_tokens),
            ("dflash_queue_depth", "gauge", "Generations waiting or running", self.queued),
            ("dflash_prompt_tokens_total", "counter", "Prompt tokens received", t.prompt_tokens),
            ("dflash_cached_prompt_tokens_total", "counter", "Prompt tokens reused from the prefix cache", t.cached_prompt_tokens),
            ("dflash_prompt_cache_bytes", "gauge", "Memory held by the prefix cache (caches and checkpoints)", self.prompt_cache_bytes),
            ("dflash_prompt_cache_budget_bytes", "gauge", "The prefix cache's memory budget (--prompt-cache-gb)", prompt_cache_budget),
            ("dflash_prompt_cache_histories", "gauge", "Token histories the prefix cache keeps", self.prompt_cache_histories),
            ("dflash_generated_tokens_total", "counter", "Tokens generated", t.tokens),
            ("dflash_generation_tokens_per_second", "gauge", "Decode speed over all requests", t.tokens_per_second),
            ("dflash_last_generation_tokens_per_second", "gauge", "Decode speed of the last request", self.last_tps),
            ("dflash_tokens_per_cycle", "gauge", "Committed tokens per target step", t.tokens_per_cycle),
            ("dflash_acceptance_rate", "gauge", "Accepted share of drafted tokens", t.acceptance_rate),
            ("dflash_active_sequences", "gauge", "Generations in the batch (decoding or prefilling)", self.active),
            ("dflash_rows_per_pass", "gauge", "Rows of the batch's last target pass (sequences x block)", self.rows),
            ("dflash_waiting_requests", "gauge", "Requests waiting for a slot in the batch", self.waiting),
            ("dflash_time_to_first_token_seconds_sum", "counter", "Seconds from submission to the first token, summed",
             self.first_token_seconds),
            ("dflash_time_to_first_token_seconds_count", "counter", "Requests that got a first token", self.first_tokens),
            ("dflash_last_time_to_first_token_seconds", "gauge", "Time to first token of the latest request",
             self.last_first_token_seconds),
        ]
        if block_stats is not None:
            rows += [
                ("dflash_auto_cycle_seconds_total", "counter", "Wall time of the cycles block_tokens=auto chose",
                 block_stats.seconds),
                ("dflash_auto_probe_seconds_total", "counter",
                 "Of which cycles that explored (probes, shadows, optimistic choices), within the controller's time budget",
                 block_stats.probe_seconds),
            ]
        out = []
        for name, kind, doc, value in rows:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f'{name}{{model="{model}"}} {value}']
        out += ["# HELP dflash_cycles_total Target steps after the prompt, by draft block size (1: plain decoding)",
                "# TYPE dflash_cycles_total counter"]
        for block, cycles in sorted(t.block_histogram.items()):
            out.append(f'dflash_cycles_total{{model="{model}",block_tokens="{block}"}} {cycles}')
        return "\n".join(out) + "\n"


@dataclass(eq=False)  # a job is itself, hashable by identity (the engine keeps a set of the live ones)
class Job:
    prompt: Any
    options: Dict[str, Any]
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Why the server cancelled it (told to the client as a 503); None: the client went away.
    cancel_reason: Optional[str] = None
    last: Optional[GenerationResponse] = None  # the latest token's response (for the request's log line)
    error: Optional[str] = None  # why the generation failed, if it did
    submitted: float = 0.0  # perf_counter at submission (time to first token)
    # Events the worker emitted that the event loop has not taken yet, and whether their hand-over
    # is scheduled: a cycle commits several tokens at once, and waking the loop for each one (a
    # write to its self-pipe, a task switch, the GIL passed back and forth with the worker) cost
    # requests one after another 8% of their time on a 2-core machine (docs/benchmarks.md).
    outbox: Deque[tuple] = field(default_factory=deque)
    handing_over: bool = False

    def cancel(self, reason: Optional[str] = None) -> None:
        self.cancel_reason = self.cancel_reason or reason
        self.cancelled.set()

    def emit(self, kind: str, payload=None) -> None:
        """From the worker's thread: queue an event for the request's handler, waking the event loop
        once for all the events emitted before it runs."""
        self.outbox.append((kind, payload))
        if self.handing_over:
            return
        self.handing_over = True
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the event loop is closed (the server stopped): nobody is listening
            pass

    def _hand_over(self) -> None:
        """On the event loop: every event emitted so far into the queue, in order. (The flag is
        cleared first: an event emitted meanwhile is either taken here or schedules the next call.)"""
        self.handing_over = False
        while self.outbox:
            self.queue.put_nowait(self.outbox.popleft())


class Engine:
    """The model, its limits and its caches, shared by every protocol's routes.

    ``context_limit`` None: the longest context that fits this machine's memory (``memory_bytes``
    to say another size) beside the weights and the prefix caches' budget, at most the target's
    ``max_position_embeddings``. ``sampling``: the server's defaults for a request's temperature,
    top_p, top_k, min_p (None: not given), over the target's generation_config.json.
    ``chat_template_args``: passed to the chat template for every request (a request's own
    template arguments win)."""

    def __init__(self, model: DFlashModel, tokenizer, name: str, context_limit: Optional[int] = None,
                 max_tokens_cap: Optional[int] = None, block_tokens: Union[None, int, str] = "auto",
                 prompt_cache_bytes: int = 4 << 30, sampling: Optional[Dict[str, Any]] = None,
                 chat_template_args: Optional[Dict[str, Any]] = None, draft_quant: Optional[str] = None,
                 memory_bytes: Optional[int] = None, max_concurrent: int = DEFAULT_CONCURRENCY,
                 max_queue: int = DEFAULT_QUEUE, max_tokens_default: int = DEFAULT_ANSWER_TOKENS,
                 prompt_store=None, prefill_step_size: Optional[int] = None):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        if max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {max_queue}")
        if max_concurrent > 1 and not model.runner.batches:
            raise ValueError(f"max_concurrent {max_concurrent}: a pipelined target serves one generation at a time "
                             "(its ranks run one request's cycle in lockstep); use 1")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.context_source = "--context-size"
        if context_limit is None:
            context_limit = own = model_context_length(model)
            self.context_source = "the target's max_position_embeddings"
            kept = prompt_cache_bytes if model.runner.keeps_prompt_cache else 0
            fits = memory_context_limit(model, draft_quant, memory_bytes, kept, own)
            if fits is not None and (own is None or fits < own):
                context_limit, self.context_source = fits, "what fits in memory beside the weights and --prompt-cache-gb"
        self.context_limit = context_limit
        self.max_tokens_cap, self.block_tokens = max_tokens_cap, block_tokens
        if max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be at least 1, got {max_tokens_default}")
        self.max_tokens_default = max_tokens_default
        self.sampling = sampling_defaults(model.target_path, sampling)
        self.chat_template_args = dict(chat_template_args or {})
        self.pending: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        # A pipelined target's caches live on every rank: none are kept between requests.
        # ``prompt_store``: its disk tier (``prompt_store.PromptStore``), written and read on the worker thread.
        self.prompt_caches = PromptCachePool(prompt_cache_bytes if model.runner.keeps_prompt_cache else 0,
                                             store=prompt_store if model.runner.keeps_prompt_cache else None)
        self.jobs: set = set()  # submitted and not done
        self.metrics = Metrics()
        self.aliases: set = set()  # other model ids served silently (--model-alias)
        self.ignored_fields = IgnoredFields()  # what requests sent that is ignored, logged once per route at WARNING
        self.keepalive_seconds = KEEPALIVE_SECONDS
        self._names_seen: set = set()
        # One engine for every request of a model held here, one at a time or several: the scheduler
        # (a request at --max-concurrent 1 is the same computation as at 4). A pipelined target's
        # ranks run one request in lockstep: it runs each through stream_generate (``_run``).
        self.prefill_step_size = prefill_step_size
        self.scheduler = (Scheduler(model, tokenizer, max_concurrent, self.prompt_caches, prefill_step_size)
                          if model.runner.batches else None)
        # Last: the worker uses every field above.
        work = self._work if self.scheduler is None else self._schedule
        threading.Thread(target=work, name="dflash-generate", daemon=True).start()

    def sampling_options(self, temperature=None, top_p=None, top_k=None, min_p=None) -> Dict[str, Any]:
        """A request's sampling as ``stream_generate`` takes it: what it gave, else the defaults."""
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        chosen = {k: (self.sampling[k] if v is None else v) for k, v in given.items()}
        return dict(temp=chosen["temperature"], top_p=chosen["top_p"], top_k=chosen["top_k"], min_p=chosen["min_p"])

    @cached_property
    def grammars(self) -> Grammars:
        """The grammar engine's setup for this tokenizer (structured outputs), made on first use."""
        return Grammars.for_tokenizer(self.tokenizer, self.model.target.args.vocab_size)

    def served_name(self, requested: Optional[str]) -> str:
        """The model id an answer carries: the one the request asked for. Any id is served by the
        loaded model (agents ask for names the user cannot always set: Claude Code's background
        model, sub-agents); one that is neither the served name nor an alias is logged, once."""
        name = requested or self.name
        note(model=name)
        if name != self.name and name not in self.aliases and name not in self._names_seen:
            self._names_seen.add(name)
            LOG.warning("model %r requested: served by %r (the only model here; --model-alias %s lists it)",
                        name, self.name, name)
        return name

    def answer_budget(self, prompt_tokens: int, requested: Optional[int]) -> int:
        """Tokens an answer may have: what was asked (without a number, ``max_tokens_default``),
        within the operator's cap and the context limit, which counts the prompt and the answer
        together. A prompt that leaves no room for an answer is refused (``ContextFull``, with the numbers)."""
        note(prompt_tokens=prompt_tokens)
        limit = self.context_limit
        if limit is not None and prompt_tokens >= limit:
            raise ContextFull(prompt_tokens, limit)
        room = None if limit is None else limit - prompt_tokens
        asked = self.max_tokens_default if requested is None else requested
        return min(b for b in (asked, self.max_tokens_cap, room) if b is not None)

    async def render(self, messages: List[Dict[str, Any]], tools=None, param: str = "messages", **template_kwargs) -> List[int]:
        """The prompt's token ids through the chat template (with the server's
        ``chat_template_args`` under the request's own), off the event loop (a long conversation
        takes a while to render and tokenize); a template error is a 400."""
        template_kwargs = {**self.chat_template_args, **template_kwargs}

        def apply(messages):
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                      **template_kwargs)

        try:
            ids = await asyncio.to_thread(apply, messages)
        except Exception as e:
            late = late_system_as_user(messages)
            if late is None:
                raise APIError(400, f"cannot apply the chat template to these messages: {e}", param=param) from e
            try:  # Qwen's templates take a system message only first: later ones go in as user turns, in place
                ids = await asyncio.to_thread(apply, late)
            except Exception:
                raise APIError(400, f"cannot apply the chat template to these messages: {e}", param=param) from e
            LOG.info("the chat template refused system messages after the first one (%s): sent as user turns", e)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    async def head_end(self, messages: List[Dict[str, Any]], tools, prompt_ids: List[int], **template_kwargs) -> List[int]:
        """Where the prompt's head ends (its leading system or developer messages and its tools, what
        every session of an agent sends alike), as ``checkpoint_at`` for the prefix cache: the
        tokens ``prompt_ids`` shares with the head rendered before a stand-in user turn. So the
        first request of a session that shares a head with a cached one (another session, a restart)
        resumes at the head's end, not at the nearest evenly spaced checkpoint before it. Empty
        without a head, or where the template does not render one."""
        head = []
        for m in messages:
            if m.get("role") not in ("system", "developer"):
                break
            head.append(m)
        if not head and not tools:
            return []
        template_kwargs = {**self.chat_template_args, **template_kwargs}

        def apply():
            return self.tokenizer.apply_chat_template([*head, {"role": "user", "content": "\u2063"}], tools=tools,
                                                      add_generation_prompt=False, tokenize=True, **template_kwargs)

        try:
            ids = await asyncio.to_thread(apply)
        except Exception:  # a template that wants more than a head: no checkpoint asked for
            return []
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        shared = next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(len(ids), len(prompt_ids)))
        return [shared] if 0 < shared < len(prompt_ids) else []

    def submit(self, prompt, options: Dict[str, Any]) -> Job:
        """Queue a generation. Beyond ``max_concurrent`` running and ``max_queue`` waiting, a 503
        that tells the client when to retry."""
        if len(self.jobs) >= self.max_concurrent + self.max_queue:
            raise APIError(503, f"the server is busy: {self.max_concurrent} generations running and {self.max_queue} "
                           f"waiting (--max-queue); retry in {RETRY_AFTER_SECONDS} s", "server_error",
                           code="server_busy", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        job = Job(prompt, {"block_tokens": self.block_tokens, **options}, asyncio.Queue(), asyncio.get_running_loop())
        job.submitted = time.perf_counter()
        self.metrics.count("queued")
        self.jobs.add(job)
        self.pending.put(job)
        note(job=job)
        return job

    def cancel_all(self, reason: str = "the server is shutting down") -> None:
        """Cancel every queued and running generation; their clients get a 503 saying ``reason``."""
        for job in list(self.jobs):
            job.cancel(reason)

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and wait (up to ``timeout`` seconds) until the worker is idle, so that
        nothing is generating while the process exits. A step in flight finishes first."""
        self.cancel_all()
        deadline = time.monotonic() + timeout
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.jobs:
            LOG.warning("a generation was still running %.0f s after the server began to stop", timeout)

    def _work(self) -> None:
        while True:
            self._run(self.pending.get())

    def _schedule(self) -> None:
        """The worker of a model held here: new jobs join the scheduler between rounds (it waits
        for one only when idle); each round is a prefill chunk and a batched cycle. A job that
        cannot be made a request fails alone; a round that fails fails the requests in it, and the
        worker serves on."""
        scheduler = self.scheduler
        while True:
            jobs = [self.pending.get()] if scheduler.idle else []
            while True:
                try:
                    jobs.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            for job in jobs:
                try:
                    scheduler.submit(self._request(job))
                except Exception as e:
                    LOG.exception("cannot schedule a generation")
                    self._failed(job, f"{type(e).__name__}: {e}")
                    self._release(job, None)
            try:
                scheduler.step()
            except Exception:  # a bug outside any one request: fail them all rather than stop serving
                LOG.exception("the scheduler failed")
                scheduler.fail_all(RuntimeError("the scheduler failed"))
            self.metrics.set(active=len(scheduler.active) + len(scheduler.prefilling), rows=scheduler.rows,
                             waiting=len(scheduler.waiting))

    def _request(self, job: Job) -> BatchRequest:
        """The scheduler's view of a job: its responses go to the job's queue, its end to ``_done``."""
        options = {k: v for k, v in job.options.items() if k != "prompt_cache"}
        request = BatchRequest(job.prompt, lambda response: self._emit(job, response), cancelled=job.cancelled.is_set,
                               **options)
        request.on_done = lambda: self._done(job, request)
        return request

    def _emit(self, job: Job, response: GenerationResponse) -> None:
        if job.last is None:
            self.metrics.first_token(time.perf_counter() - job.submitted)
        job.last = response
        if not job.cancelled.is_set():
            job.emit("token", response)

    def _done(self, job: Job, request: BatchRequest) -> None:
        if request.error is not None:
            e = request.error
            LOG.error("generation failed: %s: %s", type(e).__name__, e, exc_info=e)
            self._failed(job, f"{type(e).__name__}: {e}")
        else:
            self._ended(job, job.last)
        self._release(job, job.last)

    def _run(self, job: Job) -> None:
        last = None
        try:
            if not job.cancelled.is_set():  # else cancelled while it waited
                pool = self.prompt_caches if self.model.runner.keeps_prompt_cache else None
                stream = stream_generate(self.model, self.tokenizer, job.prompt, prompt_cache=pool,
                                         prefill_step_size=self.prefill_step_size,
                                         cancelled=job.cancelled.is_set, **job.options)
                for last in stream:
                    if job.last is None:
                        self.metrics.first_token(time.perf_counter() - job.submitted)
                    job.last = last
                    if job.cancelled.is_set():
                        stream.close()
                        break
                    job.emit("token", last)
            self._ended(job, last)
        except PeerLost as e:  # a pipelined target lost a rank: nothing more can be served
            self._failed(job, str(e))
            _stop_process(str(e))
        except Exception as e:  # reported to the client as a 500, logged in full here
            LOG.exception("generation failed")
            self._failed(job, f"{type(e).__name__}: {e}")
        finally:
            self._release(job, last)

    def _ended(self, job: Job, last: Optional[GenerationResponse]) -> None:
        """A generation that finished or was cancelled: counted; a client the server cancelled is told why."""
        if job.cancelled.is_set():
            self.metrics.count("cancelled")
            self.metrics.count("cancelled_tokens", last.generation_tokens if last is not None else 0)
            if job.cancel_reason is not None:
                job.emit("error", (503, job.cancel_reason))
        elif last is not None:
            self.metrics.add(last)

    def _failed(self, job: Job, message: str) -> None:
        self.metrics.count("errors")
        job.error = message
        job.emit("error", (500, message))

    def _release(self, job: Job, last: Optional[GenerationResponse]) -> None:
        """The job is over: the prefix cache's size measured, its place in the queue freed, its stream ended."""
        self.metrics.prompt_cache_bytes = self.prompt_caches.nbytes
        self.metrics.prompt_cache_histories = len(self.prompt_caches.histories)
        self.metrics.count("queued", -1)
        self.jobs.discard(job)
        job.emit("done", last)


def late_system_as_user(messages: List[Dict[str, Any]]) -> Optional[List[Dict[str, Any]]]:
    """The messages with every system message after the first turn as a user message, in place
    (None if there is none): clients send them mid-conversation (Claude Code's reminders, Codex's
    permission updates), and a template that takes one system message, first, refuses them.
    In place rather than merged into the first: the prompt's start, and its prefix cache, stay."""
    if not any(m.get("role") == "system" for m in messages[1:]):
        return None
    return [dict(m, role="user") if i > 0 and m.get("role") == "system" else m for i, m in enumerate(messages)]


def _stop_process(reason: str, grace: float = 0.5) -> None:
    """Exit with status 1 once the failing request's answer had time to leave."""
    def stop():
        sys.stderr.write(f"dflash-mlx: {reason}\n")
        sys.stderr.flush()
        os._exit(1)

    threading.Timer(grace, stop).start()


def current_engine(request: Request) -> Engine:
    """The app's engine, for routes (a FastAPI dependency)."""
    return request.app.state.engine


async def job_events(job: Job, failure_kind: str = "server_error", keepalive: Optional[float] = None):
    """A job's ``token`` and ``done`` events as the worker sends them; an ``error`` becomes an
    ``APIError`` (a 500, or a 503 when the server is stopping; ``failure_kind`` in the protocol's
    words). Tokens already waiting come out as one ``token`` event (their texts joined, the last
    one's statistics): a cycle commits several at once, and a message each would cost the server's
    event loop and the client a message per token for nothing. With ``keepalive``, a
    ``keepalive`` event whenever that many seconds pass without one (the job waits in the queue, or
    prefills). Leaving the loop (a client gone, or the end) cancels the job."""
    held = None  # an event taken while joining tokens, not one: handed on next
    try:
        while True:
            if held is not None:
                (kind, payload), held = held, None
            elif keepalive is None:
                kind, payload = await job.queue.get()
            else:
                try:
                    kind, payload = await asyncio.wait_for(job.queue.get(), keepalive)
                except asyncio.TimeoutError:
                    yield "keepalive", None
                    continue
            if kind == "token" and not job.queue.empty():
                texts = [payload.text]
                while not job.queue.empty():
                    held = job.queue.get_nowait()
                    if held[0] != "token":
                        break
                    (_, payload), held = held, None
                    texts.append(payload.text)
                payload = replace(payload, text="".join(texts))
            if kind == "error":
                raise APIError(*payload, failure_kind)
            yield kind, payload
            if kind == "done":
                return
    finally:
        job.cancelled.set()


async def collect(job: Job, request: Optional[Request], failure_kind: str = "server_error"):
    """The whole answer's text and its last response, for a non-streaming request (whose
    connection is watched meanwhile: a client that gives up frees the model)."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, job)) if request is not None else None
    text, last = "", None
    try:
        async for kind, r in job_events(job, failure_kind):
            if kind == "token":
                text, last = text + r.text, r
    finally:
        if watcher is not None:
            watcher.cancel()
    return text, last


async def cancel_on_disconnect(request: Request, job: Job, every: float = 0.1) -> None:
    """Watch a non-streaming request's connection: a client that gives up frees the model."""
    while not job.cancelled.is_set():
        if await request.is_disconnected():
            job.cancelled.set()
            return
        await asyncio.sleep(every)
