"""The host (Python) cost of one quantized matmul routed to our Metal kernels, against MLX's stock
``quantized_matmul``: what each call costs to build, the GPU's work left out.

    python examples/routed_matmul_cost.py [--K 4096] [--N 4096] [--rows 1,8,16] [--calls 20000] [--repeats 7]

This machine has no Metal, so the kernel launch is stubbed: ``mx.fast.metal_kernel`` is replaced
by a stand-in whose kernels return a preallocated output (MLX's own per-call work for a custom
kernel, generating and hashing its source, is not counted; nor is stock's GPU dispatch). Nothing is
evaluated: each figure is the time to build one call's graph, in microseconds, the minimum over
``--repeats`` rounds that each time ``--calls`` calls of every column in turn (so that a machine
busy with other work slows the columns of a round alike). The routed layers' self-checks are taken as passed
(``MetalKernels(self_check=False)``), as on a Mac after the first call. Rows of x [1, M, K] bfloat16,
4-bit weights in groups of 64:

- stock op: ``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)``, the graph build the
  issue compares against;
- stock layer: MLX's ``nn.QuantizedLinear`` (the op plus the layer's Python);
- kernel / tile layer: ``quantized.QuantizedLinear`` routed to the per-row kernel / the tile kernel
  (``QuantizedMatmuls`` choosing it for the layer's shape), the path every routed matmul takes in a
  forward pass;
- routed / stock op: the kernel layer against the stock op (the goal: at most 4x).
"""

from __future__ import annotations

import argparse
import math
import timeit

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx import kernels, quantized


class StubMetal:
    """Called like ``mx.fast.metal_kernel``; its kernels return a preallocated output of the
    requested shape and dtype, so that what is timed is the Python that leads to the launch."""

    def __init__(self):
        self.outputs = {}
        self.launches = 0

    def __call__(self, name, input_names, output_names, source, **_):
        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **__):
            self.launches += 1
            key = (tuple(output_shapes[0]), output_dtypes[0])
            out = self.outputs.get(key)
            if out is None:
                out = self.outputs[key] = mx.zeros(output_shapes[0], dtype=output_dtypes[0])
            return [out]

        return kernel


def per_call_us(fns: dict, calls: int, repeats: int) -> dict:
    """Microseconds per call of each of ``fns``: the minimum over ``repeats`` rounds, each round
    timing ``calls`` calls of every one in turn (a machine that gets busier slows them alike)."""
    for fn in fns.values():
        fn()  # the first call decides (self-checks, builds): not timed
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit.timeit(fn, number=calls) / calls * 1e6)
    return best


def measure(K: int, N: int, rows, calls: int, repeats: int, group_size: int = 64, bits: int = 4):
    """Per row count: (stock op, stock layer, kernel layer, tile layer) microseconds per call."""
    dtype = mx.bfloat16
    stock_layer = nn.QuantizedLinear(K, N, bias=False, group_size=group_size, bits=bits)
    stock_layer.set_dtype(dtype)
    mx.eval(stock_layer.parameters())
    w, scales, biases = stock_layer["weight"], stock_layer["scales"], stock_layer["biases"]
    routed = {}
    for impl in (quantized.OURS, quantized.TILE):
        matmuls = quantized.QuantizedMatmuls(kernels.MetalKernels(StubMetal(), self_check=False))
        layer = quantized.QuantizedLinear(stock_layer, matmuls)
        matmuls.choices = {s: impl for s in quantized.shapes_of([layer], dtype=dtype)}
        routed[impl] = layer
    out = {}
    for M in rows:
        x = mx.random.normal((1, M, K)).astype(dtype)
        mx.eval(x)
        for impl, layer in routed.items():
            assert layer(x).shape == (1, M, N)
            stub = layer.matmuls.metal._metal_kernel
            before = stub.launches
            layer(x)
            assert stub.launches == before + 1, f"the {impl} layer did not reach the (stubbed) kernel"
        times = per_call_us({
            "op": lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits,
                                              mode="affine"),
            "layer": lambda: stock_layer(x),
            "kernel": lambda: routed[quantized.OURS](x),
            "tile": lambda: routed[quantized.TILE](x),
        }, calls, repeats)
        out[M] = (times["op"], times["layer"], times["kernel"], times["tile"])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--K", type=int, default=4096)
    parser.add_argument("--N", type=int, default=4096)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    results = measure(args.K, args.N, rows, args.calls, args.repeats)
    print(f"K={args.K} N={args.N}, 4-bit group 64, bfloat16, mlx {mx.__version__}; microseconds per call "
          "(graph build, kernel launch stubbed)")
    print("| M | stock op | stock layer | kernel layer | tile layer | kernel layer / stock op "
          "| kernel layer / stock layer |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for M, (op, layer, ours, tile) in results.items():
        print(f"| {M} | {op:.2f} | {layer:.2f} | {ours:.2f} | {tile:.2f} | {ours / op:.1f}x | {ours / layer:.1f}x |")
    return results


if __name__ == "__main__":
    main()
