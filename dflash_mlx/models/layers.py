"""Layers the target and the draft share."""

import os
import threading

import mlx.core as mx
import mlx.nn as nn


class MLP(nn.Module):
    """SwiGLU feed-forward (Qwen3 and Qwen3.5 alike)."""

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


_thread_streams = threading.local()  # MLX streams belong to the thread that made them


def side_streams() -> tuple:
    """Streams whose work runs side by side: on the CPU one per core this process may use (MLX
    runs each CPU stream on a thread of its own, and an operation on one core), elsewhere the
    default stream alone (a GPU runs one stream's work in parallel already). Made once per
    calling thread: MLX refuses a stream in any thread but the one that made it."""
    if mx.default_device() != mx.cpu:
        return (mx.default_stream(mx.default_device()),)
    streams = getattr(_thread_streams, "cpu", None)
    if streams is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        count = max(1, min(cores or 1, 8))
        streams = _thread_streams.cpu = (mx.default_stream(mx.cpu),) + tuple(mx.new_stream(mx.cpu) for _ in range(count - 1))
    return streams


def submit_layer(x: mx.array) -> None:
    """Queue a layer's output for evaluation as soon as it is built, on the CPU (elsewhere nothing).

    MLX's CPU ``eval`` sets every operation up on the calling thread and hands it to the stream's
    thread, and blocks the caller while more than ten tasks (of ten operations) wait. A pass
    queued whole at its end therefore runs in lockstep: the stream's thread idles while Python
    builds the graph, and Python waits while most of it runs. Queued layer by layer, the stream
    runs layer i while Python builds layer i+1. The numbers are the same (only when each operation
    runs changes). Measured on this 2-core machine with the demo pair (docs/benchmarks.md,
    "Queuing each layer on the CPU"): through the server four requests at once took 11% less
    time, one at a time 12%. On a GPU ``async_eval`` of a whole pass returns once it is encoded:
    nothing to gain there."""
    if mx.default_device() == mx.cpu:
        mx.async_eval(x)


# Query rows x keys per key head from which the CPU attention runs its key heads on side streams.
# Each side stream's share waits for its inputs and is waited for, which costs more than the second
# core saves on small heads. Measured on this 2-core machine with the demo pair in its decode loop
# (examples/side_streams.py, and the same measurements at lower thresholds): split, a verify block
# of 4 (8 rows per key head) ran 5% slower over 1024 keys, even over 2048, 19% faster over 4096;
# a plain step (2 rows) ran slower over 2048 keys and 21% faster over 8192.
SIDE_STREAM_WORK = 16384


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """Attention of ``queries`` [B, H, T, D] over ``keys`` and ``values`` [B, Hkv, L, D]: the
    numbers of ``mx.fast.scaled_dot_product_attention`` (``mask`` None, "causal" aligned to the
    last key as MLX aligns it, or a boolean array of [T, L], [B, 1, T, L] or [B, H, T, L]), in less
    time on the CPU.

    On a GPU this is MLX's fused kernel. On the CPU MLX falls back to plain operations; here they
    run in a cheaper form with the same products and sums: the query heads that share a key head
    go as rows of one matmul instead of a broadcast batch (each score is still its own dot
    product), and the softmax is taken on float32 scores cast back (MLX's 16-bit softmax computes
    in float32 and rounds the same, but evaluates every exponential twice). The results are
    identical to the bit (tests/test_attention.py). Measured here for the demo's bfloat16 heads
    (4 of 32 over 2 key heads) at 4096 keys (examples/attention_costs.py): a decode row 0.94 ms
    against 1.40, a verify block of 4 rows 2.87 against 3.99; the demo target's plain step at 4k
    17% faster, its block-4 cycle 21% (docs/benchmarks.md, "Attention on the CPU").

    Past ``SIDE_STREAM_WORK`` the key heads go to ``side_streams()``, one per core: MLX runs one
    CPU operation on one core, so one stream leaves the others idle. Each head's numbers are the
    ones it gets on one stream."""
    if mx.default_device() != mx.cpu:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    H, T = queries.shape[1], queries.shape[2]
    n_kv, L = keys.shape[1], keys.shape[2]
    streams = side_streams()
    if n_kv == 1 or len(streams) == 1 or H // n_kv * T * L < SIDE_STREAM_WORK:
        return _cpu_attention(queries, keys, values, scale, mask)
    group, parts = H // n_kv, min(n_kv, len(streams))
    mask, heads = _causal(mask, T, L), []  # the mask built once for every part
    for part in range(parts):  # key heads [a, b) and their query heads on a core of their own
        a, b = n_kv * part // parts, n_kv * (part + 1) // parts
        part_mask = mask
        if mask is not None and mask.ndim == 4 and mask.shape[1] == H:
            part_mask = mask[:, a * group : b * group]
        with mx.stream(streams[part]):
            heads.append(_cpu_attention(queries[:, a * group : b * group], keys[:, a:b], values[:, a:b], scale, part_mask))
    return mx.concatenate(heads, axis=1)


def _causal(mask, T: int, L: int):
    """A named mask as the boolean array it stands for ("causal": aligned to the last key, as MLX
    aligns it); an array or None as it is."""
    if not isinstance(mask, str):
        return mask
    if mask != "causal":
        raise ValueError(f"attention mask {mask!r}: only 'causal' is a named mask")
    return mx.arange(L - T, L)[:, None] >= mx.arange(L)[None] if T > 1 else None


def _cpu_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None) -> mx.array:
    """``attention`` on the CPU on one stream: MLX's fallback's numbers in fewer operations."""
    B, H, T, D = queries.shape
    n_kv, L = keys.shape[1], keys.shape[2]
    group = H // n_kv
    q = (queries * mx.array(scale, queries.dtype)).reshape(B, n_kv, group * T, D)
    scores = q @ keys.swapaxes(-1, -2)
    mask = _causal(mask, T, L)
    if mask is not None:
        if mask.ndim >= 3:  # [..., heads or 1, T, L] -> [..., key heads, group or 1, T, L], as MLX does
            head_axis = mask.shape[-3]
            mask = mx.expand_dims(mask, -3) if head_axis == 1 else mask.reshape(*mask.shape[:-3], n_kv, group, T, L)
        per_group = scores.reshape(B, n_kv, group, T, L)
        scores = mx.where(mask, per_group, mx.array(-float("inf"), scores.dtype)).reshape(B, n_kv, group * T, L)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(scores.dtype)
    return (probs @ values).reshape(B, H, T, D)
