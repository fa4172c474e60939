"""The single-stream decode loops: the target alone, and DFlash speculative decoding.

Both yield ``Commit`` records, one per step of the target, so that the API layer treats them alike.
The speculative cycle is ``decoder.Decoder``'s (docs/design.md, "How it works"): draft a block in
one pass, verify it in one target pass that records the rollback tape, accept, roll the caches back
to the committed prefix, hand the committed tokens' features to the draft.

Both loops dispatch the next step before yielding the current one (one host synchronisation per
step), and closing either generator undoes the step in flight, so that a consumer that stops
leaves caches holding exactly the committed tokens but the last (the next step's input).
"""

from __future__ import annotations

import time
from typing import Container, Iterator, Optional, Sequence, Union

import mlx.core as mx

from .block_policy import BlockChooser, BlockTokens, FixedBlock
from .cache import restore, snapshot
from .decoder import Decoder
from .models.dflash import DFlashDraft
from .models.qwen3_5 import Model as Target
from .prefill import prefill
from .records import Budget, Commit, logprobs
from .sampling import Sampler


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
    budget = Budget(max_tokens, stop_tokens)
    logits = prefill(target, prompt, cache, prefill_step_size, on_chunk=on_chunk, split_at=split_at)
    token = sampler(logits)
    while True:
        commit = Commit([token.item()], logprobs(logits)[None])
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
    whose tapped features wait and reach the draft when drafting resumes. Whatever the size asked
    for, a cycle drafts no more than ``max_tokens`` leaves room for.
    """
    chooser = block_tokens if hasattr(block_tokens, "choose") else FixedBlock(
        BlockTokens.parse(block_tokens or draft.block_size).cap(draft.block_size))
    if isinstance(chooser, FixedBlock) and chooser.block == 1:  # no draft slot at all: plain decoding
        yield from target_only(target, prompt, sampler, prefill_step_size, cache, on_chunk, split_at, max_tokens, stop_tokens)
        return
    decoder = Decoder(target, draft)
    chunks = decoder.start(prompt, sampler, chooser, cache, draft_cache, draft_window, max_tokens, stop_tokens,
                           prefill_step_size, split_at)
    try:
        while True:
            fed = next(chunks)
            if on_chunk is not None:
                on_chunk(fed)
    except StopIteration as prefilled:
        seq, commit = prefilled.value
    finally:
        chunks.close()
    resolved = time.perf_counter()
    while not seq.done:
        cycle = decoder.dispatch([seq], undoable=True)  # queued before the consumer sees the last commit
        try:
            yield commit
        except GeneratorExit:  # the consumer stopped: undo the cycle in flight
            decoder.undo(cycle)
            raise
        # The cycle's cost runs from the previous read-back to this one: it includes building the
        # graph, the hand-off and whatever the consumer did with the previous tokens.
        (commit,) = decoder.resolve(cycle, since=resolved)
        resolved = cycle.read_at
    decoder.finish(seq)  # a finished stream leaves the draft's cache level with the target's
    yield commit
