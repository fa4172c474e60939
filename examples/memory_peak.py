"""A DFlash run's measured peak memory against `dflash-mlx doctor`'s estimate at the same context.

    python examples/memory_peak.py [--model demo] [--draft D] [--contexts 4096,65536] [--draft-window auto|all|N]

For each context: a prompt of that many tokens (less 6) and 6 generated tokens with the draft's
whole block, `mx.get_peak_memory()` after `mx.reset_peak_memory()` on an allocator holding only
the loaded pair, beside `doctor.estimate_memory` with the same draft window (``auto``, as `load`:
the demo draft's 1024 tokens, any other draft its whole context; docs/benchmarks.md has a table).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from dflash_mlx import defaults, doctor, load, loading
from dflash_mlx.sampling import Sampler
from dflash_mlx.speculative import speculative


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--contexts", default="4096")
    parser.add_argument("--draft-window", default="auto", help="auto (as load), all (the whole context) or N tokens")
    args = parser.parse_args()
    target_dir, draft_dir = defaults.demo(args.draft) if args.model == defaults.DEMO else (args.model, args.draft)
    window = "auto" if args.draft_window == "auto" else None if args.draft_window == "all" else int(args.draft_window)
    model, _ = load(target_dir, draft=draft_dir, draft_window=window)
    target, draft = model.target, model.draft
    new = 6
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = mx.array(np.random.default_rng(context).integers(3, min(target.args.vocab_size, 500) - 1, context - new))
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        for _ in speculative(target, draft, prompt, Sampler(), block_tokens=draft.block_size, max_tokens=new,
                             draft_window=model.draft_window):
            pass
        seconds, measured = time.perf_counter() - start, mx.get_peak_memory() - base
        estimate = doctor.estimate_memory(loading.resolve_path(target_dir), loading.resolve_path(draft_dir), None, context,
                                          draft_window=model.draft_window)
        weights = sum(estimate[k] for k in ("target weights", "draft weights"))  # loaded before base
        total = sum(estimate.values()) - weights
        print(f"{context:>7} tokens: measured {measured / 2**20:8.1f} MiB above the weights, doctor {total / 2**20:8.1f} MiB "
              f"({total / measured - 1:+.1%}); with the weights {(measured + weights) / 2**20:.1f} vs "
              f"{(total + weights) / 2**20:.1f} MiB; {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
