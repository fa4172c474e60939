"""One sequence's decode loop over bare target and draft modules: DFlash speculative decoding, or
plain decoding without a draft. It is the driver (``driver.Driver``) with a batch of one, yielding
the ``Commit`` records it hands out: the same protocol as every other request (one prefill rule,
one set of row rules, one way to abandon a cycle). A pipeline's last rank and the tests use it.

The driver dispatches the next cycle before a commit is yielded (one host synchronisation per
cycle), and closing the generator abandons the cycle in flight, so that a consumer that stops
leaves caches holding exactly the committed tokens but the last (the next cycle's input).
"""

from __future__ import annotations

from collections import deque
from typing import Container, Iterator, Optional, Sequence, Union

import mlx.core as mx

from .block_policy import BlockChooser, BlockTokens, FixedBlock
from .driver import Driver, Request
from .models.dflash import DFlashDraft
from .models.qwen3_5 import Model as Target
from .records import Commit
from .sampling import Sampler


def speculative(
    target: Target,
    draft: Optional[DFlashDraft],
    prompt: mx.array,
    sampler: Sampler,
    block_tokens: Union[None, int, BlockChooser] = None,
    prefill_step_size: Optional[int] = None,
    draft_window: Optional[int] = None,
    cache=None,
    draft_cache=None,
    split_at: Sequence[int] = (),
    max_tokens: Optional[int] = None,
    stop_tokens: Container[int] = (),
    row_limit: Optional[int] = None,
    min_rows: Optional[int] = None,
) -> Iterator[Commit]:
    """DFlash decoding: each cycle commits the accepted draft prefix plus one target token
    (``draft`` None, or a block of 1: plain decoding, one token a step).

    ``block_tokens``: a fixed size (default: the draft's block size) or a ``BlockChooser`` asked
    for each cycle's size (``block_policy.AutoBlock``). A cycle of size 1 is a plain decode step
    whose tapped features wait and reach the draft when drafting resumes. Whatever the size asked
    for, a cycle drafts no more than ``max_tokens`` leaves room for. ``cache``/``draft_cache``:
    caches holding a prefix of the sequence already (``prompt`` is what follows); ``split_at``:
    prefill chunk boundaries wanted (positions in ``prompt``, on the grid). ``row_limit`` and
    ``min_rows``: the device's row rules unless given (the tests run a GPU's on the CPU).
    """
    if hasattr(block_tokens, "choose"):
        chooser = block_tokens
    elif draft is None:
        chooser = FixedBlock(1)
    else:
        chooser = FixedBlock(BlockTokens.parse(block_tokens or draft.block_size).cap(draft.block_size))
    driver = Driver(target, draft, draft_window, prefill_step_size=prefill_step_size, row_limit=row_limit,
                    min_rows=min_rows)
    commits: deque = deque()

    def on_commit(commit: Commit) -> bool:
        commits.append(commit)
        return False

    request = Request(prompt, on_commit, sampler, max_tokens, chooser, use_draft=draft is not None,
                      stop_tokens=stop_tokens, cache=cache, draft_cache=draft_cache, split_at=split_at)
    yield from driver.stream(request, commits)
