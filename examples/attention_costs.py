"""What one attention call costs: MLX's ``mx.fast.scaled_dot_product_attention`` against
``dflash_mlx.models.layers.attention``, per context and rows, and whether they agree to the bit.

    python examples/attention_costs.py [--keys 600,4096] [--rows 1,4] [--heads 4,2] [--dim 32]
                                       [--dtype bfloat16] [--repeats 100]

The demo's heads by default (4 query heads of 32 over 2 key heads, bfloat16). Rows are the
queries of one pass: 1 for a decode step, the block for a verify pass; the last row sees every
key ("causal" as MLX aligns it). Medians over ``--repeats`` calls, each waited for, the two
functions alternating call by call. On a GPU both are MLX's fused kernel; on the CPU MLX falls back
to plain operations, which ``layers.attention`` runs in a cheaper form (see its docstring).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from dflash_mlx.models.layers import attention


def timed(fn) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="600,4096", help="keys each pass reads, comma-separated")
    parser.add_argument("--rows", default="1,4", help="queries per pass, comma-separated")
    parser.add_argument("--heads", default="4,2", help="query heads,key heads")
    parser.add_argument("--dim", type=int, default=32, help="head dimension")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per function and cell")
    args = parser.parse_args()
    n_heads, n_kv = (int(x) for x in args.heads.split(","))
    dtype = getattr(mx, args.dtype)
    print(f"device {mx.default_device()}, {n_heads} heads of {args.dim} over {n_kv} key heads, {args.dtype}")
    print("| keys | rows | MLX ms | layers.attention ms | ratio | identical |")
    print("|---:|---:|---:|---:|---:|---|")
    for keys in (int(x) for x in args.keys.split(",")):
        for rows in (int(x) for x in args.rows.split(",")):
            q, k, v = (mx.random.normal(shape).astype(dtype) for shape in
                       ((1, n_heads, rows, args.dim), (1, n_kv, keys, args.dim), (1, n_kv, keys, args.dim)))
            mx.eval(q, k, v)
            mask = "causal" if rows > 1 else None
            scale = args.dim**-0.5

            def fast():
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

            def ours():
                return attention(q, k, v, scale, mask)

            same = mx.array_equal(fast(), ours()).item()
            for _ in range(5):
                timed(fast), timed(ours)
            times = [(timed(fast), timed(ours)) for _ in range(args.repeats)]
            a = 1e3 * statistics.median(t[0] for t in times)
            b = 1e3 * statistics.median(t[1] for t in times)
            print(f"| {keys} | {rows} | {a:.3f} | {b:.3f} | {b / a:.2f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
