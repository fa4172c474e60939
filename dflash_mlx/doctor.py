"""``dflash-mlx doctor``: what this machine can run, whether the kernels work here, and whether a
pair fits in memory at a given context; each problem comes with its fix in one line."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from . import device as device_lib
from . import kernels
from .checkpoint_files import safetensors_header, text_part

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"
GiB = 1024**3
# A prefill chunk's working memory on MLX's CPU backend, measured here (MLX 0.32): bytes per
# attention score of a row block (layers.attention keeps several [heads, rows, keys] arrays of a block,
# and the next block's first ones, alive: on one stream 30 in 16-bit, 18 in float32; with the key
# heads on side streams, one per core, 17 for either plus about one copy of the layer's keys:
# examples/memory_peak.py measured the demo pair 2.5% above that estimate at 4096 tokens, 0.2% at
# 8192, 0.2% below at 32768, and its peak at 4096 varied from 24.1 to 27.3 MB with what ran
# before and how the streams met), and per token and channel of a Gated DeltaNet layer's input
# (its depthwise conv1d: 37-41 for every dtype and shape tried with the layer evaluated alone, 48
# within a chunk's whole graph, where the layer's other projections are computed ahead).
# docs/benchmarks.md compares the estimate with measured peaks.
SCORE_BYTES = {2: 30, 4: 18}
SCORE_BYTES_SIDE_STREAMS = 17
CONV_BYTES = 48
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8, "I64": 8, "U16": 2, "BOOL": 1}


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Report:
    checks: List[Check] = field(default_factory=list)
    memory: Dict[str, int] = field(default_factory=dict)
    tuning: List[Any] = field(default_factory=list)  # quantized.Timing per matmul shape (--tune)
    tuning_layers: Dict[Any, int] = field(default_factory=dict)  # the pair's layers per tuned shape

    def add(self, *args, **kwargs) -> Check:
        self.checks.append(Check(*args, **kwargs))
        return self.checks[-1]

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def safetensors_bytes(folder: Path, skip=("vision_tower", "model.visual", "visual.", "mtp.")) -> Dict[str, tuple]:
    """Tensor name -> (dtype, shape, bytes) from the files' headers, reading no weights."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        header, _ = safetensors_header(file)
        for name, entry in header.items():
            if name == "__metadata__" or any(s in name for s in skip):
                continue
            start, end = entry["data_offsets"]
            out[name] = (entry["dtype"], tuple(entry["shape"]), end - start)
    return out


def _draft_weight_bytes(tensors: Dict[str, tuple], quant: Optional[tuple], activation_bytes: Optional[int]) -> int:
    """The draft's weights after ``--draft-quant`` (and a float32 activation cast, if any)."""
    total = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        if name.startswith(("embed_tokens.", "lm_head.", "model.embed_tokens.", "model.lm_head.")):
            continue  # the draft uses the target's
        element = activation_bytes or _BYTES.get(dtype, 2)
        numel = nbytes // _BYTES.get(dtype, 2)
        if quant and len(shape) == 2 and name.endswith(".weight") and shape[-1] % quant[1] == 0:
            bits, group = quant
            total += numel * bits // 8 + (numel // group) * 2 * element  # packed weights + scales + biases
        else:
            total += numel * element
    return total


def _activation_bytes(tensors: Dict[str, tuple]) -> int:
    """Bytes per activation: those of the checkpoint's floating-point tensors (a quantized one's
    scales), whatever its config says."""
    sizes = [_BYTES[dtype] for dtype, _, _ in tensors.values() if dtype in ("F32", "F16", "BF16")]
    return max(set(sizes), key=sizes.count) if sizes else 2


def _cache_rows(cache, chunks: List[int]) -> int:
    """Rows a cache holds after taking ``chunks`` tokens at a time: the cache itself is run on
    one-element rows (mlx-lm's KVCache and the draft's ContextCache grow in steps of 256 and
    reallocate on their own rules; this follows them instead of restating them)."""
    for n in chunks:
        rows = mx.zeros((1, 1, n, 1))
        cache.update_and_fetch(rows, rows) if hasattr(cache, "update_and_fetch") else cache.append(rows, rows)
    return 0 if cache.keys is None else cache.keys.shape[2]


def _context_rows(cache, feed: List[int], windows: List[Optional[int]], block: int) -> int:
    """Rows a draft layer's context cache holds after ``feed``, fed as the loop feeds it: room
    reserved for the prompt at once, and only the last tokens' features when every layer keeps a
    window (speculative.features_from)."""
    prompt, decode = sum(n for n in feed if n > 1) or feed[0], [n for n in feed if n == 1]
    kept = [w for w in windows if w != 0]
    if kept and all(w is not None for w in kept):
        prompt = min(prompt, max(kept))
        feed = [prompt] + decode
    cache.reserve(prompt + block)
    return _cache_rows(cache, feed)


def _prompt_length(context: int, decode: int = 16) -> int:
    return max(context - decode, 1)


def _chunks(context: int, chunk: int, decode: int = 16, features_from: int = 0) -> List[int]:
    """How a run at ``context`` feeds its caches: the prompt in chunks, split where the draft's
    window starts (``features_from``), and its last token alone (as ``prefill.prefill``), then a
    few decode steps."""
    prompt = _prompt_length(context, decode)
    ends = sorted({*range(chunk, prompt, chunk), prompt - 1, prompt, *([features_from] if 0 < features_from < prompt else [])}
                  - {0})
    return [e - s for s, e in zip([0] + ends, ends)] + [1] * (context - prompt)


def _first_kept(windows: List[Optional[int]], prompt: int) -> int:
    """``prefill.features_from`` from the layers' kept rows: the first prompt position whose
    features some layer keeps (0 unless every context-reading layer keeps a window)."""
    kept = [w for w in windows if w != 0]
    if not kept or any(w is None for w in kept):
        return 0
    return max(prompt - max(kept), 0)


def _draft_windows(draft_args, draft_window: Optional[int]) -> List[Optional[int]]:
    """Context rows each draft layer keeps (DFlashDraft.make_cache's rule: a sliding layer its
    window less one, a block_attention layer none, every layer at most ``draft_window``)."""
    out = []
    for kind in draft_args.layer_types:
        sliding = {"sliding_attention": draft_args.sliding_window, "block_attention": 1}.get(kind)
        out.append(draft_window if sliding is None else min(x for x in (draft_window, sliding - 1) if x is not None))
    return out


def projection_memory(heads: int, kv_heads: int, head_dim: int, tokens: int, element: int, qk_norm: bool) -> int:
    """Bytes a ``layers.Attention`` layer's projection of a prefill chunk holds at its peak on the
    CPU (MLX 0.32): the queries, keys and values projected; with ``qk_norm`` the queries and keys
    normed (MLX's CPU ``rms_norm`` is plain operations, its output a tensor of its own); and per
    rotated tensor RoPE's CPU form: its four half-width products and their concatenation, and its
    angle, cosine and sine tables [tokens, head_dim / 2]. Measured in a prefill chunk's layer (the
    growing cache's copy subtracted, ``prefill_working_memory``), in units of one [tokens, heads x
    head_dim] float32 tensor with as many key heads as query heads: gpt-oss 10.8 to 11.1 (this
    counts 10.5), Gemma 4 11.6 to 12.7 (12.5; its values' norm, not counted, is freed by then: evaluated
    alone the projection peaks at 14.5). On a GPU ``rms_norm`` and ``rope`` are fused kernels: the
    projections alone (not measured)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    if mx.default_device() != mx.cpu:
        return tokens * (q + 2 * kv) * element
    norms = q + kv if qk_norm else 0
    rope = 3 * (q + kv) + 2 * 3 * head_dim // 2
    return tokens * (q + 2 * kv + norms + rope) * element


def attention_memory(heads: int, head_dim: int, tokens: int, rows: int, keys: int, element: int, split: bool) -> int:
    """Bytes a ``layers.Attention`` layer's row-block attention of a prefill chunk holds at its
    peak on the CPU (``layers.cached_attention``, ``rows`` query rows a block over up to ``keys``
    keys), beside the cache: the rotated queries, the blocks' outputs and their concatenation
    (three [tokens, heads x head_dim] tensors), a block's boolean mask (1 byte per row and key),
    and per score the blocks' softmax chains in ``_cpu_attention``. One block's chain, measured
    alone on MLX 0.32's CPU: 4.3 bytes in float32 (the mask and the softmax write over the scores'
    buffer), 8.3 in bfloat16 (its scores, the float32 copy the softmax writes over, the cast
    back). The row-block loop frees a block's buffers as its stream gets to it, so more than one
    block's are alive: measured (``cached_attention`` alone, 4 to 32 query heads over 2 to 8 key
    heads, 32- to 128-wide, 2031 to 8175 keys; with what else ran) 6.4-10.5 bytes a score float32
    and 12.1-16.0 bfloat16 with the key heads on side streams, counted 8 and 14 (two blocks');
    on one stream 14.1-16.6 and 23.2-28.4, counted 16 and 28. Qwen3.5's own attention keeps the
    fitted ``SCORE_BYTES``, which count its projection as well."""
    per_score = (8 if element == 4 else 2 * element + 10) * (1 if split else 2)
    return rows * keys * (per_score * heads + 1) + 3 * tokens * heads * head_dim * element


def experts_memory(tokens: int, hidden: int, experts: Tuple[int, int, int, int], element: int) -> int:
    """Bytes a ``layers.SparseMoe`` block holds for a prefill chunk at its peak: per token and expert
    slot (``experts``: top k, expert size, then the tensors of the expert's width and of the hidden
    width each slot holds), its up and gate projections with the activation's tensors (measured on
    MLX 0.32's CPU: 2 for SwiGLU, 3 for Gemma 4's GeGLU, 5 for gpt-oss's clamped SwiGLU with its
    biases), and its gathered input row, the down projection's output, unsorted and weighted (3,
    4 for Gemma 4 and gpt-oss); then the slots' sum. On the CPU the experts compute in float32
    (``experts_in_float32``: MLX's CPU gather_mm has no other dtype); elsewhere in the model's
    (not measured). Measured on the blocks alone, each within 2% of its peak; the router's float32
    logits and top k [tokens, experts] are not counted (with 4 to 8 experts, the 26 floats a token
    the measurements left)."""
    top_k, size, per_size, per_hidden = experts
    width = 4 if mx.default_device() == mx.cpu else element
    return tokens * (top_k * (per_size * size + per_hidden * hidden) + hidden) * width


def prefill_working_memory(args, context: int, chunk: int, element: int, taps: List[int] = (),
                           draft_element: int = 2, draft_layers: int = 0, draft_kv: int = 0,
                           regrown: int = 0) -> int:
    """Bytes a prefill chunk of ``chunk`` tokens at ``context`` needs on top of the caches: the
    target's pass (its largest layer: an attention layer's row blocks of scores, a Gated DeltaNet
    layer's convolution, an MLP or a mixture of experts (``args.experts``, ``experts_memory``); and
    the hidden states and tapped features alive across layers)
    or the draft's (``draft_layers`` layers that read the context, ``draft_kv`` = KV heads x head
    dim), whichever is larger. The last layer's attention runs on the last token alone unless the
    draft taps it (as the loop feeds a prompt). On a GPU the fused attention keeps no scores (not
    measured).

    A ``layers.Attention`` layer (``args.qk_norm`` set: every family but Qwen3.5, whose
    attention term above counts its own queries) has its row blocks counted from its own tensors
    (``attention_memory``: the Qwen3.5 fit put a tiny float32 Llama pair's estimate 22% over its run),
    and also peaks while it projects the chunk
    (``projection_memory``) as its KV cache grows: mlx-lm's ``KVCache`` concatenates its buffer
    with zeros for the new rows, both alive beside the result: one full layer's cache at its new
    size (``regrown`` rows, 0 where the chunk did not reallocate a cache holding rows) on top of the
    caches after the chunk."""
    from .models.layers import side_streams
    from .models.qwen3_5 import attention_rows

    c = min(chunk, context)
    kinds = list(args.layer_types)
    scored = any(t == "full_attention" for t in kinds[:-1]) or (kinds[-1] == "full_attention" and len(kinds) - 1 in taps)
    rows = attention_rows(args.num_attention_heads, c, context) if scored else None
    split = len(side_streams()) > 1
    per_score = SCORE_BYTES_SIDE_STREAMS if split else SCORE_BYTES.get(element, 30)
    scores = per_score * args.num_attention_heads * rows * context if rows is not None else 0
    if split and rows is not None:  # and about one copy of the layer's keys (fitted: 4k to 32k, see SCORE_BYTES)
        scores += context * args.num_key_value_heads * args.head_dim * element
    # Alive beside a layer's score blocks: its q_proj output (queries and output gate, 2 x heads x
    # head_dim), the rotated queries, and the blocks' outputs with their concatenation.
    attention = scores + 5 * c * args.num_attention_heads * args.head_dim * element if rows is not None else 0
    if rows is not None and getattr(args, "qk_norm", None) is not None:  # layers.Attention: projection apart
        attention = attention_memory(args.num_attention_heads, args.head_dim, c, rows, context, element, split)
    conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    gated_delta = CONV_BYTES * c * conv_dim if "linear_attention" in kinds else 0
    qk_norm = getattr(args, "qk_norm", None)
    projection = 0 if qk_norm is None else max(
        projection_memory(args.num_attention_heads, n_kv, head_dim, c, element, qk_norm)
        + (2 * regrown * n_kv * head_dim * element if window is None else 0)
        for window, n_kv, head_dim in args.kv_layers)
    mlp = 3 * c * args.intermediate_size * element
    experts = getattr(args, "experts", None)
    moe = experts_memory(c, args.hidden_size, experts, element) if experts else 0
    n = len(taps)
    target = max(attention, projection, gated_delta, mlp, moe) + c * args.hidden_size * element * (2 + n)
    # Then the draft takes the chunk's features (the loop evaluates the two passes one after the
    # other): the features, fc and its norm, and per context-reading layer its keys and values
    # (projected, normed, rotated) before they are written into its cache.
    draft = c * args.hidden_size * (element * n + 2 * draft_element) + draft_layers * 6 * c * draft_kv * draft_element if n else 0
    return max(target, draft)


def decode_working_memory(args, block: int, element: int, tape: int) -> int:
    """Bytes a verify cycle needs on top of the caches: the Gated DeltaNet tape, and the target's and
    the draft's logits over the block with what accepting and sampling make of them (16 bytes per
    vocabulary entry and block slot in float32, 12 in 16-bit, measured)."""
    return tape + block * args.vocab_size * (2 * element + 8)


def memory_args(config: Dict[str, Any], qwen3_5_args):
    """The target's shapes as the estimate reads them: Qwen3.5's ``ModelArgs`` (``qwen3_5_args``), or
    for an attention-only family (Qwen3, Qwen3-MoE, Llama 3.1) its own, every layer full attention
    and no Gated DeltaNet (Qwen3.5's defaults would count Llama's layers as recurrent ones).
    ``kv_layers`` lists each attention layer's (sliding window or None, key heads, head size): a
    sliding layer (gpt-oss, Gemma 4, windowed Qwen3) keeps its window's rows, not the context's,
    and Gemma 4's full layers have their own ``global_head_dim`` (the working memory takes the
    widest head). ``qk_norm``: whether its ``layers.Attention`` layers norm queries and keys per
    head (Qwen3's, Qwen3-MoE's and Gemma 4's; not Llama's or gpt-oss's); ``experts``: a mixture
    of experts' shapes for ``experts_memory`` (None: dense)."""
    from types import SimpleNamespace

    from .loading import CheckpointError, target_family, target_module

    try:
        family = target_family(config)
    except CheckpointError:
        family = "qwen3_5"  # what the estimate read before families: the loader names the problem
    if family in ("qwen3_5", "qwen3_5_moe"):
        args = qwen3_5_args.from_dict(config)
        args.kv_layers = [(None, args.num_key_value_heads, args.head_dim)
                          for t in args.layer_types if t == "full_attention"]
        return args
    own = target_module(config).ModelArgs.from_dict(dict(text_part(config)))
    shape = getattr(own, "head_shape", lambda i: (own.head_dim, own.num_key_value_heads))
    kv_layers = [(own.window(i), *shape(i)[::-1]) for i in range(own.num_hidden_layers)]
    experts = None  # a mixture of experts' (top k, expert size, tensors per slot: expert-wide, hidden-wide)
    if family == "gpt_oss":
        experts = (own.num_experts_per_tok, own.intermediate_size, 5, 4)
    elif family == "qwen3_moe":
        experts = (own.num_experts_per_tok, own.moe_intermediate_size, 2, 3)
    elif family == "gemma4" and own.enable_moe_block:
        experts = (own.top_k_experts, own.moe_intermediate_size, 3, 4)
    return SimpleNamespace(
        hidden_size=own.hidden_size, intermediate_size=own.intermediate_size, num_attention_heads=own.num_attention_heads,
        num_key_value_heads=own.num_key_value_heads, head_dim=max(d for _, _, d in kv_layers), vocab_size=own.vocab_size,
        kv_layers=kv_layers, qk_norm=family in ("qwen3", "qwen3_moe", "gemma4"), experts=experts,
        num_hidden_layers=own.num_hidden_layers, layer_types=["full_attention"] * own.num_hidden_layers,
        linear_num_key_heads=0, linear_key_head_dim=0, linear_num_value_heads=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=1)


def estimate_memory(target_dir: Path, draft_dir: Optional[Path], draft_quant: Optional[str], context: int,
                    block: Optional[int] = None, draft_dtype: Optional[mx.Dtype] = None, chunk: Optional[int] = None,
                    draft_window: Optional[int] = None) -> Dict[str, int]:
    """Bytes a run at ``context`` tokens peaks at: what stays (weights, attention KV caches, Gated
    DeltaNet states, the draft's context cache, each as its cache class grows it) and the working
    memory on top, the larger of the prompt's last chunk's (``chunk``: this backend's prefill
    chunk) and a verify cycle's; ``draft_window`` as ``load`` takes it. docs/benchmarks.md compares
    it with measured peaks."""
    from mlx_lm.models.cache import KVCache

    from .cache import WindowCache
    from .loading import read_config
    from .models.dflash import ContextCache, DraftArgs, resolve_taps
    from .quant import parse_quant
    from .models.qwen3_5 import ModelArgs
    from .prefill import default_prefill_step

    chunk = chunk or default_prefill_step()
    config = read_config(target_dir)
    args = memory_args(config, ModelArgs)
    tensors = safetensors_bytes(target_dir)
    element = _activation_bytes(tensors)
    out = {"target weights": sum(b for _, _, b in tensors.values())}
    n_attn = sum(t == "full_attention" for t in args.layer_types)
    n_lin = len(args.layer_types) - n_attn
    first_kept = 0
    if draft_dir is not None:
        first_kept = _first_kept(_draft_windows(DraftArgs.from_dict(read_config(draft_dir)), draft_window), _prompt_length(context))
    feed = _chunks(context, chunk, features_from=first_kept)
    # Bytes per cached row of the layers sharing a cache kind (full, or a window's): a sliding
    # layer's WindowCache holds its window and the last pass's rows, whatever the context.
    row_bytes: Dict[Optional[int], int] = {}
    for window, n_kv, head_dim in args.kv_layers:
        row_bytes[window] = row_bytes.get(window, 0) + 2 * n_kv * head_dim * element
    kv = {w: KVCache() if w is None else WindowCache(w) for w in row_bytes}
    grown, fed = [], 0  # the KV bytes after each prompt chunk: the peak may come at any
    for n in feed:
        fed += n
        before = 0 if kv.get(None) is None or kv[None].keys is None else kv[None].keys.shape[2]
        kv_bytes = sum(row_bytes[w] * _cache_rows(c, [n]) for w, c in kv.items())
        after = 0 if kv.get(None) is None else kv[None].keys.shape[2]
        grown.append((n, fed, kv_bytes, after if 0 < before < after else 0))  # rows of a full cache reallocated
    out["attention KV caches"] = grown[-1][2]
    state = args.linear_num_value_heads * args.linear_value_head_dim * args.linear_key_head_dim * 4
    conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim + args.linear_num_value_heads * args.linear_value_head_dim
    out["Gated DeltaNet states"] = n_lin * (state + (args.linear_conv_kernel_dim - 1) * conv_dim * element)
    tape, taps, draft_element, draft_layers, draft_kv = 0, [], element, 0, 0
    if draft_dir is not None:
        draft_config = read_config(draft_dir)
        draft_args = DraftArgs.from_dict(draft_config)
        block = block or draft_args.block_size
        per_step = args.linear_num_key_heads * args.linear_key_head_dim * element + args.linear_num_value_heads * (
            1 + args.linear_value_head_dim) * 4
        tape = n_lin * (state + block * per_step + (args.linear_conv_kernel_dim - 1 + block) * conv_dim * element)
        activation = 4 if draft_dtype is not None and draft_dtype == mx.float32 else None
        draft_tensors = safetensors_bytes(draft_dir)
        out["draft weights"] = _draft_weight_bytes(draft_tensors, parse_quant(draft_quant), activation)
        stored = _activation_bytes(draft_tensors)
        draft_element = activation or max(element, stored)  # the context K/V take the wider of features and weights
        windows = _draft_windows(draft_args, draft_window)
        rows = sum(_context_rows(ContextCache(w), feed, windows, block) for w in windows if w != 0)
        out["draft context cache"] = rows * 2 * draft_args.num_key_value_heads * draft_args.head_dim * draft_element
        taps = resolve_taps(draft_args.target_layer_ids, draft_args.num_hidden_layers, args.num_hidden_layers)
        draft_layers = sum(w != 0 for w in _draft_windows(draft_args, draft_window))
        draft_kv = draft_args.num_key_value_heads * draft_args.head_dim
    # The peak: after some prompt chunk (its working memory over the KV caches so far; the draft's
    # cache is reserved whole at the start) or in a verify cycle (over the final caches). What it
    # adds to the final caches is the working memory.
    # Chunks before the draft's window run untapped: no features, no draft pass.
    prefill = max(held + prefill_working_memory(args, end, n, element, taps if end > first_kept else [],
                                                           draft_element, draft_layers, draft_kv, regrown)
                  for n, end, held, regrown in grown if n > 1 or end == 1) - out["attention KV caches"]
    decode = decode_working_memory(args, block or 1, element, tape)
    out[f"working memory ({'prefill' if prefill >= decode else 'verify'})"] = max(prefill, decode)
    return out


def pipeline_memory(target_dir: Path, draft_dir: Optional[Path], memory: Dict[str, int], world: int,
                    counts: Optional[List[int]] = None) -> List[Tuple[Tuple[int, int], int, int]]:
    """Per rank of a pipeline over ``world`` ranks: its layer range, weight bytes and cache bytes.
    The split is the one ``load`` makes (from the same lazily loaded weights: nothing is read);
    caches follow the layers (attention KV, Gated DeltaNet states and tape), and the last rank
    also holds the draft (its ``memory`` estimate, after ``--draft-quant``) and its context cache;
    each rank a chunk's working memory (that of the largest layer, which any rank may hold)."""
    from .loading import read_target, read_weights
    from .pipeline import stages

    model, _, weights = read_target(target_dir)
    stored_draft = sum(v.nbytes for v in read_weights(draft_dir).values()) if draft_dir is not None else 0
    split = stages.split_pair(weights, model.args.num_hidden_layers, world, counts, stored_draft,
                              draft_dir is not None, model.args.tie_word_embeddings)
    types = model.args.layer_types
    n_attn = max(sum(t == "full_attention" for t in types), 1)
    n_lin = max(len(types) - sum(t == "full_attention" for t in types), 1)
    recurrent = memory["Gated DeltaNet states"]
    working = next(v for k, v in memory.items() if k.startswith("working memory"))
    out = []
    for rank, ((start, end), held) in enumerate(zip(split.ranges, split.weight_bytes)):
        attn = sum(t == "full_attention" for t in types[start:end])
        caches = memory["attention KV caches"] * attn // n_attn + recurrent * (end - start - attn) // n_lin + working
        if rank == world - 1:
            held += memory.get("draft weights", 0) - stored_draft
            caches += memory.get("draft context cache", 0)
        out.append(((start, end), held, caches))
    return out


def _gib(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _check_kernels(report: Report, metal: Optional[kernels.MetalKernels], shapes: List[tuple]) -> None:
    """Self-check each kernel for these head shapes and the three input dtypes."""
    if metal is None:
        report.add("Metal kernels", INFO, "not checked: no Metal GPU here (the pure-MLX references run instead; "
                   "tests/metal_emulation runs the kernels on the CPU)")
        return
    stream = mx.gpu if mx.metal.is_available() else mx.cpu
    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        for Dk, Hk, Dv, Hv in shapes:
            if not kernels.metal_supports(Dk, Hk, Dv, Hv):
                continue
            template = dict(InT=dtype, StT=mx.float32, Dk=Dk, Dv=Dv, Hk=Hk, Hv=Hv)
            with mx.stream(stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # reported below instead
                for T in (1, 8):  # a decode step (few heads: g and beta in the constant space) and a block
                    q, k, v, g, beta, state = kernels._check_inputs(template, T, dtype)
                    metal.usable(kernels.gated_delta_launch(q, k, v, g, beta, state))
                    metal.usable(kernels.tape_replay_launch(state, k, g, mx.zeros(v.shape, dtype=mx.float32), T))
                    metal.usable(kernels.mlx_lm_launch(q, k, v, g, beta, state), kernels._check_mlx_lm)  # the fallback
    for label, result in metal.report().items():
        if result == "ok":
            report.add(f"kernel {label}", OK, "compiled and matched the reference")
        else:
            report.add(f"kernel {label}", FAIL, f"failed its self-check: {result}",
                       "the engine falls back to the pure-MLX reference (slower, still exact); please report this with `dflash-mlx doctor` output")


def _probe_thinking(report: Report, model: str, draft: Optional[str], draft_quant: Optional[str], tokens: int) -> None:
    """Acceptance in each thinking mode of the template: a draft trained on one loses on the other."""
    from . import api

    loaded, tokenizer = api.load(model, draft=draft, draft_quant=draft_quant)
    template = getattr(tokenizer, "chat_template", None) or ""
    if "enable_thinking" not in template:
        report.add("thinking mode", INFO, "the chat template has no thinking switch")
        return
    rates = {}
    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    for think in (True, False):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=think)
        last = None
        # The draft's whole block, every cycle: auto would turn a poor mode into plain steps.
        for last in api.stream_generate(loaded, tokenizer, prompt, max_tokens=tokens, block_tokens=loaded.draft.block_size):
            pass
        rates[think] = last.tokens_per_cycle if last is not None else 0.0
    detail = f"tokens per cycle with --think {rates[True]:.2f}, with --no-think {rates[False]:.2f} ({tokens} greedy tokens)"
    worse, better = sorted(rates, key=rates.get)
    if rates[worse] < 0.75 * rates[better] and rates[better] > 1.2:
        flag = "--think" if better else "--no-think"
        report.add("thinking mode", WARN, detail + f": this draft was trained for {flag} (the CLI's default is --no-think)",
                   f"run chat/generate/serve with {flag}")
    else:
        report.add("thinking mode", OK, detail)


def _tune(report: Report, model: str, draft: Optional[str], draft_quant: Optional[str], matmuls, cache, measure,
          facts: device_lib.DeviceFacts, exact: bool = False) -> None:
    """Time stock quantized_matmul against the verify kernels (per-row and tile) for every shape of
    the pair (on its own weights, at the row counts the tuner times), say what exactness (one
    implementation per layer for every row count) costs on this GPU, and which layers run what:
    exact where it costs at most ``quantized.EXACT_BUDGET`` (or ``exact``), else the fastest at
    each row count."""
    from . import api, quantized

    if matmuls is None:
        matmuls = quantized.QuantizedMatmuls.for_this_process(exact=exact)
    if matmuls is None:
        report.add("quantized matmuls", INFO, "nothing to tune: not an Apple GPU (MLX's stock quantized_matmul "
                   "runs here; the verify kernel is Metal's)")
        return
    loaded, _ = api.load(model, draft=draft, draft_quant=draft_quant, matmuls=None)
    with api.TuningProgress() as progress:
        report.tuning = loaded.use_quantized_matmuls(matmuls, cache, everything=True, measure=measure, progress=progress,
                                                     stock_one=quantized.stock_rule(facts))
    if not report.tuning:
        report.add("quantized matmuls", INFO, "nothing to tune: the pair has no quantized layer the kernel has a form "
                   "for (affine 4/8-bit or mxfp4)", "quantize the draft (--draft-quant w4) or use a 4-bit target")
        return
    report.tuning_layers = quantized.shape_counts([m for m in (loaded.target, loaded.draft) if m is not None])
    where = cache.path if cache is not None else quantized.TuningCache.for_this_device().path
    _tuning_summary(report, matmuls.exact, f"saved in {where}", "please report this with `dflash-mlx doctor --tune` output")


def _tuning_summary(report: Report, exact: bool, where: str, fix: str) -> None:
    """The two lines on ``report.tuning`` (timed now or read from the cache: ``where`` says which):
    which layers run what, and what exactness costs the pair (``exact``: --exact asked for it)."""
    from . import quantized

    layers = report.tuning_layers
    exacts = [t for t in report.tuning if t.is_exact]
    count = {impl: sum(layers.get(t.shape, 1) for t in exacts if t.choice == impl)
             for impl in (quantized.OURS, quantized.TILE, quantized.SPLASH, quantized.STOCK)}
    fastest = sum(layers.get(t.shape, 1) for t in report.tuning if not t.is_exact)
    # The Splash kernel is named where some layer runs it (exact, or as the fastest at some row count).
    splash_fastest = sum(layers.get(t.shape, 1) for t in report.tuning
                         if isinstance(t.choice, quantized.Fastest) and quantized.SPLASH in t.choice.impls())
    splash = (f", {count[quantized.SPLASH]} the Splash kernel" if count[quantized.SPLASH] or splash_fastest else "")
    untimed = sum(t.splash_s == {} for t in report.tuning)  # cached before the Splash kernel had a column
    # The Splash kernel failing is not a failure of the pair: it is only offered where it passes, and
    # its 16-bit simdgroup matrices have not been compiled on a Mac yet (the other kernels run).
    splash_failed = sum(t.splash_s is None for t in report.tuning)
    failed = [t for t in report.tuning if t.kernel_s is None or t.tile_s is None]
    report.add("quantized matmuls", FAIL if failed else OK,
               f"of {sum(layers.get(t.shape, 1) for t in report.tuning)} layers ({len(report.tuning)} shapes), "
               f"{count[quantized.OURS]} run the per-row verify kernel, {count[quantized.TILE]} the tile kernel{splash} and "
               f"{count[quantized.STOCK]} stock, each one kernel at every row count (exact), {fastest} the fastest at "
               f"each row count (not exact: divergence only at the target's top-2 near-ties, `bench` reports them"
               + (f"; {splash_fastest} of them the Splash kernel at some row counts" if splash_fastest else "")
               + f"); layers with a kernel compile once their kernels are decided; {where}"
               + (f"; the Splash kernel not timed for {untimed} of the {len(report.tuning)} shapes (timings from before "
                  f"it: `--tune` times it)"
                  if untimed else "")
               + (f"; the Splash kernel failed its self-check for {splash_failed} shapes (not offered there)"
                  if splash_failed else "")
               + (f"; a kernel failed its self-check for {len(failed)}" if failed else ""),
               fix if failed else "")
    cost = quantized.exactness_cost(report.tuning, layers)
    report.add("exactness", INFO if exact or not fastest else WARN,
               f"one kernel per layer for every row count costs {cost:.1%} of the pair's quantized-matmul time on this "
               f"GPU (timed row counts summed, each shape by its layer count); kept where it costs a layer at most "
               f"{quantized.EXACT_BUDGET:.0%}" + (" and everywhere: --exact" if exact else ""),
               "" if exact or not fastest else
               "run with --exact for output token for token the target's alone (and each batched request its own)")


def _tuned(report: Report, model: str, draft: Optional[str], draft_quant: Optional[str], cache,
           facts: device_lib.DeviceFacts, exact: bool = False) -> None:
    """Without --tune: what exactness costs and which layers run what, read from the tuning cache
    (``quantized.TuningCache``, this GPU's by default) where it has every quantized shape of the
    pair, timing nothing; else "not tuned yet (run --tune)"."""
    from . import api, quantized

    if not facts.metal:
        report.add("quantized matmuls", INFO, "nothing to tune: not an Apple GPU (MLX's stock quantized_matmul "
                   "runs here; the verify kernel is Metal's)")
        return
    cache = cache if cache is not None else quantized.TuningCache.for_this_device()
    timings = {t.shape: t for t in cache.timings(exact)}
    if not timings:  # nothing to match the pair against: no need to load it
        report.add("quantized matmuls", INFO, f"not tuned yet (run --tune): no timings for this GPU in {cache.path}")
        return
    loaded, _ = api.load(model, draft=draft, draft_quant=draft_quant, matmuls=None)  # matmuls=None: times nothing
    layers = quantized.shape_counts([m for m in (loaded.target, loaded.draft) if m is not None])
    if not layers:
        report.add("quantized matmuls", INFO, "nothing to tune: the pair has no quantized layer the kernel has a form "
                   "for (affine 4/8-bit or mxfp4)")
        return
    missing = [s for s in layers if s not in timings]
    if missing:
        report.add("quantized matmuls", INFO, f"not tuned yet (run --tune): {len(missing)} of the pair's {len(layers)} "
                   f"quantized shapes have no timings for this GPU in {cache.path}")
        return
    report.tuning, report.tuning_layers = [timings[s] for s in layers], layers
    _tuning_summary(report, exact, f"read from {cache.path} (timed by an earlier --tune or first load)",
                    "run `dflash-mlx doctor --tune` to time them again")


def diagnose(model: Optional[str] = None, draft: Optional[str] = None, draft_quant: Optional[str] = None,
             context: int = 8192, memory_gb: Optional[float] = None, probe_tokens: int = 48,
             facts: Optional[device_lib.DeviceFacts] = None, metal: Optional[kernels.MetalKernels] = None,
             kernel_shapes: Optional[List[tuple]] = None, tune: bool = False, matmuls=None, tuning_cache=None,
             measure=None, ranks: int = 1, stages: Optional[List[int]] = None, exact: bool = False,
             prompt_cache_dir: Optional[Path] = None, prompt_cache_disk_gb: float = 16.0) -> Report:
    """Every check. ``facts`` and ``metal`` stand for this machine's device and kernels, and
    ``kernel_shapes`` (Dk, Hk, Dv, Hv) for the heads to self-check (tests pass others). ``tune``
    (with a model) re-times the pair's quantized matmuls, through ``matmuls``
    (``quantized.QuantizedMatmuls``, this GPU's by default, under ``exact``) into ``tuning_cache``
    with ``measure``; without ``tune``, what ``tuning_cache`` holds for the pair is reported.
    ``ranks`` > 1 (with a model): the memory of each rank of a pipeline over that many machines
    (``stages``: layers per rank), each against this machine's budget. ``prompt_cache_dir``/
    ``prompt_cache_disk_gb``: the prefix cache's disk tier to report (serve's defaults)."""
    facts = facts or device_lib.facts()
    if metal is None and facts.metal:
        metal = kernels.process_metal_kernels()
    report = Report()
    _check_device(report, facts)
    target_dir, draft_dir = _pair_folders(model, draft) if model is not None else (None, None)
    _check_kernels(report, metal, kernel_shapes or _recurrence_shapes(target_dir))
    if draft_dir is not None:
        _describe_draft(report, draft_dir)
    if target_dir is not None:
        dtype = device_lib.draft_activation_dtype(facts)
        from .defaults import draft_window  # the window load gives this draft unless told

        report.memory = estimate_memory(target_dir, draft_dir, draft_quant, context, draft_dtype=dtype,
                                        draft_window=draft_window(draft_dir))
        budget = int(memory_gb * GiB) if memory_gb else (facts.recommended_working_set or facts.memory_bytes)
        source = "--memory-gb" if memory_gb else ("MLX's recommended working set" if facts.recommended_working_set else "total memory")
        if ranks > 1:
            _check_ranks_fit(report, target_dir, draft_dir, context, budget, source, ranks, stages)
        elif budget:
            _check_fit(report, context, budget, source)
        if draft_dir is not None and probe_tokens > 0:
            _probe_thinking(report, model, draft, draft_quant, probe_tokens)
    if tune and model is not None:
        from . import quantized

        _tune(report, model, draft, draft_quant, matmuls, tuning_cache, measure or quantized.wall_time, facts, exact)
    elif model is not None:
        _tuned(report, model, draft, draft_quant, tuning_cache, facts, exact)
    _check_prompt_cache(report, prompt_cache_dir, prompt_cache_disk_gb, context)
    return report


def _check_prompt_cache(report: Report, directory: Optional[Path], gb: float, context: int) -> None:
    """The prefix cache's disk tier: its folder's size against its budget and, with a model, what
    an entry takes (K/V per 1k tokens, Gated DeltaNet states per checkpoint: the memory estimate's)."""
    from .prompt_cache import CHECKPOINTS
    from .prompt_store import default_directory, directory_usage

    directory = Path(directory or default_directory()).expanduser()
    count, size = directory_usage(directory)
    budget = int(gb * 1e9)
    detail = (f"{directory}: {count} entries, {_gib(size)} of {_gib(budget)} (--prompt-cache-disk-gb {gb:g})" if budget
              else f"{directory}: {count} entries, {_gib(size)}; off (--prompt-cache-disk-gb 0)")
    kv, states = report.memory.get("attention KV caches"), report.memory.get("Gated DeltaNet states")
    if kv is not None:
        detail += (f"; an entry: {_gib(kv * 1000 / context)} of K/V per 1k tokens"
                   f" + {_gib(states or 0)} per checkpoint (up to {CHECKPOINTS + 2}) + the draft's context rows")
    report.add("prompt cache on disk", WARN if budget and size > budget else INFO, detail)


def _check_device(report: Report, facts: device_lib.DeviceFacts) -> None:
    """What this machine is and what it runs: device, versions, Metal, memory, draft dtypes."""
    report.add("device", INFO, f"{mx.default_device()} - {facts.name} ({facts.architecture})")
    report.add("GPU family", INFO, facts.family)
    report.add("versions", INFO, f"mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}, dflash-mlx {_version('dflash-mlx')}")
    report.add("Metal", OK if facts.metal else INFO, "available" if facts.metal else
               "not available: MLX runs on the CPU here (correct, but no Apple GPU speed)")
    if facts.memory_bytes:
        working = f", recommended working set {_gib(facts.recommended_working_set)}" if facts.recommended_working_set else ""
        report.add("memory", INFO, f"{_gib(facts.memory_bytes)} total{working}")
    if facts.native_bfloat16 is False:
        report.add("draft activations", INFO, f"{facts.family} has no native bfloat16: drafts compute in float32 "
                   "here by default (16-bit drafts measured 6% acceptance vs 75% on M1/M2)")
    report.add("draft context cache", OK, "never quantized (a quantized draft KV cache costs acceptance); "
               "it keeps the target features' dtype")


def _pair_folders(model: str, draft: Optional[str]) -> Tuple[Path, Optional[Path]]:
    """The target's and the draft's folders (``demo``: the pair shipped in the package; a named
    pair, ``defaults.PAIRS``: its repos)."""
    from . import defaults, loading

    model_path, draft_path = defaults.resolve(model, draft)
    return loading.resolve_path(model_path), loading.resolve_path(draft_path) if draft_path else None


def _recurrence_shapes(target_dir: Optional[Path]) -> List[tuple]:
    """The Gated DeltaNet heads (Dk, Hk, Dv, Hv) to self-check the kernels on: the target's, or
    without one Qwen3.5-9B's and the demo's."""
    if target_dir is None:
        return [(128, 16, 128, 32), (32, 2, 16, 4)]
    from . import loading

    text = text_part(loading.read_config(target_dir))
    return [(text.get("linear_key_head_dim", 128), text.get("linear_num_key_heads", 16),
             text.get("linear_value_head_dim", 128), text.get("linear_num_value_heads", 32))]


def _describe_draft(report: Report, draft_dir: Path) -> None:
    from .loading import read_config
    from .models.dflash import DraftArgs

    draft_args = DraftArgs.from_dict(read_config(draft_dir))
    kind = "DFlash2" if draft_args.architecture == "DFlash2DraftModel" else "DFlash"
    report.add("draft", INFO, f"{kind}, block {draft_args.block_size}, {draft_args.num_hidden_layers} layers"
               + (f", candidate selector top-{draft_args.selector_top_k} (its codebooks are counted in the draft's weights)"
                  if kind == "DFlash2" else ""))


def _check_fit(report: Report, context: int, budget: int, source: str) -> None:
    """Whether the pair's weights and caches (``report.memory``) fit this machine's ``budget``."""
    need = sum(report.memory.values())
    headroom = budget - need
    detail = f"needs {_gib(need)} at {context} tokens of context; {source} {_gib(budget)}; headroom {_gib(headroom)}"
    if headroom < 0:
        report.add("fits in memory", FAIL, detail,
                   "use a 4-bit target (dflash-mlx convert-target --quant w4), --draft-quant w4, or a shorter --context")
    elif headroom < 0.1 * budget:
        report.add("fits in memory", WARN, detail, "little headroom: close other apps or use a shorter context")
    else:
        report.add("fits in memory", OK, detail)


def _check_ranks_fit(report: Report, target_dir: Path, draft_dir: Optional[Path], context: int, budget: Optional[int],
                     source: str, ranks: int, stages: Optional[List[int]]) -> None:
    """Whether each rank of the pair pipelined over ``ranks`` fits a machine like this one."""
    need = sum(report.memory.values())
    report.add("fits in memory", INFO, f"in one process the pair needs {_gib(need)} at {context} tokens of context; "
               f"pipelined over {ranks} ranks:")
    for rank, ((start, end), held, caches) in enumerate(pipeline_memory(target_dir, draft_dir, report.memory, ranks, stages)):
        detail = (f"layers {start}-{end - 1}: {_gib(held)} of weights + {_gib(caches)} of caches = {_gib(held + caches)}"
                  + (f"; {source} {_gib(budget)} (this machine's)" if budget else ""))
        fits = not budget or held + caches <= budget
        report.add(f"rank {rank} of {ranks}", OK if fits else FAIL, detail,
                   "" if fits else "more ranks, --stages to move layers to a bigger machine, or a 4-bit target")


def render(report: Report) -> List[str]:
    marks = {OK: "ok  ", INFO: "    ", WARN: "warn", FAIL: "FAIL"}
    lines = [f"[{marks[c.status]}] {c.name}: {c.detail}" + (f"\n       fix: {c.fix}" if c.fix else "") for c in report.checks]
    if report.memory:
        lines.append("memory at this context:")
        lines += [f"  {name:<26} {_gib(n):>10}" for name, n in report.memory.items()]
    if report.tuning:
        from .quantized import render_timings

        lines.append("quantized matmuls, microseconds per call in batches of calls (M = rows: 1 is a decode step, 2..16 a "
                     "verify block or draft pass), what exactness costs each shape and what its layers run:")
        lines += ["  " + line for line in render_timings(report.tuning, report.tuning_layers)]
    return lines


def as_json(report: Report) -> Dict[str, Any]:
    from .quantized import per_rows_us

    tuning = [{"shape": t.shape.__dict__, "stock_us": per_rows_us(t.stock_s), "kernel_us": per_rows_us(t.kernel_s),
               "tile_us": per_rows_us(t.tile_s), "splash_us": per_rows_us(t.splash_s or None),
               "stock_one_kernel": t.stock_one, "exact_choice": t.exact_choice,
               "exactness_cost": t.exactness_cost, "choice": str(t.choice), "exact": t.is_exact,
               "layers": report.tuning_layers.get(t.shape)}
              for t in report.tuning]
    return {"ok": not report.failed, "checks": [c.__dict__ for c in report.checks], "memory_bytes": report.memory,
            "tuning": tuning}
