"""Prefill: a prompt fed to the target in chunks, its tapped features to the draft's context.

``prefill_chunks`` feeds one chunk per ``next`` so that a scheduler can run other sequences' decode
cycles between chunks; ``prefill`` runs it to the end.

One rule places every chunk boundary, so that a prompt's caches and logits are the same bits
however it is fed (from scratch, or from a prefix cache's checkpoint): every boundary but the
last token's sits on ``GRID``, a multiple of the Gated DeltaNet recurrence's chunk, counted from
the start of the sequence. The recurrence's chunked form solves one triangular system per 64
tokens from where its call starts: a call that starts elsewhere groups the tokens otherwise and
rounds otherwise, while a boundary on the grid leaves every group as it was (measured on the demo:
boundaries at 640 or 1472 give the same bits as none; at 700, 1000 or 1435 they do not).
"""

from __future__ import annotations

from typing import Generator, Optional, Sequence

import mlx.core as mx

from .cache import GRID, cache_arrays
from .models.qwen3_5 import Model as Target


# Tokens per prefill chunk, per backend. On a GPU mlx-lm's (its generate_step's 2048). On the CPU,
# measured with the demo pair at 8k tokens (docs/benchmarks.md): 256 to 4096 all within 3% of
# each other once the attention goes in row blocks, peak 37 to 50 MB; 2048 keeps the chunk
# boundaries of the other backends. (It was 512 everywhere before.)
PREFILL_STEP_GPU = 2048
PREFILL_STEP_CPU = 2048


def default_prefill_step() -> int:
    """The prefill chunk for the backend MLX runs on now."""
    return PREFILL_STEP_CPU if mx.default_device() == mx.cpu else PREFILL_STEP_GPU


def check_prefill_step(step_size: Optional[int]) -> int:
    """The prefill chunk to use (``None``: this backend's); one off ``GRID`` is refused."""
    step = default_prefill_step() if step_size is None else step_size
    if isinstance(step, bool) or not isinstance(step, int) or step < GRID or step % GRID:
        raise ValueError(f"prefill_step_size must be a positive multiple of {GRID} (the recurrence's chunk: a chunk "
                         f"boundary elsewhere changes the numbers), got {step_size!r}")
    return step


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
    of the last tokens; ``features_from`` puts it on the grid): the chunks before it run untapped,
    their count told to ``on_skipped``. Every boundary but the last token's lies on ``GRID``
    (counted from the start of the sequence: ``cache`` may hold a prefix already), a boundary
    asked for elsewhere is refused.
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
    step_size = check_prefill_step(step_size)
    at = cache[0].offset if cache else 0  # the sequence's position of the prompt's first token
    off_grid = [p for p in (*split_at, features_from) if 0 < p < prompt.size - 1 and (at + p) % GRID]
    if off_grid:
        raise ValueError(f"prefill boundaries {off_grid} (after {at} cached tokens) are off the {GRID}-token grid")
    # The last token goes alone, as in mlx-lm: the chunks before it only fill the caches, so the
    # last layers' work that feeds nothing but the head (the last attention layer's output where the
    # draft taps no layer after it) is skipped for every prompt position but the last.
    steps = range(step_size - at % step_size, prompt.size, step_size)
    ends = sorted({*steps, *(p for p in (*split_at, features_from) if 0 < p < prompt.size), prompt.size - 1,
                   prompt.size} - {0})
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
