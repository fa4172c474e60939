"""Layers the target and the draft share, and the pieces every target family is built from: the
cached attention, the plain (attention-only) decoder layer, the sparse mixture-of-experts block,
and ``TargetModel``, the interface the decode loop, the draft and the loaders use."""

from __future__ import annotations

import os
import re
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.switch_layers import SwitchGLU

from .. import kernels, quantized
from ..cache import WindowCache
from ..checkpoint_files import text_part


class MLP(nn.Module):
    """SwiGLU feed-forward (Qwen3, Qwen3.5 and Llama alike; Llama may give it biases)."""

    def __init__(self, dims: int, hidden_dims: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=bias)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=bias)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


_thread_streams = threading.local()  # MLX streams belong to the thread that made them


def config_params(config: Dict) -> Dict:
    """A target's parameters from its config.json: a text-only config, or the ``text_config`` of a
    multimodal one, with the top level's ``tie_word_embeddings`` and ``eos_token_id`` where the text
    part lacks them (Hugging Face's multimodal releases keep them there)."""
    params = dict(text_part(config))
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key not in params and key in config:
            params[key] = config[key]
    return params


def side_streams() -> tuple:
    """Streams whose work runs side by side: on the CPU one per core this process may use (MLX
    runs each CPU stream on a thread of its own, and an operation on one core), elsewhere the
    default stream alone (a GPU runs one stream's work in parallel already). Made once per
    calling thread: MLX refuses a stream in any thread but the one that made it."""
    if mx.default_device() != mx.cpu:
        return (mx.default_stream(mx.default_device()),)
    streams = getattr(_thread_streams, "cpu", None)
    if streams is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        count = max(1, min(cores or 1, 8))
        streams = _thread_streams.cpu = (mx.default_stream(mx.cpu),) + tuple(mx.new_stream(mx.cpu) for _ in range(count - 1))
    return streams


def submit_layer(x: mx.array) -> None:
    """Queue a layer's output for evaluation as soon as it is built, on the CPU (elsewhere nothing).

    MLX's CPU ``eval`` sets every operation up on the calling thread and hands it to the stream's
    thread, and blocks the caller while more than ten tasks (of ten operations) wait. A pass
    queued whole at its end therefore runs in lockstep: the stream's thread idles while Python
    builds the graph, and Python waits while most of it runs. Queued layer by layer, the stream
    runs layer i while Python builds layer i+1. The numbers are the same (only when each operation
    runs changes). Measured on this 2-core machine with the demo pair (docs/benchmarks.md,
    "Queuing each layer on the CPU"): through the server four requests at once took 11% less
    time, one at a time 12%. On a GPU ``async_eval`` of a whole pass returns once it is encoded:
    nothing to gain there."""
    if mx.default_device() == mx.cpu:
        mx.async_eval(x)


# Query rows x keys per key head from which the CPU attention runs its key heads on side streams.
# Each side stream's share waits for its inputs and is waited for, which costs more than the second
# core saves on small heads. Measured on this 2-core machine with the demo pair in its decode loop
# (examples/side_streams.py, and the same measurements at lower thresholds): split, a verify block
# of 4 (8 rows per key head) ran 5% slower over 1024 keys, even over 2048, 19% faster over 4096;
# a plain step (2 rows) ran slower over 2048 keys and 21% faster over 8192.
SIDE_STREAM_WORK = 16384


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None,
              sinks: Optional[mx.array] = None) -> mx.array:
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
    17% faster, its block-4 cycle 21% (docs/benchmarks.md, "Attention on the CPU").

    Past ``SIDE_STREAM_WORK`` the key heads go to ``side_streams()``, one per core: MLX runs one
    CPU operation on one core, so one stream leaves the others idle. Each head's numbers are the
    ones it gets on one stream.

    ``sinks`` [H] (gpt-oss): a learned logit per query head that joins every row's softmax as
    one more key with no value (it takes a share of the attention and gives nothing back)."""
    if mx.default_device() != mx.cpu:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    H, T = queries.shape[1], queries.shape[2]
    n_kv, L = keys.shape[1], keys.shape[2]
    streams = side_streams()
    if n_kv == 1 or len(streams) == 1 or H // n_kv * T * L < SIDE_STREAM_WORK:
        return _cpu_attention(queries, keys, values, scale, mask, sinks)
    group, parts = H // n_kv, min(n_kv, len(streams))
    mask, heads = _causal(mask, T, L), []  # the mask built once for every part
    for part in range(parts):  # key heads [a, b) and their query heads on a core of their own
        a, b = n_kv * part // parts, n_kv * (part + 1) // parts
        part_mask = mask
        if mask is not None and mask.ndim == 4 and mask.shape[1] == H:
            part_mask = mask[:, a * group : b * group]
        with mx.stream(streams[part]):
            part_sinks = None if sinks is None else sinks[a * group : b * group]
            heads.append(_cpu_attention(queries[:, a * group : b * group], keys[:, a:b], values[:, a:b], scale, part_mask,
                                        part_sinks))
    return mx.concatenate(heads, axis=1)


def _causal(mask, T: int, L: int):
    """A named mask as the boolean array it stands for ("causal": aligned to the last key, as MLX
    aligns it); an array or None as it is."""
    if not isinstance(mask, str):
        return mask
    if mask != "causal":
        raise ValueError(f"attention mask {mask!r}: only 'causal' is a named mask")
    return mx.arange(L - T, L)[:, None] >= mx.arange(L)[None] if T > 1 else None


def _cpu_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None,
                   sinks: Optional[mx.array] = None) -> mx.array:
    """``attention`` on the CPU on one stream: MLX's fallback's numbers in fewer operations."""
    B, H, T, D = queries.shape
    n_kv, L = keys.shape[1], keys.shape[2]
    group = H // n_kv
    q = (queries * mx.array(scale, queries.dtype)).reshape(B, n_kv, group * T, D)
    scores = q @ keys.swapaxes(-1, -2)
    mask = _causal(mask, T, L)
    if mask is not None:
        if mask.ndim >= 3:  # [..., heads or 1, T, L] -> [..., key heads, group or 1, T, L], as MLX does
            head_axis = mask.shape[-3]
            mask = mx.expand_dims(mask, -3) if head_axis == 1 else mask.reshape(*mask.shape[:-3], n_kv, group, T, L)
        per_group = scores.reshape(B, n_kv, group, T, L)
        scores = mx.where(mask, per_group, mx.array(-float("inf"), scores.dtype)).reshape(B, n_kv, group * T, L)
    if sinks is None:
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(scores.dtype)
    else:  # each head's sink is one more column of its rows' softmax, dropped after it
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, n_kv, group, 1, 1), (B, n_kv, group, T, 1))
        scores = mx.concatenate([scores.astype(mx.float32), sink.reshape(B, n_kv, group * T, 1)], axis=-1)
        probs = mx.softmax(scores, axis=-1)[..., :-1].astype(values.dtype)
    return (probs @ values).reshape(B, H, T, D)


# ---- attention over a KV cache (every target family) -----------------------------------------------

# The longest input a layer runs compiled: every decode and verify pass (blocks of up to 16).
COMPILED_TOKENS = 16


def compiled_pieces(pieces: Sequence, inputs, deciders: Sequence = ()) -> tuple:
    """A layer's functions for decode and verify lengths, compiled (``inputs``: the layer's state).
    ``deciders``: what decides the kernels of ours that may run inside (a ``QuantizedMatmuls``, a
    ``MetalKernels``): the functions then compile once those decisions are taken
    (``kernels.CompiledAfterChecks``), and stay plain where a kernel cannot be traced (the emulator
    runs kernels on the host)."""
    deciders = [d for d in deciders if d is not None]
    if not deciders:
        return tuple(mx.compile(f, inputs=inputs) for f in pieces)
    if not all(d.traceable for d in deciders):
        return tuple(pieces)

    def stamp():
        return tuple(d.stamp() for d in deciders)

    return tuple(kernels.CompiledAfterChecks(f, inputs, stamp) for f in pieces)


# Prefill attention off the GPU. MLX's CPU attention (mx.fast.scaled_dot_product_attention falls
# back to plain operations there) materialises the scores (several [heads, queries, keys] arrays)
# and computes the masked half of a chunk's causal square too. There a prefill chunk's queries go
# in row blocks of at most SCORE_ELEMENTS / (heads x keys) rows (a multiple of SCORE_ROWS_ALIGN, at
# least that), each against the keys up to its last row, through ``attention``: the scores stay
# bounded whatever the context, the masked work shrinks to a block's triangle, and each row is the
# same numbers as MLX's (its products and softmax are its own). On a GPU MLX's fused attention
# kernel has none of these costs: there a chunk runs whole through it, as in mlx-lm.
SCORE_ELEMENTS = 1 << 20
SCORE_ROWS_ALIGN = 8


def attention_rows(heads: int, queries: int, keys: int) -> Optional[int]:
    """Query rows per ``attention`` call for a pass of ``queries`` tokens over ``keys`` keys; None
    where the pass runs whole through one call (decode and verify passes, a GPU)."""
    if queries <= COMPILED_TOKENS or mx.default_device() != mx.cpu:
        return None
    rows = SCORE_ELEMENTS // (heads * keys) // SCORE_ROWS_ALIGN * SCORE_ROWS_ALIGN
    return min(queries, max(rows, SCORE_ROWS_ALIGN))


def window_mask(T: int, L: int, window: Optional[int] = None):
    """The mask of ``T`` queries over ``L`` keys (the queries the last ``T`` of them), each query
    seeing the keys up to its own and, with a ``window``, only the last ``window`` of those (its
    position minus ``window - 1`` on): "causal" or None where the window hides no key."""
    if window is None or L <= window:
        return "causal" if T > 1 else None
    q = mx.arange(L - T, L)[:, None]
    k = mx.arange(L)[None]
    return (q >= k) & (q - k < window)


def cached_attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float,
                     window: Optional[int] = None, sinks: Optional[mx.array] = None) -> mx.array:
    """Causal attention of rotated ``queries`` [B, H, T, D] over ``cache`` (mlx-lm's ``KVCache``;
    None: no cache) extended by the pass's ``keys`` and ``values`` [B, Hkv, T, D]. A batch of
    several sequences' caches (``cache.KVBatch``: ``members``) runs each row over its own cache, as
    alone, with its own queries only (``cache.rows``: the padding after them neither enters its
    cache nor makes the call longer, which on a GPU would pick another kernel; its output rows are
    zeros); a prefill chunk on the CPU goes in row blocks (``attention_rows``).

    ``window``: a sliding-window layer (its cache a ``cache.WindowCache``, or any KV cache: each
    query is masked to its window); ``sinks``: gpt-oss's per-head sink logits (``attention``)."""
    members = getattr(cache, "members", None)
    if members is not None:  # a batch (cache.KVBatch): each row over its own cache, as alone
        streams, heads, T = side_streams(), [], queries.shape[2]
        for i, (c, n) in enumerate(zip(members, cache.rows)):
            with mx.stream(streams[i % len(streams)]):
                head = cached_attention(queries[i : i + 1, :, :n], keys[i : i + 1, :, :n], values[i : i + 1, :, :n], c,
                                        scale, window, sinks)
                heads.append(head if n == T else mx.pad(head, [(0, 0), (0, 0), (0, T - n), (0, 0)]))
        return mx.concatenate(heads)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    T, L = queries.shape[2], keys.shape[2]
    rows = attention_rows(queries.shape[1], T, L)
    if rows is None:
        return attention(queries, keys, values, scale, window_mask(T, L, window), sinks)
    # Row blocks, each over the keys up to its last row, each made to wait for the one before:
    # left independent, MLX runs them side by side with every block's scores alive at once.
    # (An mx.eval per block bounds memory as well but measured 20% slower over a prefill.)
    past, heads = L - T, []
    for s in range(0, T, rows):
        end = past + min(s + rows, T)
        begin = 0 if window is None else max(past + s - window + 1, 0)  # the block's first window
        q = queries[:, :, s : s + rows]
        if heads:
            q = mx.depends(q, heads[-1])
        mask = window_mask(q.shape[2], end - begin, window)
        heads.append(attention(q, keys[:, :, begin:end], values[:, :, begin:end], scale, mask, sinks))
    return heads[0] if len(heads) == 1 else mx.concatenate(heads, axis=2)


def make_rope(head_dim: int, theta: float, scaling: Optional[dict] = None,
              max_position_embeddings: Optional[int] = None) -> nn.Module:
    """RoPE over whole heads (not interleaved) with a config's scaling: ``yarn`` as transformers
    computes it (``YarnRoPE``), the others (``default``, ``linear``, ``llama3``...) through mlx-lm's
    ``initialize_rope``, as the draft's."""
    from mlx_lm.models.rope_utils import initialize_rope

    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else None
    if kind in ("default", None):
        scaling = None
    if kind == "yarn":
        return YarnRoPE(head_dim, theta, scaling, max_position_embeddings)
    return initialize_rope(head_dim, base=theta, traditional=False, scaling_config=scaling,
                           max_position_embeddings=max_position_embeddings)


class YarnRoPE(nn.Module):
    """YaRN RoPE (``rope_type: yarn``) as transformers' ``_compute_yarn_parameters``: frequencies
    blended between interpolated (divided by ``factor``) and original along a ramp over the
    dimensions between the ``beta_fast`` and ``beta_slow`` rotation counts, and both rotated
    vectors scaled by the attention factor (``0.1 ln(factor) + 1`` unless the config says).

    Written here rather than taken from mlx-lm because mlx-lm always rounds the ramp's ends to
    whole dimensions, while gpt-oss's config says ``truncate: false`` (OpenAI's reference does not
    round): its frequencies differ from mlx-lm's in the ramp."""

    def __init__(self, dims: int, base: float, scaling: dict, max_position_embeddings: Optional[int] = None):
        super().__init__()
        import math

        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = scaling.get("factor") or (max_position_embeddings / original)
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def correction_dim(rotations):
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dims - 1)
        if low == high:
            high += 0.001
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # the share of the original frequency
        inv_freq = 1.0 / base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        self._freqs = 1.0 / inv_freq  # mx.fast.rope takes periods
        self.dims, self.scale = dims, attention_factor

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if self.scale != 1.0:
            x = x * mx.array(self.scale, x.dtype)
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


class Attention(nn.Module):
    """Grouped-query attention with RoPE (Llama), with per-head ``q_norm``/``k_norm`` RMSNorms
    before RoPE where ``qk_norm_eps`` is given (Qwen3), over a sliding ``window`` of positions where
    one is given (its cache a ``cache.WindowCache``), with a learned sink logit per head where
    ``sinks`` (gpt-oss).

    Called by its decoder layer as ``project`` and ``output`` (compiled) around ``attend`` (the KV
    cache, whose key count grows every step)."""

    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int, rope: nn.Module,
                 bias: bool = False, qk_norm_eps: Optional[float] = None, window: Optional[int] = None,
                 sinks: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.window = window
        if sinks:
            self.sinks = mx.zeros((n_heads,))
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden_size, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.rope = rope

    def project(self, x: mx.array, offset) -> Tuple[mx.array, mx.array, mx.array]:
        """Rotated queries, keys and values [B, heads, T, D]."""
        B, T, _ = x.shape
        queries = self.q_proj(x).reshape(B, T, self.n_heads, -1)
        keys = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)
        values = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        return self.rope(queries, offset=offset), self.rope(keys, offset=offset), values

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, cache) -> mx.array:
        return cached_attention(queries, keys, values, cache, self.scale, self.window, self.get("sinks"))

    def output(self, heads: mx.array) -> mx.array:
        B, _, T, _ = heads.shape
        return self.o_proj(heads.transpose(0, 2, 1, 3).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    """A pre-norm transformer layer: RMSNorm -> attention -> residual -> RMSNorm -> ``mlp`` (SwiGLU
    or a mixture of experts) -> residual. Compiled on either side of the attention for decode and
    verify lengths (up to ``COMPILED_TOKENS``), as Qwen3.5's attention layers are, once the kernels
    of a layer that may run the Metal verify kernel (``kernel_matmuls``) are decided
    (``compiled_pieces``); a prefill chunk runs the plain functions."""

    is_linear = False  # no Gated DeltaNet: its cache is a KV cache, its rollback a trim

    def __init__(self, attention: Attention, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        # Compiled forms per mode (a dict set the plain way would become a child of the module tree).
        object.__setattr__(self, "_compiled", {})
        self.kernel_matmuls = None  # set by quantized.route_layers where a kernel of ours may run inside
        self.resolve_mode()

    def resolve_mode(self) -> None:
        """``kernels`` where a quantized matmul may run the Metal kernel, else ``attention``; the
        compiled forms are made again (the deciders may have changed)."""
        self.mode = "kernels" if self.kernel_matmuls is not None else "attention"
        self._compiled.clear()

    def __call__(self, x: mx.array, cache=None, record_tape: bool = False) -> mx.array:
        # record_tape: nothing to record, a KV cache rolls back by trimming.
        mode = self.mode if x.shape[1] <= COMPILED_TOKENS else "plain"
        before, after = self._pieces(mode)
        queries, keys, values = before(x, mx.array(0) if cache is None else mx.array(cache.offset))
        return after(x, self.self_attn.attend(queries, keys, values, cache))

    def _pieces(self, mode: str):
        if mode not in self._compiled:
            pieces = (self._project, self._output)
            self._compiled[mode] = pieces if mode == "plain" else compiled_pieces(pieces, self.state,
                                                                                  [self.kernel_matmuls])
        return self._compiled[mode]

    def _project(self, x, offset):
        return self.self_attn.project(self.input_layernorm(x), offset)

    def _output(self, x, heads):
        h = x + self.self_attn.output(heads)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextModel(nn.Module):
    """The embedding, the decoder layers and the final norm (``model.*`` in every checkpoint)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: List[nn.Module], eps: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


# ---- the target interface --------------------------------------------------------------------------


class TargetModel(nn.Module):
    """What the decode loop, the draft (``bind``), the prefill, the pipeline and the loaders use of a
    target, whatever its family. A family's ``Model`` sets ``args`` (its ``ModelArgs``: at least
    ``hidden_size``, ``num_hidden_layers``, ``vocab_size``, ``tie_word_embeddings``,
    ``layer_types``), ``model`` (``embed_tokens``, ``layers``, ``norm``) and ``lm_head`` unless the
    head is tied; it overrides ``make_cache`` where a layer keeps another state than a KV cache
    (Qwen3.5's Gated DeltaNet)."""

    args: object

    @property
    def layers(self):
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def head(self, h: mx.array) -> mx.array:
        """The output projection alone (no final norm); the draft shares it."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def forward(
        self,
        inputs: mx.array,
        cache: Optional[list] = None,
        taps: Sequence[int] = (),
        record_tape: bool = False,
        last_only: bool = False,
        proposed: Sequence[int] = (),
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """Logits and, when ``taps`` is given, those layers' outputs concatenated on features.

        ``record_tape`` makes every Gated DeltaNet cache keep what ``cache.rollback`` needs (KV
        caches need nothing: they are trimmed).
        ``last_only``: logits of the last position alone (``[B, 1, V]``), as a prefill chunk needs
        them: the vocabulary head over every prompt position is about a tenth of a 9B prefill.
        ``proposed``: how many of each sequence's rows the draft proposed (the rows after them are
        padding); nothing to do with it here, a pipeline's last rank reports it to rank 0's stats.
        """
        h, tapped = self.run_layers(self.embed_tokens(inputs), cache, taps, record_tape)
        hidden = mx.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        return self.logits(h, last_only), hidden

    def logits(self, h: mx.array, last_only: bool = False) -> mx.array:
        """The final norm and the head on the last layer's output (its last position alone with
        ``last_only``; a pipeline's last stage calls this too)."""
        return self.head(self.model.norm(h[:, -1:] if last_only else h))

    def run_layers(self, h: mx.array, cache: Optional[list], taps: Sequence[int] = (),
                   record_tape: bool = False) -> Tuple[mx.array, Dict[int, mx.array]]:
        """The decoder layers on hidden states; also the outputs of the ``taps`` layers by index
        (a pipeline stage runs only this, on the layers it holds)."""
        cache = cache if cache is not None else [None] * len(self.layers)
        tapped = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, c, record_tape)
            submit_layer(h)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.forward(inputs, cache)[0]

    def make_cache(self) -> list:
        """One mlx-lm ``KVCache`` per layer, a ``cache.WindowCache`` per sliding-window layer (both
        rolled back by ``trim``)."""
        windows = [getattr(getattr(layer, "self_attn", None), "window", None) for layer in self.layers]
        return [KVCache() if w is None else WindowCache(w) for w in windows]

    def use_recurrence(self, recurrence) -> "TargetModel":
        """Run every Gated DeltaNet layer through ``recurrence`` (a target without one: nothing)."""
        for layer in self.layers:
            layer.resolve_mode()
        return self

    def use_quantized_matmuls(self, matmuls: Optional[quantized.QuantizedMatmuls]) -> "TargetModel":
        """Route every quantized layer through ``matmuls`` (the verify kernel on Metal); the layers
        that may then run the kernel compile once it is decided."""
        quantized.route_layers(self, self.layers, matmuls)
        for layer in self.layers:
            layer.resolve_mode()
        return self

    def experts_in_float32(self) -> "TargetModel":
        """Unquantized experts in float32 (MLX's CPU gather_mm has no other dtype); a target
        without experts: nothing."""
        for layer in self.layers:
            if isinstance(getattr(layer, "mlp", None), SparseMoe):
                layer.mlp.experts_in_float32()
        return self


def drop_unused(weights: Dict[str, mx.array], tie_word_embeddings: bool) -> Dict[str, mx.array]:
    """A checkpoint's weights less what no module holds: precomputed RoPE tables (``rotary_emb``),
    and the head when it is the embedding."""
    out = {k: v for k, v in weights.items() if "rotary_emb." not in k}
    if tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ---- mixtures of experts ---------------------------------------------------------------------------

ROW_INDEPENDENT_ROWS = quantized.MAX_ROWS  # verify blocks; prefill chunks route in one call


class SparseMoe(nn.Module):
    """A sparse mixture of SwiGLU experts: a router ``gate`` ``Linear(H, E)`` with a float32
    softmax, the top k of it (renormalized with ``norm_topk_prob``), the experts stacked as
    mlx-lm's ``SwitchGLU`` (the T tokens of a verify pass go through the experts in one batched
    gather). Qwen3-MoE's block as it is; Qwen3.5-MoE's adds a shared expert.

    Exactness under verification: a token's experts must not depend on how many tokens are
    verified with it. The router is the one place where a near-tie between two experts turns
    rounding into a different computation, so up to ``ROW_INDEPENDENT_ROWS`` tokens are routed one
    token at a time (each exactly as a decode step computes it) or, for a quantized router on
    Metal, through the verify-matmul kernel, whose rows do not depend on each other."""

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(hidden_size, expert_size, num_experts)
        # MLX's CPU gather_mm computes only in float32: unquantized experts are cast once at load
        # there (``experts_in_float32``), and their inputs with each call. A plain attribute.
        self.float32_experts = False

    def router_logits(self, x: mx.array) -> mx.array:
        """[..., E] logits, each token's computed exactly as a one-token call computes it."""
        rows = x.size // x.shape[-1]
        if rows > ROW_INDEPENDENT_ROWS:
            return self.gate(x)
        logits = quantized.kernel_rows(self.gate, x)  # a quantized router on Metal: one call, rows independent
        if logits is not None:
            return logits
        if rows == 1:
            return self.gate(x)
        flat = x.reshape(rows, 1, x.shape[-1])
        return mx.concatenate([self.gate(flat[i]) for i in range(rows)], axis=0).reshape(*x.shape[:-1], -1)

    def route(self, x: mx.array):
        """(expert indices [..., k], their weights in float32, renormalized with ``norm_topk_prob``)."""
        probs = mx.softmax(self.router_logits(x).astype(mx.float32), axis=-1)
        indices = mx.argpartition(probs, kth=-self.top_k, axis=-1)[..., -self.top_k:]
        weights = mx.take_along_axis(probs, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return indices, weights

    def experts(self, x: mx.array, inputs: Optional[mx.array] = None) -> mx.array:
        """The routed experts' outputs, weighted and summed, in ``x``'s dtype; ``inputs``: what the
        experts take where it is not what the router takes (Gemma 4 routes the unnormed stream)."""
        indices, weights = self.route(x)
        inputs = x if inputs is None else inputs
        experts_in = inputs.astype(mx.float32) if self.float32_experts else inputs
        y = self.switch(experts_in, indices, sort=x.size // x.shape[-1] > ROW_INDEPENDENT_ROWS)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2).astype(x.dtype)

    def switch(self, x: mx.array, indices: mx.array, sort: bool) -> mx.array:
        """mlx-lm's ``SwitchGLU`` call, with its token sort decided by the pass, not by the index
        count: mlx-lm sorts once a call has 64 expert indices, which moves a verify pass from
        ``gather_qmv`` to sorted ``gather_qmm`` on a Mac, and a batch-mate's rows can cross that
        line. Verify passes (up to ``ROW_INDEPENDENT_ROWS`` rows) never sort, so a sequence's
        experts run one gather path whatever its batch-mates; a prefill chunk sorts (its rows are
        the prompt's own)."""
        mlp = self.switch_mlp
        x = mx.expand_dims(x, (-2, -3))
        idx, unsort = indices, None
        if sort:
            flat = indices.flatten()
            order = mx.argsort(flat)
            x, idx, unsort = x.flatten(0, -3)[order // indices.shape[-1]], flat[order], mx.argsort(order)
        up = mlp.up_proj(x, idx, sorted_indices=sort)
        gate = mlp.gate_proj(x, idx, sorted_indices=sort)
        y = mlp.down_proj(mlp.activation(up, gate), idx, sorted_indices=sort)
        if sort:
            y = mx.unflatten(y[unsort], 0, indices.shape)
        return y.squeeze(-2)

    def __call__(self, x: mx.array) -> mx.array:
        return self.experts(x)

    def experts_in_float32(self) -> None:
        """Unquantized experts in float32 (quantized ones run gather_qmm, in any dtype)."""
        if "scales" in self.switch_mlp.gate_proj:
            return
        self.switch_mlp.set_dtype(mx.float32)
        self.float32_experts = True


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp)\.switch_mlp\.")


def stack_experts(weights: Dict[str, mx.array], num_experts: int) -> Dict[str, mx.array]:
    """Every published expert layout (keys already under ``model.layers.N.mlp``) -> stacked
    ``switch_mlp`` experts: HF's fused ``experts.gate_up_proj`` [E, 2I, H] (gate half first) and
    ``experts.down_proj`` [E, H, I]; one tensor per expert (``experts.{e}.{gate,up,down}_proj.weight``:
    Qwen3-MoE's releases, FP8/NVFP4 releases, fine-tunes, transformers 5's own save); MLX's stacked
    ``switch_mlp`` (kept). Other keys pass as they are."""
    layouts: Dict[str, List[str]] = {}
    per_expert: Dict[str, Dict[str, Dict[int, mx.array]]] = {}
    out = {}
    for key, value in weights.items():
        if m := _FUSED.match(key):
            layouts.setdefault("fused (experts.gate_up_proj)", []).append(m.group(1))
            if m.group(2) == "gate_up_proj":
                half = value.shape[-2] // 2
                out[f"{m.group(1)}.switch_mlp.gate_proj.weight"] = value[..., :half, :]
                out[f"{m.group(1)}.switch_mlp.up_proj.weight"] = value[..., half:, :]
            else:
                out[f"{m.group(1)}.switch_mlp.down_proj.weight"] = value
        elif m := _PER_EXPERT.match(key):
            layouts.setdefault("one tensor per expert (experts.N.*_proj)", []).append(m.group(1))
            per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
        else:
            if m := _STACKED.match(key):
                layouts.setdefault("stacked (switch_mlp)", []).append(m.group(1))
            out[key] = value
    if len(layouts) > 1:
        found = "; ".join(f"{name} in {sorted(set(where))[0]}..." for name, where in layouts.items())
        raise ValueError(f"the checkpoint mixes expert layouts ({found}): convert it with one layout")
    E = num_experts
    for prefix, projections in per_expert.items():
        for name, experts in projections.items():
            if sorted(experts) != list(range(E)):
                missing = sorted(set(range(E)) - set(experts))[:5]
                raise ValueError(f"{prefix}.experts: {name} missing for experts {missing} (of {E})")
            out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack([experts[e] for e in range(E)])
    return out
