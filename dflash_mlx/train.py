"""Training a DFlash draft for a target (``dflash-mlx train-draft``).

The DFlash objective: pick random anchor positions in a sequence; for each, the draft sees the
block ``[token at anchor, MASK, ...]`` placed at the anchor's positions, attends to the target's
context features strictly before the anchor and bidirectionally inside the block, and predicts
the token at each slot 1.. (same-position prediction), with a cross-entropy weight that decays
with the slot. The target (and the embedding and head the draft borrows) stay frozen. All anchors
of a sequence train in one batched pass, each anchor a batch row with its own positions.

DFlash2 drafts (``--arch dflash2``) start as the DFlash draft they wrap (identity convolutions, a
selector that adds nothing) and add the selector's top-K cross-entropy (``selector_loss``). That
objective is ours, built from what the published code does at inference: z-lab's training recipe
is not in its released sources.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .loading import draft_class
from .models.dflash import DFlashDraft, DraftArgs, resolve_taps

# Resume state lives beside the weights, out of the loaders' way.
STATE_DIR = "training_state"


@dataclass
class TrainConfig:
    seq_len: int = 256
    anchors: int = 16  # blocks per sequence and step
    block_size: int = 8
    steps: int = 1000
    learning_rate: float = 3e-4
    weight_decay: float = 0.01
    warmup: int = 50
    decay_gamma: float = 4.0  # slot k weighs exp(-(k-1)/gamma)
    labels: str = "target"  # "target": the target's greedy next token (what verification accepts); "corpus": the text
    seed: int = 0
    save_every: int = 200
    answers_only: bool = False  # anchors only in assistant answers, one chat per window from its start


ARCHS = ("dflash", "dflash2")


def parse_taps(text: str) -> Optional[List[int]]:
    """``--taps 1,3,5``: the target layers the draft reads (None when empty: spread evenly)."""
    try:
        return [int(t) for t in text.split(",") if t.strip()] or None
    except ValueError:
        raise ValueError(f"--taps {text!r}: expected layer numbers separated by commas") from None


def check_run(corpus: Sequence[Path], out: Path, resume: bool, from_draft: bool) -> None:
    """Refuse a run that cannot start, before the target loads, naming the flag: a missing data
    file, an output folder that holds something else (a new run would overwrite it), a new start
    from a draft that is also a resume."""
    missing = [str(p) for p in corpus if not Path(p).is_file()]
    if missing:
        raise ValueError(f"--data {missing[0]} does not exist")
    if out.exists() and not resume and any(out.iterdir()):
        raise ValueError(f"{out} already exists and is not empty (use --resume to continue it, or another --out)")
    if from_draft and resume:
        raise ValueError("--from-draft starts a new run; --resume continues the one in --out: give one of them")


@dataclass
class DFlash2Shape:
    """The DFlash2 parts of a new draft (``--arch dflash2``): z-lab's published drafter uses
    kernel 2, groups of 16 channels, rank 256 and 16 candidates."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self):
        for flag, value in (("--conv-kernel-size", self.conv_kernel_size), ("--conv-group-size", self.conv_group_size),
                            ("--selector-rank", self.selector_rank), ("--selector-top-k", self.selector_top_k)):
            if value < 1:
                raise ValueError(f"{flag} {value}: at least 1")

    @classmethod
    def for_arch(cls, arch: str, *sizes: int) -> Optional["DFlash2Shape"]:
        """``--arch``'s shape: None for ``dflash``; the sizes are checked whichever it is."""
        if arch not in ARCHS:
            raise ValueError(f"--arch {arch!r}: choose 'dflash' or 'dflash2'")
        shape = cls(*sizes)
        return shape if arch == "dflash2" else None

    def check(self, target_args) -> None:
        """Refuse a shape the target cannot take, naming the flag."""
        if target_args.hidden_size % self.conv_group_size:
            raise ValueError(f"--conv-group-size {self.conv_group_size} must divide the target's hidden size {target_args.hidden_size}")
        if not 1 <= self.selector_top_k <= target_args.vocab_size:
            raise ValueError(f"--selector-top-k {self.selector_top_k} must be within 1..{target_args.vocab_size} (the vocabulary)")


def new_draft_config(
    target, num_layers: int, block_size: int, mask_token_id: int, taps: Optional[List[int]] = None,
    block_only_layers: int = 0, causal: bool = False, dflash2: Optional[DFlash2Shape] = None,
) -> Dict:
    """A z-lab (nested schema) draft config sized after the target's attention.

    ``block_only_layers``: the last layers see only the block (``sliding_window`` 1): they gather
    from the anchor slot what the first layers read from the context. ``causal``: causal
    attention inside the block (slot k sees slots 0..k). ``dflash2``: a DFlash2 draft of that shape.
    """
    a = target.args
    if not 0 <= block_only_layers < num_layers:
        raise ValueError(f"block-only layers must be 0..{num_layers - 1} for a {num_layers}-layer draft, got {block_only_layers}")
    taps = resolve_taps(taps, num_layers, a.num_hidden_layers)
    args = DraftArgs(
        hidden_size=a.hidden_size, num_hidden_layers=num_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, intermediate_size=a.intermediate_size,
        mask_token_id=mask_token_id, block_size=block_size, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        layer_types=["full_attention"] * (num_layers - block_only_layers) + ["block_attention"] * block_only_layers,
        is_causal=True if causal else None, vocab_size=a.vocab_size,
        **({"architecture": "DFlash2DraftModel", **vars(dflash2)} if dflash2 is not None else {}),
    )
    if dflash2 is not None:
        dflash2.check(a)
    return args.to_config(taps, a.num_hidden_layers)


def dflash2_init(draft) -> None:
    """A new DFlash2 draft starts as the DFlash draft it wraps: each convolution the identity
    (base kernel 1 at the current slot, 0 before it; no dynamic part) and the selector the head's
    own argmax (a zero successor codebook adds nothing to the logits)."""
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = mx.zeros(conv.base_kernel.shape)
            base[:, 0] = 1.0
            conv.base_kernel = base
            conv.kernel_projection.weight = mx.zeros(conv.kernel_projection.weight.shape)
    selector = draft.candidate_selector
    selector.successor_codebook.weight = mx.zeros(selector.successor_codebook.weight.shape)


def draft_from(path: Path, target, dflash2: Optional[DFlash2Shape] = None):
    """A trained draft to train further, bound to ``target``, and its config. With ``dflash2`` a
    DFlash draft becomes the DFlash2 draft that wraps it: its weights, identity convolutions and a
    selector that first adds nothing (``dflash2_init``), so training starts from its acceptance."""
    from .loading import load_draft, mlx_quantization
    from .models.dflash2 import DFlash2Draft

    draft, config = load_draft(path)
    if mlx_quantization(config):
        raise ValueError(f"{path} is quantized: start from the unquantized draft (quantize after training)")
    is_dflash2 = isinstance(draft, DFlash2Draft)
    if is_dflash2 and dflash2 is None:
        raise ValueError(f"{path} is a DFlash2 draft: train it with --arch dflash2")
    draft.set_dtype(mx.float32)  # it trains in float32, whatever it was stored in
    draft.bind(target)  # a draft made for another target is refused here, by what does not fit
    if dflash2 is None or is_dflash2:
        return draft, config
    a = target.args
    dflash2.check(a)
    args = DraftArgs(**{**vars(draft.args), "architecture": "DFlash2DraftModel", "vocab_size": a.vocab_size,
                        **vars(dflash2)})
    wrapper = DFlash2Draft(args)
    wrapper.load_weights(tree_flatten(draft.parameters()), strict=False)
    dflash2_init(wrapper)
    return wrapper.bind(target), args.to_config(draft.target_layer_ids, a.num_hidden_layers)


def content_match_init(draft: DFlashDraft, target) -> None:
    """Start the first layer as a lookup of the position before the anchor.

    Mask slots have no content to query with, and RoPE alone cannot single out the latest of
    hundreds of context positions, so a random draft sits at the unigram for a long time. With
    tied embeddings the target's normed last-layer state at position a-1 points at the anchor's
    embedding (it predicted that token): fc reads that state, hidden_norm takes the target's final
    norm, k/v/o are identities and q is the identity turned back by RoPE's one-position rotation,
    so the anchor slot attends to a-1 from the first step. Needs ``kv_heads * head_dim == hidden``.
    """
    a, t = draft.args, target.args
    H, D = a.hidden_size, a.head_dim
    if not t.tie_word_embeddings:
        raise ValueError("content-match init needs a target with tied embeddings (its head is its embedding)")
    if a.num_key_value_heads * D != H:
        raise ValueError(f"content-match init needs kv_heads * head_dim == hidden_size ({a.num_key_value_heads} * {D} != {H})")
    last = t.num_hidden_layers - 1
    if last not in draft.target_layer_ids:
        raise ValueError(f"content-match init reads the target's last layer: include {last} in the taps")
    i = draft.target_layer_ids.index(last)
    fc = mx.zeros((H, H * len(draft.target_layer_ids)))
    fc[:, i * H : (i + 1) * H] = mx.eye(H)
    draft.fc.weight = fc
    draft.hidden_norm.weight = mx.array(target.model.norm.weight)
    attn = draft.layers[0].self_attn
    attn.k_proj.weight, attn.v_proj.weight = mx.eye(H), mx.eye(H)
    unrotate = draft.rope(mx.eye(D).reshape(D, 1, 1, D), offset=1).reshape(D, D)  # = R(1)^T
    per_group = a.num_attention_heads // a.num_key_value_heads
    q = mx.zeros((a.num_attention_heads * D, H))
    o = mx.zeros((H, a.num_attention_heads * D))
    for group in range(a.num_key_value_heads):  # one query head per kv group does the lookup
        head = group * per_group
        q[head * D : (head + 1) * D, group * D : (group + 1) * D] = unrotate
        o[group * D : (group + 1) * D, head * D : (head + 1) * D] = mx.eye(D)
    attn.q_proj.weight, attn.o_proj.weight = q, o
    attn.q_norm.weight = mx.full((D,), 2.0)  # sharp enough to pick one position among hundreds
    attn.k_norm.weight = mx.full((D,), 2.0)


def block_logits(draft: DFlashDraft, features: mx.array, tokens: mx.array, anchors: mx.array) -> mx.array:
    """Draft logits [n_anchors, B-1, V] for the blocks at ``anchors`` of one sequence (see
    ``block_hidden``)."""
    return draft.logits(block_hidden(draft, features, tokens, anchors))


def block_hidden(draft: DFlashDraft, features: mx.array, tokens: mx.array, anchors: mx.array) -> mx.array:
    """The draft's final-normed states [n_anchors, B-1, H] of slots 1.. for the blocks at
    ``anchors`` of one sequence: what inference computes, for every anchor in one pass.

    features: [1, N, taps*H] target features of ``tokens`` [N]; block j sits at positions
    anchors[j] .. anchors[j]+B-1 and sees context positions < anchors[j]. A DFlash2 layer's
    convolutions wrap its attention and MLP as in inference (they run along the block only).
    """
    B = draft.block_size
    n, N = anchors.shape[0], tokens.shape[0]
    block = mx.full((n, B), draft.mask_token_id, dtype=tokens.dtype)
    block[:, 0] = tokens[anchors]
    x = draft._embed(block)
    if draft.args.input_embedding_scale != 1.0:
        x = x * draft.args.input_embedding_scale
    ctx = draft.hidden_norm(draft.fc(features))  # [1, N, H]
    context_pos = mx.arange(N)[None, None, :]
    query_pos = (anchors[:, None] + mx.arange(B)[None, :])[:, :, None]
    before_anchor = context_pos < anchors[:, None, None]  # [n, 1, N]
    for layer in draft.layers:
        attn = layer.self_attn
        attention_conv, mlp_conv = getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)
        h = layer.input_layernorm(x)
        if attention_conv is not None:
            h, kernel = attention_conv.prepare(h)
        q, k, v = attn.project(h)
        ck, cv = attn.project_context(ctx)
        q, k = draft.rope(q, offset=anchors), draft.rope(k, offset=anchors)
        ck = draft.rope(ck)
        keys = mx.concatenate([mx.broadcast_to(ck, (n, *ck.shape[1:])), k], axis=2)
        values = mx.concatenate([mx.broadcast_to(cv, (n, *cv.shape[1:])), v], axis=2)
        visible = before_anchor
        if attn.sliding_window is not None:
            visible = visible & (query_pos - context_pos < attn.sliding_window)
        inside = mx.ones((B, B), dtype=mx.bool_)
        inside = mx.tril(inside) if attn.is_causal else inside
        mask = mx.concatenate([mx.broadcast_to(visible, (n, B, N)), mx.broadcast_to(inside, (n, B, B))], axis=-1)
        heads = attn.attend(q, keys, values, mask[:, None])
        x = x + (attention_conv.finish(heads, kernel) if attention_conv is not None else heads)
        h = layer.post_attention_layernorm(x)
        if mlp_conv is not None:
            h, kernel = mlp_conv.prepare(h)
        out = layer.mlp(h)
        x = x + (mlp_conv.finish(out, kernel) if mlp_conv is not None else out)
    return draft.norm(x[:, 1:])


def dflash_loss(draft, features, tokens, labels, anchors, gamma: float) -> mx.array:
    """Weighted same-position cross-entropy; ``labels[p]`` is the wanted token at position p.
    A DFlash2 draft adds its selector's loss (``selector_loss``) with the same slot weights."""
    B = draft.block_size
    hidden = block_hidden(draft, features, tokens, anchors)
    logits = draft.logits(hidden)
    slot_labels = labels[anchors[:, None] + mx.arange(1, B)[None, :]]
    weights = mx.exp(-(mx.arange(B - 1).astype(mx.float32)) / gamma)
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), slot_labels)  # [n, B-1]
    loss = (ce * weights).sum() / (weights.sum() * anchors.shape[0])
    if hasattr(draft, "candidate_selector"):
        previous = mx.concatenate([tokens[anchors][:, None], slot_labels[:, :-1]], axis=1)
        loss = loss + selector_loss(draft.candidate_selector, hidden, logits, previous, slot_labels, weights)
    return loss


def selector_loss(selector, hidden: mx.array, logits: mx.array, previous: mx.array, labels: mx.array,
                  weights: mx.array) -> mx.array:
    """The DFlash2 selector's top-K cross-entropy: per slot, the head's K best tokens are the
    candidates, scored as inference scores them (``logit + <A[previous] * proj(h), B[candidate]>``)
    with the wanted previous token (teacher forcing), and the wanted token must win. Slots whose
    wanted token is not among the candidates carry no selector loss (the head's own cross-entropy
    has to bring it in first); the draft's states and logits enter as constants, so this trains the
    selector alone."""
    K = selector.top_k
    hidden, logits = mx.stop_gradient(hidden), mx.stop_gradient(logits)
    candidates = mx.argpartition(logits, -K, axis=-1)[..., -K:]  # [n, B-1, K]
    unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
    projected = selector.hidden_projection(hidden)  # [n, B-1, R]
    edges = (selector.predecessor_codebook(previous)[:, :, None] * projected[:, :, None]
             * selector.successor_codebook(candidates)).sum(axis=-1)
    scores = unary + edges.astype(mx.float32)
    hit = candidates == labels[..., None]
    inside = hit.any(axis=-1).astype(mx.float32)
    ce = nn.losses.cross_entropy(scores, mx.argmax(hit, axis=-1))  # [n, B-1]
    counted = (weights * inside).sum()
    return (ce * weights * inside).sum() / mx.maximum(counted, 1e-6)


def _texts(path: Path) -> List[str]:
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    return [path.read_text()]


def corpus_tokens(paths: List[Path], tokenizer) -> np.ndarray:
    """All text of the corpus files (``.jsonl``: the ``text`` field of each line) as one id stream."""
    ids: List[int] = []
    for path in paths:
        for text in _texts(path):
            ids.extend(tokenizer.encode(text, add_special_tokens=False))
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
    return np.array(ids, dtype=np.int32)


ANSWER_START, ANSWER_END = "<|im_start|>assistant\n", "<|im_end|>"


def corpus_chats(paths: List[Path], tokenizer):
    """Id stream of the corpus, a mask of assistant-answer tokens, and each text's start.

    Answers run from ``<|im_start|>assistant\\n`` to their ``<|im_end|>`` (included: the target
    predicts it). Each piece is tokenized on its own, so merges never cross a boundary.
    """
    ids: List[int] = []
    answer: List[bool] = []
    starts: List[int] = []
    for path in paths:
        for text in _texts(path):
            starts.append(len(ids))
            head, *turns = text.split(ANSWER_START)
            pieces = [(head + (ANSWER_START if turns else ""), False)]
            for i, turn in enumerate(turns):
                reply, end, rest = turn.partition(ANSWER_END)
                pieces += [(reply + end, True), (rest + (ANSWER_START if i + 1 < len(turns) else ""), False)]
            for piece, is_answer in pieces:
                piece_ids = tokenizer.encode(piece, add_special_tokens=False) if piece else []
                ids.extend(piece_ids)
                answer.extend([is_answer] * len(piece_ids))
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
                answer.append(False)
    return np.array(ids, dtype=np.int32), np.array(answer, dtype=bool), np.array(starts, dtype=np.int64)


def answer_windows(ids: np.ndarray, answer: np.ndarray, starts: np.ndarray, config: TrainConfig,
                   rng: np.random.Generator) -> Iterator[tuple]:
    """One text per window, from its start (the context the answer depends on, e.g. the file an
    edit copies, is in the window); anchors only where a block fits inside an answer's window."""
    n, B = config.seq_len, config.block_size
    ends = np.append(starts[1:], len(ids))

    def candidates(start, end):
        window_answer = answer[start : min(start + n, end)]
        return np.flatnonzero(window_answer[1 : len(window_answer) - B + 1]) + 1

    usable = [(s, e, c) for s, e in zip(starts, ends) if len(c := candidates(s, e))]
    if not usable:
        raise ValueError(
            f"--answers-only: no assistant answer in the corpus leaves room for a block of {B} "
            f"in {n} tokens (answers start after {ANSWER_START!r})"
        )
    while True:
        start, end, cand = usable[int(rng.integers(0, len(usable)))]
        anchors = rng.choice(cand, size=min(config.anchors, len(cand)), replace=False)
        yield mx.array(ids[start : min(start + n, end)]), mx.array(np.sort(anchors).astype(np.int32))


def batches(ids: np.ndarray, config: TrainConfig, rng: np.random.Generator) -> Iterator[tuple]:
    """Random windows of the stream, each with random anchors that leave room for a block."""
    n = config.seq_len
    if len(ids) < n + 1:
        raise ValueError(f"the corpus has {len(ids)} tokens; need at least {n + 1} for --seq-len {n}")
    while True:
        start = int(rng.integers(0, len(ids) - n))
        window = ids[start : start + n]
        anchors = rng.choice(np.arange(1, n - config.block_size + 1), size=config.anchors, replace=False)
        yield mx.array(window), mx.array(np.sort(anchors).astype(np.int32))


def save_draft(draft: DFlashDraft, config: Dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), draft.layout_weights())
    (out / "config.json").write_text(json.dumps(config, indent=2))


def train_draft(
    target,
    tokenizer,
    corpus: List[Path],
    out: Path,
    config: TrainConfig,
    num_layers: int = 2,
    mask_token_id: Optional[int] = None,
    resume: bool = False,
    taps: Optional[List[int]] = None,
    block_only_layers: int = 0,
    causal: bool = False,
    init: str = "random",
    on_step=None,
    dflash2: Optional[DFlash2Shape] = None,
    start: Optional[Path] = None,
) -> List[float]:
    """Train (or resume training) a draft for ``target`` and write it in z-lab's layout to ``out``
    (``dflash2``: a DFlash2 draft of that shape; ``start``: from that trained draft, see
    ``draft_from``)."""
    if config.labels not in ("target", "corpus"):
        raise ValueError(f"labels must be 'target' or 'corpus', got {config.labels!r}")
    mx.random.seed(config.seed)  # before the draft exists: its initialisation is part of the run
    checkpoint = _Checkpoint(out)
    if resume:
        draft, draft_config, state = checkpoint.load()
        draft.bind(target)
    elif start is not None:
        draft, draft_config = draft_from(start, target, dflash2)
        state = {"step": 0, "losses": []}
    else:
        draft, draft_config = _new_draft(target, tokenizer, config, num_layers, mask_token_id, taps,
                                         block_only_layers, causal, init, dflash2)
        state = {"step": 0, "losses": []}
    config = replace(config, block_size=draft.block_size)  # the caller's config stays as given
    # The windows and anchors come from this generator alone: a resume restores its state, so that
    # the run continues with the batches an uninterrupted one would have drawn.
    rng = np.random.default_rng(config.seed)
    if "rng" in state:
        rng.bit_generator.state = state["rng"]
    elif state["step"]:  # saved before the generator's state was kept
        rng = np.random.default_rng(config.seed + state["step"])
    optimizer = _optimizer(config)
    if resume:
        checkpoint.restore_optimizer(optimizer)
    loss_and_grad = nn.value_and_grad(draft, lambda f, t, y, a: dflash_loss(draft, f, t, y, a, config.decay_gamma))
    losses = list(state["losses"])
    if config.answers_only:
        data = answer_windows(*corpus_chats(corpus, tokenizer), config, rng)
    else:
        data = batches(corpus_tokens(corpus, tokenizer), config, rng)
    while state["step"] < config.steps:
        tokens, anchors = next(data)
        logits, features = target.forward(tokens[None], taps=draft.target_layer_ids)
        if config.labels == "target":  # position p gets the target's choice after tokens[:p]
            labels = mx.concatenate([tokens[:1], mx.argmax(logits[0, :-1], axis=-1).astype(tokens.dtype)])
        else:
            labels = tokens
        loss, grads = loss_and_grad(mx.stop_gradient(features), tokens, labels, anchors)
        optimizer.update(draft, grads)
        mx.eval(loss, draft.parameters(), optimizer.state)
        if not math.isfinite(float(loss)):  # stop at once, not after every remaining step
            _diverged(state["step"] + 1, f"loss {float(loss)}", config)
        state["step"] += 1
        losses.append(float(loss))
        if on_step is not None:
            on_step(state["step"], float(loss))
        if state["step"] % config.save_every == 0 or state["step"] == config.steps:
            # The loss was computed before this step's update: the weights are checked before a save
            # so that a checkpoint never holds a diverged draft.
            if not all(bool(mx.all(mx.isfinite(w))) for _, w in tree_flatten(draft.trainable_parameters())):
                _diverged(state["step"], "weights not finite", config)
            checkpoint.save(draft, draft_config, optimizer, {**state, "losses": losses, "rng": rng.bit_generator.state})
    return losses


def _diverged(step: int, what: str, config: TrainConfig):
    raise RuntimeError(f"training diverged at step {step} ({what}); lower --learning-rate (now {config.learning_rate})")


def _new_draft(target, tokenizer, config: TrainConfig, num_layers, mask_token_id, taps, block_only_layers, causal, init,
               dflash2: Optional[DFlash2Shape] = None):
    """A fresh draft bound to ``target`` and its config (the mask id defaults to the first
    embedding row past the tokenizer)."""
    if init not in ("random", "content-match"):
        raise ValueError(f"init must be 'random' or 'content-match', got {init!r}")
    if mask_token_id is None:
        mask_token_id = target.args.vocab_size - 1
        if mask_token_id < len(tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer):
            raise ValueError(
                "the target's embedding has no free row past its tokenizer for the mask token; "
                "pass --mask-token-id with an id the tokenizer never produces"
            )
    draft_config = new_draft_config(target, num_layers, config.block_size, mask_token_id, taps, block_only_layers, causal,
                                    dflash2)
    args = DraftArgs.from_dict(draft_config)
    draft = draft_class(args)(args).bind(target)
    if dflash2 is not None:
        dflash2_init(draft)
    if init == "content-match":
        content_match_init(draft, target)
    return draft, draft_config


def _optimizer(config: TrainConfig) -> optim.Optimizer:
    """AdamW with a linear warm-up and a cosine decay to a tenth of the rate."""
    warmup = max(config.warmup, 1)
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-7, config.learning_rate, warmup),
         optim.cosine_decay(config.learning_rate, max(config.steps - config.warmup, 1), config.learning_rate * 0.1)],
        [warmup],
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=config.weight_decay)


class _Checkpoint:
    """A training run's folder: the draft in z-lab's layout, and under ``STATE_DIR`` the step,
    the losses, the batch generator's state and the optimizer's."""

    def __init__(self, out: Path):
        self.out = out
        self.state_file = out / STATE_DIR / "state.json"
        self.optimizer_file = out / STATE_DIR / "optimizer.safetensors"

    def load(self):
        from .loading import load_draft

        if not self.state_file.exists():
            raise ValueError(f"nothing to resume in {self.out} (no {STATE_DIR}/state.json)")
        draft, draft_config = load_draft(self.out)
        return draft, draft_config, json.loads(self.state_file.read_text())

    def restore_optimizer(self, optimizer: optim.Optimizer) -> None:
        if self.optimizer_file.exists():
            optimizer.state = tree_unflatten(list(mx.load(str(self.optimizer_file)).items()))

    def save(self, draft, draft_config, optimizer: optim.Optimizer, state: dict) -> None:
        save_draft(draft, draft_config, self.out)
        self.state_file.parent.mkdir(exist_ok=True)
        mx.save_safetensors(str(self.optimizer_file), dict(tree_flatten(optimizer.state)))
        self.state_file.write_text(json.dumps(state))
