"""Sampling and the speculative acceptance rule.

A ``Sampler`` is mlx-lm's ``make_sampler`` as a value: the same settings with the same defaults
and "off" values, and ``probs`` gives exactly the distribution mlx-lm's sampler draws from, so
that the same filtering applies to target and draft rows alike: that is what makes rejection
sampling reproduce the target's own sampling distribution.

Every random draw of a request (target tokens, draft proposals, acceptance uniforms, residual
and bonus draws) takes a key from the request's own ``Generator``, carried by its ``Sampler``;
MLX's global generator (``mx.random.seed``) is never read nor advanced.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx


class Generator:
    """A request's own random stream: a PRNG key, split for every draw.

    Seeded from the request's seed (any int, taken modulo 2**64), or from OS entropy when there is
    none; the key is made on the first draw (greedy requests never make one)."""

    def __init__(self, seed: Optional[int] = None):
        if seed is not None and not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.seed = secrets.randbits(64) if seed is None else seed % 2**64
        self._key: Optional[mx.array] = None

    def key(self) -> mx.array:
        """A fresh key for one draw (lazy: no host synchronisation)."""
        if self._key is None:
            self._key = mx.random.key(self.seed)
        self._key, key = mx.random.split(self._key)
        return key


@dataclass(frozen=True)
class Sampler:
    """Sampling settings, as mlx-lm's ``make_sampler`` takes them, and a random generator.

    ``temperature`` 0 is greedy (the filters are then ignored, as in mlx-lm). Otherwise the
    untempered log-probabilities go through top-p (on when ``0 < top_p < 1``), then min-p (on
    when ``min_p > 0``; the ``min_tokens_to_keep`` most likely tokens always survive it), then
    top-k (on when ``top_k > 0``), each on the previous one's output exactly as mlx-lm's
    ``apply_top_p`` / ``apply_min_p`` / ``apply_top_k``, and the survivors are sampled from
    ``softmax(logprobs / temperature)``. Differences from mlx-lm, all outside what it defines:
    ``top_k`` at or above the vocabulary keeps every token, as does ``min_tokens_to_keep`` above
    it (mlx-lm raises for both), and out-of-range settings are refused here, at construction,
    naming the value (mlx-lm ignores some, e.g. ``top_p`` 1.5, and raises for others at the first
    draw).

    Only ``temperature`` may be given by position; the rest are keywords (the field order is
    mlx-lm's argument order). The generator is a new one from OS entropy unless given;
    ``for_request(seed)`` gives these settings with a fresh generator for one request.
    """

    temperature: float = 0.0
    _: KW_ONLY
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    generator: Optional[Generator] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1] (0 or 1 = off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name, low, off in (("min_tokens_to_keep", 1, ""), ("top_k", 0, " (0 = off)")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}{off}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.generator is None:
            object.__setattr__(self, "generator", Generator())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def settings(self) -> Dict[str, Any]:
        """The settings alone (``Sampler(**settings)`` rebuilds them, with a new generator)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "generator"}

    def for_request(self, seed: Optional[int] = None) -> "Sampler":
        """These settings with a generator of their own: seeded, or from OS entropy."""
        return dataclasses.replace(self, generator=Generator(seed))

    def key(self) -> mx.array:
        """A key for one random draw, from this sampler's generator."""
        return self.generator.key()

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution (float32, rows sum to 1) mlx-lm's sampler draws from for ``logits``.

        Computed in float32 from ``logits - logsumexp(logits)`` (mlx-lm's log-probs; it keeps the
        logits' dtype). Top-k is applied last, as in mlx-lm, so only the k largest log-probs can
        survive: those k are found by partition (``argpartition``, as mlx-lm's top-k), not by a
        sort of the vocabulary (248k entries on Qwen3.5, on every target and draft row of every
        cycle), and top-p and min-p run on them alone, top-p with the whole row's mass (every
        token above a candidate is a candidate, so the mass above it is the same). When several
        tokens tie for the k-th place both keep exactly k of them, chosen by ``argpartition``;
        with top-p or min-p also on, mlx-lm partitions their output instead of the log-probs, so
        which of the tied (equally likely) tokens survive may differ.
        """
        if self.greedy:
            raise ValueError("a greedy sampler (temperature 0) has no distribution to sample: use its argmax")
        x = logits.astype(mx.float32)
        scale = 1.0 / self.temperature
        vocab = x.shape[-1]
        top_p, min_p = 0 < self.top_p < 1, self.min_p > 0
        top_k = 0 < self.top_k < vocab
        if not (top_p or min_p or top_k):
            return mx.softmax(x * scale, axis=-1)
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if not top_k:
            return mx.softmax(self._top_p_min_p(logprobs) * scale, axis=-1)
        index = mx.argpartition(-logprobs, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        total = mx.exp(logprobs).sum(axis=-1, keepdims=True) if top_p else None
        kept = self._top_p_min_p(mx.take_along_axis(logprobs, index, axis=-1), total)
        return mx.put_along_axis(mx.zeros_like(logprobs), index, mx.softmax(kept * scale, axis=-1), axis=-1)

    def _top_p_min_p(self, logprobs: mx.array, total: Optional[mx.array] = None) -> mx.array:
        """mlx-lm's ``apply_top_p`` then ``apply_min_p`` on log-probs [..., n] (the vocabulary, or
        top-k's candidates with ``total`` the whole row's probability mass)."""
        if 0 < self.top_p < 1:
            ordered = mx.sort(logprobs, axis=-1)
            ordered_probs = mx.exp(ordered)
            above = mx.cumsum(ordered_probs, axis=-1, reverse=True, inclusive=False)
            if total is None:
                total = above[..., :1] + ordered_probs[..., :1]
            dropped = (above >= self.top_p * total).sum(axis=-1, keepdims=True)
            threshold = mx.take_along_axis(ordered, dropped, axis=-1)
            logprobs = mx.where(logprobs < threshold, -mx.inf, logprobs)
        if self.min_p > 0:
            floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(self.min_p)
            remove = logprobs < floor
            keep = min(self.min_tokens_to_keep, logprobs.shape[-1])
            if keep > 1:
                top = mx.argpartition(logprobs, kth=-keep, axis=-1)[..., -keep:]
                remove = mx.put_along_axis(remove, top, mx.array(False), axis=-1)
            logprobs = mx.where(remove, -mx.inf, logprobs)
        return logprobs

    def __call__(self, logits: mx.array) -> mx.array:
        """Token ids for the last axis of ``logits`` (mlx-lm's sampler interface)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return categorical(self.probs(logits), self.key())


def categorical(probs: mx.array, key: mx.array) -> mx.array:
    """One draw per row of ``probs``, with ``key`` (a request's, never the global generator)."""
    return mx.random.categorical(mx.log(probs), key=key)


def propose(draft_logits: mx.array, sampler: Sampler) -> Tuple[mx.array, mx.array | None]:
    """Draft tokens [n] (and their distributions [n, V] when sampling) from logits [n, V]."""
    if sampler.greedy:
        return mx.argmax(draft_logits, axis=-1), None
    q = sampler.probs(draft_logits)
    return categorical(q, sampler.key()), q


def accept(
    target_logits: mx.array, proposals: mx.array, draft_probs: mx.array | None, sampler: Sampler
) -> Tuple[mx.array, mx.array]:
    """How many of the draft's ``proposals`` survive, and the target's token after them.

    ``target_logits`` [n+1, V] are the verify logits over ``[t_last, d_1..d_n]``; row i
    predicts the token after position i. Greedy: the longest prefix where ``d_i`` is the
    target's argmax. Sampling: standard speculative rejection sampling (accept ``d_i`` with
    probability ``min(1, p/q)``; on the first rejection draw from ``norm(max(p - q, 0))``; if
    all are accepted draw the bonus from the last row), every draw with the sampler's keys.
    Both results stay on the device.
    """
    n = proposals.shape[0]
    if sampler.greedy:
        return _greedy_accept(target_logits, proposals)
    p = sampler.probs(target_logits)
    p_d = mx.take_along_axis(p[:n], proposals[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(draft_probs, proposals[:, None], axis=-1)[:, 0]
    ok = mx.random.uniform(shape=(n,), key=sampler.key()) * q_d < p_d
    accepted = mx.cumprod(ok.astype(mx.int32)).sum()
    residual = mx.maximum(p[:n] - draft_probs, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # p == q leaves no residual mass; any rejection is then impossible, keep p to stay finite.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:n])
    candidates = categorical(mx.concatenate([residual, p[n:]], axis=0), sampler.key())
    return accepted, candidates[accepted]


@mx.compile
def _greedy_accept(target_logits: mx.array, proposals: mx.array) -> Tuple[mx.array, mx.array]:
    # Compiled: a handful of tiny ops per cycle cost more to dispatch than to run on CPU.
    choice = mx.argmax(target_logits, axis=-1)
    accepted = mx.cumprod((proposals == choice[: proposals.shape[0]]).astype(mx.int32)).sum()
    return accepted, choice[accepted]


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[List[int]] = None,
) -> Sampler:
    """mlx-lm's ``make_sampler``: the same arguments, defaults and distribution, as a ``Sampler``.

    XTC is accepted only off (``xtc_probability`` 0, the default): XTC removes the likely tokens
    at random per step, a distribution that rejection sampling would have to reproduce for draft
    and target alike; a positive ``xtc_probability`` raises ``ValueError``.
    """
    if xtc_probability > 0:
        raise ValueError(f"XTC sampling is not supported (xtc_probability={xtc_probability}): leave it 0")
    return Sampler(temp, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep, top_k=top_k)
