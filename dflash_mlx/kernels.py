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

Three implementations: the Metal kernels (Apple GPU), the step-by-step reference (the
specification, and the decode step everywhere), and a chunked form for multi-token calls
off Metal. The chunked form solves a block's deltas as one small triangular system
(the WY/UT form of the delta rule), so a verify pass or a prefill chunk costs a handful of
batched operations instead of a few per token: on MLX's CPU backend, where every operation
has a fixed dispatch cost, that is what makes verifying a block cheap.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from typing import Optional, Tuple

import mlx.core as mx

KERNEL_NAMES = ("gated_delta_tape", "tape_replay")
# Set to "reference" to run the pure-MLX functions even where Metal is available.
BACKEND_ENV = "DFLASH_MLX_KERNELS"


def kernel_source(name: str) -> str:
    """The body of a Metal kernel, as shipped in the package (``metal/`` in a checkout)."""
    return resources.files("dflash_mlx.metal").joinpath(f"{name}.metal").read_text()


@functools.lru_cache(maxsize=None)
def _metal_kernel(name: str):
    """Build each kernel once per process."""
    inputs = {
        "gated_delta_tape": ["q", "k", "v", "g", "beta", "state_in", "T"],
        "tape_replay": ["state_in", "k", "g", "delta", "T", "steps"],
    }[name]
    outputs = {"gated_delta_tape": ["y", "state_out", "delta"], "tape_replay": ["state_out"]}[name]
    return mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs, source=kernel_source(name))


def recurrence_mode(k_head_dim: int, k_heads: int, v_head_dim: int, v_heads: int) -> str:
    """What ``gated_delta`` runs for these head shapes now: ``"metal"`` (the kernels, on an Apple
    GPU, for the shapes they support, unless switched off) or the pure-MLX choice
    (``"reference"``, or ``"mlx-cpu"`` / ``"mlx-gpu"``: chunked on CPU for multi-token calls).
    Callers that compile around the recurrence key their compiled graph on it."""
    if os.environ.get(BACKEND_ENV, "auto") == "reference":
        return "reference"
    on_gpu = mx.default_device() == mx.gpu
    if on_gpu and mx.metal.is_available() and k_head_dim % 32 == 0 and v_head_dim % 4 == 0 and v_heads % k_heads == 0:
        return "metal"
    return "mlx-gpu" if on_gpu else "mlx-cpu"


def use_metal(k: mx.array, v: mx.array) -> bool:
    return recurrence_mode(k.shape[-1], k.shape[-2], v.shape[-1], v.shape[-2]) == "metal"


def _template(k: mx.array, v: mx.array):
    _, _, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    return [("InT", k.dtype), ("StT", mx.float32), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)]


def gated_delta_metal(q, k, v, g, beta, state):
    B, T, _, _ = k.shape
    Hv, Dv = v.shape[-2:]
    return _metal_kernel("gated_delta_tape")(
        inputs=[q, k, v.astype(k.dtype), g.astype(mx.float32), beta.astype(k.dtype), state.astype(mx.float32), T],
        template=_template(k, v),
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv)],
        output_dtypes=[k.dtype, mx.float32, mx.float32],
    )


def tape_replay_metal(state, k, g, delta, steps):
    B, T, _, _ = k.shape
    Hv, Dv = delta.shape[-2:]
    return _metal_kernel("tape_replay")(
        inputs=[state.astype(mx.float32), k, g.astype(mx.float32), delta, T, steps],
        template=_template(k, delta),
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[state.shape],
        output_dtypes=[mx.float32],
    )[0]


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


# Tokens per chunk of the chunked form: one triangular solve per chunk.
CHUNK = 64


def _log_decay(g):
    # A decay that underflowed to 0 clears the state; a floor keeps the cumulative sums finite.
    return mx.cumsum(mx.log(mx.maximum(g.astype(mx.float32), 1e-30)).swapaxes(1, 2), axis=-1)


def _head_major(x):
    return x.swapaxes(1, 2).astype(mx.float32)


def _state_after(state, K, lg, delta):
    """S_n = G_n S_0 + sum_s (G_n/G_s) delta_s k_s^T over the chunk (head-major operands)."""
    weights = mx.exp(lg[..., -1:] - lg)[..., None]
    return mx.exp(lg[..., -1])[..., None, None] * state + (delta * weights).swapaxes(-1, -2) @ K


@mx.compile
def _chunk_step(q, k, v, g, beta, state):
    """One chunk, token-major in and out like the reference: ``(y, state, delta)``.

    delta_t = beta_t (v_t - G_t S_0 k_t - sum_{s<t} (G_t/G_s) (k_s.k_t) delta_s) is a unit
    lower-triangular system in the chunk's deltas, solved with one triangular inverse.
    """
    q, k = _expand_heads(q, v.shape[-2]), _expand_heads(k, v.shape[-2])
    Q, K, V = _head_major(q), _head_major(k), _head_major(v)
    lg, b = _log_decay(g), _head_major(beta[..., None])[..., 0]
    T = Q.shape[2]
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    decay = mx.exp(mx.where(causal, lg[..., :, None] - lg[..., None, :], -mx.inf))  # G_t/G_s, s <= t
    strictly_lower = b[..., None] * decay * (K @ K.swapaxes(-1, -2)) * (1 - mx.eye(T))
    start = mx.exp(lg)[..., None]
    state_t = state.swapaxes(-1, -2)  # [B, H, Dk, Dv]
    rhs = b[..., None] * (V - start * (K @ state_t))
    delta = mx.linalg.tri_inv(mx.eye(T) + strictly_lower, upper=False, stream=mx.cpu) @ rhs
    y = start * (Q @ state_t) + ((Q @ K.swapaxes(-1, -2)) * decay) @ delta
    return y.swapaxes(1, 2), _state_after(state, K, lg, delta), delta.swapaxes(1, 2)


@mx.compile
def _replay_chunk(k, g, delta, state):
    k = _expand_heads(k, delta.shape[-2])
    return _state_after(state, _head_major(k), _log_decay(g), _head_major(delta))


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunked recurrence: returns ``(y, final_state, delta_tape)`` like the reference."""
    if q.shape[1] <= chunk:  # a verify block: no slicing (each slice is one more dispatched op)
        y, state, delta = _chunk_step(q, k, v, g, beta, state)
        return y.astype(q.dtype), state, delta
    ys, deltas = [], []
    for s in range(0, q.shape[1], chunk):
        e = s + chunk
        y, state, delta = _chunk_step(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], state)
        ys.append(y)
        deltas.append(delta)
    y = ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)
    return y.astype(q.dtype), state, deltas[0] if len(deltas) == 1 else mx.concatenate(deltas, axis=1)


def tape_replay_chunked(state, k, g, delta, steps: int):
    """Replay as one weighted sum per chunk (the algebra of ``_state_after``)."""
    for s in range(0, steps, CHUNK):
        e = min(s + CHUNK, steps)
        state = _replay_chunk(k[:, s:e], g[:, s:e], delta[:, s:e], state)
    return state


def use_chunked(steps: int) -> bool:
    """Multi-token calls off Metal take the chunked form (``reference`` forces the loop)."""
    return os.environ.get(BACKEND_ENV, "auto") != "reference" and steps > 1 and mx.default_device() == mx.cpu


@mx.compile
def _replay_prefix(state, k, g, delta, steps: int, chunked: bool):
    """A rollback's replay, slicing included, as one compiled graph per (steps, form): a
    handful of tiny operations per layer otherwise, each paying a dispatch on CPU."""
    return (tape_replay_chunked if chunked else tape_replay_reference)(state, k, g, delta, steps)


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
    if use_metal(k, v):
        y, state, delta = gated_delta_metal(q, k, v, g, beta, state)
        return y.astype(q.dtype), state, delta
    if use_chunked(k.shape[1]):
        return gated_delta_chunked(q, k, v, g, beta, state)
    return gated_delta_reference(q, k, v, g, beta, state)


def tape_replay(
    state: mx.array, k: mx.array, g: mx.array, delta: mx.array, steps: int
) -> mx.array:
    """State after the first ``steps`` taped steps, starting from ``state``."""
    if steps == 0:
        return state
    if use_metal(k, delta):
        return tape_replay_metal(state, k, g, delta, steps)
    if steps <= CHUNK:  # a rollback after a verify block
        return _replay_prefix(state, k, g, delta, steps, use_chunked(steps))
    if use_chunked(steps):
        return tape_replay_chunked(state, k, g, delta, steps)
    return tape_replay_reference(state, k, g, delta, steps)
