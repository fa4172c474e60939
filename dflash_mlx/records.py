"""What the decode loops hand up: a ``Commit`` per target step (with its ``logprobs``), ``Cancelled`` to stop a
prefill, and the ``Budget`` that says when a generation is over
(a leaf: the single-process loops and the pipeline's ranks yield the same records)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, List, Optional

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


def logprobs(logits: mx.array) -> mx.array:
    """Log-probabilities from logits over the last axis (what a ``Commit`` carries)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Budget:
    """When a generation is over, so that no step is dispatched past its end: ``left`` tokens to go
    (None: unbounded) and the tokens that end it."""

    def __init__(self, max_tokens: Optional[int], stop_tokens: Container[int]):
        self.left, self.stop_tokens = max_tokens, stop_tokens

    def spent(self, commit: Commit) -> bool:
        if self.left is not None:
            self.left -= len(commit.tokens)
        return (self.left is not None and self.left <= 0) or any(t in self.stop_tokens for t in commit.tokens)
