"""``layers.attention``: on the CPU, MLX's own attention numbers to the bit (its fallback's
products and sums in a cheaper form, large heads split over the side streams: the cases past
``SIDE_STREAM_WORK`` run that way), and a query row's result independent of the rows beside it,
which lossless verification rests on (a verify row must be the decode step it stands for)."""

from __future__ import annotations

import itertools
import os

import mlx.core as mx
import pytest

from dflash_mlx.models.layers import SIDE_STREAM_WORK, attention, side_streams

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
HEADS = ((4, 2), (4, 4), (8, 1), (16, 4))  # query heads, key heads
PASSES = ((1, 600), (4, 37), (4, 4096), (16, 1024), (40, 100))  # queries, keys before them
DIMS = (16, 64, 256)  # 256: Qwen3.5's heads


def qkv(dtype, heads, queries, keys, dim=32, seed=0):
    mx.random.seed(seed)
    (H, n_kv) = heads
    return tuple(mx.random.normal(shape).astype(dtype) for shape in
                 ((1, H, queries, dim), (1, n_kv, keys, dim), (1, n_kv, keys, dim)))


@pytest.mark.parametrize("dtype,heads,lengths,dim", list(itertools.product(DTYPES, HEADS, PASSES, DIMS))[::4])
def test_causal_attention_is_mlx_attention(dtype, heads, lengths, dim):
    """Decode (one query, no mask), verify blocks and prefill chunks ("causal"): exactly what
    mx.fast.scaled_dot_product_attention gives."""
    T, past = lengths
    q, k, v = qkv(dtype, heads, T, past + T, dim)
    mask = "causal" if T > 1 else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
    assert mx.array_equal(attention(q, k, v, dim**-0.5, mask), want).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", (1, 3, 64))
def test_boolean_masks_are_mlx_attention(dtype, window):
    """The draft's sliding-window masks (boolean [T, L]: the block sees itself and the context
    keys within the window): exactly MLX's attention under the same mask."""
    T = 4
    n_ctx = SIDE_STREAM_WORK // (2 * T)  # 2 query heads per key head: split over side streams
    q, k, v = qkv(dtype, (4, 2), T, n_ctx + T, seed=window)
    query = mx.arange(T)[:, None]
    key = mx.arange(n_ctx + T)[None] - n_ctx
    mask = ((key >= 0) & (key <= query)) | ((key < 0) & (query - key < window))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert mx.array_equal(attention(q, k, v, 0.2, mask), want).item()


def test_one_side_stream_per_core():
    """On the CPU the key heads of a large pass run on one stream per core (the CI machines have
    two: the cases past SIDE_STREAM_WORK above run split there)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    streams = side_streams()
    assert len(streams) == min(cores, 8) and len(set(streams)) == len(streams)
    assert all(s.device == mx.cpu for s in streams) and side_streams() is streams


def test_each_thread_runs_on_side_streams_of_its_own():
    """MLX refuses a stream in any thread but its maker's, and the server decodes in a worker
    thread after others have loaded and warmed the model: every thread gets its own streams."""
    from concurrent.futures import ThreadPoolExecutor

    q, k, v = qkv(mx.bfloat16, (4, 2), 4, SIDE_STREAM_WORK // 8 + 4)
    here = attention(q, k, v, 0.2, "causal")
    mx.eval(here)

    def in_a_worker():
        out = attention(q, k, v, 0.2, "causal")
        mx.eval(out)
        return out, side_streams()

    with ThreadPoolExecutor(1) as pool:
        there, streams = pool.submit(in_a_worker).result()
    assert mx.array_equal(here, there).item()
    assert streams != side_streams()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verify_row_is_the_decode_step_it_stands_for(dtype):
    """Row i of a causal pass of 8 queries equals a pass of that query alone over the keys up to
    its own: a verify block's logits are the steps' logits, whatever the block size."""
    T, past = 8, 300
    q, k, v = qkv(dtype, (4, 2), T, past + T, seed=7)
    block = attention(q, k, v, 0.2, "causal")
    for i in range(T):
        alone = attention(q[:, :, i : i + 1], k[:, :, : past + i + 1], v[:, :, : past + i + 1], 0.2)
        assert mx.array_equal(block[:, :, i : i + 1], alone).item(), i


@pytest.mark.parametrize("heads_axis", (1, 4))
def test_per_row_and_per_head_masks_are_mlx_attention(heads_axis):
    """Boolean masks with a batch axis and a heads axis (of one, or one per query head): MLX's
    numbers, each row and head under its own mask."""
    B, T = 2, 3
    L = SIDE_STREAM_WORK // (2 * T) + 1  # 2 query heads per key head: split over side streams
    mx.random.seed(heads_axis)
    q, k, v = (mx.random.normal(shape).astype(mx.bfloat16) for shape in ((B, 4, T, 32), (B, 2, L, 32), (B, 2, L, 32)))
    mask = mx.random.uniform(shape=(B, heads_axis, T, L)) < 0.7
    mask[..., -1] = True  # every row sees a key
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert mx.array_equal(attention(q, k, v, 0.2, mask), want).item()
