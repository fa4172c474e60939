"""What quantizing a DFlash2 draft's selector codebooks costs in acceptance.

    python examples/dflash2_codebooks.py [--model demo] [--draft DFLASH2_DRAFT] [--block 4] [--tokens 160]

The target answers the bench's prompts greedily; then, at every position of its answers, the
draft proposes the block that starts there (its greedy walk, from the target's features of the
text before it: what a cycle proposes after committing that text) and the walk is scored against
the target's own next tokens. Every setting sees the same anchors, so the columns differ only by
the draft's weights: acceptance without the noise of which cycles a run happened to make.

Rows: the codebooks as stored, at 8 and 4 bits (``--group-size``, 64), the draft's linear layers at 4 bits
(``--draft-quant w4``) with the codebooks as stored and at 4 bits, and the selector switched off
(the walk is the head's argmax: what the draft would propose as the DFlash draft it wraps). A
DFlash draft gets the rows that apply to it (as stored, layers at 4 bits), for comparison.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash_mlx import load
from dflash_mlx.api import encode_prompt
from dflash_mlx.bench import SUITES
from dflash_mlx.loading import load_draft
from dflash_mlx.models.dflash import quantize_draft
from dflash_mlx.models.dflash2 import DFlash2Draft
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative
from dflash_mlx.train import block_hidden


def quantize_codebooks(draft: DFlash2Draft, bits: int, group_size: int = 64) -> None:
    nn.quantize(draft.candidate_selector, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: isinstance(m, nn.Embedding))


def settings(model, group_size: int):
    """(name, draft, whether the selector walks) for every row: the draft loaded afresh for each,
    quantized as named, computing in the dtype ``load`` chose. A DFlash draft (no selector) gets
    the rows that apply to it, for comparison."""
    def variant(codebook_bits=None, body=None):
        draft, _ = load_draft(model.draft_path)
        draft.bind(model.target)
        quantize_draft(draft, body)
        if codebook_bits:
            quantize_codebooks(draft, codebook_bits, group_size)
        return draft.compute_in(model.draft.activation_dtype)

    if not isinstance(model.draft, DFlash2Draft):
        yield "DFlash draft as stored", model.draft, False
        yield "DFlash draft, layers w4", variant(body="w4"), False
        return
    yield "codebooks as stored", model.draft, True
    yield "codebooks w8", variant(8), True
    yield "codebooks w4", variant(4), True
    yield "layers w4, codebooks as stored", variant(body="w4"), True
    yield "layers w4, codebooks w4", variant(4, "w4"), True
    yield "selector off (head argmax)", model.draft, False


def walks(draft, features: mx.array, sequence: mx.array, anchors: mx.array, selector: bool) -> np.ndarray:
    """Greedy walks [anchors, B-1] of the blocks at ``anchors`` of ``sequence``, whose target
    features (the draft's taps) are ``features``."""
    if draft.activation_dtype is not None:  # as add_context casts them
        features = features.astype(draft.activation_dtype)
    hidden = block_hidden(draft, features, sequence, anchors)
    logits = draft.logits(hidden)
    if not selector:
        return np.array(mx.argmax(logits, axis=-1))
    tokens, _, _ = draft.candidate_selector.select(hidden, logits, sequence[anchors], 0.0)
    return np.array(tokens)


def accepted(walk: np.ndarray, sequence: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """Drafted tokens the target accepts at each anchor: the walk's prefix that is its next tokens."""
    wanted = sequence[anchors[:, None] + np.arange(1, walk.shape[1] + 1)[None, :]]
    return np.cumprod(walk == wanted, axis=1).sum(axis=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="Target (anything `load` takes).")
    parser.add_argument("--draft", help="A DFlash2 draft for it (folder or repo id; default: the demo's own draft with "
                                        "--model demo); a DFlash one gets the rows that apply to it, for comparison.")
    parser.add_argument("--block", type=int, default=4, help="Block size the walks are scored at (<= the draft's).")
    parser.add_argument("--tokens", type=int, default=160, help="Tokens of each greedy answer.")
    parser.add_argument("--suites", default="edit,code,prose", help="Bench suites whose prompts to answer.")
    parser.add_argument("--group-size", type=int, default=64, help="Quantization group of the codebooks' rows.")
    args = parser.parse_args()
    model, tokenizer = load(args.model, draft=args.draft)
    draft, target = model.draft, model.target
    if draft is None:
        parser.error(f"--draft: {args.model} has no draft of its own")
    if not 2 <= args.block <= draft.block_size:
        parser.error(f"--block {args.block}: within 2..{draft.block_size} (the draft's block size)")
    rank = draft.args.selector_rank
    if isinstance(draft, DFlash2Draft) and rank % args.group_size:
        parser.error(f"--group-size {args.group_size} does not divide the codebooks' rank {rank}")
    suites = args.suites.split(",")
    answers = []
    for suite, prompt in ((suite, p) for suite in suites for p in SUITES[suite]):
        # The target's greedy answer and its features: every setting is scored on them.
        ids = encode_prompt(tokenizer, [{"role": "user", "content": prompt}])
        commits = speculative(target, None, ids, Sampler(), max_tokens=args.tokens, stop_tokens=tokenizer.eos_token_ids)
        sequence = mx.concatenate([ids, mx.array([t for c in commits for t in c.tokens], dtype=ids.dtype)])
        _, features = target.forward(sequence[None], taps=draft.target_layer_ids)
        answers.append((suite, sequence, features, mx.arange(ids.size - 1, sequence.size - args.block + 1)))
    rows, stored = {}, {}
    for name, variant, selector in settings(model, args.group_size):
        variant.args.block_size = args.block  # walks of that length (slot 0 is the anchor)
        for index, (suite, sequence, features, anchors) in enumerate(answers):
            walk = walks(variant, features, sequence, anchors, selector)
            stored.setdefault(index, walk)  # the first row's: the codebooks as stored
            row = rows.setdefault(name, {}).setdefault(suite, {"accepted": [], "changed": []})
            row["accepted"].extend(accepted(walk, np.array(sequence), np.array(anchors)).tolist())
            row["changed"].extend((walk != stored[index]).any(axis=1).tolist())
    positions = {suite: sum(int(a.size) for s, _, _, a in answers if s == suite) for suite in suites}
    print(f"target {args.model}, draft {args.draft or 'its own'}, block {args.block}, {args.tokens}-token greedy answers "
          f"({', '.join(f'{suite}: {n} positions' for suite, n in positions.items())})")
    print("accepted drafted tokens per block, mean over every answer position (walks that differ from the stored codebooks')")
    print(f"| setting | {' | '.join(suites)} |")
    print(f"|---|{'---:|' * len(suites)}")
    for name, per_suite in rows.items():
        cells = [f"{np.mean(per_suite[s]['accepted']):.3f} ({np.mean(per_suite[s]['changed']):.1%})" for s in suites]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
