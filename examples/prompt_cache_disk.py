"""Time to first token of a long prompt's next turn: cold, resumed from RAM, resumed from disk after a restart.

    python examples/prompt_cache_disk.py [--model demo] [--tokens 16384] [--dir DIR]

The first process prefills the prompt cold on a pool over a disk tier (``prompt_store``), which
writes the entry at the request's release, then sends the next turn (the prompt and 16 more
tokens) resumed from RAM. A second process (a restarted server) sends the same next turn on a new
pool over the same directory: it loads the entry from disk. Both warm turns prefill the same
tokens (from the prompt's last grid checkpoint); the disk one adds the load. The numbers speak for
this machine's CPU; on a Mac prefill is compute-bound and the load is the SSD's.

It also times the worker's stall when the first request ends (``PromptStore.save``: a snapshot
queued for the writer thread), against writing the same history on the worker (``background=False``:
the tier as first landed), and what reading the file a second time for its CRC would add to the
load (``file_crc``, from the page cache). ``--stall-gb 1`` times the same two for arrays of that
size shaped as a 9B's K/V (no model: what a 19k-token agent head costs).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from dflash_mlx import load, stream_generate
from dflash_mlx.bench import file_context
from dflash_mlx.prompt_cache import PromptCachePool
from dflash_mlx.prompt_store import PromptStore, file_crc, snapshot, write_entry

MORE = 16  # the next turn's new tokens


def first_token(model, tokenizer, ids, pool):
    """Seconds to the first token, and the prompt tokens reused (the request runs to its end, so
    its history is released: and written, with a disk tier)."""
    start = time.perf_counter()
    stream = stream_generate(model, tokenizer, mx.array(ids), max_tokens=1, prompt_cache=pool)
    first = next(stream)
    seconds = time.perf_counter() - start
    for _ in stream:
        pass
    return seconds, first.cached_prompt_tokens


def phase(args, restarted: bool) -> dict:
    model, tokenizer = load(args.model)
    ids = tokenizer.encode(file_context(tokenizer, args.tokens + MORE))[: args.tokens + MORE]
    prompt, turn = ids[: args.tokens], ids
    first_token(model, tokenizer, ids[:64], PromptCachePool(1 << 30))  # compile outside the timings
    if restarted:
        again = tempfile.mkdtemp()
        shutil.copytree(args.dir, again, dirs_exist_ok=True)  # the entry as the restart found it
    store = PromptStore.for_model(model, args.dir, int(args.disk_gb * 1e9))
    store.wait_scanned()
    pool = PromptCachePool(1 << 34, store=store)
    if restarted:
        seconds, reused = first_token(model, tokenizer, turn, pool)
        # Once more in this process, now warm (the first long pass in a new process pays for
        # MLX's first large allocations too): a new pool and store over the copy.
        second = PromptStore.for_model(model, again, int(args.disk_gb * 1e9))
        second.wait_scanned()
        warm = first_token(model, tokenizer, turn, PromptCachePool(1 << 34, store=second))[0]
        shutil.rmtree(again)
        (entry,) = list(store._entries.values())
        started = time.perf_counter()
        file_crc(entry.path)
        return {"disk": [seconds, reused], "load_seconds": store.stats.load_seconds, "disk_again": warm,
                "load_again": second.stats.load_seconds, "crc_reread": time.perf_counter() - started}
    cold, _ = first_token(model, tokenizer, prompt, pool)
    stall = store.stats.save_seconds  # the worker's, at the cold request's release
    store.flush()
    written = store.stats.written_bytes
    with tempfile.TemporaryDirectory() as inline_dir:  # the same history written on the worker
        inline = PromptStore.for_model(model, inline_dir, int(args.disk_gb * 1e9), background=False)
        inline.wait_scanned()
        inline.save(pool.histories[-1])
    pool.store = None  # the next turn from RAM (its release writes no second entry)
    warm, reused = first_token(model, tokenizer, turn, pool)
    return {"tokens": len(prompt), "cold": cold, "ram": [warm, reused], "written_bytes": written,
            "write_seconds": store.stats.write_seconds, "stall": stall, "stall_inline": inline.stats.save_seconds}


def stall_only(gb: float) -> None:
    """The worker's stall for an entry of ``gb`` GB of K/V slices (8 layers of 4 heads of 256, a
    9B's, 512 positions of headroom past the checkpoint as a cache keeps): snapshot against write."""
    positions = int(gb * 2**30 / (8 * 2 * 4 * 256 * 2))
    layers = [mx.random.normal((1, 4, positions + 512, 256)).astype(mx.bfloat16) for _ in range(16)]
    mx.eval(layers)
    arrays = {f"target.{i}": a[..., :positions, :] for i, a in enumerate(layers)}
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        snapshot(arrays)
        snap = time.perf_counter() - started
        started = time.perf_counter()
        path = write_entry(Path(directory), "0" * 16 + "-" + "0" * 16, arrays, {})
        write = time.perf_counter() - started
        size = path.stat().st_size
    print(f"{size / 2**30:.2f} GiB of K/V ({positions} positions): snapshot on the worker {snap * 1000:.1f} ms, "
          f"the write itself {write * 1000:.0f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="The pair to load (as load: demo, a folder).")
    parser.add_argument("--tokens", type=int, default=16384, help="Prompt tokens (of the standard library's source).")
    parser.add_argument("--dir", default=None, help="The disk tier's folder (default: a new temporary one).")
    parser.add_argument("--disk-gb", type=float, default=16.0, help="The disk tier's budget (GB).")
    parser.add_argument("--stall-gb", type=float, default=None,
                        help="Only time the worker's stall for an entry of this many GB of K/V (no model).")
    parser.add_argument("--phase", choices=["write", "read"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stall_gb is not None:
        stall_only(args.stall_gb)
        return
    if args.phase is not None:
        print(json.dumps(phase(args, args.phase == "read")))
        return
    with tempfile.TemporaryDirectory() as temp:
        args.dir = args.dir or temp
        runs = {}
        for name in ("write", "read"):  # each in a process of its own: the second is a restart
            done = subprocess.run([sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens),
                                   "--dir", args.dir, "--disk-gb", str(args.disk_gb), "--phase", name],
                                  capture_output=True, text=True, check=True)
            runs.update(json.loads(done.stdout.splitlines()[-1]))
    cold, (ram, reused), (disk, from_disk) = runs["cold"], runs["ram"], runs["disk"]
    per_1k = runs["written_bytes"] / runs["tokens"] * 1000
    print(f"{runs['tokens']}-token prompt, model {args.model}; next turn: {MORE} more tokens")
    print("| run | time to first token | prompt tokens reused |")
    print("|---|---:|---:|")
    print(f"| cold | {cold * 1000:.1f} ms | 0 |")
    print(f"| warm from RAM | {ram * 1000:.1f} ms | {reused} |")
    print(f"| warm from disk, new process | {disk * 1000:.1f} ms (load {runs['load_seconds'] * 1000:.1f} ms) | {from_disk} |")
    print(f"| warm from disk, again in that process | {runs['disk_again'] * 1000:.1f} ms "
          f"(load {runs['load_again'] * 1000:.1f} ms) | {from_disk} |")
    print(f"disk/RAM {disk / ram:.2f}x (again: {runs['disk_again'] / ram:.2f}x), disk/cold {disk / cold:.1%}; entry {runs['written_bytes'] / 1e6:.2f} MB "
          f"({per_1k / 1e3:.1f} kB per 1k tokens), written in {runs['write_seconds'] * 1000:.1f} ms")
    print(f"worker's stall at the release: {runs['stall'] * 1000:.1f} ms (snapshot, written on the writer thread), "
          f"{runs['stall_inline'] * 1000:.1f} ms written on the worker; a second read of the file for its CRC "
          f"would add {runs['crc_reread'] * 1000:.1f} ms to the load")


if __name__ == "__main__":
    main()
