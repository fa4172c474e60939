"""Layers the target and the draft share."""

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
    17% faster, its block-4 cycle 21% (docs/benchmarks.md, "Attention on the CPU")."""
    if mx.default_device() != mx.cpu:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    B, H, T, D = queries.shape
    n_kv, L = keys.shape[1], keys.shape[2]
    group = H // n_kv
    q = (queries * mx.array(scale, queries.dtype)).reshape(B, n_kv, group * T, D)
    scores = q @ keys.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask {mask!r}: only 'causal' is a named mask")
        mask = mx.arange(L - T, L)[:, None] >= mx.arange(L)[None] if T > 1 else None
    if mask is not None:
        if mask.ndim >= 3:  # [..., heads or 1, T, L] -> [..., key heads, group or 1, T, L], as MLX does
            head_axis = mask.shape[-3]
            mask = mx.expand_dims(mask, -3) if head_axis == 1 else mask.reshape(*mask.shape[:-3], n_kv, group, T, L)
        per_group = scores.reshape(B, n_kv, group, T, L)
        scores = mx.where(mask, per_group, mx.array(-float("inf"), scores.dtype)).reshape(B, n_kv, group * T, L)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(scores.dtype)
    return (probs @ values).reshape(B, H, T, D)
