"""Where a request runs: in this process (``Local``), or through the ranks of a pipelined target
(``Pipelined``: rank 0 leads, the others follow).

Both answer the same questions (``leads``, ``keeps_prompt_cache``, ``batches``, ``reads_input``…)
and run a request the same way (``start``), so the API, the server, the bench and the command line
ask what the loaded model can do, not what kind it is. The one thing that differs by a process's
role is ``leads``: the leader takes requests, a follower enters ``follow`` and takes part in them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Container, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import wired_limit

from . import loading
from .block_policy import AutoBlock, BlockTokens
from .models.dflash import DraftArgs, resolve_taps
from .pipeline import Pipeline, PipelinedTarget, stages
from .pipeline.link import Link
from .prompt_cache import PromptCache, PromptCachePool
from .records import Cancelled, Commit
from .sampling import Sampler
from .speculative import speculative, target_only


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


def drafting(model, sampler: Sampler, setting: BlockTokens, use_draft: bool, seed: Optional[int]):
    """The draft to run (None: the target alone) and its block size or ``BlockChooser``."""
    draft = model.draft if use_draft else None
    cap = setting.cap(draft.block_size if draft is not None else None) if use_draft else 1
    if cap == 1:
        return None, None  # no draft slot: plain decoding
    # Auto's choices follow measured times, and a sampled cycle's random draws depend on its size:
    # a seeded sampled request drafts whole blocks, so the seed gives the same text every time.
    # Shadow probes grade drafts by matching greedy tokens: greedy only.
    if setting.auto and (sampler.greedy or seed is None):
        return draft, AutoBlock(model.block_stats, cap, shadow=sampler.greedy)
    return draft, cap


def decode(target, draft, chooser, draft_window: Optional[int], request: DecodeRequest, prompt: mx.array,
           cache=None, draft_cache=None, on_chunk=None, split_at: Sequence[int] = ()) -> Iterator[Commit]:
    """The request's decode loop over ``prompt`` (what the caches do not hold yet): DFlash with a
    draft, else the target alone."""
    r = request
    if draft is not None:
        return speculative(target, draft, prompt, r.sampler, chooser, r.prefill_step_size, draft_window, cache,
                           draft_cache, on_chunk, split_at, r.max_tokens, r.stop_tokens)
    return target_only(target, prompt, r.sampler, r.prefill_step_size, cache, on_chunk, split_at, r.max_tokens,
                       r.stop_tokens)


@dataclass
class Run:
    """A request under way on the leader: its commits, the prompt tokens taken from a prompt cache,
    the ``history`` its committed tokens are recorded in (None: no prompt cache) and the ``pool``
    that history goes back to."""

    steps: Iterator[Commit]
    reused: int = 0
    history: Optional[PromptCache] = None
    pool: Optional[PromptCachePool] = None

    def close(self) -> None:
        """Undo the step in flight (the caches hold exactly the recorded tokens); settle and free
        the history."""
        self.steps.close()
        if self.history is not None:
            self.history.settle()
        if self.pool is not None:
            self.pool.release(self.history)


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
        """The request's decode loop in this process, on the caches of ``prompt_cache`` if given."""
        draft, chooser = drafting(model, request.sampler, BlockTokens.parse(request.block_tokens), request.use_draft,
                                  request.seed)
        if prompt_cache is None:
            def after_chunk(fed: int) -> None:
                if cancelled is not None and cancelled():
                    raise Cancelled

            return Run(decode(model.target, draft, chooser, model.draft_window, request, request.prompt,
                              on_chunk=after_chunk))
        return _on_prompt_cache(model, draft, chooser, request, prompt_cache, checkpoint_at, cancelled)

    def follow(self, model, forever: bool = False) -> None:
        raise RuntimeError("this process runs its own requests: it has no leader to follow")

    def close(self) -> None:
        """Nothing to tell anyone: the process holds everything."""


def _on_prompt_cache(model, draft, chooser, request: DecodeRequest, prompt_cache: Union[PromptCache, PromptCachePool],
                     checkpoint_at: Sequence[int], cancelled: Optional[Callable[[], bool]]) -> Run:
    """The decode loop on a prompt cache's history: only what it does not hold yet is prefilled,
    and the prompt is recorded (with its checkpoints) as the prefill feeds it."""
    pool = prompt_cache if isinstance(prompt_cache, PromptCachePool) else None
    ids = request.prompt.tolist()
    history = pool.take(ids) if pool is not None else prompt_cache
    try:
        reused = history.prepare(model.target, draft, ids, model.draft_window, checkpoint_at)
    except BaseException:
        if pool is not None:
            pool.release(history)  # else it would stay busy, never reused nor evicted
        raise
    split_at = [p - reused for p in history.split_points()]

    def after_chunk(fed: int) -> None:
        history.fed(reused + fed)
        if cancelled is not None and cancelled():
            raise Cancelled

    steps = decode(model.target, draft, chooser, model.draft_window, request, request.prompt[reused:], history.cache,
                   history.draft_cache, after_chunk, split_at)
    return Run(steps, reused, history, pool)


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
    request = DecodeRequest.from_message(message)
    draft, chooser = drafting(model, request.sampler, BlockTokens.parse(request.block_tokens), request.use_draft,
                              request.seed)
    return decode(target, draft, chooser, model.draft_window, request, request.prompt)


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
