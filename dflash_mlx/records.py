"""What the decode loops hand up: a ``Commit`` per target step, and ``Cancelled`` to stop a prefill
(a leaf: the single-process loops and the pipeline's ranks yield the same records)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import mlx.core as mx


@dataclass
class Commit:
    """Tokens committed by one target step, with the target's log-probs for each."""

    tokens: List[int]
    logprobs: mx.array  # [len(tokens), V]
    drafted: int = 0  # draft proposals verified in this step
    accepted: int = 0  # of which accepted (they are tokens[:accepted])


class Cancelled(Exception):
    """Raised from an ``on_chunk`` callback to stop a prefill between chunks."""
