"""What a plain step and a speculative cycle cost as the context grows, and where the growth comes from.

    python examples/cycle_costs.py [--model demo] [--contexts 1k,4k,8k,16k,32k] [--block 4] [--window 1024] [--repeats 15]

One process, one prompt grown chunk by chunk (the standard library's source, as `bench --context`):
at each context the pair's caches hold exactly that many tokens, and every measurement below is
undone after it (the target's caches restored, the draft's rewound), so all of them see the same
context. Per context, medians over ``--repeats`` rounds, each round running every measurement once
in turn (a machine that gets busier hits them alike):

- plain step: one token through the target, as the target-alone loop runs it (no taps);
- plain cycle: a cycle of block 1 through the decoder, as ``auto`` runs it when it does not draft
  (the target's taps kept for the draft, the decoder's and the controller's Python);
- cycle: ``Decoder.dispatch`` + ``resolve`` of one block of ``--block`` tokens, as the decode loop
  runs it (draft, verify, accept, rollback, hand-off, the controller's bookkeeping);
- its parts, each run alone and waited for: the draft pass (its attention reads its context cache),
  the verify pass (``--block`` tokens with the rollback tape), the rollback (nothing accepted: the
  Gated DeltaNet states replayed one step, the KV caches trimmed), the hand-off (the kept token's
  features into the draft's cache); "other" is the cycle less those parts (Python: building the
  graphs, the read-back, the controller; negative where the parts overlap inside the cycle);
- the same cycle and draft pass with the draft's context cut to the last ``--window`` tokens
  (``load(..., draft_window=W)``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from dflash_mlx.api import load
from dflash_mlx.bench import file_context, parse_context_sizes
from dflash_mlx.block_policy import FixedBlock
from dflash_mlx.cache import cache_arrays, rollback, restore, snapshot
from dflash_mlx.decoder import GREEDY, Decoder, Sequence
from dflash_mlx.prefill import prefill
from dflash_mlx.records import Budget


def timed(work) -> float:
    """Milliseconds of ``work()`` (which evaluates what it built)."""
    mx.synchronize()
    start = time.perf_counter()
    work()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - start)


def measure(target, draft, cache, draft_caches, token, block, taps, repeats):
    """Medians in ms at the caches' current context; ``draft_caches``: name -> a draft context cache."""
    masks = mx.full((block - 1,), draft.mask_token_id, token.dtype)
    block_tokens = mx.concatenate([token, masks])
    verify_tokens = mx.concatenate([token, mx.zeros((block - 1,), token.dtype)])  # rejected drafts: nothing kept
    samples = {}

    def keep(name, ms):
        samples.setdefault(name, []).append(ms)

    def rewind(dcache, offsets):
        for c, offset in zip(dcache, offsets):
            c.rewind(offset)

    for _ in range(repeats):
        undo = snapshot(cache)
        keep("plain step", timed(lambda: GREEDY(target.forward(token[None], cache)[0][0, -1]).item()))
        restore(cache, undo)
        for name, dcache in draft_caches.items():
            offsets = [c.offset for c in dcache]
            keep(f"draft pass{name}", timed(lambda: mx.eval(draft.propose(block_tokens, dcache, GREEDY)[0])))

            def cycle():
                seq = Sequence(cache, dcache, GREEDY, FixedBlock(block), Budget(None, ()), token)
                decoder = Decoder(target, draft)
                decoder.resolve(decoder.dispatch([seq]))

            keep(f"cycle{name}", timed(cycle))
            restore(cache, undo)
            rewind(dcache, offsets)
        seq = Sequence(cache, draft_caches[""], GREEDY, FixedBlock(1), Budget(None, ()), token)
        decoder = Decoder(target, draft)
        keep("plain cycle", timed(lambda: decoder.resolve(decoder.dispatch([seq]))))
        restore(cache, undo)
        dcache = draft_caches[""]
        offsets = [c.offset for c in dcache]
        out = {}

        def verify():
            out["logits"], out["features"] = target.forward(verify_tokens[None], cache, taps, record_tape=True)
            mx.eval(out["logits"], out["features"], cache_arrays(cache))

        keep("verify pass", timed(verify))
        keep("rollback", timed(lambda: (rollback(cache, fed=block, kept=1), mx.eval(cache_arrays(cache)))))
        keep("hand-off", timed(lambda: (draft.add_context(out["features"][:, :1], dcache), mx.eval(cache_arrays(dcache)))))
        restore(cache, undo)
        rewind(dcache, offsets)
    return {name: statistics.median(values) for name, values in samples.items()}


def grown_contexts(model, tokenizer, contexts, draft_caches):
    """One prompt (the standard library's source, as `bench --context`) fed chunk by chunk: yields
    ``(context, token, cache)`` once the target's cache and every one of ``draft_caches`` (name ->
    a draft context cache) hold ``context`` tokens, for each of ``contexts`` in increasing order;
    ``token`` is any token (the costs do not depend on which)."""
    target, draft = model.target, model.draft
    contexts = sorted(contexts)
    ids = tokenizer.encode(file_context(tokenizer, contexts[-1]), add_special_tokens=False)
    prompt = mx.array(ids[: contexts[-1]])
    cache = target.make_cache()

    def to_drafts(features):
        for dcache in draft_caches.values():
            draft.add_context(features, dcache)
        return [a for dcache in draft_caches.values() for a in cache_arrays(dcache)]

    fed = 0
    for context in contexts:
        prefill(target, prompt[fed:context], cache, None, draft.target_layer_ids, to_drafts)
        fed = context
        yield context, prompt[context - 1 : context], cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="a target with a draft: demo, or a target directory (with --draft)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--contexts", default="1k,4k,8k,16k,32k")
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024, help="the draft's context window to compare with the whole context")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    model, tokenizer = load(args.model, draft=args.draft)
    target, draft = model.target, model.draft
    taps = draft.target_layer_ids
    draft_caches = {"": draft.make_cache(), f" (window {args.window})": draft.make_cache(args.window)}
    columns = ["plain step", "plain cycle", "cycle", "draft pass", "verify pass", "rollback", "hand-off", "other",
               f"cycle (window {args.window})", f"draft pass (window {args.window})"]
    print(f"block {args.block}, ms (medians of {args.repeats} rounds)")
    print("| context | " + " | ".join(columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for context, token, cache in grown_contexts(model, tokenizer, parse_context_sizes(args.contexts), draft_caches):
        measure(target, draft, cache, draft_caches, token, args.block, taps, 2)  # compile, settle
        ms = measure(target, draft, cache, draft_caches, token, args.block, taps, args.repeats)
        ms["other"] = ms["cycle"] - ms["draft pass"] - ms["verify pass"] - ms["rollback"] - ms["hand-off"]
        print(f"| {context} | " + " | ".join(f"{ms[c]:.2f}" for c in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
