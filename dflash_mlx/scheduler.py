"""Continuous batching of text requests: the server's and ``batch_generate``'s. Each request's
prompt (text, token ids or chat messages) becomes token ids, its sampling settings its own
sampler, and its commits per-token responses with stop strings (``responses.Responder``); it
then runs through the one decode protocol, ``driver.Driver``, with every other request, exactly
as it would run alone (``stream_generate`` runs one through the same driver).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Union

from .api import DFlashModel, GenerationResponse, encode_prompt
from .driver import Driver, Request
from .prompt_cache import PromptCachePool
from .records import Commit
from .responses import Responder
from .sampling import Sampler


@dataclass(eq=False)
class BatchRequest:
    """One generation in the scheduler: its prompt, settings and where its responses go.

    ``emit(response)`` gets every response; ``cancelled()`` is polled every round. ``done`` is
    set when the request has left (finished, cancelled or failed: ``error``); ``driven`` is the
    driver's view of it once submitted."""

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
    constraint: Any = None  # a structured output's grammar (``grammar.Constraint``; None: free text)
    cancelled: Callable[[], bool] = lambda: False
    on_done: Optional[Callable[[], None]] = None  # called once the request has left
    # Filled in by the scheduler
    arrived: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None  # seconds from arrival to the first response
    last: Optional[GenerationResponse] = None
    error: Optional[BaseException] = None
    done: bool = False
    driven: Optional[Request] = None


class Scheduler(Driver):
    """Runs many text requests on one model: at most ``max_active`` decoding at once, the rest
    waiting in arrival order. ``prompt_cache``: the pool every request takes its starting caches
    from and gives its history back to. The other arguments are the driver's."""

    def __init__(self, model: DFlashModel, tokenizer, max_active: int = 4, prompt_cache: Optional[PromptCachePool] = None,
                 prefill_step_size: Optional[int] = None, row_limit: Optional[int] = None, min_rows: Optional[int] = None,
                 shared_calls: Optional[bool] = None):
        if not model.runner.batches:
            raise ValueError("a pipelined target decodes one request at a time: batching needs every layer here")
        super().__init__(model.target, model.draft, model.draft_window, model.block_stats, max_active, prompt_cache,
                         prefill_step_size, row_limit, min_rows, shared_calls)
        self.model, self.tokenizer = model, tokenizer

    def submit(self, request: BatchRequest) -> None:
        """Queue ``request``; one whose prompt or settings are refused leaves at once (``error``)."""
        try:
            request.driven = self._driven(request)
        except Exception as e:
            request.error, request.done = e, True
            if request.on_done is not None:
                request.on_done()
            return
        super().submit(request.driven)

    def _driven(self, r: BatchRequest) -> Request:
        """The driver's request for ``r``: token ids, its own sampler, its commits as responses."""
        if r.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {r.max_tokens}")
        ids = encode_prompt(self.tokenizer, r.prompt, r.enable_thinking)
        sampler = Sampler(r.temp, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p).for_request(r.seed)
        respond = Responder(self.tokenizer, ids.size, r.stop or [], r.max_tokens)

        def on_commit(commit: Commit) -> bool:
            if respond.n == 0:
                respond.start(driven.reused, driven.admitted)
            for response in respond(commit):
                if r.first_token is None:
                    r.first_token = time.perf_counter() - r.arrived
                r.last = response
                r.emit(response)
            return respond.finished

        def on_done() -> None:
            r.error, r.done = driven.error, True
            if r.on_done is not None:
                r.on_done()

        driven = Request(ids, on_commit, sampler, r.max_tokens, r.block_tokens, r.seed, r.use_draft,
                         set(self.tokenizer.eos_token_ids), r.checkpoint_at, constraint=r.constraint,
                         cancelled=r.cancelled, on_done=on_done)
        return driven


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
