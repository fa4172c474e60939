"""The tests' oracle for plain decoding: the target alone, one token per step, written apart from
the package's driver (``dflash_mlx.driver``), which decodes every request, plain ones included.
Speculative, batched and cached output is compared with this loop."""

from __future__ import annotations

from typing import Container, Iterator, Optional, Sequence

import mlx.core as mx

from dflash_mlx.cache import restore, snapshot
from dflash_mlx.models.qwen3_5 import Model as Target
from dflash_mlx.prefill import prefill
from dflash_mlx.records import Budget, Commit, logprobs
from dflash_mlx.sampling import Sampler


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
    """Ordinary decoding, one token per step: the reference.

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
