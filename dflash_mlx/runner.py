"""Where a request runs: in this process (``Local``), or through the ranks of a pipelined target
(``Pipelined``: rank 0 leads, the others follow).

Both answer the same questions (``leads``, ``keeps_prompt_cache``, ``batches``, ``reads_input``…)
and run a request the same way (``start``), so the API, the server, the bench and the command line
ask what the loaded model can do, not what kind it is. The one thing that differs by a process's
role is ``leads``: the leader takes requests, a follower enters ``follow`` and takes part in them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Container, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import wired_limit

from . import loading
from .driver import Driver, Request
from .models.dflash import DraftArgs, resolve_taps
from .pipeline import Pipeline, PipelinedTarget, stages
from .pipeline.link import Link
from .prompt_cache import PromptCache, PromptCachePool
from .records import Commit
from .sampling import Sampler


@dataclass(frozen=True)
class DecodeRequest:
    """What one request asks of the decode loop (on a pipeline, what rank 0 sends the last rank)."""

    prompt: mx.array  # token ids
    max_tokens: int
    block_tokens: Union[None, int, str]
    sampler: Sampler  # with the request's own generator
    seed: Optional[int]
    use_draft: bool
    prefill_step_size: Optional[int]
    stop_tokens: Container[int]
    constraint: Any = None  # a structured output's grammar (``grammar.Constraint``); never sent round a pipeline

    def message(self) -> Dict[str, Any]:
        """The request as JSON for the other ranks (the sampler as its settings and seed)."""
        return {"prompt": self.prompt.tolist(), "max_tokens": self.max_tokens, "block_tokens": self.block_tokens,
                "sampler": self.sampler.settings(), "seed": self.seed, "use_draft": self.use_draft,
                "prefill_step_size": self.prefill_step_size, "stop_tokens": sorted(self.stop_tokens)}

    @classmethod
    def from_message(cls, message: Dict[str, Any]) -> "DecodeRequest":
        seed = message["seed"]
        return cls(mx.array(message["prompt"]), message["max_tokens"], message["block_tokens"],
                   Sampler(**message["sampler"]).for_request(seed), seed, message["use_draft"],
                   message["prefill_step_size"], set(message["stop_tokens"]))


@dataclass
class Run:
    """A request under way on the leader: its commits as they come (closing the stream abandons
    the cycle in flight) and, where it decodes here, the driver's view of it (``request``: the
    prompt tokens a prompt cache held, when its prefill began)."""

    steps: Iterator[Commit]
    request: Optional[Request] = None

    @property
    def reused(self) -> int:
        return self.request.reused if self.request is not None else 0

    @property
    def started(self) -> Optional[float]:
        return self.request.admitted if self.request is not None else None

    def close(self) -> None:
        self.steps.close()


def drive(model, target, request: DecodeRequest, pool: Optional[PromptCachePool] = None,
          history: Optional[PromptCache] = None, checkpoint_at: Sequence[int] = (),
          cancelled: Optional[Callable[[], bool]] = None) -> Run:
    """``request`` through the driver (``driver.Driver``) as a batch of one, on ``target`` (the
    model's, or a pipeline's last stage) and the model's draft: the protocol every request
    follows, alone or batched."""
    driver = Driver(target, model.draft, model.draft_window, model.block_stats, prompt_cache=pool,
                    prefill_step_size=request.prefill_step_size)
    commits: deque = deque()
    r = Request(request.prompt, lambda commit: commits.append(commit) or False, request.sampler, request.max_tokens,
                request.block_tokens, request.seed, request.use_draft, request.stop_tokens, checkpoint_at,
                history=history, constraint=request.constraint, cancelled=cancelled or (lambda: False))
    return Run(driver.stream(r, commits), r)


class Local:
    """Requests decode in this process, which holds the whole pair."""

    leads = True  # it takes requests (prints, serves)
    ranks = 1
    holds_whole_target = True  # every layer is here: memory estimates, logits, mlx-lm's build beside it
    keeps_prompt_cache = True
    batches = True
    returns_logprobs = True
    reads_input = True  # standard input (the keyboard, a pipe)
    exits_cleanly = True
    draft_block_size = draft_kind = None  # of a draft on another process: none

    def describe(self, draft=None) -> Optional[str]:
        """A line for the logs about this process's part (None: it holds everything)."""
        return None

    def start(self, model, request: DecodeRequest, prompt_cache: Union[None, PromptCache, PromptCachePool] = None,
              checkpoint_at: Sequence[int] = (), cancelled: Optional[Callable[[], bool]] = None) -> Run:
        """The request in this process, on the caches of ``prompt_cache`` if given (a history of
        its own, or a pool to take one from and give it back to)."""
        pool = prompt_cache if isinstance(prompt_cache, PromptCachePool) else None
        history = prompt_cache if isinstance(prompt_cache, PromptCache) else None
        return drive(model, model.target, request, pool, history, checkpoint_at, cancelled)

    def follow(self, model, forever: bool = False) -> None:
        raise RuntimeError("this process runs its own requests: it has no leader to follow")

    def close(self) -> None:
        """Nothing to tell anyone: the process holds everything."""


class Pipelined:
    """The target's layers over the ranks of an ``mx.distributed`` group (docs/pipeline.md): rank
    0 leads (sends each request round the ranks and yields the answer), the others follow (the
    last rank runs the decode loop with the draft). Its caches live on every rank, so none are kept
    between requests; its ranks run one request's cycle in lockstep, so it does not batch."""

    holds_whole_target = False
    keeps_prompt_cache = False
    batches = False
    returns_logprobs = False  # they stay on the last rank
    reads_input = False  # mlx.launch forwards no standard input
    # Once a ring group was used from a worker thread, MLX 0.32 sometimes aborts at interpreter exit.
    exits_cleanly = False

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    @property
    def leads(self) -> bool:
        return self.pipeline.drives

    @property
    def ranks(self) -> int:
        return self.pipeline.link.size

    @property
    def draft_block_size(self) -> Optional[int]:
        return self.pipeline.draft_block_size

    @property
    def draft_kind(self) -> Optional[str]:
        return self.pipeline.draft_kind

    def describe(self, draft=None) -> Optional[str]:
        return self.pipeline.describe(draft)

    def start(self, model, request: DecodeRequest, prompt_cache: Union[None, PromptCache, PromptCachePool] = None,
              checkpoint_at: Sequence[int] = (), cancelled: Optional[Callable[[], bool]] = None) -> Run:
        """Rank 0: send the request round the ranks; its commits come back (without log-probs)."""
        if prompt_cache is not None:
            raise ValueError("a pipelined target keeps no prompt cache between requests (prompt_cache must be None)")
        if request.constraint is not None:
            raise ValueError("a pipelined target decodes without a grammar: structured outputs need the whole pair here")
        return Run(self.pipeline.drive(request.message(), cancelled))

    def follow(self, model, forever: bool = False) -> None:
        """A rank other than 0: take part in rank 0's next request (``forever``: in every one, until
        rank 0 closes the pipeline)."""
        run = partial(_last_rank_decode, model)
        with wired_limit(model.target):
            if forever:
                self.pipeline.serve_forever(run)
            else:
                self.pipeline.take_part(run)

    def close(self) -> None:
        """Rank 0: tell every other rank to exit (their ``follow(forever=True)`` returns)."""
        self.pipeline.shutdown()


def _last_rank_decode(model, message: Dict[str, Any], target: PipelinedTarget) -> Iterator[Commit]:
    """The last rank's decode loop for a request from rank 0, exactly as one process runs it."""
    return drive(model, target, DecodeRequest.from_message(message)).steps


class PipelineLayout:
    """Where a pipelined pair's parts go: this rank's stage (planned from the lazily loaded
    weights, so nothing else is read), the draft's taps and block size (every rank forwards the
    tapped features; rank 0 checks block sizes)."""

    def __init__(self, group, target_path: Path, draft_path: Optional[Path], counts):
        self.group, self.rank, self.world = group, group.rank(), group.size()
        self.counts = stages.parse_counts(counts) if isinstance(counts, (str, type(None))) else list(counts)
        self.has_draft = draft_path is not None
        self.taps: List[int] = []
        self.block_size: Optional[int] = None
        self.draft_kind: Optional[str] = None
        self.draft_bytes = 0
        if draft_path is not None:
            args = DraftArgs.from_dict(loading.read_config(draft_path))
            config = loading.read_config(target_path)
            layers = loading.target_module(config).ModelArgs.from_dict(config).num_hidden_layers
            self.taps = resolve_taps(args.target_layer_ids, args.num_hidden_layers, layers)
            self.block_size = args.block_size
            self.draft_kind = loading.draft_class(args).kind_of(args)
            self.draft_bytes = sum(v.nbytes for v in loading.read_weights(draft_path).values())
        self.stage: Optional[stages.Stage] = None

    def stage_of(self, model, weights) -> stages.Stage:
        tied = model.args.tie_word_embeddings
        split = stages.split_pair(weights, model.args.num_hidden_layers, self.world, self.counts, self.draft_bytes,
                                  self.has_draft, tied)
        stages.agree(self.group, split.ranges)
        start, end = split.ranges[self.rank]
        last = self.rank == self.world - 1
        embedding = self.rank == 0 or (last and (self.has_draft or tied))
        self.stage = stages.Stage(self.rank, self.world, start, end, embedding=embedding)
        return self.stage

    def runner(self, target, peer_timeout: float) -> "Pipelined":
        """This rank's part, once ``target`` holds its stage (``stage_of`` was called)."""
        pipeline = Pipeline(Link(self.group, peer_timeout), target, self.stage, self.taps, self.block_size,
                            self.draft_kind)
        return Pipelined(pipeline)
