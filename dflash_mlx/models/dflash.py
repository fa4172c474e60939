"""DFlash block-diffusion draft (z-lab layout).

Qwen3-style decoder layers whose attention reads, besides the block, the target's context
features projected by each layer's own ``k_proj``/``v_proj``. No embedding and no head of its
own: ``bind`` attaches the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import quantized
from ..quant import parse_quant
from ..sampling import Sampler, propose
from .layers import MLP, attention, compiled_pieces, side_streams, submit_layer


def evenly_spaced_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """z-lab's default taps when a config does not list them."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def resolve_taps(listed: Optional[Sequence[int]], num_draft_layers: int, num_target_layers: int) -> List[int]:
    """The target layers a draft reads: as its config lists them, or z-lab's default. A tap the
    target does not have is a ValueError naming it."""
    ids = list(listed) if listed else evenly_spaced_layer_ids(num_target_layers, num_draft_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"taps {bad} are not layers of the {num_target_layers}-layer target (0..{num_target_layers - 1})")
    return ids


# z-lab's layer types, and ours: a ``block_attention`` layer reads no context, only the block
# (z-lab's torch reference would read a one-token sliding window as "each slot sees itself", so we
# record it under a name that other loaders refuse instead of one they would misread).
LAYER_TYPES = ("full_attention", "sliding_attention", "block_attention")


@dataclass
class DraftArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: Optional[List[int]] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 262144
    layer_types: List[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    attention_bias: bool = False
    vocab_size: Optional[int] = None
    # DFlash2 (``DFlash2DraftModel``; 0 turns a part off) and both kinds' optional output scaling.
    architecture: str = "DFlashDraftModel"
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    input_embedding_scale: float = 1.0

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"draft layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unsupported draft layer types: {sorted(unknown)} (known: {', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("draft config has sliding_attention layers but no sliding_window")
        if self.block_size < 2:
            raise ValueError(f"draft block_size must be at least 2, got {self.block_size}")

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "DraftArgs":
        """Reads the legacy (top-level ``block_size``) and the nested z-lab schema."""
        dflash = config.get("dflash_config") or {}
        if "mask_token_id" not in dflash and "mask_token_id" not in config:
            raise ValueError(
                "draft config has no mask_token_id (expected in dflash_config); "
                "refusing to guess: the mask id decides what the draft sees"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        names = cls.__dataclass_fields__
        params = {k: v for k, v in config.items() if k in names}
        params.update(
            mask_token_id=int(dflash.get("mask_token_id", config.get("mask_token_id"))),
            block_size=int(dflash.get("block_size", config.get("block_size", 16))),
            target_layer_ids=dflash.get("target_layer_ids", config.get("target_layer_ids")),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope_type not in ("default", None) else None,
            layer_types=list(config.get("layer_types") or []),
            is_causal=dflash.get("is_causal", config.get("is_causal")),
            architecture="DFlash2DraftModel" if "DFlash2DraftModel" in (config.get("architectures") or []) else "DFlashDraftModel",
        )
        for name, kind in (("conv_kernel_size", int), ("conv_group_size", int), ("selector_rank", int),
                           ("selector_top_k", int), ("output_multiplier", float), ("input_embedding_scale", float),
                           ("final_logit_softcapping", float)):
            value = dflash.get(name, config.get(name))
            if value is not None:
                params[name] = kind(value)
        if params.get("head_dim") is None:
            params["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
        return cls(**params)

    def to_config(self, target_layer_ids: List[int], num_target_layers: int) -> Dict[str, Any]:
        """The one schema every draft we write uses: z-lab's nested one, with what its loaders
        require (``is_causal`` at the top level, ``num_target_layers``)."""
        config = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "num_target_layers": num_target_layers,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "layer_types": self.layer_types,
            "rope_parameters": {**(self.rope_scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta},
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": target_layer_ids,
            },
        }
        if self.sliding_window:
            config["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            config["is_causal"] = self.is_causal
        if self.vocab_size is not None:
            config["vocab_size"] = self.vocab_size
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                     "final_logit_softcapping", "input_embedding_scale"):
            if getattr(self, name) != DraftArgs.__dataclass_fields__[name].default:
                config["dflash_config"][name] = getattr(self, name)
        return config


class ContextCache:
    """Context-only K/V of one draft layer, with scratch room after it for the block.

    Writing the block into the buffer (not concatenating) keeps a cycle's copies
    independent of the context length. ``window`` bounds how much context is kept.
    """

    step = 256

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0  # context tokens seen (absolute position of the next one)
        self.start = 0  # absolute position of buffer row 0
        self.reserved = 0  # rows the next growth makes room for at least (see reserve)

    def _ensure_room(self, needed_rows: int, like_k: mx.array, like_v: mx.array):
        used = self.offset - self.start
        if self.window is not None and used > self.window and used + needed_rows > self._capacity():
            drop = used - self.window
            self.keys = mx.contiguous(self.keys[..., drop:used, :])
            self.values = mx.contiguous(self.values[..., drop:used, :])
            self.start += drop
            used = self.window
        if used + needed_rows > self._capacity():
            rows = ((used + max(needed_rows, self.reserved) + self.step - 1) // self.step) * self.step
            self.reserved = 0
            B, H, _, _ = like_k.shape
            new_k = mx.zeros((B, H, rows, like_k.shape[-1]), like_k.dtype)
            new_v = mx.zeros((B, H, rows, like_v.shape[-1]), like_v.dtype)
            if used:
                new_k[..., :used, :] = self.keys[..., :used, :]
                new_v[..., :used, :] = self.values[..., :used, :]
            self.keys, self.values = new_k, new_v

    def reserve(self, rows: int) -> None:
        """Make the next growth room for ``rows`` more rows at once (a prompt's whole feed), so that
        a long prompt's chunks are written in place: grown chunk by chunk, every layer would hold
        its old buffer, the new one and a copy at once, each chunk, and copy the context again."""
        if self.window is not None:
            rows = min(rows, self.window + 1)
        if self.reads_no_context or self._capacity() - (self.offset - self.start) >= rows:
            return
        self.reserved = rows

    def _capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def arrays(self) -> List[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def reads_no_context(self) -> bool:
        """A block-only layer (window 0): its context K/V would never be read."""
        return self.window == 0

    def rewind(self, position: int) -> bool:
        """Forget context from ``position`` on; False if that part was already dropped."""
        if self.reads_no_context and 0 <= position <= self.offset:
            self.offset = self.start = position
            return True
        if not self.start <= position <= self.offset:
            return False
        self.offset = position
        return True

    def fork(self, position: int) -> Optional["ContextCache"]:
        """A copy holding the context before ``position`` (new arrays: the buffer is written in
        place); None if that part was already dropped."""
        new = ContextCache(self.window)
        if self.reads_no_context:
            new.offset = new.start = position
            return new if 0 <= position <= self.offset else None
        if not self.start <= position <= self.offset:
            return None
        used = position - self.start
        if used:
            new.keys, new.values = self.keys[..., :used, :], self.values[..., :used, :]
        new.start, new.offset = self.start, position
        return new

    def advance(self, count: int) -> None:
        """Move on ``count`` positions without storing them (block-only layers)."""
        self.offset += count
        self.start = self.offset

    def append(self, ctx_k: mx.array, ctx_v: mx.array) -> None:
        """Add committed context K/V (positions ``offset..``)."""
        S = ctx_k.shape[2]
        self._ensure_room(S, ctx_k, ctx_v)
        used = self.offset - self.start
        self.keys[..., used : used + S, :] = ctx_k
        self.values[..., used : used + S, :] = ctx_v
        self.offset += S

    def fetch_with_block(self, block_k: mx.array, block_v: mx.array, window: Optional[int] = None):
        """Keys/values of the visible context followed by the block, and the context count.

        ``window`` limits the visible context to its last ``window`` tokens (sliding layers).
        """
        L = block_k.shape[2]
        self._ensure_room(L, block_k, block_v)
        used = self.offset - self.start
        self.keys[..., used : used + L, :] = block_k
        self.values[..., used : used + L, :] = block_v
        visible = min(x for x in (used, window, self.window) if x is not None)
        first = used - visible
        return self.keys[..., first : used + L, :], self.values[..., first : used + L, :], visible


class ContextBatch:
    """Several sequences' context caches of one draft layer, for one pass over their blocks
    padded to ``[B, T]``: row i's block is its first ``lengths[i]`` slots (the block attends both
    ways, so the padding is kept out of its attention; the work outside attention is per row)."""

    def __init__(self, members: List[ContextCache], lengths: Sequence[int]):
        self.members, self.lengths = members, list(lengths)

    @property
    def offset(self) -> mx.array:
        return mx.array([m.offset for m in self.members])


class DraftAttention(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        # A block-only layer is a sliding window of one: no context position is within it.
        self.sliding_window = {"sliding_attention": args.sliding_window, "block_attention": 1}.get(layer_type)
        sliding = self.sliding_window is not None
        self.is_causal = sliding if args.is_causal is None else bool(args.is_causal)
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def _heads(self, x, n):
        B, T, _ = x.shape
        return x.reshape(B, T, n, self.head_dim)

    def project_context(self, ctx: mx.array):
        """Context features -> this layer's keys and values [B, Hkv, S, D], before RoPE.

        They skip the layer's input norm by design: they are keys/values, not residual input."""
        k = self.k_norm(self._heads(self.k_proj(ctx), self.n_kv_heads)).transpose(0, 2, 1, 3)
        return k, self._heads(self.v_proj(ctx), self.n_kv_heads).transpose(0, 2, 1, 3)

    def project(self, x: mx.array):
        """Normed block input -> queries, keys, values [B, H, L, D], before RoPE."""
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads)).transpose(0, 2, 1, 3)
        return (q, *self.project_context(x))

    def attend(self, q, keys, values, mask) -> mx.array:
        return self.output(mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask))

    def output(self, heads: mx.array) -> mx.array:
        """Attention heads [B, H, L, D] -> the layer's attention output [B, L, hidden]."""
        B, _, L, _ = heads.shape
        return self.o_proj(heads.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def add_context(self, ctx: mx.array, rope, cache: ContextCache) -> None:
        """Project context features into this layer's K/V cache."""
        if cache.reads_no_context:
            cache.advance(ctx.shape[1])  # positions still count: the block's RoPE offset
            return
        ck, cv = self.project_context(ctx)
        cache.append(rope(ck, offset=cache.offset), cv)

    def add_context_batch(self, ctx: mx.array, lengths: Sequence[int], rope, caches: Sequence[ContextCache]) -> None:
        """``add_context`` for several sequences, row i of ``ctx`` [B, S, H] holding sequence i's
        features in its first ``lengths[i]`` slots: one projection and one RoPE (each row at its
        own cache's offset) for all, then each sequence's append of its own slots."""
        reading = [i for i, cache in enumerate(caches) if not cache.reads_no_context]
        for n, cache in zip(lengths, caches):
            if cache.reads_no_context:
                cache.advance(n)
        if not reading:
            return
        ck, cv = self.project_context(ctx)
        ck = rope(ck, offset=mx.array([cache.offset for cache in caches]))
        for i in reading:
            caches[i].append(ck[i : i + 1, :, : lengths[i]], cv[i : i + 1, :, : lengths[i]])

    def block_heads(self, q, k, v, cache: ContextCache) -> mx.array:
        """Attention heads of the rotated block over the cached context and itself."""
        if isinstance(cache, ContextBatch):  # each row's own block over its own context, as alone
            T, heads, streams = q.shape[2], [], side_streams()
            for i, (c, n) in enumerate(zip(cache.members, cache.lengths)):
                with mx.stream(streams[i % len(streams)]):
                    h = self.block_heads(q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n], c)
                heads.append(h if n == T else mx.pad(h, [(0, 0), (0, 0), (0, T - n), (0, 0)]))
            return mx.concatenate(heads)
        if cache.reads_no_context:
            keys, values, n_ctx = k, v, 0
        else:
            window = None if self.sliding_window is None else self.sliding_window - 1
            keys, values, n_ctx = cache.fetch_with_block(k, v, window)
        return attention(q, keys, values, self.scale, self._mask(q.shape[2], n_ctx))

    def _mask(self, L: int, n_ctx: int):
        if self.sliding_window is None or n_ctx == 0:
            # Every fetched context key is visible to every slot. MLX aligns "causal" to the
            # last key, so block slot i sees the context and slots <= i; named masks also
            # spare the per-cycle ops of building one (the cycle is dispatch-bound on CPU).
            return "causal" if self.is_causal else None
        query = mx.arange(L)[:, None]
        key = mx.arange(n_ctx + L)[None] - n_ctx  # block-relative: context keys are negative
        visible = key >= 0 if not self.is_causal else (key >= 0) & (key <= query)
        return visible | ((key < 0) & (query - key < self.sliding_window))  # sliding: the window's context


class DraftLayer(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        self.self_attn = DraftAttention(args, layer_type)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._before_attention = self._after_attention = None  # compiled on first use
        self.kernel_matmuls = None  # where a quantized matmul may run the Metal kernel (route_layers)

    def __call__(self, x, rope, cache):
        before, after = self._compiled(rope)
        q, k, v, *carry = before(x, mx.array(cache.offset))
        return after(x, self.self_attn.block_heads(q, k, v, cache), *carry)

    def _functions(self, rope):
        """The work before the attention (``x, offset -> q, k, v, *carry``) and after it
        (``x, heads, *carry -> x``); a DFlash2 layer wraps both in its convolutions."""
        attn = self.self_attn

        def before(x, offset):
            q, k, v = attn.project(self.input_layernorm(x))
            return rope(q, offset=offset), rope(k, offset=offset), v

        def after(x, heads):
            h = x + attn.output(heads)
            return h + self.mlp(self.post_attention_layernorm(h))

        return before, after

    def _compiled(self, rope):
        """The work on either side of the attention, compiled (fixed shapes, weights as inputs).

        A cycle on MLX's CPU backend costs per operation more than per FLOP; fusing the norms,
        RoPE and activations removes most of the draft's operations. The attention itself stays
        outside: its key count grows every cycle. Where a kernel of ours may run inside, compiled
        once it is decided (``compiled_pieces``)."""
        if self._before_attention is None:
            self._before_attention, self._after_attention = compiled_pieces(
                self._functions(rope), self.state, [self.kernel_matmuls])
        return self._before_attention, self._after_attention


def _in_features(linear: nn.Module) -> int:
    bits = getattr(linear, "bits", None)
    width = linear.weight.shape[-1]
    return width * 32 // bits if bits else width


class DFlashDraft(nn.Module):
    layer_class = DraftLayer  # DFlash2 drafts wrap each sublayer in convolutions (models/dflash2.py)

    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        n_taps = len(args.target_layer_ids) if args.target_layer_ids else args.num_hidden_layers
        self.fc = nn.Linear(n_taps * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, t) for t in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.rope_scaling:
            from mlx_lm.models.rope_utils import initialize_rope

            self.rope = initialize_rope(
                args.head_dim,
                base=args.rope_theta,
                traditional=False,
                scaling_config=args.rope_scaling,
                max_position_embeddings=args.max_position_embeddings,
            )
        else:
            self.rope = nn.RoPE(args.head_dim, traditional=False, base=args.rope_theta)
        # Bound methods of the target (plain attributes, so not draft parameters).
        self._embed: Optional[Callable] = None
        self._head: Optional[Callable] = None
        self.target_layer_ids: List[int] = list(args.target_layer_ids or [])
        self.activation_dtype: Optional[mx.Dtype] = None  # None: the inputs' own dtype

    def compute_in(self, dtype: Optional[mx.Dtype]) -> "DFlashDraft":
        """Run the draft's activations (and its float weights, quantization scales included) in
        ``dtype``; the target's embeddings and features are cast on the way in."""
        if dtype is not None:
            self.set_dtype(dtype)
            self.activation_dtype = dtype
        return self

    def use_quantized_matmuls(self, matmuls: Optional[quantized.QuantizedMatmuls]) -> "DFlashDraft":
        """Route the draft's quantized layers through ``matmuls`` (the verify kernel on Metal);
        layers that may then run the kernel compile once it is decided."""
        quantized.route_layers(self, self.layers, matmuls)
        for layer in self.layers:
            layer._before_attention = layer._after_attention = None  # rebuilt, compiled or not
        return self

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def kind(self) -> str:
        """What the draft is, for reports: ``DFlash`` or ``DFlash2``."""
        return self.kind_of(self.args)

    @staticmethod
    def kind_of(args: DraftArgs) -> str:
        return "DFlash2" if args.architecture == "DFlash2DraftModel" else "DFlash"

    def layout_weights(self) -> Dict[str, mx.array]:
        """The parameters under the names z-lab's layout stores them (what ``sanitize`` reads)."""
        return dict(tree_flatten(self.parameters()))

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    def bind(self, target) -> "DFlashDraft":
        """Share the target's embedding and head, after checking the pair fits."""
        t_args = target.args
        n_layers = t_args.num_hidden_layers
        if self.args.hidden_size != t_args.hidden_size:
            raise ValueError(
                f"draft hidden_size {self.args.hidden_size} != target hidden_size {t_args.hidden_size}: "
                "this draft was made for another target"
            )
        ids = resolve_taps(self.args.target_layer_ids, self.args.num_hidden_layers, n_layers)
        fc_in = _in_features(self.fc)
        if fc_in != len(ids) * t_args.hidden_size:
            raise ValueError(
                f"draft fc expects {fc_in} features; {len(ids)} taps of the target give "
                f"{len(ids) * t_args.hidden_size}"
            )
        vocab = target.embed_tokens.weight.shape[0]
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"draft mask_token_id {self.mask_token_id} outside the target vocabulary (0..{vocab - 1})")
        self.target_layer_ids = ids
        self._embed = target.embed_tokens.__call__
        self._head = target.head
        return self

    def make_cache(self, window: Optional[int] = None) -> List[ContextCache]:
        """One context cache per layer; ``window`` keeps only that many recent tokens."""
        caches = []
        for layer in self.layers:
            sliding = layer.self_attn.sliding_window
            layer_window = window if sliding is None else min(x for x in (window, sliding - 1) if x is not None)
            caches.append(ContextCache(layer_window))
        return caches

    def _context_states(self, context: mx.array) -> mx.array:
        """Tapped target features [B, S, taps*H] -> the states every layer projects its context from."""
        if self.activation_dtype is not None:
            context = context.astype(self.activation_dtype)
        return self.hidden_norm(self.fc(context))

    def add_context(self, context: mx.array, cache: List[ContextCache]) -> None:
        """Append committed tokens' tapped target features [B, S, taps*H] to the cache."""
        ctx = self._context_states(context)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(ctx, self.rope, c)

    def add_context_batch(self, contexts: Sequence[mx.array], caches: Sequence[List[ContextCache]]) -> None:
        """``add_context`` for several sequences (``contexts[i]`` [1, S_i, taps*H] to ``caches[i]``):
        padded to the longest and stacked, so that ``fc``, the norm, each layer's projections and
        its RoPE (one offset per row) run once for all; each sequence appends its own slots. A
        row's numbers are those ``add_context`` gives it alone where a product's row does not
        depend on the rows beside it (MLX's CPU matmuls, at any row count; not a GPU, whose
        one-row products take another kernel: there the caller calls per sequence)."""
        lengths = [c.shape[1] for c in contexts]
        S = max(lengths)
        context = mx.concatenate([c if c.shape[1] == S else mx.pad(c, [(0, 0), (0, S - c.shape[1]), (0, 0)])
                                  for c in contexts])
        ctx = self._context_states(context)
        for i, layer in enumerate(self.layers):
            layer.self_attn.add_context_batch(ctx, lengths, self.rope, [cache[i] for cache in caches])

    def hidden(self, block: mx.array, cache: List[ContextCache]) -> mx.array:
        """Final-normed states [B, L-1, H] of block slots 1.. (``[t_last, MASK, ...]``), one pass."""
        if self._embed is None:
            raise RuntimeError("bind(target) the draft before using it")
        x = self._embed(block)
        if self.args.input_embedding_scale != 1.0:
            x = x * self.args.input_embedding_scale
        if self.activation_dtype is not None:
            x = x.astype(self.activation_dtype)
        for layer, c in zip(self.layers, cache):
            x = layer(x, self.rope, c)
            submit_layer(x)
        return self.norm(x[:, 1:])

    def logits(self, hidden: mx.array) -> mx.array:
        """The target's head on draft states, with the config's multiplier and soft cap."""
        logits = self._head(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits

    def __call__(self, block: mx.array, cache: List[ContextCache]) -> mx.array:
        """Logits [B, L-1, V] for block slots 1.. (``[t_last, MASK, ...]``), one pass."""
        return self.logits(self.hidden(block, cache))

    def propose(self, block: mx.array, cache: List[ContextCache], sampler: Sampler,
                guide: Optional[Callable] = None) -> Tuple[mx.array, Optional[mx.array]]:
        """Proposals [L-1] for a block [L], and (sampling) the distributions [L-1, V] they were
        drawn from, which rejection sampling needs. ``guide``: picks them instead of
        ``sampling.propose``, from the logits [L-1, V] and the sampler (a grammar's walk,
        ``grammar.Guide.propose``: it may propose fewer)."""
        return self.pick(self.hidden(block[None], cache), block, sampler, guide=guide)

    def pick(self, hidden: mx.array, block: mx.array, sampler: Sampler,
             logits: Optional[mx.array] = None, guide: Optional[Callable] = None) -> Tuple[mx.array, Optional[mx.array]]:
        """Proposals (and their distributions) from one block's draft states [1, L-1, H]
        (``logits``: the head's on them, when the caller ran it over several blocks at once)."""
        return (propose if guide is None else guide)((self.logits(hidden) if logits is None else logits)[0], sampler)

    def propose_batch(self, blocks: Sequence[mx.array], caches: Sequence[List[ContextCache]],
                      samplers: Sequence[Sampler], one_head: bool = False,
                      guides: Optional[Sequence[Optional[Callable]]] = None) -> List[Tuple[mx.array, Optional[mx.array]]]:
        """``propose`` for several sequences in one pass: their blocks (any lengths) padded to the
        longest, each attending over its own context. Row i's proposals are those ``propose`` gives
        it alone: the padding follows its slots and never enters its attention. ``one_head``: the
        head runs once over every row, then each sequence picks on its own rows (where a product's
        row does not depend on the rows beside it: the CPU; see ``add_context_batch``). ``guides``:
        each sequence's ``guide`` (see ``propose``), or None."""
        T = max(b.size for b in blocks)
        padded = mx.stack([b if b.size == T else mx.concatenate([b, mx.full((T - b.size,), self.mask_token_id, b.dtype)])
                           for b in blocks])
        lengths = [b.size for b in blocks]
        hidden = self.hidden(padded, [ContextBatch(list(layer), lengths) for layer in zip(*caches)])
        logits = self.logits(hidden) if one_head else None
        guides = guides or [None] * len(blocks)
        return [self.pick(hidden[i : i + 1, : n - 1], b, s, None if logits is None else logits[i : i + 1, : n - 1], g)
                for i, (b, n, s, g) in enumerate(zip(blocks, lengths, samplers, guides))]

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = {}
        for key, value in weights.items():
            if key.startswith("model."):
                key = key[len("model.") :]
            if key.startswith(("embed_tokens.", "lm_head.")):
                continue  # some exports carry a copy of the target's; the draft uses the target's own
            out[key] = value
        return out


def quantize_draft(draft: DFlashDraft, spec: Optional[str]) -> Optional[Dict[str, int]]:
    """Quantize the draft's linear layers in place; returns the config entry MLX uses."""
    parsed = parse_quant(spec)
    if parsed is None:
        return None
    bits, group_size = parsed
    nn.quantize(
        draft,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0,
    )
    return {"group_size": group_size, "bits": bits}
