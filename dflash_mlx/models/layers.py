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
