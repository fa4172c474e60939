"""The decode loops: target alone, and DFlash speculative decoding.

Both yield ``Commit`` records, one per step of the target, so that the API layer treats
them alike. The speculative cycle (docs/design.md, "How it works"): draft a block in one pass, verify it in one
target pass that records the rollback tape, accept, roll the caches back to the committed
prefix, hand the committed tokens' features to the draft.

Both loops dispatch the next step before yielding the current one (one host synchronisation per
step), and closing either generator undoes the step in flight, so that a consumer that stops
leaves caches holding exactly the committed tokens but the last (the next step's input).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Container, Generator, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .block_policy import BlockChooser, BlockTokens, FixedBlock
from .cache import cache_arrays, restore, rollback, snapshot
from .models.dflash import DFlashDraft
from .models.qwen3_5 import Model as Target
from .records import Cancelled, Commit
from .sampling import Sampler, accept

GREEDY = Sampler()  # shadows grade drafts by greedy tokens


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# Tokens per prefill chunk, per backend. On a GPU mlx-lm's (its generate_step's 2048). On the CPU,
# measured with the demo pair at 8k tokens (docs/benchmarks.md): 256 to 4096 all within 3% of
# each other once the attention goes in row blocks, peak 37 to 50 MB; 2048 keeps the chunk
# boundaries of the other backends. (It was 512 everywhere before.)
PREFILL_STEP_GPU = 2048
PREFILL_STEP_CPU = 2048


def default_prefill_step() -> int:
    """The prefill chunk for the backend MLX runs on now."""
    return PREFILL_STEP_CPU if mx.default_device() == mx.cpu else PREFILL_STEP_GPU


def prefill(
    target: Target,
    prompt: mx.array,
    cache: list,
    step_size: int,
    taps: Sequence[int] = (),
    on_features=None,
    on_chunk=None,
    split_at: Sequence[int] = (),
    features_from: int = 0,
    on_skipped=None,
) -> mx.array:
    """Feed the prompt in chunks; returns the last position's logits [V].

    The last token goes alone and the head runs on it only (the other chunks' logits are never
    asked for, and what feeds nothing but the head is never computed for them). Each chunk's
    tapped features go to ``on_features`` (the draft's context cache), which returns the arrays it
    made; they are evaluated after the chunk's target pass, so that memory stays bounded by the
    chunk size and the first draft pass does not pay for the whole prompt's context.
    ``step_size``: tokens per chunk (``None``: ``default_prefill_step()``, this backend's).
    ``on_chunk(fed)`` runs after each chunk with the count of prompt tokens fed so far
    (checkpoints; raising ``Cancelled`` there stops between chunks, caches consistent).
    ``split_at`` adds chunk boundaries (positions in ``prompt``) where a checkpoint is wanted.
    ``features_from``: the first position whose features the draft keeps (its context is a window
    of the last tokens): the chunks before it run untapped, their count told to ``on_skipped``.
    """
    chunks = prefill_chunks(target, prompt, cache, step_size, taps, on_features, split_at, features_from, on_skipped)
    while True:
        try:
            fed = next(chunks)
        except StopIteration as done:
            return done.value
        if on_chunk is not None:
            on_chunk(fed)


def prefill_chunks(
    target: Target,
    prompt: mx.array,
    cache: list,
    step_size: Optional[int],
    taps: Sequence[int] = (),
    on_features=None,
    split_at: Sequence[int] = (),
    features_from: int = 0,
    on_skipped=None,
) -> Generator[int, None, mx.array]:
    """``prefill`` one chunk per ``next``: yields the prompt tokens fed so far after each chunk and
    returns the last position's logits [V]. A scheduler runs decode cycles between the chunks."""
    if prompt.size == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    step_size = step_size or default_prefill_step()
    # The last token goes alone, as in mlx-lm: the chunks before it only fill the caches, so the
    # last layers' work that feeds nothing but the head (the last attention layer's output where the
    # draft taps no layer after it) is skipped for every prompt position but the last.
    ends = sorted({*range(step_size, prompt.size, step_size), *(p for p in (*split_at, features_from) if 0 < p < prompt.size),
                   prompt.size - 1, prompt.size} - {0})
    start = 0
    for end in ends:
        tapped = taps if end > features_from else ()
        logits, features = target.forward(prompt[None, start:end], cache, tapped, last_only=True)
        # The target's pass, then the draft's: in one graph MLX would run the draft's projections
        # of early taps beside the target's last layers, both working sets alive at once.
        mx.eval(*([logits] if end == prompt.size else []), cache_arrays(cache), features if tapped else [])
        if tapped and on_features is not None:
            mx.eval(on_features(features))
        elif not tapped and taps and on_skipped is not None:
            on_skipped(end - start)
        start = end
        mx.clear_cache()  # the chunk's activations go back to the system, as mlx-lm's prefill does
        yield end
    return logits[0, -1]


def features_from(draft_cache: list, count: int) -> int:
    """The first of ``count`` new positions whose context features some draft layer keeps: all of
    them unless every layer keeps a window of the last tokens (a sliding or ``--draft-window``
    draft); then the target's layers after the last tap need not run for the positions before."""
    kept = [getattr(c, "window", None) for c in draft_cache if not getattr(c, "reads_no_context", False)]
    if not kept or any(w is None for w in kept):
        return 0
    return max(count - max(kept), 0)


class _Budget:
    """When a generation is over, so that no step is dispatched past its end."""

    def __init__(self, max_tokens: Optional[int], stop_tokens: Container[int]):
        self.left, self.stop_tokens = max_tokens, stop_tokens

    def spent(self, commit: Commit) -> bool:
        if self.left is not None:
            self.left -= len(commit.tokens)
        return (self.left is not None and self.left <= 0) or any(t in self.stop_tokens for t in commit.tokens)


def target_only(
    target: Target,
    prompt: mx.array,
    sampler: Sampler,
    prefill_step_size: Optional[int] = None,
    cache=None,
    on_chunk=None,
    split_at: Sequence[int] = (),
    max_tokens: Optional[int] = None,
    stop_tokens: Container[int] = (),
) -> Iterator[Commit]:
    """Ordinary decoding, one token per step: the baseline and the reference.

    As mlx-lm's ``generate_step`` does, step n+1 is dispatched before token n is yielded, so the
    device works while the consumer handles it. Nothing is dispatched once ``max_tokens`` tokens
    or a token of ``stop_tokens`` have been committed.
    """
    cache = target.make_cache() if cache is None else cache
    budget = _Budget(max_tokens, stop_tokens)
    logits = prefill(target, prompt, cache, prefill_step_size, on_chunk=on_chunk, split_at=split_at)
    token = sampler(logits)
    while True:
        commit = Commit([token.item()], _logprobs(logits)[None])
        if budget.spent(commit):
            yield commit
            return
        undo = snapshot(cache)
        logits = target.forward(token.reshape(1, 1), cache)[0][0, -1]
        token = sampler(logits)
        mx.async_eval(token)  # step n+1 runs while the consumer handles token n
        try:
            yield commit
        except GeneratorExit:
            restore(cache, undo)
            raise


@dataclass
class _Cycle:
    """A dispatched target step (queued with ``mx.async_eval``; nothing read back yet)."""

    block: int
    logits: mx.array  # [block, V]
    features: mx.array  # tapped features of the fed tokens
    next_token: mx.array
    undo: list  # the target cache's snapshot from before the step
    handed_off: int = 0  # plain steps whose features reached the draft with this cycle
    drafted: Optional[mx.array] = None  # the verified proposals (block > 1)
    accepted: Optional[mx.array] = None
    shadow: Optional[mx.array] = None  # an unverified draft run beside a plain step


def speculative(
    target: Target,
    draft: DFlashDraft,
    prompt: mx.array,
    sampler: Sampler,
    block_tokens: Union[None, int, BlockChooser] = None,
    prefill_step_size: Optional[int] = None,
    draft_window: Optional[int] = None,
    cache=None,
    draft_cache=None,
    on_chunk=None,
    split_at: Sequence[int] = (),
    max_tokens: Optional[int] = None,
    stop_tokens: Container[int] = (),
) -> Iterator[Commit]:
    """DFlash decoding: each step commits the accepted draft prefix plus one target token.

    ``block_tokens``: a fixed size (default: the draft's block size) or a ``BlockChooser`` asked
    for each cycle's size (``block_policy.AutoBlock``). A cycle of size 1 is a plain decode step
    whose tapped features wait in ``pending`` and reach the draft when drafting resumes. Whatever
    the size asked for, a cycle drafts no more than ``max_tokens`` leaves room for.
    """
    chooser = block_tokens if hasattr(block_tokens, "choose") else FixedBlock(
        BlockTokens.parse(block_tokens or draft.block_size).cap(draft.block_size))
    if isinstance(chooser, FixedBlock):
        if chooser.block == 1:  # no draft slot at all: plain decoding
            yield from target_only(target, prompt, sampler, prefill_step_size, cache, on_chunk, split_at, max_tokens, stop_tokens)
            return
    taps = draft.target_layer_ids
    cache = target.make_cache() if cache is None else cache
    draft_cache = draft.make_cache(draft_window) if draft_cache is None else draft_cache
    pending: List[mx.array] = []

    def to_draft(features):
        draft.add_context(features, draft_cache)
        return cache_arrays(draft_cache)

    def hand_off_pending() -> int:
        """The plain steps' features reach the draft in one batch."""
        count = len(pending)
        if pending:
            draft.add_context(mx.concatenate(pending, axis=1), draft_cache)
            pending.clear()
        return count

    def dispatch(token: mx.array) -> _Cycle:
        # A cycle commits at most ``block`` tokens: with ``left`` to go, drafting more verifies rows
        # for nothing; with one left it is a plain step. The chooser is told the size that ran
        # (``_Cycle.block``), so a capped cycle teaches it nothing false.
        left = budget.left
        block = chooser.choose()
        block = block if left is None else min(block, left)
        ahead = chooser.shadow_tokens() if block == 1 else 0
        ahead = ahead if left is None else min(ahead, left - 1)  # a shadow is graded by the tokens after it
        handed_off = hand_off_pending() if block > 1 or ahead else 0
        undo = snapshot(cache)
        if block == 1:  # a plain step; a shadow drafts alongside, unverified (the next tokens grade it)
            shadow = draft.propose(mx.concatenate([token, masks[ahead + 1]]), draft_cache, GREEDY)[0] if ahead else None
            logits, features = target.forward(token[None], cache, taps)
            next_token = sampler(logits[0, -1])
            mx.async_eval(next_token, features, *([shadow] if ahead else []))
            return _Cycle(1, logits[0], features, next_token, undo, handed_off, shadow=shadow)
        drafted, draft_probs = draft.propose(mx.concatenate([token, masks[block]]), draft_cache, sampler)
        mx.async_eval(drafted, draft_probs)  # the draft runs while Python builds the verify graph
        verify_in = mx.concatenate([token, drafted.astype(token.dtype)])
        logits, features = target.forward(verify_in[None], cache, taps, record_tape=True)
        accepted, next_token = accept(logits[0], drafted, draft_probs, sampler)
        mx.async_eval(accepted, next_token, drafted)
        return _Cycle(block, logits[0], features, next_token, undo, handed_off, drafted, accepted)

    def resolve(c: _Cycle) -> Commit:
        """Read the cycle back (its one host synchronisation), roll back, feed the draft."""
        if c.block == 1:
            pending.append(c.features)
            return Commit([c.next_token.item()], _logprobs(c.logits))
        n = c.accepted.item()
        rollback(cache, fed=c.block, keep=n + 1)
        draft.add_context(c.features[:, : n + 1], draft_cache)
        tokens = c.drafted.tolist()[:n] + [c.next_token.item()]  # evaluated: no slice op, no second sync
        return Commit(tokens, _logprobs(c.logits[: n + 1]), drafted=c.block - 1, accepted=n)

    def skip_draft(count: int) -> None:
        for c in draft_cache:
            c.advance(count)

    budget = _Budget(max_tokens, stop_tokens)
    first_kept = features_from(draft_cache, prompt.size)
    for c in draft_cache:  # room for the prompt's features (and a first block) in one growth
        if hasattr(c, "reserve"):
            c.reserve(prompt.size - first_kept + draft.block_size)
    logits = prefill(target, prompt, cache, prefill_step_size, taps, to_draft, on_chunk, split_at, first_kept, skip_draft)
    token = sampler(logits).reshape(1)
    masks = {b: mx.full((b - 1,), draft.mask_token_id, dtype=token.dtype) for b in range(2, draft.block_size + 1)}
    commit, resolved = Commit([token.item()], _logprobs(logits)[None]), time.perf_counter()
    while not budget.spent(commit):
        cycle = dispatch(token)  # queued before the consumer sees the last commit
        try:
            yield commit
        except GeneratorExit:  # the consumer stopped: undo the cycle in flight
            restore(cache, cycle.undo)
            hand_off_pending()
            raise
        commit = resolve(cycle)
        # The cycle's cost runs from the previous read-back to this one: it includes building
        # the graph, the hand-off and whatever the consumer did with the previous tokens.
        now, started = time.perf_counter(), resolved
        resolved = now
        chooser.observe(block=cycle.block, accepted=commit.accepted, seconds=now - started, committed=commit.tokens,
                        proposals=cycle.shadow.tolist() if cycle.shadow is not None else [],
                        handed_off=cycle.handed_off, context=cache[0].offset)
        token = cycle.next_token.reshape(1)
    hand_off_pending()  # a finished stream leaves the draft's cache level with the target's
    yield commit
