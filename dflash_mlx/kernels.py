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


def use_metal(k: mx.array, v: mx.array) -> bool:
    """The Metal kernels run on an Apple GPU, for the shapes they support, unless switched off."""
    return (
        os.environ.get(BACKEND_ENV, "auto") != "reference"
        and mx.default_device() == mx.gpu
        and mx.metal.is_available()
        and k.shape[-1] % 32 == 0
        and v.shape[-1] % 4 == 0
        and v.shape[-2] % k.shape[-2] == 0
    )


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
    return gated_delta_reference(q, k, v, g, beta, state)


def tape_replay(
    state: mx.array, k: mx.array, g: mx.array, delta: mx.array, steps: int
) -> mx.array:
    """State after the first ``steps`` taped steps, starting from ``state``."""
    if steps == 0:
        return state
    if use_metal(k, delta):
        return tape_replay_metal(state, k, g, delta, steps)
    return tape_replay_reference(state, k, g, delta, steps)
