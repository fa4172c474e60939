"""The decode loops: target alone, and DFlash speculative decoding.

Both yield ``Commit`` records, one per step of the target, so that the API layer treats
them alike. The speculative cycle (DESIGN.md §3): draft a block in one pass, verify it in one
target pass that records the rollback tape, accept, roll the caches back to the committed
prefix, hand the committed tokens' features to the draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .block_policy import BlockChooser, FixedBlock
from .cache import cache_arrays, rollback
from .models.dflash import DFlashDraft
from .models.qwen3_5 import Model as Target
from .sampling import Sampler, accept, propose


@dataclass
class Commit:
    """Tokens committed by one target step, with the target's log-probs for each."""

    tokens: List[int]
    logprobs: mx.array  # [len(tokens), V]
    drafted: int = 0  # draft proposals verified in this step
    accepted: int = 0  # of which accepted (they are tokens[:accepted])


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def prefill(
    target: Target,
    prompt: mx.array,
    cache: list,
    step_size: int,
    taps: Sequence[int] = (),
    on_features=None,
    on_chunk=None,
    split_at: Sequence[int] = (),
) -> mx.array:
    """Feed the prompt in chunks; returns the last position's logits [V].

    Each chunk's tapped features go to ``on_features`` (the draft's context cache), which returns
    the arrays it made; they are evaluated with the chunk, so that memory stays bounded by the
    chunk size and the first draft pass does not pay for the whole prompt's context.
    ``on_chunk`` runs after each chunk (checkpoints).
    ``split_at`` adds chunk boundaries (positions in ``prompt``) where a checkpoint is wanted.
    """
    if prompt.size == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    ends = sorted({*range(step_size, prompt.size, step_size), *(p for p in split_at if 0 < p < prompt.size), prompt.size})
    start = 0
    for end in ends:
        logits, features = target.forward(prompt[None, start:end], cache, taps)
        start = end
        made = on_features(features) if on_features is not None else None
        mx.eval(logits, cache_arrays(cache), made or [])
        mx.clear_cache()  # the chunk's activations go back to the system, as mlx-lm's prefill does
        if on_chunk is not None:
            on_chunk()
    return logits[0, -1]


def target_only(
    target: Target,
    prompt: mx.array,
    sampler: Sampler,
    prefill_step_size: int = 512,
    cache=None,
    on_chunk=None,
    split_at: Sequence[int] = (),
) -> Iterator[Commit]:
    """Ordinary decoding, one token per step: the baseline and the reference.

    As in ``speculative``, a commit's last token is not in the cache yet when it is yielded.
    """
    cache = target.make_cache() if cache is None else cache
    logits = prefill(target, prompt, cache, prefill_step_size, on_chunk=on_chunk, split_at=split_at)
    while True:
        token = sampler(logits)
        yield Commit([token.item()], _logprobs(logits)[None])
        logits = target.forward(token.reshape(1, 1), cache)[0][0, -1]


def speculative(
    target: Target,
    draft: DFlashDraft,
    prompt: mx.array,
    sampler: Sampler,
    block_tokens: Union[None, int, BlockChooser] = None,
    prefill_step_size: int = 512,
    draft_window: Optional[int] = None,
    cache=None,
    draft_cache=None,
    on_chunk=None,
    split_at: Sequence[int] = (),
) -> Iterator[Commit]:
    """DFlash decoding: each step commits the accepted draft prefix plus one target token.

    ``block_tokens``: a fixed size (default: the draft's block size) or a ``BlockChooser`` asked
    for each cycle's size (``block_policy.AutoBlock``). A cycle of size 1 is a plain decode step
    whose tapped features wait in ``pending`` and reach the draft when drafting resumes.
    """
    chooser = block_tokens if hasattr(block_tokens, "choose") else FixedBlock(block_tokens or draft.block_size)
    if isinstance(chooser, FixedBlock):
        if not 1 <= chooser.block <= draft.block_size:
            raise ValueError(f"block_tokens={block_tokens} must be between 1 and the draft's block size {draft.block_size}")
        if chooser.block == 1:  # no draft slot at all: plain decoding
            yield from target_only(target, prompt, sampler, prefill_step_size, cache, on_chunk, split_at)
            return
    taps = draft.target_layer_ids
    cache = target.make_cache() if cache is None else cache
    draft_cache = draft.make_cache(draft_window) if draft_cache is None else draft_cache

    def to_draft(features):
        draft.add_context(features, draft_cache)
        return cache_arrays(draft_cache)

    logits = prefill(target, prompt, cache, prefill_step_size, taps, to_draft, on_chunk, split_at)
    token = sampler(logits).reshape(1)
    yield Commit([token.item()], _logprobs(logits)[None])
    masks = {b: mx.full((b - 1,), draft.mask_token_id, dtype=token.dtype) for b in range(2, draft.block_size + 1)}
    pending: List[mx.array] = []
    last, started = None, 0.0  # the previous cycle: reported when this one starts, so its time
    while True:  # includes the hand-off and whatever the consumer did with its tokens
        start = time.perf_counter()
        if last is not None:
            chooser.observe(seconds=start - started, **last)
        block, proposals, handed_off = chooser.choose(), [], 0
        ahead = chooser.shadow_tokens() if block == 1 else 0
        if pending and (block > 1 or ahead):  # the plain steps' features reach the draft in one batch
            draft.add_context(mx.concatenate(pending, axis=1), draft_cache)
            pending, handed_off = [], len(pending)
        if block == 1:  # a plain step; a shadow drafts alongside, unverified (the next tokens grade it)
            shadow = []
            if ahead:
                shadow = [mx.argmax(draft(mx.concatenate([token, masks[ahead + 1]])[None], draft_cache)[0], axis=-1)]
                mx.async_eval(shadow)  # runs while Python builds the target's step
            logits, features = target.forward(token[None], cache, taps)
            next_token = sampler(logits[0, -1])
            mx.eval(next_token, features, shadow)
            pending.append(features)
            n, tokens, proposals = 0, [next_token.item()], shadow[0].tolist() if ahead else []
        else:
            draft_logits = draft(mx.concatenate([token, masks[block]])[None], draft_cache)[0]
            drafted, draft_probs = propose(draft_logits, sampler)
            mx.async_eval(drafted, draft_probs)  # the draft runs while Python builds the verify graph
            verify_in = mx.concatenate([token, drafted.astype(token.dtype)])
            logits, features = target.forward(verify_in[None], cache, taps, record_tape=True)
            n_accepted, next_token = accept(logits[0], drafted, draft_probs, sampler)
            mx.eval(n_accepted, next_token, drafted)  # the cycle's one host synchronisation
            n = n_accepted.item()
            rollback(cache, fed=block, keep=n + 1)
            draft.add_context(features[:, : n + 1], draft_cache)
            tokens = drafted.tolist()[:n] + [next_token.item()]  # evaluated: no slice op, no second sync
        last = dict(block=block, accepted=n, committed=tokens, proposals=proposals, handed_off=handed_off)
        started = start
        yield Commit(tokens, _logprobs(logits[0, : n + 1]), drafted=block - 1, accepted=n)
        token = next_token.reshape(1)
