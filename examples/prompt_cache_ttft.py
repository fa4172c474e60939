"""Time to first token for an 8k-token prompt: cold, resent, and edited at 10/50/90% of its length.

    python examples/prompt_cache_ttft.py [--model demo] [--tokens 8192]

Each edited prompt runs on a ``PromptCache`` (what a chat session or the server keeps) that holds
the original prompt, so each row shows how much of the prompt it reused and what the rest cost.
The numbers speak for this machine's CPU (dispatch-bound); on a Mac prefill is compute-bound.
"""

import argparse
import time

import mlx.core as mx

from dflash_mlx import load, stream_generate
from dflash_mlx.bench import file_context
from dflash_mlx.prompt_cache import PromptCache


def first_token(model, tokenizer, ids, cache):
    start = time.perf_counter()
    response = next(iter(stream_generate(model, tokenizer, mx.array(ids), max_tokens=1, prompt_cache=cache)))
    return time.perf_counter() - start, response.cached_prompt_tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    ids = tokenizer.encode(file_context(tokenizer, args.tokens))[: args.tokens]
    first_token(model, tokenizer, ids[:64], PromptCache())  # compile outside the timings
    print(f"{len(ids)}-token prompt, model {args.model}")
    cache = PromptCache()
    rows = [("cold", ids), ("resent", ids)]
    for share in (0.1, 0.5, 0.9):
        edited = list(ids)
        edited[int(share * len(ids))] = (edited[int(share * len(ids))] + 1) % 64
        rows.append((f"edit at {share:.0%}", edited))
    for i, (label, prompt) in enumerate(rows):
        if i >= 2:  # a history holding the original prompt, made outside the timing
            cache = PromptCache()
            first_token(model, tokenizer, ids, cache)
        seconds, reused = first_token(model, tokenizer, prompt, cache)
        print(f"{label:>12}: time to first token {seconds * 1000:8.1f} ms, {reused:5d} tokens reused")


if __name__ == "__main__":
    main()
