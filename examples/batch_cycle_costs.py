"""What several requests at once can gain on this machine: the batched cycle's cost and yield, then
the scheduler's rounds without HTTP.

    python examples/batch_cycle_costs.py [--model demo] [--sequences 1,4] [--blocks 1,2,3,4] [--cycles 24]
                                         [--repeats 3] [--max-tokens 256]

1. Cycles. Per number of sequences and fixed block: ``Decoder.cycle`` over that many sequences (the
   bench's ``edit`` prompts in turn, greedy, prefilled as the scheduler prefills them), the median
   milliseconds per cycle over ``--cycles`` cycles after three to warm, the tokens each sequence
   commits per cycle, and the aggregate tokens per second; medians over ``--repeats`` rounds. The
   best aggregate at N sequences over the best at one is what N requests at once could gain at
   full occupancy (every sequence active in every cycle, nothing else running).
2. Rounds. The server example's workload without HTTP (``examples/concurrent_requests.py``): each
   prompt run once alone so that the prompt cache holds it, then ``--sequences``' largest count of
   requests of ``--max-tokens`` through one ``Scheduler`` at once, against one at a time through
   the same scheduler; the rounds at full occupancy and the rest (admission, and the tail where
   requests that finished early leave the batch).
3. Layers. Where a verify pass of the largest block goes, per count of sequences: each target
   layer timed alone (evaluated after it, the caches put back after the pass), and the draft pass;
   medians over ``--cycles`` passes. The attention layers run per sequence (exactness); the Gated
   DeltaNet layers and the products run on the whole batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import mlx.core as mx

from dflash_mlx.api import encode_prompt, load
from dflash_mlx.bench import SUITES
from dflash_mlx.block_policy import FixedBlock
from dflash_mlx.cache import batch_view, cache_arrays, restore, snapshot
from dflash_mlx.decoder import Decoder, batch_min_rows, products_row_independent
from dflash_mlx.prompt_cache import PromptCachePool
from dflash_mlx.sampling import Sampler
from dflash_mlx.scheduler import BatchRequest, Scheduler


def sequences(model, prompts, count: int, block: int):
    """A decoder and ``count`` prefilled sequences decoding at ``block``."""
    decoder = Decoder(model.target, model.draft, min_rows=batch_min_rows())
    out = []
    for i in range(count):
        start = decoder.start(prompts[i % len(prompts)], Sampler(0.0), FixedBlock(block),
                              draft_window=model.draft_window)
        try:
            while True:
                next(start)
        except StopIteration as prefilled:
            out.append(prefilled.value[0])
    return decoder, out


def cycle_cost(model, prompts, count: int, block: int, cycles: int):
    """(ms per cycle, tokens per cycle per sequence, aggregate tokens per second)."""
    decoder, batch = sequences(model, prompts, count, block)
    for _ in range(3):
        decoder.cycle(batch)
    times, tokens = [], 0
    for _ in range(cycles):
        start = time.perf_counter()
        commits = decoder.cycle(batch)
        times.append(time.perf_counter() - start)
        tokens += sum(len(c.tokens) for c in commits)
    ms = 1e3 * statistics.median(times)
    per_sequence = tokens / cycles / count
    return ms, per_sequence, 1e3 * count * per_sequence / ms


def layer_costs(model, prompts, count: int, block: int, passes: int):
    """Median ms per target layer (``L0 linear``, ``L2 attention``...) and of the draft pass, for a
    verify pass of ``block`` tokens over ``count`` sequences."""
    decoder, batch = sequences(model, prompts, count, block)
    for _ in range(3):
        decoder.cycle(batch)
    tokens = mx.stack([mx.concatenate([s.token, mx.zeros((block - 1,), s.token.dtype)]) for s in batch])
    samples = {}
    for _ in range(passes):
        saved = [snapshot(s.cache) for s in batch]
        mx.eval([cache_arrays(s.cache) for s in batch])
        cache = batch[0].cache if count == 1 else batch_view([s.cache for s in batch], [block] * count)
        h = model.target.embed_tokens(tokens)
        mx.eval(h)
        for i, (layer, c) in enumerate(zip(model.target.layers, cache)):
            start = time.perf_counter()
            h = layer(h, c, block > 1)
            mx.eval(h, [cache_arrays(s.cache) for s in batch])
            name = f"L{i} {'linear' if layer.is_linear else 'attention'}"
            samples.setdefault(name, []).append(1e3 * (time.perf_counter() - start))
        for s, state in zip(batch, saved):
            restore(s.cache, state)
        blocks = [mx.concatenate([s.token, mx.full((block - 1,), model.draft.mask_token_id, s.token.dtype)]) for s in batch]
        start = time.perf_counter()
        if count == 1:
            proposals = [model.draft.propose(blocks[0], batch[0].draft_cache, Sampler(0.0))]
        else:
            proposals = model.draft.propose_batch(blocks, [s.draft_cache for s in batch], [Sampler(0.0)] * count,
                                                      one_head=products_row_independent())
        mx.eval([p for pair in proposals for p in pair if p is not None])
        samples.setdefault("draft pass", []).append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(v) for name, v in samples.items()}


def rounds(model, tokenizer, pool, prompts, max_active: int, max_tokens: int):
    """Wall seconds and (active requests, rows of the pass) per round, for ``prompts`` at once."""
    scheduler = Scheduler(model, tokenizer, max_active, pool)
    for prompt in prompts:
        scheduler.submit(BatchRequest(prompt, lambda response: None, max_tokens=max_tokens))
    log = []
    start = time.perf_counter()
    while not scheduler.idle:
        active = len(scheduler.active)
        scheduler.step()
        log.append((active, scheduler.rows))
    return time.perf_counter() - start, log


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="a pair with a draft (default: the shipped demo)")
    parser.add_argument("--sequences", default="1,4", help="sequences per cycle to measure, comma-separated")
    parser.add_argument("--blocks", default="1,2,3,4", help="fixed blocks to measure, comma-separated")
    parser.add_argument("--cycles", type=int, default=24, help="timed cycles per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every measurement (medians)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per request in the rounds")
    args = parser.parse_args()
    counts = [int(n) for n in args.sequences.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    model, tokenizer = load(args.model)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": p}]) for p in SUITES["edit"]]

    results = {}
    for _ in range(args.repeats):
        for count in counts:
            for block in blocks:
                results.setdefault((count, block), []).append(cycle_cost(model, prompts, count, block, args.cycles))
    print("| sequences | block | ms per cycle | tokens per cycle per sequence | aggregate tok/s |")
    print("|---:|---:|---:|---:|---:|")
    best = {}
    for (count, block), runs in sorted(results.items()):
        ms, per, agg = (statistics.median(r[i] for r in runs) for i in range(3))
        best[count] = max(best.get(count, 0.0), agg)
        print(f"| {count} | {block} | {ms:.2f} | {per:.2f} | {agg:.0f} |")
    one = best.get(1)
    for count in counts:
        if one and count > 1:
            print(f"best aggregate at {count} over the best at 1: {best[count] / one:.2f}x (full occupancy)")

    n = max(counts)
    ids = [p.tolist() for p in prompts]
    batch = [ids[i % len(ids)] for i in range(n)]
    walls = {n: [], 1: []}
    for repeat in range(args.repeats):
        pool = PromptCachePool(8 << 30)
        for prompt in ids:  # each prompt once alone: the prompt cache holds it, as in the server example
            rounds(model, tokenizer, pool, [prompt], 1, args.max_tokens)
        for active in (n, 1) if repeat % 2 == 0 else (1, n):
            if active == 1:
                wall = sum(rounds(model, tokenizer, pool, [p], 1, args.max_tokens)[0] for p in batch)
            else:
                wall, log = rounds(model, tokenizer, pool, batch, n, args.max_tokens)
                occupancy = Counter(a for a, _ in log)
                print(f"{n} at once: {wall:.2f} s in {len(log)} rounds, {occupancy[n]} of them with all {n} active "
                      f"(rows per pass there: {statistics.median([r for a, r in log if a == n] or [0]):.0f})")
            walls[active].append(wall)
    together, apart = statistics.median(walls[n]), statistics.median(walls[1])
    print(f"scheduler, no HTTP: {n} at once {together:.2f} s, one at a time {apart:.2f} s: {apart / together:.2f}x")

    block = max(blocks)
    costs = {count: layer_costs(model, prompts, count, block, args.cycles) for count in counts}
    names = list(costs[counts[0]])
    print(f"\nverify pass of block {block}, ms per layer (medians of {args.cycles})")
    print("| sequences | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for count in counts:
        print(f"| {count} | " + " | ".join(f"{costs[count][name]:.2f}" for name in names) + " |")


if __name__ == "__main__":
    main()
