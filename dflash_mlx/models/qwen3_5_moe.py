"""Qwen3.5/3.6 mixture-of-experts targets (``qwen3_5_moe``: 35B-A3B, 122B-A10B).

The dense target (``qwen3_5``: Gated DeltaNet, gated attention, taps, rollback tape) with a sparse
block as every layer's MLP: ``layers.SparseMoe`` (a router ``Linear(H, E)`` with a float32 softmax,
the top k of it renormalized, SwiGLU experts as mlx-lm's ``SwitchGLU``: the T tokens of a verify
pass go through the experts in one batched gather), plus a shared expert scaled by
``sigmoid(shared_expert_gate)``.

Exactness under verification: a token's experts must not depend on how many tokens are verified
with it. The router is the one place where a near-tie between two experts turns rounding into a
different computation, so up to ``ROW_INDEPENDENT_ROWS`` tokens are routed one token at a time
(each exactly as a decode step computes it) or, for a quantized router on Metal, through the
verify-matmul kernel, whose rows do not depend on each other (``layers.SparseMoe.router_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import mlx.core as mx
import mlx.nn as nn

from . import qwen3_5
from .layers import MLP, ROW_INDEPENDENT_ROWS, SparseMoe, stack_experts  # noqa: F401 (ROW_INDEPENDENT_ROWS: named above)

module_path = qwen3_5.module_path


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_5_moe_text"
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})")


class SparseMoeBlock(SparseMoe):
    """The routed experts (``layers.SparseMoe``) plus the shared expert."""

    def __init__(self, args: ModelArgs):
        H = args.hidden_size
        super().__init__(H, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob)
        self.shared_expert = MLP(H, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.experts(x) + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Model(qwen3_5.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args, feed_forward=SparseMoeBlock)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Every published expert layout -> stacked ``switch_mlp`` experts (``layers.stack_experts``:
        HF's fused ``experts.gate_up_proj``, one tensor per expert, MLX's stacked ``switch_mlp``),
        then the dense mapping."""
        mapped = {}
        for key, value in weights.items():
            path = qwen3_5.module_path(key)
            if path is not None:
                mapped[path] = value
        return super().sanitize(stack_experts(mapped, self.args.num_experts))
