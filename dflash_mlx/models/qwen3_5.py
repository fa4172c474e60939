"""Qwen3.5 (dense, text) target: hybrid Gated DeltaNet + gated full attention.

Beyond a plain forward pass it can return the outputs of chosen layers (the draft's context
features) and, in verify mode, record the Gated DeltaNet rollback tape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .. import kernels
from ..cache import GatedDeltaCache, GatedDeltaTape
from .layers import MLP, TargetModel, cached_attention, compiled_pieces, config_params
# Where they were first defined; kept importable from here (doctor, tests).
from .layers import COMPILED_TOKENS, SCORE_ELEMENTS, SCORE_ROWS_ALIGN, attention_rows  # noqa: F401

# Gated DeltaNet output gates that are Qwen3.5's silu (``None``: the field is absent).
SILU_GATES = (None, "silu", "swish")


@dataclass
class ModelArgs:
    model_type: str = "qwen3_5_text"
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: Optional[int] = 256
    vocab_size: int = 248320
    rms_norm_eps: float = 1e-6
    linear_num_value_heads: int = 32
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    layer_types: Optional[List[str]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    eos_token_id: Any = None
    rope_parameters: Dict[str, Any] = field(default_factory=dict)
    # The activation of the gate that each Gated DeltaNet layer's norm multiplies by. Qwen3.5 says
    # none, Qwen3.6 and Qwen3.8 say "swish" (the same function); vLLM also runs "sigmoid", which
    # only models of another architecture (Qwen3.8-Flash-Next) ask for: refused, never ignored.
    output_gate_type: Optional[str] = None

    def __post_init__(self):
        if self.output_gate_type not in SILU_GATES:
            raise ValueError(
                f"output_gate_type {self.output_gate_type!r}: its Gated DeltaNet layers would gate their norm "
                "with another function than Qwen3.5's silu (swish); this is not a Qwen3.5-architecture model"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:
            self.rope_theta = self.rope_parameters.get("rope_theta", self.rope_theta)
            self.partial_rotary_factor = self.rope_parameters.get(
                "partial_rotary_factor", self.partial_rotary_factor
            )
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "ModelArgs":
        """Reads a text-only config or the ``text_config`` of a multimodal one."""
        params = config_params(config)
        if "rope_scaling" in params and not params.get("rope_parameters"):
            params["rope_parameters"] = params["rope_scaling"]
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in params.items() if k in names})


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm. Weights are stored as ``1 + w`` after ``sanitize``."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x, gate):
        normed = mx.fast.rms_norm(x, self.weight, self.eps)
        return (nn.silu(gate.astype(mx.float32)) * normed.astype(mx.float32)).astype(x.dtype)


@partial(mx.compile, shapeless=True)
def _decay(A_log, a, dt_bias):
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


class GatedDeltaNet(nn.Module):
    """Called by its decoder layer as ``states`` -> ``mix`` (pure, compiled with the layer) ->
    ``update_cache``, so that the cache bookkeeping stays outside the compiled graph."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        self.in_proj_qkv = nn.Linear(args.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(args.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(args.hidden_size, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim, bias=False
        )
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)
        # How the recurrence runs (Metal kernels, chunked, reference): decided at load, see
        # Model.use_recurrence; a plain attribute, not a parameter.
        self.recurrence = kernels.Recurrence.for_this_process()

    def states(self, x, cache: Optional[GatedDeltaCache]):
        """The conv and recurrent states a call starts from (zeros for a fresh cache)."""
        B = x.shape[0]
        conv_state = None if cache is None else cache.conv_state
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=x.dtype)
        start_state = None if cache is None else cache.state
        if start_state is None:
            start_state = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32)
        return conv_state, start_state

    def update_cache(self, cache: Optional[GatedDeltaCache], start_state, carry, record_tape: bool) -> None:
        if cache is None:
            return
        conv_input, state, k, g, delta = carry
        tape = GatedDeltaTape(start_state, conv_input, k, g, delta) if record_tape else None
        conv_state = conv_input[:, -(self.conv_kernel_size - 1) :]
        # A slice keeps its whole buffer alive: after a prefill chunk, every layer would hold the
        # chunk's conv input (2048 x 8192 values a layer for a 9B) instead of its last K-1 rows.
        conv_state = mx.contiguous(conv_state) if k.shape[1] > COMPILED_TOKENS else conv_state
        cache.update(conv_state, state, k.shape[1], tape)

    def recurrence_mode(self) -> str:
        return self.recurrence.mode(self.head_k_dim, self.num_k_heads, self.head_v_dim, self.num_v_heads)

    def mix(self, x, conv_state, start_state):
        """Output, conv input, final state, and the tape's k, g, delta (a pure function)."""
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta = mx.sigmoid(self.in_proj_b(x))
        g = _decay(self.A_log, self.in_proj_a(x), self.dt_bias)
        conv_input = mx.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        # L2 norm with eps 1e-6 on sum(x^2) (HF/FLA), written as an RMSNorm; q also takes Dk^-0.5.
        inv_scale = self.head_k_dim**-0.5
        eps = 1e-6 * inv_scale**2
        q = (inv_scale**2) * mx.fast.rms_norm(q, None, eps)
        k = inv_scale * mx.fast.rms_norm(k, None, eps)
        y, state, delta = self.recurrence.gated_delta(q, k, v, g, beta, start_state)
        out = self.norm(y, z)
        return self.out_proj(out.reshape(B, T, -1)), conv_input, state, k, g, delta


class Attention(nn.Module):
    """Full attention whose ``q_proj`` also emits a per-channel sigmoid output gate.

    Called by its decoder layer as ``project`` and ``output`` (compiled) around ``attend``
    (the KV cache, whose key count grows every step)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, 2 * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, args.rms_norm_eps)
        self.rope = nn.RoPE(
            int(self.head_dim * args.partial_rotary_factor), traditional=False, base=args.rope_theta
        )

    def project(self, x, offset):
        """Rotated queries, keys, values [B, H, T, D] and the output gate [B, T, H*D]."""
        B, T, _ = x.shape
        queries, gate = mx.split(self.q_proj(x).reshape(B, T, self.n_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, T, -1)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(queries, offset=offset), self.rope(keys, offset=offset), values, gate

    def attend(self, queries, keys, values, cache: Optional[KVCache]) -> mx.array:
        return cached_attention(queries, keys, values, cache, self.scale)

    def output(self, heads, gate):
        B, _, T, _ = heads.shape
        return self.o_proj(heads.transpose(0, 2, 1, 3).reshape(B, T, -1) * mx.sigmoid(gate))


def module_path(key: str) -> Optional[str]:
    """A checkpoint's tensor (or module) name as this module tree names it; None for the vision
    tower and the MTP head, which the text model does not have."""
    if key.startswith(("vision_tower", "model.visual", "visual.")) or "mtp." in key:
        return None
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head.")):
        if key.startswith(old):
            return new + key[len(old):]
        if key == old[:-1]:  # the module itself (a quantization override names modules)
            return new[:-1]
    return key


def dense_mlp(args: ModelArgs) -> nn.Module:
    return MLP(args.hidden_size, args.intermediate_size)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str, mlp: Optional[nn.Module] = None):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp if mlp is not None else dense_mlp(args)  # a mixture of experts in qwen3_5_moe
        # Compiled forms per mode (see _pieces), the matmuls whose kernels may run in the layer
        # (quantized.route_layers), and the mode those settle on: attributes, resolved when the
        # model is set up (Model.use_recurrence, use_quantized_matmuls).
        # A dict set the plain way would become a child of the module tree (nn.Module stores dicts,
        # lists and arrays as parameters): the one module attribute that needs object.__setattr__.
        object.__setattr__(self, "_compiled", {})
        self.kernel_matmuls = None
        self.resolve_mode()

    def _deciders(self) -> list:
        """What decides the kernels of ours that may run in this layer: its routed matmuls, and
        the recurrence's kernels where they run it."""
        recurrence = self.is_linear and self.linear_attn.recurrence_mode() == "metal"
        return [d for d in (self.kernel_matmuls, recurrence and self.linear_attn.recurrence.metal) if d]

    def resolve_mode(self) -> None:
        """``kernels`` where a kernel of ours may run inside (compiled once decided), else the
        recurrence variant for Gated DeltaNet (compiled graphs embed the one they traced) or
        ``attention``; the compiled forms are made again (the deciders may have changed)."""
        if self._deciders():
            self.mode = "kernels"
        else:
            self.mode = self.linear_attn.recurrence_mode() if self.is_linear else "attention"
        self._compiled.clear()

    def __call__(self, x, cache=None, record_tape: bool = False):
        # Compiled graphs are traced per input shape: only decode and verify lengths (at most
        # COMPILED_TOKENS) are compiled, so prefill chunks of any length add no trace. A chunk
        # that long is matmul-bound, where compiling saves nothing.
        mode = self.mode if x.shape[1] <= COMPILED_TOKENS else "plain"
        if self.is_linear:
            mixer = self.linear_attn
            conv_state, start_state = mixer.states(x, cache)
            out, *carry = self._pieces(mode)(x, conv_state, start_state)
            mixer.update_cache(cache, start_state, carry, record_tape)
            return out
        before, after = self._pieces(mode)
        q, k, v, gate = before(x, mx.array(0) if cache is None else mx.array(cache.offset))
        return after(x, self.self_attn.attend(q, k, v, cache), gate)

    def _pieces(self, mode: str):
        """This layer compiled: whole for Gated DeltaNet (the recurrence is plain MLX off Metal),
        around the cache for attention (its key count grows every step).

        A decode step of a small model on MLX's CPU backend costs per dispatched operation;
        compiled, the elementwise work fuses and Python builds the graph once per shape.
        ``kernels``: compiled once the kernels inside are decided (``compiled_pieces``);
        ``plain``: the plain functions, uncompiled (a prefill chunk)."""
        if mode not in self._compiled:
            pieces = (self._linear_layer,) if self.is_linear else (
                lambda x, offset: self.self_attn.project(self.input_layernorm(x), offset), self._attention_output)
            if mode != "plain":
                pieces = compiled_pieces(pieces, self.state, self._deciders() if mode == "kernels" else ())
            self._compiled[mode] = pieces[0] if self.is_linear else pieces
        return self._compiled[mode]

    def _linear_layer(self, x, conv_state, start_state):
        out, *carry = self.linear_attn.mix(self.input_layernorm(x), conv_state, start_state)
        return (self._feed_forward(x + out), *carry)

    def _attention_output(self, x, heads, gate):
        return self._feed_forward(x + self.self_attn.output(heads, gate))

    def _feed_forward(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5TextModel(nn.Module):
    def __init__(self, args: ModelArgs, feed_forward: Callable[[ModelArgs], nn.Module] = dense_mlp):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, t, feed_forward(args)) for t in args.layer_types]
        self.norm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(TargetModel):
    """The Qwen3.5 target; ``layers.TargetModel`` gives it the interface every target shares
    (forward with taps, the head, ``run_layers``...)."""

    def __init__(self, args: ModelArgs, feed_forward: Callable[[ModelArgs], nn.Module] = dense_mlp):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen3_5TextModel(args, feed_forward)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def make_cache(self) -> list:
        return [GatedDeltaCache(l.linear_attn.recurrence) if l.is_linear else KVCache() for l in self.layers]

    def use_recurrence(self, recurrence: kernels.Recurrence) -> "Model":
        """Run every Gated DeltaNet layer (and its caches' rollbacks) through ``recurrence``."""
        for layer in self.layers:
            if layer.is_linear:
                layer.linear_attn.recurrence = recurrence
            layer.resolve_mode()
        return self

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Maps HF (multimodal or text-only) and MLX checkpoints onto this module tree."""
        out = {}
        for key, value in weights.items():
            key = module_path(key)
            if key is not None:
                out[key] = value
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        # HF stores conv weights [C, 1, K] and zero-centred norms; MLX checkpoints are converted.
        from_hf = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in out.items())
        if from_hf:
            for key, value in out.items():
                if "conv1d.weight" in key:
                    out[key] = value.moveaxis(2, 1)
                elif value.ndim == 1 and key.endswith(
                    ("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")
                ):
                    out[key] = value + 1.0
        return out
