"""Sampling and the speculative acceptance rule.

A ``Sampler`` turns logits into the probabilities it samples from, so that the same
temperature / top-p / top-k / min-p filtering applies to target and draft alike: that is
what makes rejection sampling reproduce the target's own sampling distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import mlx.core as mx


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: mx.array) -> mx.array:
        """The filtered distribution (float32, rows sum to 1) for sampled decoding.

        Top-k takes the k largest by partition, not a sort of the vocabulary (248k entries on
        Qwen3.5, on every target and draft row of every cycle); with top-k set, top-p sorts only
        those k (every token above a kept one is among them, so the mass above it is the same)."""
        probs = mx.softmax(logits.astype(mx.float32) / self.temperature, axis=-1)
        vocab = probs.shape[-1]
        keep = None
        candidates = probs  # the values top-p has to look at
        if 0 < self.top_k < vocab:
            candidates = mx.topk(probs, self.top_k, axis=-1)
            keep = probs >= candidates.min(axis=-1, keepdims=True)
        if self.top_p < 1.0:
            ordered = mx.sort(candidates, axis=-1)  # ascending
            # A token stays if the mass strictly above it is below top_p.
            total = 1.0 if candidates is probs else ordered.sum(axis=-1, keepdims=True)
            above = total - mx.cumsum(ordered, axis=-1)
            threshold = mx.min(mx.where(above < self.top_p, ordered, mx.inf), axis=-1, keepdims=True)
            nucleus = probs >= threshold
            keep = nucleus if keep is None else keep & nucleus
        if self.min_p > 0:
            floor = probs >= self.min_p * mx.max(probs, axis=-1, keepdims=True)
            keep = floor if keep is None else keep & floor
        if keep is not None:
            probs = mx.where(keep, probs, 0.0)
            probs = probs / probs.sum(axis=-1, keepdims=True)
        return probs

    def __call__(self, logits: mx.array) -> mx.array:
        """Token ids for the last axis of ``logits`` (mlx-lm's sampler interface)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return categorical(self.probs(logits))


def categorical(probs: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(probs))


def propose(draft_logits: mx.array, sampler: Sampler) -> Tuple[mx.array, mx.array | None]:
    """Draft tokens [n] (and their distributions [n, V] when sampling) from logits [n, V]."""
    if sampler.greedy:
        return mx.argmax(draft_logits, axis=-1), None
    q = sampler.probs(draft_logits)
    return categorical(q), q


def accept(
    target_logits: mx.array, drafted: mx.array, draft_probs: mx.array | None, sampler: Sampler
) -> Tuple[mx.array, mx.array]:
    """How many drafted tokens survive, and the target's token after them.

    ``target_logits`` [n+1, V] are the verify logits over ``[t_last, d_1..d_n]``; row i
    predicts the token after position i. Greedy: the longest prefix where ``d_i`` is the
    target's argmax. Sampling: standard speculative rejection sampling (accept ``d_i`` with
    probability ``min(1, p/q)``; on the first rejection draw from ``norm(max(p - q, 0))``; if
    all are accepted draw the bonus from the last row). Both results stay on the device.
    """
    n = drafted.shape[0]
    if sampler.greedy:
        return _greedy_accept(target_logits, drafted)
    p = sampler.probs(target_logits)
    p_d = mx.take_along_axis(p[:n], drafted[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(draft_probs, drafted[:, None], axis=-1)[:, 0]
    ok = mx.random.uniform(shape=(n,)) * q_d < p_d
    accepted = mx.cumprod(ok.astype(mx.int32)).sum()
    residual = mx.maximum(p[:n] - draft_probs, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # p == q leaves no residual mass; any rejection is then impossible, keep p to stay finite.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:n])
    candidates = categorical(mx.concatenate([residual, p[n:]], axis=0))
    return accepted, candidates[accepted]


@mx.compile
def _greedy_accept(target_logits: mx.array, drafted: mx.array) -> Tuple[mx.array, mx.array]:
    # Compiled: a handful of tiny ops per cycle cost more to dispatch than to run on CPU.
    choice = mx.argmax(target_logits, axis=-1)
    accepted = mx.cumprod((drafted == choice[: drafted.shape[0]]).astype(mx.int32)).sum()
    return accepted, choice[accepted]


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """mlx-lm's name for it."""
    return Sampler(temp, top_p, top_k, min_p)
