"""Gemma 4 targets (``gemma4``/``gemma4_text``: gemma-4-31B dense and gemma-4-26B-A4B, a mixture of
experts; ``gemma4_unified``/``gemma4_unified_text``: gemma-4-12B, the same dense decoder beside
encoder-free image and audio projections; all among z-lab's DFlash pairs).

Every layer: RMSNorm -> attention -> RMSNorm -> residual -> RMSNorm -> GeGLU MLP (with, in the
mixture-of-experts release, a routed block beside it, each normed on its own way out) -> RMSNorm
-> residual, times a learned ``layer_scalar``. The attention has per-head ``q_norm``/``k_norm``,
values normed without a gain (``v_norm``), no 1/sqrt(d) scale (the norms set it); its layers
follow ``layer_types``: sliding-window ones (``sliding_window``; RoPE per ``rope_parameters``'s
``sliding_attention``) with ``head_dim``, full ones with ``global_head_dim`` and their own RoPE
(``proportional``: a quarter of each head rotated), and, where ``attention_k_eq_v``, keys reused
as values (``num_global_key_value_heads`` key heads). The embedding's rows are scaled by
sqrt(hidden_size) (``ScaledEmbedding``, so the draft's embedding of a block is the target's); the
logits are soft-capped (``final_logit_softcapping``: ``cap * tanh(logits / cap)``). RMSNorm gains
are plain (not Gemma 3's ``1 + w``). Sliding layers' caches are ``cache.WindowCache``s: rollback
is a trim everywhere.

Not here: the per-layer embeddings and shared KV layers of the small on-device releases
(``hidden_size_per_layer_input``, ``num_kv_shared_layers``; no DFlash draft targets them),
refused by name.

Checkpoints: Hugging Face releases are multimodal (``model.language_model.*`` beside vision and
audio towers, dropped; gemma-4-12B's projections instead, ``model.vision_embedder``,
``model.embed_vision``, ``model.embed_audio``, dropped too) with experts fused
(``experts.gate_up_proj`` [E, 2I, H], gate half first); mlx-community's use mlx-lm's names
(``experts.switch_glu.*``, ``router.proj``; gemma-4-12B's, converted by mlx-vlm,
``language_model.model.*`` beside ``vision_embedder``), quantized or not. ``Model.sanitize`` maps
them all onto this tree (the routed block under ``moe``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from .layers import Attention, DecoderLayer, SparseMoe, TargetModel, TextModel, config_params, drop_unused, make_rope

_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}


@dataclass
class ModelArgs:
    model_type: str = "gemma4_text"
    hidden_size: int = 5376
    intermediate_size: int = 21504
    num_hidden_layers: int = 60
    num_attention_heads: int = 32
    num_key_value_heads: int = 16
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    attention_bias: bool = False
    vocab_size: int = 262144
    rms_norm_eps: float = 1e-6
    rope_parameters: Dict[str, Any] = field(default_factory=lambda: dict(_DEFAULT_ROPE))
    sliding_window: int = 1024
    layer_types: Optional[List[str]] = None
    max_position_embeddings: int = 262144
    final_logit_softcapping: Optional[float] = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    eos_token_id: Any = None
    enable_moe_block: bool = False
    num_experts: Optional[int] = None
    top_k_experts: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    hidden_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_bidirectional_attention: Optional[str] = None
    # transformers 5 saves the full layers' head size and key heads per layer instead of
    # global_head_dim / num_global_key_value_heads: {"3": {"head_dim": 512, ...}, ...}, the keys
    # zero-padded to the widest index ("05" among 48 layers; read as integers, as transformers does)
    per_layer_config: Optional[Dict[Any, Dict[str, Any]]] = None

    def __post_init__(self):
        if self.layer_types is None:  # transformers' default: five sliding layers, then a full one
            self.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.layer_types[-1] != "full_attention":  # transformers forces it (with a warning): so here
            self.layer_types = [*self.layer_types[:-1], "full_attention"]
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"{self.model_type}: layer types {sorted(unknown)} are not attention layers this runs")
        for name in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
            if getattr(self, name):
                raise ValueError(f"{self.model_type} with {name}={getattr(self, name)} (the on-device releases' "
                                 "per-layer embeddings and shared KV layers) is not supported")
        if self.use_bidirectional_attention not in (None, "vision"):
            raise ValueError(f"use_bidirectional_attention={self.use_bidirectional_attention!r}: only causal "
                             "text attention runs here")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_approx"):
            raise ValueError(f"hidden_activation {self.hidden_activation!r}: Gemma 4's is gelu_pytorch_tanh")
        if self.per_layer_config is not None:
            self.per_layer_config = {int(k): v for k, v in self.per_layer_config.items()}
            unknown = {key for own in self.per_layer_config.values() for key in own}
            unknown -= {"head_dim", "num_key_value_heads"}
            if unknown:
                raise ValueError(f"{self.model_type}: per_layer_config overrides {sorted(unknown)}: only head_dim and "
                                 "num_key_value_heads vary by layer here")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size, got "
                             f"{self.num_experts}, {self.top_k_experts}, {self.moe_intermediate_size}")

    def window(self, layer: int) -> Optional[int]:
        """Layer ``layer``'s sliding window (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def head_shape(self, layer: int) -> Tuple[int, int]:
        """Layer ``layer``'s (head size, key heads): a full layer's from ``per_layer_config`` where
        the config has one, else ``global_head_dim`` and, with ``attention_k_eq_v``,
        ``num_global_key_value_heads`` (transformers' rule either way)."""
        if self.per_layer_config is not None:
            own = self.per_layer_config.get(layer, {})
            return own.get("head_dim", self.head_dim), own.get("num_key_value_heads", self.num_key_value_heads)
        if self.layer_types[layer] != "full_attention":
            return self.head_dim, self.num_key_value_heads
        n_kv = self.num_global_key_value_heads if self.attention_k_eq_v and self.num_global_key_value_heads else None
        return self.global_head_dim or self.head_dim, n_kv or self.num_key_value_heads

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "ModelArgs":
        params = config_params(config)
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in params.items() if k in names and v is not None})


_NAMES = (
    (re.compile(r"^model\.language_model\."), "model."),  # Hugging Face's multimodal release
    (re.compile(r"^language_model\.model\."), "model."),  # mlx-lm's multimodal model
    (re.compile(r"^language_model\.lm_head(?=\.|$)"), "lm_head"),
    (re.compile(r"\.router\.proj(?=\.|$)"), ".moe.gate"),
    (re.compile(r"\.router\.(scale|per_expert_scale)$"), r".moe.\1"),
    (re.compile(r"\.experts\.switch_glu(?=\.|$)"), ".moe.switch_mlp"),
)
_MULTIMODAL = ("model.vision_tower", "model.audio_tower", "model.embed_vision", "model.embed_audio",
               "model.multi_modal_projector", "model.vision_embedder", "vision_tower", "multi_modal_projector",
               "audio_tower", "embed_audio", "embed_vision", "vision_embedder")
_FUSED = re.compile(r"^(model\.layers\.\d+)\.experts\.(gate_up_proj|down_proj)$")


def module_path(key: str) -> Optional[str]:
    """A checkpoint's tensor or module name as this tree names it (None: a vision or audio part)."""
    if key.startswith(_MULTIMODAL):
        return None
    for pattern, name in _NAMES:
        key = pattern.sub(name, key)
    return key


class NoScaleRMSNorm(nn.Module):
    """RMSNorm without a gain (Gemma 4's ``v_norm`` and its router's input norm)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, self.eps)


class GeGLU(nn.Module):
    """The experts' activation: tanh-approximated GELU of the gate times the linear half."""

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        return nn.gelu_approx(gate) * up


class MLP(nn.Module):
    """The dense GeGLU feed-forward."""

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Moe(SparseMoe):
    """Gemma 4's routed block: the router reads the stream normed without a gain, times ``scale``
    and 1/sqrt(hidden_size); a float32 softmax over every expert, the top k renormalized, each
    times its ``per_expert_scale``; GeGLU experts (``SparseMoe``: verify blocks routed a token at
    a time)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.top_k_experts,
                         norm_topk_prob=True)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts, activation=GeGLU())
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.norm = NoScaleRMSNorm(args.rms_norm_eps)

    def route(self, x: mx.array):
        h = self.norm(x) * (self.scale * x.shape[-1] ** -0.5)
        indices, weights = super().route(h)
        return indices, weights * self.per_expert_scale[indices].astype(mx.float32)


class Gemma4Attention(Attention):
    """``layers.Attention`` with Gemma 4's norms (``v_norm`` without a gain), scale 1, a head size
    and RoPE per layer type, and keys reused as values in full layers where ``attention_k_eq_v``."""

    def __init__(self, args: ModelArgs, layer: int):
        k_eq_v = args.attention_k_eq_v and args.layer_types[layer] == "full_attention"
        head_dim, n_kv = args.head_shape(layer)
        rope_params = dict(args.rope_parameters.get(args.layer_types[layer]) or {})
        rope = make_rope(head_dim, rope_params.get("rope_theta", 10_000.0), rope_params, args.max_position_embeddings)
        super().__init__(args.hidden_size, args.num_attention_heads, n_kv, head_dim, rope, bias=args.attention_bias,
                         qk_norm_eps=args.rms_norm_eps, window=args.window(layer))
        self.scale = 1.0
        if k_eq_v:
            self.pop("v_proj")
        self.v_norm = NoScaleRMSNorm(args.rms_norm_eps)

    def project(self, x: mx.array, offset):
        B, T, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, T, self.n_heads, -1))
        keys = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)
        values = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1) if "v_proj" in self else keys
        keys, values = self.k_norm(keys), self.v_norm(values)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        return self.rope(queries, offset=offset), self.rope(keys, offset=offset), values.transpose(0, 2, 1, 3)


class Gemma4Layer(DecoderLayer):
    """``layers.DecoderLayer`` (compiled around the cached attention) with Gemma 4's four norms,
    the routed block beside the MLP where the config enables it, and the ``layer_scalar``."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(Gemma4Attention(args, layer), MLP(args.hidden_size, args.intermediate_size), args.hidden_size,
                         args.rms_norm_eps)
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        if args.enable_moe_block:
            self.moe = Moe(args)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(H, eps=eps)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(H, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(H, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def _output(self, x, heads):
        h = x + self.post_attention_layernorm(self.self_attn.output(heads))
        ff = self.mlp(self.pre_feedforward_layernorm(h))
        if "moe" in self:
            routed = self.moe.experts(h, self.pre_feedforward_layernorm_2(h))
            ff = self.post_feedforward_layernorm_1(ff) + self.post_feedforward_layernorm_2(routed)
        return (h + self.post_feedforward_layernorm(ff)) * self.layer_scalar


class ScaledEmbedding:
    """Gemma's embedding as its ``embed_tokens`` returns it: rows times sqrt(hidden_size) (rounded
    to the weight's dtype, as transformers does). The draft embeds its blocks through it; the tied
    head reads the rows unscaled (``as_linear``)."""

    def __init__(self, embedding: nn.Module, scale: float):
        self.embedding, self.scale = embedding, scale

    @property
    def weight(self) -> mx.array:
        return self.embedding.weight

    def __call__(self, ids: mx.array) -> mx.array:
        h = self.embedding(ids)
        return h * mx.array(self.scale, h.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.embedding.as_linear(x)


def quant_predicate(path: str, module: nn.Module):
    """mlx-lm's recipe for Gemma 4 (``mlx_lm.models.gemma4_text.Model.quant_predicate``): the
    router at 8 bits, group 64, everything else as asked."""
    if path.endswith("moe.gate"):
        return {"group_size": 64, "bits": 8}
    return True


class Model(TargetModel):
    """A Gemma 4 target: ``layers.TargetModel``'s interface with the scaled embedding and the
    soft-capped logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        layers = [Gemma4Layer(args, i) for i in range(args.num_hidden_layers)]
        self.model = TextModel(args.vocab_size, args.hidden_size, layers, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def embed_tokens(self) -> ScaledEmbedding:
        return ScaledEmbedding(self.model.embed_tokens, self.args.hidden_size**0.5)

    def logits(self, h: mx.array, last_only: bool = False) -> mx.array:
        out = super().logits(h, last_only)
        cap = self.args.final_logit_softcapping
        return out if cap is None else mx.tanh(out / cap) * cap

    def experts_in_float32(self) -> "Model":
        for layer in self.layers:
            if "moe" in layer:
                layer.moe.experts_in_float32()
        return self

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Hugging Face's multimodal layout (towers dropped, fused experts split) and mlx-community's
        (mlx-lm's names) -> this tree."""
        out = {}
        for key, value in weights.items():
            name = module_path(key)
            if name is None:
                continue
            if m := _FUSED.match(name):
                prefix = f"{m.group(1)}.moe.switch_mlp"
                if m.group(2) == "gate_up_proj":
                    gate, up = mx.split(value, 2, axis=-2)
                    out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = gate, up
                else:
                    out[f"{prefix}.down_proj.weight"] = value
                continue
            out[name] = value
        return drop_unused(out, self.args.tie_word_embeddings)
