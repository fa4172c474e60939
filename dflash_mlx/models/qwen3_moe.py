"""Qwen3 mixture-of-experts targets (``qwen3_moe``: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B among
z-lab's DFlash pairs).

Qwen3's layers (``qwen3``: per-head ``q_norm``/``k_norm``, KV caches only) with a sparse block as
the MLP of every layer that ``decoder_sparse_step`` picks and ``mlp_only_layers`` leaves alone
(dense SwiGLU there, as transformers builds it): ``layers.SparseMoe``, a router ``Linear(H, E)``
with a float32 softmax, top ``num_experts_per_tok`` renormalized when ``norm_topk_prob``, SwiGLU
experts; no shared expert. The router routes each token of a verify block as a decode step would
(see ``layers.SparseMoe``).

Checkpoints: HF releases store one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj``);
mlx-community's are stacked (``mlp.switch_mlp.*``) with the router at 8 bits, group 64 (mlx-lm's
``quant_predicate``, which ``convert-target`` follows: ``quant_predicate`` here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn

from . import qwen3
from .layers import SparseMoe, stack_experts

module_path = qwen3.module_path


@dataclass
class ModelArgs(qwen3.ModelArgs):
    model_type: str = "qwen3_moe"
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    vocab_size: int = 151936
    num_experts: int = 128
    num_local_experts: int = None  # what transformers 5 writes for num_experts
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        if self.num_local_experts is not None:
            self.num_experts = self.num_local_experts

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (transformers' rule)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def feed_forward(args: ModelArgs, layer: int) -> nn.Module:
    if args.is_sparse(layer):
        return SparseMoe(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok,
                         args.norm_topk_prob)
    return qwen3.dense_mlp(args, layer)


def quant_predicate(path: str, module: nn.Module):
    """mlx-lm's recipe for this model (``mlx_lm.models.qwen3_moe.Model.quant_predicate``): the
    router at 8 bits, group 64 (its rows decide which experts run), everything else as asked."""
    if path.endswith("mlp.gate"):
        return {"group_size": 64, "bits": 8}
    return True


class Model(qwen3.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args, feed_forward=feed_forward)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Every published expert layout -> stacked ``switch_mlp`` experts (``layers.stack_experts``),
        then Qwen3's mapping."""
        return super().sanitize(stack_experts(weights, self.args.num_experts))
