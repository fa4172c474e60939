"""Qwen3 dense targets (``qwen3``: Qwen3-0.6B ... 32B, Qwen3-4B/8B among z-lab's DFlash pairs).

A plain transformer: every layer RMSNorm -> grouped-query attention with per-head ``q_norm`` and
``k_norm`` (RMSNorm over each head, before RoPE) -> residual -> RMSNorm -> SwiGLU -> residual.
Nothing but KV caches: a verify pass's rejected rows roll back by a trim (``cache.rollback``), in
sliding-window layers too (``layer_types`` or ``use_sliding_window`` from ``max_window_layers`` on,
as transformers reads them: a ``cache.WindowCache`` each; no Qwen3 release uses one).
Hugging Face checkpoints and mlx-community's (bf16, 4/8-bit) share one layout; RMSNorm weights are
plain gains (not zero-centred as Qwen3.5's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .layers import MLP, Attention, DecoderLayer, TargetModel, TextModel, config_params, drop_unused, make_rope


@dataclass
class ModelArgs:
    model_type: str = "qwen3"
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None  # num_attention_heads unless given
    head_dim: Optional[int] = 128
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # transformers < 5 writes ``rope_theta`` and ``rope_scaling``, transformers 5 ``rope_parameters``
    # (theta, type and scaling together): both are read, the latter winning.
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: Any = None
    use_sliding_window: bool = False
    sliding_window: Optional[int] = None
    max_window_layers: int = 0
    layer_types: Optional[List[str]] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:
            self.rope_theta = self.rope_parameters.get("rope_theta", self.rope_theta)
            self.rope_scaling = self.rope_parameters
        if self.layer_types is None:  # transformers' rule: the layers from max_window_layers on slide
            slide = self.use_sliding_window and self.sliding_window
            self.layer_types = ["sliding_attention" if slide and i >= self.max_window_layers else "full_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"{self.model_type}: layer types {sorted(unknown)} are not attention layers this runs")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) >= 1:
            raise ValueError(f"{self.model_type}: sliding_attention layers need a sliding_window of at least 1, "
                             f"got {self.sliding_window!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    def window(self, layer: int) -> Optional[int]:
        """Layer ``layer``'s sliding window (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "ModelArgs":
        params = config_params(config)
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in params.items() if k in names and v is not None})


def module_path(key: str) -> Optional[str]:
    """A checkpoint's tensor (or module) name as this module tree names it (the same: HF's and
    mlx-community's layouts are this tree's)."""
    return key


def rope(args) -> nn.Module:
    return make_rope(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)


def attention(args, qk_norm: bool = True, layer: int = 0) -> Attention:
    return Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim, rope(args),
                     bias=args.attention_bias, qk_norm_eps=args.rms_norm_eps if qk_norm else None,
                     window=args.window(layer))


def dense_mlp(args, layer: int) -> nn.Module:
    return MLP(args.hidden_size, args.intermediate_size)


class Model(TargetModel):
    """A Qwen3 target: ``layers.TargetModel``'s interface over plain attention layers, each with
    per-head ``q_norm``/``k_norm``. ``feed_forward(args, i)``: layer i's MLP (the mixture of experts
    of ``qwen3_moe``)."""

    def __init__(self, args: ModelArgs, feed_forward=dense_mlp):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        layers = [DecoderLayer(attention(args, layer=i), feed_forward(args, i), args.hidden_size, args.rms_norm_eps)
                  for i in range(args.num_hidden_layers)]
        self.model = TextModel(args.vocab_size, args.hidden_size, layers, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """HF and mlx-community checkpoints name the tensors as this tree does: only what no module
        holds goes (precomputed RoPE tables, a tied head)."""
        return drop_unused(weights, self.args.tie_word_embeddings)
