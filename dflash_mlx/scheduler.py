"""Continuous batching: requests join a shared decode batch after their prefill and leave it
when they finish, each exactly as it would run alone through the same engine.

One scheduling round: the cycles in flight are read back (``decoder.Decoder.resolve``);
cancelled requests leave; waiting ones are admitted while the batch has room (in arrival order);
the requests being prefilled run their chunks, ``BATCH_PREFILL_STEP`` prompt tokens at most in all
(at least one chunk); the next cycle is dispatched for every active request (nothing read back),
and only then are the cycle's commits turned into responses by each request's own ``Responder``,
while that cycle computes (as the single-stream loop dispatches ahead). So active streams pause
for at most one prefill chunk's worth of tokens per round while a long prompt comes in, requests
whose prompts are cached join together, and a cancelled request frees its slot at the next round.
A request that a response finishes (a stop string) while its next cycle is in flight leaves when
that cycle is read back, its caches put back where the cycle found them. Everything runs on the
caller's thread (the server's worker): the prefix caches need no lock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Generator, List, Optional, Sequence, Tuple, Union


from .api import DFlashModel, GenerationResponse, Responder, encode_prompt
from .decoder import Decoder, Pass, batch_min_rows, batch_row_limit, Sequence as DecodeSequence
from .block_policy import BlockTokens, FixedBlock
from .prompt_cache import PromptCache, PromptCachePool
from .runner import drafting
from .records import Commit
from .sampling import Sampler

# Prompt tokens per prefill chunk in the batch, and at most per round in all (at least one chunk
# runs), between the active streams' cycles: what they pause for at most while a prompt comes in.
# 512 rather than the single stream's 2048 (``prefill.default_prefill_step``) keeps that pause a
# quarter as long (measured in docs/benchmarks.md). Every request through the scheduler, alone or
# not, prefills in these chunks, so its caches are what it gets alone (on the CPU any multiple of
# the recurrence's 64-token chunk gives the same bits as 2048, checked; on a GPU attention kernels
# may tile by query count, hence one size for all).
BATCH_PREFILL_STEP = 512


@dataclass(eq=False)
class BatchRequest:
    """One generation in the scheduler: its prompt, settings and where its responses go.

    ``emit(response)`` gets every response; ``cancelled()`` is polled every round. ``done`` is
    set when the request has left (finished, cancelled or failed: ``error``)."""

    prompt: Any
    emit: Callable[[GenerationResponse], None]
    max_tokens: int = 256
    block_tokens: Union[None, int, str] = "auto"
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Sequence[str]] = None
    use_draft: bool = True
    enable_thinking: Optional[bool] = None
    checkpoint_at: Sequence[int] = ()
    cancelled: Callable[[], bool] = lambda: False
    on_done: Optional[Callable[[], None]] = None  # called once the request has left
    # Filled in by the scheduler
    arrived: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None  # seconds from arrival to the first response
    last: Optional[GenerationResponse] = None
    error: Optional[BaseException] = None
    done: bool = False
    _sequence: Optional[DecodeSequence] = None
    _prefill: Optional[Generator] = None
    _respond: Optional[Responder] = None
    _history: Optional[PromptCache] = None
    _reused: int = 0
    _to_feed: int = 0  # prompt tokens its prefill feeds (those the prompt cache does not hold)
    _left: int = 0  # of which still to feed (0: its next prefill step samples the first token)
    _leaving: bool = False  # finished while its next cycle is in flight: leaves when it is read back
    _sat_out: int = 0  # cycles in a row it sat out (a batch-mate's whole block filled the pass): it goes first


@dataclass(eq=False)
class _InFlight:
    """A dispatched cycle not yet read back, and its requests in the pass's order."""

    decoder: Decoder
    cycle: Pass
    requests: List[BatchRequest]


class Scheduler:
    """Runs many requests on one model: at most ``max_active`` decoding at once, the rest waiting
    in arrival order. ``prompt_cache``: the pool every request takes its starting caches from and
    gives its history back to. ``row_limit``, ``min_rows`` and ``shared_calls``: the device's batch
    rules (``Decoder``) unless given (the tests run a GPU's on the CPU)."""

    def __init__(self, model: DFlashModel, tokenizer, max_active: int = 4, prompt_cache: Optional[PromptCachePool] = None,
                 prefill_step_size: Optional[int] = None, row_limit: Optional[int] = None, min_rows: Optional[int] = None,
                 shared_calls: Optional[bool] = None):
        if max_active < 1:
            raise ValueError(f"max_active must be at least 1, got {max_active}")
        row_limit = batch_row_limit() if row_limit is None else row_limit
        min_rows = batch_min_rows() if min_rows is None else min_rows
        if max_active * min_rows > row_limit:
            raise ValueError(f"max_active {max_active}: a pass takes at most {row_limit} rows on this device, at least "
                             f"{min_rows} per sequence (docs/design.md, 'Batched decoding'): at most "
                             f"{row_limit // min_rows} at once")
        if not model.runner.batches:
            raise ValueError("a pipelined target decodes one request at a time: batching needs every layer here")
        self.model, self.tokenizer, self.max_active = model, tokenizer, max_active
        self.prompt_cache = prompt_cache
        self.prefill_step_size = BATCH_PREFILL_STEP if prefill_step_size is None else prefill_step_size
        self.decoders: Dict[bool, Decoder] = {}  # with the draft and without (use_draft False)
        self.row_limit, self.min_rows, self.shared_calls = row_limit, min_rows, shared_calls
        self.waiting: Deque[BatchRequest] = deque()
        self.prefilling: Deque[BatchRequest] = deque()
        self.active: List[BatchRequest] = []
        self.in_flight: List[_InFlight] = []
        self.rows = 0  # rows of the last target pass (all batches of the round)

    def submit(self, request: BatchRequest) -> None:
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.active or self.in_flight)

    def step(self) -> None:
        """One round (see the module's docstring)."""
        answers = self._resolve()
        for queue in (self.waiting, self.prefilling, self.active):
            for r in [r for r in queue if r.cancelled()]:
                self._leave(r)
        while self.waiting and len(self.prefilling) + len(self.active) < self.max_active:
            self._admit(self.waiting.popleft())
        self._prefill_round()
        self._dispatch()
        for r, commit in answers:  # while the next cycle computes
            if not r.done:
                self._respond(r, commit)

    def fail_all(self, error: BaseException) -> None:
        """Every request leaves with ``error`` (a failure outside any one request)."""
        self.in_flight = []
        for r in [*self.waiting, *self.prefilling, *self.active]:
            r.error = r.error or error
            self._leave(r)

    def run(self) -> None:
        """Rounds until every submitted request has left."""
        while not self.idle:
            self.step()

    def _decoder(self, use_draft: bool) -> Decoder:
        if use_draft not in self.decoders:
            self.decoders[use_draft] = Decoder(self.model.target, self.model.draft if use_draft else None, self.row_limit,
                                               self.min_rows, self.shared_calls)
        return self.decoders[use_draft]

    def _admit(self, r: BatchRequest) -> None:
        try:
            if r.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {r.max_tokens}")
            model = self.model
            sampler = Sampler(r.temp, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p).for_request(r.seed)
            draft, chooser = drafting(model, sampler, BlockTokens.parse(r.block_tokens), r.use_draft, r.seed)
            chooser = chooser if chooser is None or hasattr(chooser, "choose") else FixedBlock(chooser)
            ids = encode_prompt(self.tokenizer, r.prompt, r.enable_thinking)
            history = self.prompt_cache.take(ids.tolist()) if self.prompt_cache is not None else None
            r._history = history
            cache = draft_cache = None
            split_at: List[int] = []
            if history is not None:
                r._reused = history.prepare(model.target, draft, ids.tolist(), model.draft_window, r.checkpoint_at)
                cache, draft_cache = history.cache, history.draft_cache
                split_at = [p - r._reused for p in history.split_points()]
            r._respond = Responder(self.tokenizer, ids.size, r._reused, r.stop or [], r.max_tokens, history)
            r._to_feed = r._left = ids.size - r._reused
            r._prefill = self._decoder(draft is not None).start(
                ids[r._reused:], sampler, chooser, cache, draft_cache, model.draft_window, r.max_tokens,
                set(self.tokenizer.eos_token_ids), self.prefill_step_size, split_at)
        except Exception as e:
            r.error = e
            self._leave(r)
            return
        self.prefilling.append(r)

    def _prefill_round(self) -> None:
        """The prefill chunks of this round: the requests coming in, in arrival order, at most
        ``prefill_step_size`` prompt tokens in all (and at least one chunk). Requests whose
        prompts are cached, with a token or a few left to feed, all join the batch in one round
        rather than one every two; a long prompt still runs one chunk per round."""
        budget = self.prefill_step_size
        while self.prefilling:
            r = self.prefilling[0]
            chunk = min(r._left, self.prefill_step_size)  # at most what its next chunk feeds
            if chunk > budget:
                return
            self._prefill_chunk(r)
            budget -= chunk

    def _prefill_chunk(self, r: BatchRequest) -> None:
        try:
            fed = next(r._prefill)
        except StopIteration as finished:
            self.prefilling.remove(r)
            r._sequence, commit = finished.value
            self.active.append(r)
            self._respond(r, commit)
            return
        except Exception as e:
            r.error = e
            self._leave(r)
            return
        r._left = r._to_feed - fed
        if r._history is not None:
            r._history.fed(r._reused + fed)

    def _dispatch(self) -> None:
        """The next cycle of every active request whose stream goes on, one pass per decoder
        (with the draft, without), queued: nothing is read back."""
        self.rows = 0
        for use_draft in (True, False):
            batch = [r for r in self.active if not r._sequence.done and (r._sequence.draft_cache is not None) == use_draft]
            if not batch:
                continue
            decoder = self._decoder(use_draft)
            batch.sort(key=lambda r: -r._sat_out)  # stable: otherwise in arrival order
            going = decoder.fit([r._sequence for r in batch])
            for r in batch:
                r._sat_out = 0 if r._sequence in going else r._sat_out + 1
            batch = [r for r in batch if r._sat_out == 0]
            try:
                cycle = decoder.dispatch(going, undoable=True)
            except Exception as e:  # the whole batch's caches are in doubt: every request in it fails
                self._fail(batch, e)
                continue
            self.rows += decoder.rows
            self.in_flight.append(_InFlight(decoder, cycle, batch))

    def _resolve(self) -> List[Tuple[BatchRequest, Commit]]:
        """Read back the cycles in flight: each going-on request's commit. A request that left (a
        stop string) or was cancelled while its cycle ran is dropped from it: its caches are put
        back where the cycle found them, and it leaves."""
        answers = []
        flights, self.in_flight = self.in_flight, []
        for flight in flights:
            dropped = {i for i, r in enumerate(flight.requests) if r._leaving or r.cancelled()}
            try:
                commits = flight.decoder.resolve(flight.cycle, dropped=dropped)
            except Exception as e:
                self._fail(flight.requests, e)
                continue
            for i, (r, commit) in enumerate(zip(flight.requests, commits)):
                if i in dropped:
                    self._leave(r)
                else:
                    answers.append((r, commit))
        return answers

    def _fail(self, batch: List[BatchRequest], error: BaseException) -> None:
        for r in batch:
            r.error = error
            self._leave(r)

    def _respond(self, r: BatchRequest, commit) -> None:
        for response in r._respond(commit):
            if r.first_token is None:
                r.first_token = time.perf_counter() - r.arrived
            r.last = response
            r.emit(response)
        if r._respond.finished or r._sequence.done:
            if any(r in flight.requests for flight in self.in_flight):
                r._leaving = True  # its next cycle is in flight: it leaves when that is read back
            else:
                self._leave(r)

    def _leave(self, r: BatchRequest) -> None:
        """``r`` leaves: its slot is free, its history goes back to the prompt cache."""
        for queue in (self.waiting, self.prefilling, self.active):
            if r in queue:
                queue.remove(r)
        if r._sequence is not None:
            self._decoder(r._sequence.draft_cache is not None).finish(r._sequence)
        if r._prefill is not None:
            r._prefill.close()
        if self.prompt_cache is not None and r._history is not None:
            r._history.settle()
            self.prompt_cache.release(r._history)
        r._history = None
        r.done = True
        if r.on_done is not None:
            r.on_done()


def batch_generate(model: DFlashModel, tokenizer, prompts: Sequence[Any], max_tokens: Union[int, Sequence[int]] = 128,
                   max_active: Optional[int] = None, verbose: bool = False, **options) -> "BatchResponse":
    """Generate for several prompts at once, as ``mlx_lm.batch_generate`` does: the texts in the
    prompts' order, with statistics. Every prompt goes through the same batched engine as the
    server's requests (``max_active`` at once, default all), each answer the one it gets alone.
    ``options``: those of ``BatchRequest`` (``block_tokens``, ``temp``, ``seed``, ``stop``...)."""
    if not isinstance(model, DFlashModel):
        model = DFlashModel(model)
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"{len(limits)} max_tokens for {len(prompts)} prompts")
    texts = [""] * len(prompts)
    token_ids: List[List[int]] = [[] for _ in prompts]
    scheduler = Scheduler(model, tokenizer, max_active or max(1, len(prompts)))
    requests = []
    tic = time.perf_counter()
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        def emit(response, i=i):
            texts[i] += response.text
            token_ids[i].append(response.token)
        requests.append(BatchRequest(prompt, emit, max_tokens=limit, **options))
        scheduler.submit(requests[-1])
    scheduler.run()
    elapsed = time.perf_counter() - tic
    for r in requests:
        if r.error is not None:
            raise r.error
    response = BatchResponse(texts, [r.last for r in requests], elapsed, token_ids)
    if verbose:
        print(f"[batch_generate] {len(prompts)} prompts: {response.generation_tokens} tokens in {elapsed:.2f} s, "
              f"{response.generation_tps:.1f} tokens/s")
    return response


@dataclass
class BatchResponse:
    """``batch_generate``'s answer: ``texts`` in the prompts' order and what each request's last
    response said (its statistics), with the wall time of the whole batch."""

    texts: List[str]
    responses: List[Optional[GenerationResponse]]
    seconds: float
    token_ids: List[List[int]] = field(default_factory=list)  # each answer's tokens (eos included)

    @property
    def generation_tokens(self) -> int:
        return sum(r.generation_tokens for r in self.responses if r is not None)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.responses if r is not None)

    @property
    def generation_tps(self) -> float:
        """All requests' generated tokens over the batch's wall time (prefill included)."""
        return self.generation_tokens / self.seconds if self.seconds > 0 else 0.0
