"""How much of a block the draft gets right as the context grows, with its whole context or a window.

    python examples/context_acceptance.py [--model demo] [--contexts 0,1k,2k,4k,8k] [--windows none,256,512,1024,2048]
                                          [--suite edit] [--block 4] [--max-tokens 160]

Each prompt of the suite after that many tokens of the standard library's source (as
`bench --context`), greedy, at a fixed block: the draft's accepted tokens per cycle and the share
of drafted tokens accepted, with the draft's context cache whole (``none``) or cut to the last W
tokens (``load(..., draft_window=W)``). Only what the draft sees changes; the output can still
differ where the target's top two logits nearly tie (a verify pass of another length rounds them
apart on the CPU, as `bench` reports): a star marks each prompt whose output differed from the
first column's.
"""

from __future__ import annotations

import argparse

from dflash_mlx.api import load, stream_generate
from dflash_mlx.bench import SUITES, file_context, parse_context_sizes, with_context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--contexts", default="0,1k,2k,4k,8k")
    parser.add_argument("--windows", default="none,256,512,1024,2048")
    parser.add_argument("--suite", default="edit", choices=sorted(SUITES))
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--think", action="store_true", default=True, help="the demo's draft was trained with thinking on")
    args = parser.parse_args()

    windows = [None if w.strip().lower() == "none" else int(w) for w in args.windows.split(",")]
    models = {w: load(args.model, draft=args.draft, draft_window=w) for w in windows}
    tokenizer = next(iter(models.values()))[1]
    contexts = parse_context_sizes(args.contexts)
    print(f"{args.suite}, block {args.block}, accepted drafted tokens per cycle (share of drafted tokens accepted)")
    print("| context | " + " | ".join("whole" if w is None else f"window {w}" for w in windows) + " |")
    print("|---:|" + "---:|" * len(windows))
    for context in contexts:
        text = file_context(tokenizer, context)
        cells, reference = [], {}
        for w in windows:
            model, _ = models[w]
            accepted = cycles = differs = 0
            for prompt in SUITES[args.suite]:
                request = [{"role": "user", "content": with_context(prompt, text)}]
                tokens = []
                for last in stream_generate(model, tokenizer, request, max_tokens=args.max_tokens,
                                            block_tokens=args.block, enable_thinking=args.think):
                    tokens.append(last.token)
                accepted += last.accepted_tokens
                cycles += last.cycles
                differs += reference.setdefault(prompt, tokens) != tokens
            cells.append(f"{accepted / cycles:.2f} ({accepted / (cycles * (args.block - 1)):.0%}){'*' * differs}")
        print(f"| {context} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
