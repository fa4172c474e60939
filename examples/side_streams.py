"""The decode loop's costs on the CPU with the attention's key heads on side streams, and on one stream.

    python examples/side_streams.py [--model demo] [--contexts 1k,2k,4k,8k] [--block 4] [--repeats 8]

MLX runs one CPU operation on one core and each CPU stream on a thread of its own. Past
``layers.SIDE_STREAM_WORK`` query rows x keys per key head, ``layers.attention`` sends the key
heads to one stream per core (``layers.side_streams``). This measures what that does inside the
decode loop, where each side stream's share waits for its inputs and is waited for: one process,
one prompt grown chunk by chunk as ``examples/cycle_costs.py`` grows it, and at each context the
same measurements as there (plain step, plain cycle, block cycle, draft pass, verify pass; medians
over ``--repeats`` rounds) with the threshold as shipped ("side streams") and out of reach ("one
stream"), alternating round by round so that a machine that gets busier hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from cycle_costs import grown_contexts, measure  # noqa: E402

from dflash_mlx import load  # noqa: E402
from dflash_mlx.bench import parse_context_sizes  # noqa: E402
from dflash_mlx.models import layers  # noqa: E402

COLUMNS = ["plain step", "plain cycle", "cycle", "draft pass", "verify pass"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="a target with a draft: demo, or a target directory (with --draft)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--contexts", default="1k,2k,4k,8k")
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()

    model, tokenizer = load(args.model, draft=args.draft)
    target, draft = model.target, model.draft
    taps = draft.target_layer_ids
    draft_caches = {"": draft.make_cache(model.draft_window)}

    shipped = layers.SIDE_STREAM_WORK
    threshold = {"side streams": shipped, "one stream": float("inf")}
    print(f"{len(layers.side_streams())} side streams, SIDE_STREAM_WORK {shipped}; block {args.block}, "
          f"draft window {model.draft_window}; ms, medians of {args.repeats} rounds")
    print("| context | streams | " + " | ".join(COLUMNS) + " |")
    print("|---:|---|" + "---:|" * len(COLUMNS))
    try:
        for context, token, cache in grown_contexts(model, tokenizer, parse_context_sizes(args.contexts), draft_caches):
            results = {name: [] for name in threshold}
            for name in threshold:  # compile and settle both ways
                layers.SIDE_STREAM_WORK = threshold[name]
                measure(target, draft, cache, draft_caches, token, args.block, taps, 2)
            for round_ in range(args.repeats):
                for name in list(threshold)[:: 1 if round_ % 2 == 0 else -1]:
                    layers.SIDE_STREAM_WORK = threshold[name]
                    results[name].append(measure(target, draft, cache, draft_caches, token, args.block, taps, 1))
            for name, runs in results.items():
                cells = " | ".join(f"{statistics.median(run[c] for run in runs):.2f}" for c in COLUMNS)
                print(f"| {context} | {name} | {cells} |", flush=True)
    finally:
        layers.SIDE_STREAM_WORK = shipped


if __name__ == "__main__":
    main()
