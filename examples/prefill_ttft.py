"""Time to first token of long prompts: ours against mlx-lm's own prefill, on the same checkpoint.

    python examples/prefill_ttft.py [--model demo | --tiny] [--tokens 8192,32768] [--repeats 2] [--draft-window W]

Each prompt length runs, alternating in an order rotated per repeat: mlx-lm's ``stream_generate``
on mlx-lm's build of the target (``bench.load_mlx_lm``), ours with the draft (a DFlash request:
the prefill also feeds the draft its context features) and ours on the target alone; each up to
its first token (``max_tokens=1``), medians over the repeats, peak memory per run. Then, at the
longest length, an agent's next turn: the same prompt plus ``--new`` tokens on the ``PromptCache``
that served the first one, which prefills only the new part.

``--tiny`` writes a tiny random pair with Qwen3.5's 248,320-token vocabulary (the head costs per
position what it costs a real model's) and its draft's default taps, which skip the last layer as
z-lab's drafts do. The numbers speak for this machine's CPU (docs/benchmarks.md): a Mac's prefill
is compute-bound on its GPU, where MLX's fused attention runs instead of the CPU's row blocks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx import defaults, load, stream_generate, tiny
from dflash_mlx.bench import compute_backend, file_context, load_mlx_lm
from dflash_mlx.prompt_cache import PromptCache

QWEN_VOCAB = 248320


def tiny_pair(root: Path):
    """A tiny random target with Qwen3.5's vocabulary (and a 512-token tokenizer) and its draft."""
    target_dir, draft_dir = root / "target", root / "draft"
    eos = tiny.write_tokenizer(target_dir, 512)
    config = tiny.write_target(target_dir, tiny.target_config(QWEN_VOCAB, eos_token_id=eos))
    tiny.write_draft(draft_dir, tiny.draft_config(config, block_size=16))
    return target_dir, draft_dir


def timed(run):
    """Seconds to the first token and the run's peak memory (bytes), from a clean allocator."""
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start, mx.get_peak_memory()


def first(responses):
    return next(iter(responses))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="a target folder (with --draft) or 'demo'")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--tiny", action="store_true", help="a tiny random pair with Qwen3.5's vocabulary instead")
    parser.add_argument("--tokens", default="8192,32768", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new", type=int, default=1024, help="tokens the next turn adds to the longest prompt")
    parser.add_argument("--draft-window", type=int, default=None, help="the draft keeps only this many recent tokens' context")
    args = parser.parse_args()

    from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

    keep = tempfile.TemporaryDirectory()
    if args.tiny:
        target_dir, draft_dir = tiny_pair(Path(keep.name))
        label = "tiny random pair (vocabulary 248320, float32)"
    else:
        target_dir, draft_dir = defaults.demo(args.draft) if args.model == defaults.DEMO else (args.model, args.draft)
        label = args.model
    model, tokenizer = load(str(target_dir), draft=str(draft_dir) if draft_dir else None, draft_window=args.draft_window)
    reference = load_mlx_lm(Path(target_dir))
    lengths = [int(n) for n in args.tokens.split(",")]
    longest = max(lengths) + args.new
    if args.tiny:
        pool = np.random.default_rng(0).integers(3, 500, longest).tolist()
    else:
        pool = tokenizer.encode(file_context(tokenizer, longest), add_special_tokens=False)[:longest]

    runs = {
        "mlx-lm": lambda ids: first(mlx_lm_stream_generate(reference, tokenizer, ids, max_tokens=1)),
        "ours (DFlash)": lambda ids: first(stream_generate(model, tokenizer, ids, max_tokens=1)),
        "ours (target alone)": lambda ids: first(stream_generate(model, tokenizer, ids, max_tokens=1, use_draft=False)),
    }
    for name, run in runs.items():  # compile and warm outside the timings
        run(pool[:600])
    backend = compute_backend()
    window = f", draft window {args.draft_window}" if args.draft_window else ""
    print(f"{label}{window}: {', '.join(f'{k} {v}' for k, v in backend.items())}", flush=True)
    print(f"{'tokens':>7} {'mlx-lm s':>9} {'DFlash s':>9} {'ratio':>6} {'alone s':>8} {'ratio':>6} "
          f"{'peak MB: mlx-lm':>16} {'DFlash':>7} {'alone':>6}")
    for n in lengths:
        ids = pool[:n]
        got = {name: [] for name in runs}
        names = list(runs)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                got[name].append(timed(lambda: runs[name](ids)))
        sec = {k: statistics.median(s for s, _ in v) for k, v in got.items()}
        peak = {k: max(p for _, p in v) / 2**20 for k, v in got.items()}
        m, d, a = sec["mlx-lm"], sec["ours (DFlash)"], sec["ours (target alone)"]
        print(f"{n:>7} {m:>9.2f} {d:>9.2f} {d / m:>5.2f}x {a:>8.2f} {a / m:>5.2f}x "
              f"{peak['mlx-lm']:>16.0f} {peak['ours (DFlash)']:>7.0f} {peak['ours (target alone)']:>6.0f}", flush=True)
    if args.new:
        n = max(lengths)
        cache = PromptCache()
        cold, _ = timed(lambda: first(stream_generate(model, tokenizer, pool[:n], max_tokens=1, prompt_cache=cache)))
        box = {}
        warm, _ = timed(lambda: box.setdefault("r", first(stream_generate(model, tokenizer, pool[: n + args.new], max_tokens=1,
                                                                          prompt_cache=cache))))
        print(f"next turn: {n} tokens cold {cold:.2f} s; then {n + args.new} tokens sharing them: {warm:.2f} s, "
              f"{box['r'].cached_prompt_tokens} tokens from the cache, {n + args.new - box['r'].cached_prompt_tokens} prefilled")


if __name__ == "__main__":
    main()
