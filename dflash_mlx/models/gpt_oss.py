"""gpt-oss targets (``gpt_oss``: gpt-oss-20b and gpt-oss-120b among z-lab's DFlash pairs).

Every layer: RMSNorm -> grouped-query attention with biases, a learned sink logit per head
(``layers.attention``'s ``sinks``) and YaRN RoPE (``layers.YarnRoPE``: its config says
``truncate: false``) -> residual -> RMSNorm -> a sparse mixture of experts -> residual. Layers
alternate sliding-window (``sliding_window``, 128) and full attention (``layer_types``); a
sliding layer's cache is a ``cache.WindowCache``, which rolls back exactly by a trim as a full
one does. The experts (with biases) use OpenAI's clamped SwiGLU (``ClampedSwiGLU``); the router
(a ``Linear`` with a bias) takes the top k logits and a softmax over those k alone, as the
reference does.

Checkpoints, all mapped by ``Model.sanitize`` onto this tree (``layers.SparseMoe``'s names:
``mlp.gate`` the router, ``mlp.switch_mlp`` the experts): transformers' layout (bf16 releases and
what transformers saves: ``mlp.experts.gate_up_proj`` [E, H, 2I], gate and up interleaved
column by column, ``down_proj`` [E, I, H], their ``_bias``); OpenAI's release (the same with the
experts in MXFP4: ``*_blocks`` [E, rows, H/32, 16] bytes and ``*_scales``, read as MLX's
``mxfp4`` quantization, ``quantization_config: {"quant_method": "mxfp4"}``); mlx-community's
(mlx-lm's names: ``mlp.router``, ``mlp.experts.{gate,up,down}_proj``, quantized or not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from . import qwen3
from .layers import Attention, DecoderLayer, SparseMoe, TargetModel, TextModel, drop_unused


@dataclass
class ModelArgs(qwen3.ModelArgs):
    model_type: str = "gpt_oss"
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_position_embeddings: int = 131072
    sliding_window: int = 128
    attention_bias: bool = True
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        if self.layer_types is None:  # transformers' default: even layers slide
            self.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        super().__post_init__()


_MLX_LM_NAMES = ((re.compile(r"\.mlp\.router(?=\.|$)"), ".mlp.gate"),
                 (re.compile(r"\.mlp\.experts(?=\.|$)"), ".mlp.switch_mlp"))


def module_path(key: str) -> Optional[str]:
    """A checkpoint's tensor or module name (mlx-lm's ``mlp.router``, ``mlp.experts.*``; the
    quantization overrides of mlx-community's configs are keyed so) as this tree names it."""
    for pattern, name in _MLX_LM_NAMES:
        key = pattern.sub(name, key)
    return key


_OUR_NAMES = ((re.compile(r"\.mlp\.gate(?=\.|$)"), ".mlp.router"),
              (re.compile(r"\.mlp\.switch_mlp(?=\.|$)"), ".mlp.experts"))


def checkpoint_path(key: str) -> str:
    """This tree's tensor or module name as mlx-lm's gpt-oss names it (``module_path``'s inverse):
    what ``convert-target`` writes, so that mlx-lm loads the folder too."""
    for pattern, name in _OUR_NAMES:
        key = pattern.sub(name, key)
    return key


class ClampedSwiGLU(nn.Module):
    """OpenAI's gated activation: the gate clamped above at ``limit``, the linear half to
    [-limit, limit] and shifted by one: ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        gate = mx.minimum(gate, self.limit)
        up = mx.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * mx.sigmoid(self.alpha * gate))


class Experts(SparseMoe):
    """gpt-oss's mixture of experts: ``SparseMoe`` (tokens routed one at a time in verify passes,
    experts in one gather) with a biased router whose top k logits alone are softmaxed, and
    biased experts with the clamped SwiGLU."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.hidden_size, args.intermediate_size, args.num_local_experts, args.num_experts_per_tok,
                         norm_topk_prob=False)
        self.gate = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.intermediate_size, args.num_local_experts,
                                    activation=ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit), bias=True)

    def route(self, x: mx.array):
        """The top k experts by logit, weighted by a float32 softmax over their k logits."""
        logits = self.router_logits(x).astype(mx.float32)
        indices = mx.argpartition(logits, kth=-self.top_k, axis=-1)[..., -self.top_k:]
        return indices, mx.softmax(mx.take_along_axis(logits, indices, axis=-1), axis=-1)


def quant_predicate(path: str, module: nn.Module):
    """mlx-lm's recipe for gpt-oss (``mlx_lm.models.gpt_oss.Model.quant_predicate``): the router
    at 8 bits, group 64, everything else as asked."""
    if path.endswith("mlp.gate"):
        return {"group_size": 64, "bits": 8}
    return True


_TRANSFORMERS = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def _experts(prefix: str, name: str, suffix: Optional[str], value: mx.array) -> Dict[str, mx.array]:
    """One tensor of transformers' or OpenAI's expert layout as this tree's (gate and up are
    interleaved along the output: even rows gate, odd rows up)."""
    if suffix == "_blocks":  # MXFP4 bytes [E, rows, groups, 16] -> MLX's packed words [E, rows, groups * 4]
        value, leaf = value.view(mx.uint32).flatten(-2), "weight"
    elif suffix == "_scales":
        leaf = "scales"
    elif suffix == "_bias":
        leaf = "bias"
    else:  # transformers' float weights are [E, in, out]: MLX's are [E, out, in]
        value, leaf = value.swapaxes(-1, -2), "weight"
    out = f"{prefix}.switch_mlp"
    if name == "down_proj":
        return {f"{out}.down_proj.{leaf}": value}
    axis = -1 if leaf == "bias" else -2
    gate, up = (mx.contiguous(v) for v in (_every_other(value, axis, 0), _every_other(value, axis, 1)))
    return {f"{out}.gate_proj.{leaf}": gate, f"{out}.up_proj.{leaf}": up}


def _every_other(value: mx.array, axis: int, first: int) -> mx.array:
    index = [slice(None)] * value.ndim
    index[axis] = slice(first, None, 2)
    return value[tuple(index)]


class Model(TargetModel):
    """A gpt-oss target: ``layers.TargetModel``'s interface over attention layers with sinks,
    alternating sliding-window and full, each with the mixture of experts."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        rope = qwen3.rope(args)
        layers = [DecoderLayer(Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                                         args.head_dim, rope, bias=args.attention_bias, window=args.window(i),
                                         sinks=True),
                               Experts(args), args.hidden_size, args.rms_norm_eps)
                  for i in range(args.num_hidden_layers)]
        self.model = TextModel(args.vocab_size, args.hidden_size, layers, args.rms_norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """transformers', OpenAI's MXFP4 and mlx-community's layouts -> this tree (see the module's
        docstring)."""
        out = {}
        for key, value in weights.items():
            if m := _TRANSFORMERS.match(key):
                out.update(_experts(m.group(1), m.group(2), m.group(3), value))
            else:
                out[module_path(key)] = value
        return drop_unused(out, self.args.tie_word_embeddings)
