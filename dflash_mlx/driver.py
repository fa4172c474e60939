"""The one decode protocol: requests join a shared decode batch after their prefill and leave it
when they finish, each exactly as it would run alone. Every request runs through it: the
server's, ``batch_generate``'s, ``stream_generate``'s (a batch of one), the single-sequence loop
``speculative.speculative`` and a pipeline's last rank.

One round (``Driver.step``): the cycles in flight are read back (``decoder.Decoder.resolve``);
requests that were cancelled, or finished while their next cycle ran (a stop string), leave,
their caches put back where that cycle found them (the one way to abandon a cycle); waiting
requests are admitted while the batch has room (in arrival order); the requests being prefilled
run their chunks, one prefill step's worth of prompt tokens in all (at least one chunk); the next
cycle is dispatched for every active request (nothing read back), and only then are the read-back
commits handed to each request's consumer, while that cycle computes. So a stream's tokens are
handled while its next cycle runs, active streams pause for at most one prefill chunk per round,
and requests whose prompts are cached join together. Everything runs on the caller's thread: the
prefix caches need no lock.

One prefill rule (``prefill.prefill_chunks``: chunk boundaries on the recurrence's grid, one
chunk size for every request of a driver) and one set of row rules (``decoder.batch_row_limit``,
``decoder.batch_min_rows``) hold for a request alone and in a batch alike.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Deque, Dict, Generator, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .block_policy import AutoBlock, BlockChooser, BlockStats, BlockTokens, FixedBlock
from .decoder import Decoder, Pass, batch_min_rows, batch_row_limit, Sequence as DecodeSequence
from .prefill import check_prefill_step
from .prompt_cache import PromptCache, PromptCachePool
from .records import Commit
from .sampling import Sampler


def drafting(draft, block_stats: BlockStats, sampler: Sampler, setting: BlockTokens, seed: Optional[int]):
    """The draft to run (None: the target alone) and its block size or ``BlockChooser``."""
    cap = setting.cap(draft.block_size) if draft is not None else 1
    if cap == 1:
        return None, None  # no draft slot: plain decoding
    # Auto's choices follow measured times, and a sampled cycle's random draws depend on its size:
    # a seeded sampled request drafts whole blocks, so the seed gives the same text every time.
    # Shadow probes grade drafts by matching greedy tokens: greedy only.
    if setting.auto and (sampler.greedy or seed is None):
        return draft, AutoBlock(block_stats, cap, shadow=sampler.greedy)
    return draft, cap


@dataclass(eq=False)
class Request:
    """One generation in the driver: its prompt's token ids, its sampling and budget, where its
    commits go (``on_commit``, which returns True once its consumer wants no more, e.g. a stop
    string) and what it starts from: a prompt-cache ``history`` of its own, else the driver's
    pool, else ``cache``/``draft_cache`` (with ``split_at``: prefill boundaries wanted, positions
    in ``prompt``), else fresh caches. ``cancelled()`` is polled every round; ``done`` is set when
    it has left (finished, cancelled or failed: ``error``), then ``on_done`` is called."""

    prompt: mx.array
    on_commit: Callable[[Commit], bool]
    sampler: Sampler  # with the request's own generator (``Sampler.for_request``)
    max_tokens: Optional[int] = None  # None: until a stop token
    block_tokens: Union[None, int, str, BlockChooser] = "auto"
    seed: Optional[int] = None
    use_draft: bool = True
    stop_tokens: Container[int] = ()
    checkpoint_at: Sequence[int] = ()
    history: Optional[PromptCache] = None
    cache: Optional[list] = None
    draft_cache: Optional[list] = None
    split_at: Sequence[int] = ()
    constraint: Any = None  # a structured output's grammar (``grammar.Constraint``; None: free text)
    cancelled: Callable[[], bool] = lambda: False
    on_done: Optional[Callable[[], None]] = None
    # Filled in by the driver
    arrived: float = field(default_factory=time.perf_counter)
    admitted: Optional[float] = None  # when its prefill began
    reused: int = 0  # prompt tokens its prompt cache held
    first_token: Optional[float] = None  # seconds from arrival to the first commit
    error: Optional[BaseException] = None
    done: bool = False
    _sequence: Optional[DecodeSequence] = None
    _prefill: Optional[Generator] = None
    _history: Optional[PromptCache] = None
    _pooled: bool = False  # its history came from the pool and goes back to it
    _last: List[int] = field(default_factory=list)  # its last committed token: in no cache yet
    _to_feed: int = 0  # prompt tokens its prefill feeds (those the prompt cache does not hold)
    _left: int = 0  # of which still to feed (0: its next prefill step samples the first token)
    _leaving: bool = False  # finished while its next cycle is in flight: leaves when it is read back
    _sat_out: int = 0  # cycles in a row it sat out (a batch-mate's whole block filled the pass): it goes first


@dataclass(eq=False)
class _InFlight:
    """A dispatched cycle not yet read back, and its requests in the pass's order."""

    decoder: Decoder
    cycle: Pass
    requests: List[Request]


class Driver:
    """Runs requests on one target and draft (``draft`` None: plain decoding): at most
    ``max_active`` decoding at once, the rest waiting in arrival order. ``block_stats``: what
    ``auto`` block sizes learn, kept across requests. ``prompt_cache``: the pool a request without
    a history of its own takes its starting caches from and gives its history back to.
    ``prefill_step_size``: prompt tokens per prefill chunk (default: the backend's,
    ``prefill.default_prefill_step``), the same for every request. ``row_limit``, ``min_rows`` and
    ``shared_calls``: the device's batch rules (``Decoder``) unless given (the tests run a GPU's
    on the CPU)."""

    def __init__(self, target, draft=None, draft_window: Optional[int] = None, block_stats: Optional[BlockStats] = None,
                 max_active: int = 1, prompt_cache: Optional[PromptCachePool] = None,
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
        self.target, self.draft, self.draft_window = target, draft, draft_window
        self.block_stats = BlockStats() if block_stats is None else block_stats
        self.max_active, self.prompt_cache = max_active, prompt_cache
        self.prefill_step_size = check_prefill_step(prefill_step_size)
        self.decoders: Dict[bool, Decoder] = {}  # with the draft and without
        self.row_limit, self.min_rows, self.shared_calls = row_limit, min_rows, shared_calls
        self.waiting: Deque[Request] = deque()
        self.prefilling: Deque[Request] = deque()
        self.active: List[Request] = []
        self.in_flight: List[_InFlight] = []
        self.rows = 0  # rows of the last target pass (all batches of the round)

    def submit(self, request: Request) -> None:
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

    def run(self) -> None:
        """Rounds until every submitted request has left."""
        while not self.idle:
            self.step()

    def stream(self, request: Request, outputs: Deque) -> Iterator[Any]:
        """Run ``request`` as a batch of one, yielding what its consumer puts in ``outputs`` as
        the rounds go (each round's after its next cycle was dispatched). Closing the generator
        abandons the request the one way a batch does: it is cancelled, and the cycle in flight is
        put back at the next read-back. The request's error, if any, is raised."""
        abandoned = False
        cancelled = request.cancelled
        request.cancelled = lambda: abandoned or cancelled()
        self.submit(request)
        try:
            while outputs or not request.done:
                while outputs:
                    yield outputs.popleft()
                if not request.done:
                    self.step()
        finally:
            abandoned = True
            while not request.done:
                self.step()
        if request.error is not None:
            raise request.error

    def fail_all(self, error: BaseException) -> None:
        """Every request leaves with ``error`` (a failure outside any one request)."""
        self.in_flight = []
        for r in [*self.waiting, *self.prefilling, *self.active]:
            r.error = r.error or error
            self._leave(r)

    def _decoder(self, use_draft: bool) -> Decoder:
        if use_draft not in self.decoders:
            self.decoders[use_draft] = Decoder(self.target, self.draft if use_draft else None, self.row_limit,
                                               self.min_rows, self.shared_calls)
        return self.decoders[use_draft]

    def _admit(self, r: Request) -> None:
        try:
            if r.max_tokens is not None and r.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {r.max_tokens}")
            r.admitted = time.perf_counter()
            if hasattr(r.block_tokens, "choose"):
                draft, chooser = (self.draft, r.block_tokens) if r.use_draft and self.draft is not None else (None, None)
                if isinstance(chooser, FixedBlock) and chooser.block == 1:
                    draft, chooser = None, None
            else:
                draft, chooser = drafting(self.draft if r.use_draft else None, self.block_stats, r.sampler,
                                          BlockTokens.parse(r.block_tokens), r.seed)
            chooser = chooser if chooser is None or hasattr(chooser, "choose") else FixedBlock(chooser)
            ids = r.prompt.reshape(-1)
            history = r.history
            if history is None and self.prompt_cache is not None:
                history, r._pooled = self.prompt_cache.take(ids.tolist()), True
            r._history = history
            cache, draft_cache, split_at = r.cache, r.draft_cache, list(r.split_at)
            if history is not None:
                r.reused = history.prepare(self.target, draft, ids.tolist(), self.draft_window, r.checkpoint_at)
                cache, draft_cache = history.cache, history.draft_cache
                split_at = [p - r.reused for p in history.split_points()]
            r._to_feed = r._left = ids.size - r.reused
            constrained = {} if r.constraint is None else {"constraint": r.constraint}
            r._prefill = self._decoder(draft is not None).start(
                ids[r.reused:], r.sampler, chooser, cache, draft_cache, self.draft_window, r.max_tokens, r.stop_tokens,
                self.prefill_step_size, split_at, **constrained)
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

    def _prefill_chunk(self, r: Request) -> None:
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
            r._history.fed(r.reused + fed)

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
                cycle = decoder.dispatch(going)
            except Exception as e:  # the whole batch's caches are in doubt: every request in it fails
                self._fail(batch, e)
                continue
            self.rows += decoder.rows
            self.in_flight.append(_InFlight(decoder, cycle, batch))

    def _resolve(self) -> List[Tuple[Request, Commit]]:
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

    def _fail(self, batch: List[Request], error: BaseException) -> None:
        for r in batch:
            r.error = error
            self._leave(r)

    def _respond(self, r: Request, commit: Commit) -> None:
        """``commit`` recorded in the request's history (every committed token but the last is in
        its caches now) and handed to its consumer; the request leaves when either is done."""
        if r._history is not None:
            r._history.extend(r._last + commit.tokens[:-1])
            r._last = commit.tokens[-1:]
        if r.first_token is None:
            r.first_token = time.perf_counter() - r.arrived
        finished = r.on_commit(commit)
        if finished or r._sequence.done:
            if any(r in flight.requests for flight in self.in_flight):
                r._leaving = True  # its next cycle is in flight: it leaves when that is read back
            else:
                self._leave(r)

    def _leave(self, r: Request) -> None:
        """``r`` leaves: its slot is free, its history goes back to the prompt cache."""
        for queue in (self.waiting, self.prefilling, self.active):
            if r in queue:
                queue.remove(r)
        if r._sequence is not None:
            self._decoder(r._sequence.draft_cache is not None).finish(r._sequence)
        if r._prefill is not None:
            r._prefill.close()
        if r._history is not None:
            r._history.settle()
            if r._pooled:
                self.prompt_cache.release(r._history)
        r._history = None
        r.done = True
        if r.on_done is not None:
            r.on_done()
