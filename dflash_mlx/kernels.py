"""Gated DeltaNet recurrence with a rollback tape, and tape replay.

Every use of the recurrence in dflash-mlx goes through the two functions here, so a
faster backend (the Metal kernels) only has to match these references.

Shapes (mlx-lm layout):
  q, k:   [B, T, Hk, Dk]   (already L2-normalised; q carries the Dk**-0.5 scale)
  v:      [B, T, Hv, Dv]
  g:      [B, T, Hv]       decay in (0, 1], float32
  beta:   [B, T, Hv]
  state:  [B, Hv, Dv, Dk]  float32
The tape of a step is its innovation ``delta`` [B, T, Hv, Dv] (float32); with ``k`` and
``g`` it is enough to rebuild the state after any prefix of the steps without a single
dot product: ``S = g*S + delta ⊗ k``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx


def _expand_heads(x: mx.array, hv: int) -> mx.array:
    """Repeat key heads so that each value head sees its GQA key head."""
    repeat = hv // x.shape[-2]
    return mx.repeat(x, repeat, axis=-2) if repeat > 1 else x


@mx.compile
def _step(q, k, v, g, beta, state):
    # Same operation order as the replay below, so a replayed state is bit-identical.
    state = state * g[..., None, None]
    kv = (state * k[..., None, :]).sum(axis=-1)
    delta = (v.astype(mx.float32) - kv) * beta.astype(mx.float32)[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y, state, delta


@mx.compile
def _replay_step(k, g, delta, state):
    state = state * g[..., None, None]
    return state + k[..., None, :] * delta[..., None]


def gated_delta_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
) -> Tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX recurrence: returns ``(y, final_state, delta_tape)``."""
    hv = v.shape[-2]
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    ys, deltas = [], []
    for t in range(q.shape[1]):
        y, state, delta = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        deltas.append(delta)
    return mx.stack(ys, axis=1).astype(q.dtype), state, mx.stack(deltas, axis=1)


def tape_replay_reference(
    state: mx.array, k: mx.array, g: mx.array, delta: mx.array, steps: int
) -> mx.array:
    """Pure-MLX replay of the first ``steps`` steps of a tape onto ``state``."""
    k = _expand_heads(k, delta.shape[-2])
    for t in range(steps):
        state = _replay_step(k[:, t], g[:, t], delta[:, t], state)
    return state


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """The recurrence over T steps; returns ``(y, final_state, delta_tape)``."""
    if state is None:
        B, _, _, Dk = k.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    return gated_delta_reference(q, k, v, g, beta, state)


def tape_replay(
    state: mx.array, k: mx.array, g: mx.array, delta: mx.array, steps: int
) -> mx.array:
    """State after the first ``steps`` taped steps, starting from ``state``."""
    if steps == 0:
        return state
    return tape_replay_reference(state, k, g, delta, steps)
