"""DFlash2 drafts (z-lab's ``DFlash2DraftModel``): DFlash with a grouped dynamic causal
convolution around each sublayer, and a candidate selector that walks the block from the anchor.

Layout beyond DFlash: per layer ``attention_conv`` and ``mlp_conv``, each ``base_kernel [2, K, H]``
and ``kernel_projection.weight [2*K*H/G, H]``; ``candidate_selector.hidden_projection.weight
[R, H]``, ``candidate_selector.predecessor_codebook [V, R]`` and ``successor_codebook [V, R]``
(stored without ``.weight``). Verification is DFlash's: one chain of block-1 tokens.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..sampling import Sampler
from .dflash import DFlashDraft, DraftArgs, DraftLayer

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def grouped_dynamic_convolve(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """``out[i, c] = sum_t (base[t, c] + dynamic[i, t, c // group_size]) * x[i - t, c]`` along the
    block (zero before slot 0). x [B, L, H], dynamic [B, L, K, H/G], base [K, H]."""
    B, L, H = x.shape
    groups = H // group_size
    blocks = x.reshape(B, L, groups, group_size)
    out = mx.zeros_like(blocks)
    for t in range(base.shape[0]):
        shifted = blocks if t == 0 else mx.concatenate([mx.zeros_like(blocks[:, :t]), blocks[:, : L - t]], axis=1)
        weight = base[t].reshape(1, 1, groups, group_size).astype(x.dtype) + dynamic[:, :, t, :, None]
        out = out + weight * shifted
    return out.reshape(B, L, H)


class GroupedDynamicCausalConv(nn.Module):
    """Two causal convolutions along the block whose kernels are a learned base plus a part
    predicted from the sublayer's normed input, one per contiguous group of channels."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"DFlash2 convolution: kernel size {kernel_size} and group size {group_size} "
                             f"must be positive, the group size dividing hidden_size {hidden_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        """The first convolution of ``x``, and the dynamic kernels of the second."""
        B, L, H = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, H // self.group_size)
        return grouped_dynamic_convolve(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_dynamic_convolve(x, dynamic, self.base_kernel[1], self.group_size)


class DFlash2Layer(DraftLayer):
    """``x, k = conv.prepare(norm(x)); x = residual + conv.finish(sublayer(x), k)`` for the
    attention and the MLP; the context features are never convolved."""

    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.attention_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def _functions(self, rope):
        attn = self.self_attn

        def before(x, offset):
            h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
            q, k, v = attn.project(h)
            return rope(q, offset=offset), rope(k, offset=offset), v, kernel

        def after(x, heads, kernel):
            x = x + self.attention_conv.finish(attn.output(heads), kernel)
            h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
            return x + self.mlp_conv.finish(self.mlp(h), kernel)

        return before, after


class CandidateSelector(nn.Module):
    """Per slot, the top-K head logits are candidates, scored ``logit + <A[previous token] *
    proj(h_slot), B[candidate]>``; the walk starts from the anchor (the block's first token)."""

    def __init__(self, args: DraftArgs):
        super().__init__()
        if args.vocab_size is None:
            raise ValueError("a DFlash2 draft config needs vocab_size (its selector's codebooks have a row per token)")
        self.top_k = args.selector_top_k
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)

    def select(self, hidden: mx.array, logits: mx.array, anchor: mx.array, temperature: float,
               path: Optional[mx.array] = None, key: Optional[mx.array] = None) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
        """Tokens [B, L], candidates [B, L, K] and, when ``temperature`` > 0, the distributions
        [B, L, K] over the candidates the tokens were drawn from (softmax of score/temperature),
        drawn with ``key`` (the request's: split per slot). ``path`` [B, L] replaces the draws (so
        that a test can score a given walk)."""
        if temperature > 0 and path is None and key is None:
            raise ValueError("sampling a walk needs a key (the request's generator)")
        keys = mx.random.split(key, hidden.shape[1]) if temperature > 0 and path is None else None
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k:]
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        projected = self.hidden_projection(hidden)
        previous, tokens, q_rows = anchor, [], []
        for slot in range(hidden.shape[1]):
            edges = (self.predecessor_codebook(previous)[:, None] * projected[:, slot, None]
                     * self.successor_codebook(candidates[:, slot])).sum(axis=-1)
            scores = unary[:, slot] + edges.astype(mx.float32)
            if temperature > 0:
                q = mx.softmax(scores / temperature, axis=-1)
                q_rows.append(q)
                choice = mx.random.categorical(mx.log(q), key=keys[slot]) if path is None else None
            else:
                choice = mx.argmax(scores, axis=-1) if path is None else None
            if path is None:
                previous = mx.take_along_axis(candidates[:, slot], choice[:, None], axis=-1)[:, 0]
            else:
                previous = path[:, slot]
            tokens.append(previous)
        return mx.stack(tokens, axis=1), candidates, mx.stack(q_rows, axis=1) if q_rows else None


class DFlash2Draft(DFlashDraft):
    layer_class = DFlash2Layer

    def __init__(self, args: DraftArgs):
        if not (args.conv_kernel_size and args.conv_group_size and args.selector_rank and args.selector_top_k):
            raise ValueError("a DFlash2 draft config needs conv_kernel_size, conv_group_size, selector_rank and "
                             "selector_top_k under dflash_config")
        super().__init__(args)
        self.candidate_selector = CandidateSelector(args)

    def pick(self, hidden: mx.array, block: mx.array, sampler: Sampler,
             logits: Optional[mx.array] = None, guide: Optional[Callable] = None) -> Tuple[mx.array, Optional[mx.array]]:
        """The selector's walk over the block's slots. Sampling draws each slot from the softmax of
        its candidates' scores at the sampler's temperature (as z-lab's reference does); the
        returned distributions are that sparse q, scattered over the vocabulary for rejection
        sampling (whose residual ``p - q`` then touches only the candidates). ``logits``: the
        head's on ``hidden``, when the caller ran it over several blocks at once. ``guide`` (a
        grammar's walk, ``DFlashDraft.propose``): it picks from the head's logits instead of the
        selector (any proposal distribution keeps the cycle lossless)."""
        logits = self.logits(hidden) if logits is None else logits
        if guide is not None:
            return guide(logits[0], sampler)
        key = None if sampler.greedy else sampler.key()
        tokens, candidates, q = self.candidate_selector.select(hidden, logits, block[None, 0], sampler.temperature, key=key)
        if q is None:
            return tokens[0], None
        dense = mx.zeros(logits.shape[1:], dtype=mx.float32)
        dense = mx.put_along_axis(dense, candidates[0], q[0], axis=-1)
        return tokens[0], dense

    def layout_weights(self) -> Dict[str, mx.array]:
        out = super().layout_weights()
        for name in CODEBOOKS:
            key = f"candidate_selector.{name}"
            out[key] = out.pop(f"{key}.weight")
        return out

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = super().sanitize(weights)
        for name in CODEBOOKS:  # stored without ".weight" in z-lab's layout
            key = f"candidate_selector.{name}"
            if key in out:
                out[f"{key}.weight"] = out.pop(key)
        return out
