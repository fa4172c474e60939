"""Llama 3.x targets (``llama``: Llama-3.1-8B-Instruct among z-lab's DFlash pairs).

A plain transformer: every layer RMSNorm -> grouped-query attention with RoPE -> residual ->
RMSNorm -> SwiGLU -> residual (no per-head norms). Llama 3.1 scales RoPE's low frequencies
(``rope_scaling`` / ``rope_parameters`` with ``rope_type: llama3``: ``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings``), built by ``layers.make_rope``. Nothing
but KV caches: rejected rows roll back by a trim. Hugging Face checkpoints and mlx-community's
share one layout (HF's may carry ``rotary_emb.inv_freq`` tables, dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import mlx.core as mx
import mlx.nn as nn

from . import qwen3
from .layers import MLP, DecoderLayer, TargetModel, TextModel, drop_unused

module_path = qwen3.module_path


@dataclass
class ModelArgs(qwen3.ModelArgs):
    model_type: str = "llama"
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    head_dim: int = None  # hidden_size // num_attention_heads unless given
    vocab_size: int = 128256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    max_position_embeddings: int = 131072
    mlp_bias: bool = False


class Model(TargetModel):
    """A Llama target: ``layers.TargetModel``'s interface over plain attention layers."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        layers = [DecoderLayer(qwen3.attention(args, qk_norm=False),
                               MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias),
                               args.hidden_size, args.rms_norm_eps)
                  for _ in range(args.num_hidden_layers)]
        self.model = TextModel(args.vocab_size, args.hidden_size, layers, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """HF and mlx-community checkpoints name the tensors as this tree does: only what no module
        holds goes (``rotary_emb.inv_freq`` tables, a tied head)."""
        return drop_unused(weights, self.args.tie_word_embeddings)
